//! Stand-ins for the model servers an operator already runs, written from each one's public
//! API (not from our client): a real HTTP server on `127.0.0.1` (random port) per instance.
//!
//! * `Vllm`: vLLM's OpenAI server: `GET /v1/models` (`data[].id`, `max_model_len`),
//!   `POST /v1/chat/completions` (whole, or server-sent events with `stream: true`),
//!   `POST /v1/embeddings`; a request naming another model is a 404 as vLLM answers it.
//! * `Ollama`: `GET /api/tags` (`models[].name`, `digest`), `POST /api/embed`
//!   (`{embeddings, prompt_eval_count}`), and its OpenAI `POST /v1/chat/completions`.
//! * `Tei`: text-embeddings-inference: `GET /health` (an empty 200), `GET /info` (`model_id`,
//!   `model_sha`), `POST /embed` (`{inputs}` → an array of vectors); no chat.
//!
//! With `rerank`, they rerank too, as each one's API does: vLLM's `POST /v1/score`
//! (`{text_1, text_2}` → `data[].score`, probabilities) and, when `cohere_route`, Cohere's
//! `POST /v1/rerank` (`results[].relevance_score`; else that path is vLLM's 404); TEI's
//! `POST /rerank` (`[{index, score}]`, logits with `raw_scores`, else probabilities). The logit
//! is a fixed function of the words a query and a document share, plus `shift`: two stand-ins
//! with the same shift are one scorer, another shift a different one.
//!
//! Vectors come from a supplied embedder (or a hash of the text), normalised, and optionally
//! perturbed to an exact cosine ([`crate::upstream::perturb`]). An API key, when set, is
//! required as a bearer token. [`ModelServer::stop`] closes the listener: from then on nothing
//! answers (connection refused), as when the process dies; [`ModelServer::restart`] answers on
//! the same port again. Every call is counted; waits are
//! on a change counter, bounded.
#![allow(dead_code)]
// Handlers answer errors as ready-made responses, as axum handlers do.
#![allow(clippy::result_large_err)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::upstream::{Embedder, embed_off_runtime, normalise, perturb};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Vllm,
    Ollama,
    Tei,
}

pub struct ModelServerConfig {
    pub kind: Kind,
    pub model: String,
    /// Clean vectors; `None`: 8 numbers from a hash of the text.
    pub embedder: Option<Embedder>,
    /// Served vectors at exactly this cosine to the clean ones.
    pub cosine: Option<f32>,
    pub api_key: Option<String>,
    /// Serves reranking (see the module's comment).
    pub rerank: Option<RerankStandIn>,
}

#[derive(Clone, Copy, Debug)]
pub struct RerankStandIn {
    /// Added to every logit.
    pub shift: f64,
    /// vLLM only: serves Cohere's `/v1/rerank` as well as `/v1/score`.
    pub cohere_route: bool,
}

#[derive(Default)]
pub struct Counts {
    pub health: AtomicU64,
    pub chats: AtomicU64,
    pub streams: AtomicU64,
    pub embed_calls: AtomicU64,
    pub embedded_texts: AtomicU64,
    pub unauthorized: AtomicU64,
    /// Documents scored on the rerank routes.
    pub reranked_docs: AtomicU64,
}

pub struct ServerState {
    cfg: ModelServerConfig,
    /// The served cosine now (starts as `cfg.cosine`).
    cosine: Mutex<Option<f32>>,
    /// Ollama's digest (TEI's `model_sha`) of the model now.
    digest: Mutex<String>,
    pub counts: Counts,
    /// The last chat body received.
    pub last_chat: Mutex<Option<Value>>,
    events: watch::Sender<u64>,
}

impl ServerState {
    /// New weights behind the same model name: another digest, vectors at `cosine`.
    pub fn swap_weights(&self, digest: &str, cosine: Option<f32>) {
        *self.digest.lock().unwrap() = digest.to_string();
        *self.cosine.lock().unwrap() = cosine;
    }

    fn bump(&self) {
        self.events.send_modify(|n| *n += 1);
    }
}

pub struct ModelServer {
    pub url: String,
    pub port: u16,
    kind: Kind,
    pub state: Arc<ServerState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ModelServer {
    pub async fn start(cfg: ModelServerConfig) -> ModelServer {
        let kind = cfg.kind;
        let state = Arc::new(ServerState {
            cosine: Mutex::new(cfg.cosine),
            digest: Mutex::new(
                "8eeb52dfb3bb9aefdf9d1ef24b3bdbcfbf5e3b7c0d1a2f3e4d5c6b7a8f9e0d1c".into(),
            ),
            cfg,
            counts: Counts::default(),
            last_chat: Mutex::new(None),
            events: watch::channel(0).0,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut server = ModelServer {
            url: format!("http://127.0.0.1:{port}"),
            port,
            kind,
            state,
            stop: None,
            task: None,
        };
        server.serve(listener);
        server
    }

    /// Answers again on the same port (the server restarted).
    pub async fn restart(&mut self) {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        self.serve(listener);
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (kind, state) = (self.kind, self.state.clone());
        let router = match kind {
            Kind::Vllm => Router::new()
                .route("/v1/models", get(vllm_models))
                .route("/v1/embeddings", post(openai_embeddings)),
            Kind::Ollama => Router::new()
                .route("/api/tags", get(ollama_tags))
                .route("/api/embed", post(ollama_embed)),
            Kind::Tei => Router::new()
                .route("/health", get(|| async { StatusCode::OK }))
                .route("/info", get(tei_info))
                .route("/embed", post(tei_embed)),
        };
        let router = match kind {
            Kind::Tei => router,
            _ => router.route("/v1/chat/completions", post(chat)),
        };
        let router = match (kind, state.cfg.rerank) {
            (Kind::Tei, Some(_)) => router.route("/rerank", post(tei_rerank)),
            (Kind::Vllm, Some(r)) => {
                let router = router.route("/v1/score", post(vllm_score));
                if r.cohere_route {
                    router.route("/v1/rerank", post(cohere_rerank))
                } else {
                    router
                }
            }
            _ => router,
        }
        .with_state(state);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        self.stop = Some(stop);
        self.task = Some(task);
    }

    /// Closes the listener and waits until it is closed: nothing answers afterwards.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(crate::support::PATIENCE, task).await;
        }
    }

    pub fn count(&self, pick: impl Fn(&Counts) -> &AtomicU64) -> u64 {
        pick(&self.state.counts).load(Ordering::SeqCst)
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message}}))).into_response()
}

/// The bearer check, when a key is set.
fn authorized(s: &ServerState, headers: &HeaderMap) -> Result<(), Response> {
    let Some(key) = &s.cfg.api_key else {
        return Ok(());
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if presented == Some(key.as_str()) {
        return Ok(());
    }
    s.counts.unauthorized.fetch_add(1, Ordering::SeqCst);
    Err(refuse(StatusCode::UNAUTHORIZED, "invalid api key"))
}

async fn vllm_models(State(s): State<Arc<ServerState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    s.counts.health.fetch_add(1, Ordering::SeqCst);
    s.bump();
    Json(
        json!({"object": "list", "data": [{"id": s.cfg.model, "object": "model",
        "owned_by": "vllm", "max_model_len": 40960}]}),
    )
    .into_response()
}

async fn ollama_tags(State(s): State<Arc<ServerState>>) -> Response {
    s.counts.health.fetch_add(1, Ordering::SeqCst);
    s.bump();
    Json(
        json!({"models": [{"name": s.cfg.model, "model": s.cfg.model,
        "digest": *s.digest.lock().unwrap(),
        "size": 274302450u64, "details": {"format": "gguf", "family": "bert"}}]}),
    )
    .into_response()
}

async fn tei_info(State(s): State<Arc<ServerState>>) -> Response {
    s.counts.health.fetch_add(1, Ordering::SeqCst);
    s.bump();
    Json(
        json!({"model_id": s.cfg.model, "model_sha": *s.digest.lock().unwrap(),
        "model_dtype": "float16", "model_type": {"embedding": {"pooling": "mean"}},
        "max_input_length": 512, "max_client_batch_size": 32, "version": "1.8.0"}),
    )
    .into_response()
}

async fn tei_embed(State(s): State<Arc<ServerState>>, body: Bytes) -> Response {
    let texts = match parse(&body).and_then(|b| texts_of(&b["inputs"])) {
        Ok(t) => t,
        Err(r) => return r,
    };
    Json(vectors(&s, texts).await).into_response()
}

/// `model` must be the server's own (vLLM: 404 `The model ... does not exist.`).
fn same_model(s: &ServerState, body: &Value) -> Result<(), Response> {
    let asked = body["model"].as_str().unwrap_or_default();
    let asked = asked.strip_suffix(":latest").unwrap_or(asked);
    if asked == s.cfg.model {
        return Ok(());
    }
    Err(refuse(
        StatusCode::NOT_FOUND,
        &format!("The model `{asked}` does not exist."),
    ))
}

fn parse(body: &Bytes) -> Result<Value, Response> {
    serde_json::from_slice(body).map_err(|_| refuse(StatusCode::BAD_REQUEST, "invalid JSON"))
}

fn texts_of(v: &Value) -> Result<Vec<String>, Response> {
    match v {
        Value::String(t) => Ok(vec![t.clone()]),
        Value::Array(a) if a.iter().all(Value::is_string) => Ok(a
            .iter()
            .map(|t| t.as_str().unwrap_or_default().to_string())
            .collect()),
        _ => Err(refuse(StatusCode::BAD_REQUEST, "input must be strings")),
    }
}

async fn vectors(s: &ServerState, texts: Vec<String>) -> Vec<Vec<f32>> {
    s.counts.embed_calls.fetch_add(1, Ordering::SeqCst);
    s.counts
        .embedded_texts
        .fetch_add(texts.len() as u64, Ordering::SeqCst);
    let clean: Vec<Vec<f32>> = match &s.cfg.embedder {
        Some(e) => embed_off_runtime(e, &texts).await,
        None => texts
            .iter()
            .map(|t| {
                (0..8u32)
                    .map(|i| ((t.len() as u32 * 31 + i * 17) % 97) as f32 + 1.0)
                    .collect()
            })
            .collect(),
    };
    let cosine = *s.cosine.lock().unwrap();
    let out = clean
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let v = normalise(v);
            match cosine {
                Some(c) => perturb(&v, c, 7 + i as u64),
                None => v,
            }
        })
        .collect();
    s.bump();
    out
}

/// An embedding request's texts: JSON, the server's own model, strings.
fn embed_texts(s: &ServerState, body: &Bytes) -> Result<Vec<String>, Response> {
    let body = parse(body)?;
    same_model(s, &body)?;
    texts_of(&body["input"])
}

async fn ollama_embed(State(s): State<Arc<ServerState>>, body: Bytes) -> Response {
    let texts = match embed_texts(&s, &body) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let tokens: usize = texts.iter().map(|t| t.len() / 4 + 1).sum();
    let embeddings = vectors(&s, texts).await;
    Json(json!({"model": s.cfg.model, "embeddings": embeddings,
        "total_duration": 1_000_000u64, "prompt_eval_count": tokens}))
    .into_response()
}

async fn openai_embeddings(
    State(s): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let texts = match authorized(&s, &headers).and_then(|()| embed_texts(&s, &body)) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let data: Vec<Value> = vectors(&s, texts)
        .await
        .into_iter()
        .enumerate()
        .map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": v}))
        .collect();
    Json(json!({"object": "list", "model": s.cfg.model, "data": data,
        "usage": {"prompt_tokens": 4, "total_tokens": 4}}))
    .into_response()
}

/// The answer's text: the server's model and the last user message, so a test knows who
/// answered what.
fn answer_text(s: &ServerState, body: &Value) -> String {
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    format!("{} says: {last}", s.cfg.model)
}

async fn chat(State(s): State<Arc<ServerState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    let body = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    if let Err(r) = same_model(&s, &body) {
        return r;
    }
    if body["messages"].as_array().is_none_or(Vec::is_empty) {
        return refuse(StatusCode::BAD_REQUEST, "messages must be a non-empty list");
    }
    *s.last_chat.lock().unwrap() = Some(body.clone());
    let text = answer_text(&s, &body);
    let model = s.cfg.model.clone();
    let usage = json!({"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19});
    if body["stream"] != true {
        s.counts.chats.fetch_add(1, Ordering::SeqCst);
        s.bump();
        return Json(json!({"id": "chatcmpl-local", "object": "chat.completion",
            "created": 1_764_000_000u64, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": usage}))
        .into_response();
    }
    s.counts.streams.fetch_add(1, Ordering::SeqCst);
    s.bump();
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-local", "object": "chat.completion.chunk",
            "created": 1_764_000_000u64, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let (head, tail) = text.split_at(text.len() / 2);
    let mut last = chunk(json!({}), json!("stop"));
    last["usage"] = usage;
    let events: String = [
        chunk(json!({"role": "assistant", "content": head}), Value::Null),
        chunk(json!({"content": tail}), Value::Null),
        last,
    ]
    .iter()
    .map(|c| format!("data: {c}\n\n"))
    .chain(["data: [DONE]\n\n".to_string()])
    .collect();
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream")],
        events,
    )
        .into_response()
}

/// The stand-ins' relevance logit: 1.5 per word (of three letters or more) a document shares
/// with the query, less 2, plus the server's shift.
pub fn stand_in_logit(query: &str, document: &str, shift: f64) -> f64 {
    let words = |t: &str| -> std::collections::BTreeSet<String> {
        t.split(|c: char| !c.is_alphanumeric())
            .filter(|w| w.len() >= 3)
            .map(str::to_lowercase)
            .collect()
    };
    let q = words(query);
    let shared = words(document).intersection(&q).count();
    1.5 * shared as f64 - 2.0 + shift
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The query and documents of a rerank body, scored (logits), counted.
fn score_body(s: &ServerState, query: &Value, docs: &Value) -> Result<Vec<f64>, Response> {
    let query = query
        .as_str()
        .ok_or_else(|| refuse(StatusCode::UNPROCESSABLE_ENTITY, "query must be a string"))?;
    let docs = texts_of(docs)?;
    let shift = s.cfg.rerank.map_or(0.0, |r| r.shift);
    s.counts
        .reranked_docs
        .fetch_add(docs.len() as u64, Ordering::SeqCst);
    s.bump();
    Ok(docs
        .iter()
        .map(|d| stand_in_logit(query, d, shift))
        .collect())
}

/// Indexes by falling score, as the servers sort their answers.
fn by_score(scores: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]));
    order
}

async fn vllm_score(State(s): State<Arc<ServerState>>, body: Bytes) -> Response {
    let logits = match parse(&body).and_then(|b| {
        same_model(&s, &b)?;
        score_body(&s, &b["text_1"], &b["text_2"])
    }) {
        Ok(l) => l,
        Err(r) => return r,
    };
    let data: Vec<Value> = logits
        .iter()
        .enumerate()
        .map(|(i, l)| json!({"index": i, "object": "score", "score": sigmoid(*l)}))
        .collect();
    Json(
        json!({"id": "score-1", "object": "list", "model": s.cfg.model, "data": data,
        "usage": {"prompt_tokens": 7 * logits.len(), "total_tokens": 7 * logits.len()}}),
    )
    .into_response()
}

async fn cohere_rerank(State(s): State<Arc<ServerState>>, body: Bytes) -> Response {
    let logits = match parse(&body).and_then(|b| {
        same_model(&s, &b)?;
        score_body(&s, &b["query"], &b["documents"])
    }) {
        Ok(l) => l,
        Err(r) => return r,
    };
    let results: Vec<Value> = by_score(&logits)
        .into_iter()
        .map(|i| json!({"index": i, "relevance_score": sigmoid(logits[i])}))
        .collect();
    Json(
        json!({"id": "rerank-1", "model": s.cfg.model, "results": results,
        "usage": {"total_tokens": 7 * logits.len()}}),
    )
    .into_response()
}

async fn tei_rerank(State(s): State<Arc<ServerState>>, body: Bytes) -> Response {
    let (logits, raw) = match parse(&body).and_then(|b| {
        let raw = b["raw_scores"].as_bool().unwrap_or(false);
        Ok((score_body(&s, &b["query"], &b["texts"])?, raw))
    }) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let rows: Vec<Value> = by_score(&logits)
        .into_iter()
        .map(|i| {
            let score = if raw { logits[i] } else { sigmoid(logits[i]) };
            json!({"index": i, "score": score})
        })
        .collect();
    Json(Value::Array(rows)).into_response()
}
