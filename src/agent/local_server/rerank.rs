//! Reranking on a fronted server, in each kind's own API, as Fantom's rerank router speaks them:
//!
//! * TEI: `POST /rerank` with `raw_scores: true`, so the answer is the model's logits (TEI
//!   applies the sigmoid otherwise); the probability is ours to compute.
//! * vLLM, llama.cpp and any OpenAI-compatible server: Cohere's `POST /v1/rerank`; a 404 there
//!   falls back to vLLM's `POST /v1/score` (an older vLLM), remembered for the server's life.
//!   vLLM's scores are probabilities (its cross-encoders end in a sigmoid); llama.cpp's are
//!   logits.
//!
//! Every answer is checked: one score per document, each index once, finite, and a probability
//! within [0, 1]. A score is always carried as both: the logit (`score`) and `sigmoid(logit)`,
//! the scale a fronted reranker declares ([`ScoreActivation::Sigmoid`]).

use std::sync::atomic::Ordering;

use serde_json::{Value, json};

use super::api::{ServerApi, ServerError};
use crate::config::local_server::ServerKind;
use crate::protocol::{Score, ScoreActivation};

/// What a fronted reranker's scores are, as the response tells the client.
pub const ACTIVATION: ScoreActivation = ScoreActivation::Sigmoid;

/// The scale a server's numbers arrive in.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Scale {
    Logit,
    Probability,
}

impl ServerApi {
    /// Scores `documents` against `query` (in input order) and the tokens the server counted.
    pub async fn rerank(
        &self,
        kind: ServerKind,
        model: &str,
        query: &str,
        documents: &[String],
    ) -> Result<(Vec<Score>, u64), ServerError> {
        let n = documents.len();
        if kind == ServerKind::Tei {
            let path = "/rerank";
            let body = json!({"query": query, "texts": documents, "raw_scores": true,
                "truncate": true, "return_text": false});
            let v = self.post(path, body).await?;
            let rows = v
                .as_array()
                .ok_or_else(|| self.bad(path, "the answer is not an array of scores"))?;
            let scores = self.scores(path, rows, n, "score", Scale::Logit)?;
            return Ok((scores, 0));
        }
        // llama.cpp answers logits on Cohere's shape; vLLM and the rest probabilities.
        let scale = if kind == ServerKind::LlamaCpp {
            Scale::Logit
        } else {
            Scale::Probability
        };
        let mut not_found = None;
        if !self.score_route.load(Ordering::Relaxed) {
            let path = "/v1/rerank";
            let body = json!({"model": model, "query": query, "documents": documents,
                "top_n": n, "return_documents": false});
            match self.post(path, body).await {
                Ok(v) => {
                    let rows = v
                        .get("results")
                        .and_then(Value::as_array)
                        .ok_or_else(|| self.bad(path, "no results array"))?;
                    let scores = self.scores(path, rows, n, "relevance_score", scale)?;
                    return Ok((scores, tokens(&v)));
                }
                Err(e @ ServerError::Status { status: 404, .. }) => not_found = Some(e),
                Err(e) => return Err(e),
            }
        }
        let scored = self.score(model, query, documents, scale).await;
        match (not_found, scored) {
            // Remembered only once /v1/score answered: a passing 404 (a restart under another
            // name) never moves a server that has /v1/rerank off it for good.
            (Some(_), Ok(answer)) => {
                tracing::info!(url = %self.base(), "no /v1/rerank here: scoring on /v1/score");
                self.score_route.store(true, Ordering::Relaxed);
                Ok(answer)
            }
            (Some(rerank_404), Err(_)) => Err(rerank_404),
            (None, scored) => scored,
        }
    }

    /// vLLM's `/v1/score`.
    async fn score(
        &self,
        model: &str,
        query: &str,
        documents: &[String],
        scale: Scale,
    ) -> Result<(Vec<Score>, u64), ServerError> {
        let n = documents.len();
        let path = "/v1/score";
        let body = json!({"model": model, "text_1": query, "text_2": documents});
        let v = self.post(path, body).await?;
        let rows = v
            .get("data")
            .and_then(Value::as_array)
            .ok_or_else(|| self.bad(path, "no data array"))?;
        let scores = self.scores(path, rows, n, "score", scale)?;
        Ok((scores, tokens(&v)))
    }

    async fn post(&self, path: &'static str, body: Value) -> Result<Value, ServerError> {
        let rb = self.request(reqwest::Method::POST, path).json(&body);
        self.send(path, rb).await
    }

    /// `{index, <field>}` rows: each of the `n` indexes once, finite, in the scale's range.
    fn scores(
        &self,
        path: &str,
        rows: &[Value],
        n: usize,
        field: &str,
        scale: Scale,
    ) -> Result<Vec<Score>, ServerError> {
        if rows.len() != n {
            return Err(self.bad(path, format!("{} scores for {n} documents", rows.len())));
        }
        let mut out: Vec<Option<Score>> = vec![None; n];
        for row in rows {
            let index = row
                .get("index")
                .and_then(Value::as_u64)
                .and_then(|i| usize::try_from(i).ok())
                .filter(|i| *i < n)
                .ok_or_else(|| self.bad(path, "a score without a valid index"))?;
            let x = row
                .get(field)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite())
                .ok_or_else(|| self.bad(path, format!("score {index} is not a finite number")))?;
            let score = match scale {
                Scale::Logit => Score::from_logit(x as f32),
                Scale::Probability => {
                    if !(0.0..=1.0).contains(&x) {
                        return Err(self.bad(
                            path,
                            format!(
                                "score {index} is {x}, not a probability; a server that answers logits on /v1/rerank is kind = \"llama-cpp\""
                            ),
                        ));
                    }
                    Score::from_probability(x as f32)
                }
            };
            if out[index].replace(score).is_some() {
                return Err(self.bad(path, format!("index {index} is scored twice")));
            }
        }
        out.into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| self.bad(path, "a document has no score"))
    }
}

/// The tokens a rerank answer counted: vLLM's `usage`, Cohere's `meta.billed_units`.
fn tokens(v: &Value) -> u64 {
    v.pointer("/usage/total_tokens")
        .or_else(|| v.pointer("/usage/prompt_tokens"))
        .or_else(|| v.pointer("/meta/billed_units/input_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}
