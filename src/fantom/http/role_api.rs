//! The role containers' endpoints the master calls directly (§3.2), answered by the local
//! models: Ollama's `POST /api/embed`, OpenAI's `POST /v1/embeddings`, vLLM's `POST /v1/rerank`
//! and `POST /v1/score`. A request names its model as the heartbeat reported it
//! (`containers[role].config.model`; Ollama's `:latest` is ignored); on a role port a request
//! without a model goes to that port's role. An unknown model gets Ollama's "not found, try
//! pulling it first", which the master files as `model-missing` for 5 minutes.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Refusal, error, json_body};
use crate::agent::provider::WorkResult;
use crate::fantom::containers::{ContainerError, LocalContainer};
use crate::fantom::sidecar::Sidecar;
use crate::protocol::{EmbedInput, FailureClass, RerankInput, WorkInput, WorkOutput};
use crate::roles::{Op, Role};

/// The most texts (or documents) one request may carry.
pub const MAX_INPUTS: usize = 4096;

#[derive(Clone)]
struct RoleState {
    sidecar: Arc<Sidecar>,
    /// The roles served here; `None`: every local role (the agent port).
    roles: Option<Arc<Vec<Role>>>,
}

pub fn router(sidecar: Arc<Sidecar>, roles: Option<Vec<Role>>) -> Router {
    let state = RoleState {
        sidecar,
        roles: roles.map(Arc::new),
    };
    Router::new()
        .route("/api/embed", post(ollama_embed))
        .route("/v1/embeddings", post(openai_embeddings))
        .route("/v1/rerank", post(rerank))
        .route("/v1/score", post(score))
        .with_state(state)
}

/// One text or many (`"input": "a"` or `"input": ["a", "b"]`).
#[derive(Deserialize)]
#[serde(untagged)]
enum Texts {
    One(String),
    Many(Vec<String>),
}

impl Texts {
    fn into_vec(self) -> Vec<String> {
        match self {
            Texts::One(t) => vec![t],
            Texts::Many(v) => v,
        }
    }
}

#[derive(Deserialize)]
struct EmbedRequest {
    #[serde(default)]
    model: Option<String>,
    input: Texts,
    /// OpenAI's Matryoshka truncation.
    #[serde(default)]
    dimensions: Option<usize>,
}

/// A document as vLLM takes it: text, or `{text}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Document {
    Text(String),
    Object { text: String },
}

#[derive(Deserialize)]
struct RerankRequest {
    #[serde(default)]
    model: Option<String>,
    query: String,
    documents: Vec<Document>,
    #[serde(default)]
    top_n: Option<usize>,
    #[serde(default)]
    return_documents: bool,
}

#[derive(Deserialize)]
struct ScoreRequest {
    #[serde(default)]
    model: Option<String>,
    text_1: String,
    text_2: Texts,
}

impl RoleState {
    fn allows(&self, role: Role) -> bool {
        self.roles
            .as_ref()
            .is_none_or(|roles| roles.contains(&role))
    }

    /// The container a request is for: by model, or (on a role port) the port's role.
    fn container(&self, model: Option<&str>, op: Op) -> Result<&LocalContainer, Refusal> {
        let containers = &self.sidecar.containers;
        let of_op = |role: Role| self.allows(role) && role.op() == op;
        let found = match model.map(str::trim).filter(|m| !m.is_empty()) {
            Some(model) => containers
                .by_model(model, |r| self.allows(r))
                .ok_or_else(|| not_found(model))?,
            None if self.roles.is_some() => containers
                .first(of_op)
                .ok_or_else(|| error(StatusCode::NOT_FOUND, "no such model on this port"))?,
            None => return Err(error(StatusCode::BAD_REQUEST, "model is required")),
        };
        if found.role.op() != op {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!(
                    "model \"{}\" serves the {} role, which this endpoint does not",
                    found.model, found.role
                ),
            ));
        }
        Ok(found)
    }

    /// Runs one work item on the container.
    async fn run(
        &self,
        container: &LocalContainer,
        input: WorkInput,
    ) -> Result<WorkResult, Refusal> {
        let (provider, _active) = container.begin().map_err(|e| {
            let status = match e {
                ContainerError::Stopped(_) => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            error(status, e.to_string())
        })?;
        provider.run(input).await.map_err(|f| {
            let status = match f.class {
                FailureClass::Fatal | FailureClass::Refused => StatusCode::BAD_REQUEST,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            error(status, f.message)
        })
    }
}

fn not_found(model: &str) -> Refusal {
    error(
        StatusCode::NOT_FOUND,
        format!("model \"{model}\" not found, try pulling it first"),
    )
}

fn check_count(n: usize, what: &str) -> Result<(), Refusal> {
    if n == 0 {
        return Err(error(StatusCode::BAD_REQUEST, format!("{what} is empty")));
    }
    if n > MAX_INPUTS {
        return Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{n} {what}: at most {MAX_INPUTS} per request"),
        ));
    }
    Ok(())
}

/// Embeds a request's texts: `(model, vectors, tokens)`.
async fn embed(state: &RoleState, body: &[u8]) -> Result<(String, Vec<Vec<f32>>, u64), Refusal> {
    let req: EmbedRequest = json_body(body)?;
    let texts = req.input.into_vec();
    check_count(texts.len(), "input")?;
    let container = state.container(req.model.as_deref(), Op::Embed)?;
    let input = WorkInput::Embed(EmbedInput {
        texts,
        dimensions: req.dimensions,
        is_query: false,
        instruction: None,
        truncate: false,
    });
    let done = state.run(container, input).await?;
    match done.output {
        WorkOutput::Embeddings(vectors) => Ok((container.model.clone(), vectors, done.tokens)),
        _ => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the model answered something else",
        )),
    }
}

/// Scores documents against a query in document order: `(model, scores, tokens)`.
async fn scores(
    state: &RoleState,
    model: Option<&str>,
    query: String,
    documents: Vec<String>,
) -> Result<(String, Vec<f32>, u64), Refusal> {
    check_count(documents.len(), "documents")?;
    let container = state.container(model, Op::Rerank)?;
    let input = WorkInput::Rerank(RerankInput {
        query,
        documents,
        instruction: None,
    });
    let done = state.run(container, input).await?;
    match done.output {
        WorkOutput::Scores(scores) => Ok((
            container.model.clone(),
            scores
                .iter()
                .map(|s| s.probability.unwrap_or(s.score))
                .collect(),
            done.tokens,
        )),
        _ => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the model answered something else",
        )),
    }
}

async fn ollama_embed(State(state): State<RoleState>, body: Bytes) -> Response {
    match embed(&state, &body).await {
        Ok((model, embeddings, tokens)) => Json(json!({
            "model": model,
            "embeddings": embeddings,
            "prompt_eval_count": tokens,
        }))
        .into_response(),
        Err(refusal) => refusal.into_response(),
    }
}

async fn openai_embeddings(State(state): State<RoleState>, body: Bytes) -> Response {
    match embed(&state, &body).await {
        Ok((model, embeddings, tokens)) => {
            let data: Vec<Value> = embeddings
                .into_iter()
                .enumerate()
                .map(|(index, embedding)| {
                    json!({"object": "embedding", "index": index, "embedding": embedding})
                })
                .collect();
            Json(json!({
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }))
            .into_response()
        }
        Err(refusal) => refusal.into_response(),
    }
}

async fn rerank(State(state): State<RoleState>, body: Bytes) -> Response {
    let req: RerankRequest = match json_body(&body) {
        Ok(req) => req,
        Err(refusal) => return refusal.into_response(),
    };
    let documents: Vec<String> = req
        .documents
        .into_iter()
        .map(|d| match d {
            Document::Text(t) | Document::Object { text: t } => t,
        })
        .collect();
    let shown = req.return_documents.then(|| documents.clone());
    match scores(&state, req.model.as_deref(), req.query, documents).await {
        Ok((model, scores, tokens)) => {
            let hits = crate::fantom::commands::ranked(&scores, req.top_n);
            let results: Vec<Value> = hits
                .iter()
                .map(|h| {
                    let mut row = json!({"index": h.index, "relevance_score": h.relevance_score});
                    if let Some(docs) = &shown {
                        row["document"] = json!({"text": docs[h.index]});
                    }
                    row
                })
                .collect();
            Json(json!({
                "model": model,
                "results": results,
                "usage": {"total_tokens": tokens},
            }))
            .into_response()
        }
        Err(refusal) => refusal.into_response(),
    }
}

async fn score(State(state): State<RoleState>, body: Bytes) -> Response {
    let req: ScoreRequest = match json_body(&body) {
        Ok(req) => req,
        Err(refusal) => return refusal.into_response(),
    };
    match scores(
        &state,
        req.model.as_deref(),
        req.text_1,
        req.text_2.into_vec(),
    )
    .await
    {
        Ok((model, scores, tokens)) => {
            let data: Vec<Value> = scores
                .iter()
                .enumerate()
                .map(|(index, score)| json!({"index": index, "object": "score", "score": score}))
                .collect();
            Json(json!({
                "object": "list",
                "model": model,
                "data": data,
                "usage": {"total_tokens": tokens},
            }))
            .into_response()
        }
        Err(refusal) => refusal.into_response(),
    }
}
