//! Ollama's `POST /api/embed` on the hub (the `ollama` client's `embed`): `model` is a role
//! name or the model id a role serves (`:latest` ignored; neither is a 404, as Ollama answers
//! for a model it does not have); `input` a string or an array of strings; an empty input is
//! Ollama's preload call and answers no vectors. Durations are integer nanoseconds, as the
//! client validates. Errors are Ollama's `{"error"}`.

use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::client_api::{self, EmbedCall, client_auth};
use super::error::{ApiError, ErrorShape, Shaped};
use crate::hub::Hub;
use crate::roles::Op;

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = OllamaEmbedRequest)]
#[schema(example = json!({"model": "embedding", "input": ["fn main() {}"]}))]
pub struct EmbedRequest {
    /// A role or the model id one serves (`:latest` ignored).
    pub model: String,
    /// A text or a list of texts; none (or "") preloads and answers no vectors.
    #[serde(default)]
    #[schema(value_type = Option<super::openapi::TextInput>)]
    pub input: Option<Value>,
    /// Ollama's default (true) is what we do; false is refused.
    #[serde(default)]
    pub truncate: Option<bool>,
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    pub dimensions: Option<usize>,
    /// Accepted and not applied (`num_ctx`, ...): the model's limits are the agent's.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub options: Option<Value>,
    /// Accepted and not applied.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub keep_alive: Option<Value>,
}

/// Ollama's embed answer, with provenance in `x_fantom`.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // a schema only: the answer is built as JSON below
#[schema(as = OllamaEmbedResponse)]
pub struct EmbedResponse {
    model: String,
    embeddings: Vec<Vec<f32>>,
    /// Nanoseconds.
    total_duration: Option<u64>,
    load_duration: Option<u64>,
    prompt_eval_count: Option<u64>,
    x_fantom: Option<super::cohere_api::CohereEmbedProvenance>,
}

/// Embeds texts (Ollama's shape).
#[utoipa::path(post, path = "/api/embed", tag = "ollama", request_body = EmbedRequest,
    responses((status = 200, body = EmbedResponse), super::openapi::OllamaErrors),
    security((), ("client_key" = [])))]
pub async fn embed(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Shaped> {
    run(&hub, &headers, &body)
        .await
        .map_err(|e| e.shaped(ErrorShape::Ollama))
}

async fn run(hub: &Hub, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    let started = Instant::now();
    let client = client_auth(hub, headers)?;
    let req: EmbedRequest = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "invalid request body: {}",
            crate::secret::redact(&e.to_string())
        ))
    })?;
    let role = client_api::role_named(hub, &req.model, Op::Embed)?.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            crate::secret::redact(&format!(
                "model '{}' not found: name an embedding role (embedding, code-embedding) or the model id one serves",
                req.model
            )),
        )
    })?;
    if req.truncate == Some(false) {
        return Err(ApiError::bad_request(
            "truncate=false is not served: a long input is cut at the model's limit",
        ));
    }
    let texts = match req.input {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) if s.is_empty() => Vec::new(),
        Some(v) => client_api::texts_of(v, "input")?,
    };
    if texts.is_empty() {
        return Ok(Json(json!({"model": req.model, "embeddings": []})).into_response());
    }
    let done = client_api::embed(
        hub,
        EmbedCall {
            client,
            role,
            field: "input",
            texts,
            dimensions: req.dimensions,
            is_query: false,
            instruction: None,
            space: None,
        },
    )
    .await?;
    let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    let provenance: Vec<_> = done.vectors.iter().map(|e| (*e.provider).clone()).collect();
    let space = done
        .vectors
        .first()
        .and_then(|e| e.space.as_deref().cloned());
    let embeddings: Vec<Vec<f32>> = done.vectors.into_iter().map(|e| e.vector).collect();
    Ok((
        done.timing.headers(),
        Json(json!({
            "model": req.model,
            "embeddings": embeddings,
            "total_duration": ns(started.elapsed()),
            "load_duration": 0,
            "prompt_eval_count": done.tokens,
            "x_fantom": {"role": role, "space": space, "provenance": provenance},
        })),
    )
        .into_response())
}
