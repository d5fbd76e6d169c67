//! The client API: `POST /v1/embeddings` (OpenAI-compatible; `model` names a role) and
//! `POST /v1/rerank` (Cohere/TEI shape). Each request is split into items on its role's
//! shared queue; every vector comes back with its provenance (which provider made it).

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::HeaderMap;
use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::auth;
use super::error::ApiError;
use crate::hub::Hub;
use crate::hub::core::{ItemOutput, ScorerRef, SpaceRef};
use crate::hub::queue::Shape;
use crate::hub::registry::ProviderRef;
use crate::roles::{Op, Role};

/// Inputs one request may carry.
pub const MAX_INPUTS: usize = 8192;

#[derive(Deserialize)]
#[serde(untagged)]
pub enum TextInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub struct EmbeddingsRequest {
    /// A role: `embedding` or `code-embedding`.
    pub model: String,
    pub input: TextInput,
    #[serde(default)]
    pub dimensions: Option<usize>,
    /// `float` (default) or `base64` (little-endian f32).
    #[serde(default)]
    pub encoding_format: Option<String>,
    /// `query` applies the model's query template; `document` (default) does not.
    #[serde(default)]
    pub input_type: Option<String>,
    /// The instruction of instruction-aware models (with `input_type: query`).
    #[serde(default)]
    pub instruction: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Serialize)]
pub struct EmbeddingsResponse {
    pub object: &'static str,
    pub data: Vec<EmbeddingData>,
    pub model: String,
    pub usage: Usage,
}

#[derive(Serialize)]
pub struct EmbeddingData {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingValue,
    pub provenance: ProviderRef,
    /// The vector space (role, model, dims) whose gate the provider passed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub space: Option<SpaceRef>,
}

#[derive(Serialize)]
#[serde(untagged)]
pub enum EmbeddingValue {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
}

#[derive(Deserialize)]
pub struct RerankRequest {
    /// A role; `reranker` when absent.
    #[serde(default)]
    pub model: Option<String>,
    pub query: String,
    pub documents: Vec<String>,
    #[serde(default)]
    pub top_n: Option<usize>,
    #[serde(default)]
    pub return_documents: bool,
    #[serde(default)]
    pub instruction: Option<String>,
}

#[derive(Serialize)]
pub struct RerankResponse {
    pub model: String,
    /// The one scorer every score came from (a request is never scored on two scales).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scorer: Option<ScorerRef>,
    pub results: Vec<RerankResult>,
    pub usage: Usage,
}

#[derive(Serialize)]
pub struct RerankResult {
    pub index: usize,
    /// The scorer's probability where it defines one (cross-encoders with a sigmoid, Qwen3,
    /// cloud rerankers), else its raw logit; one scale per response.
    pub relevance_score: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<RerankDocument>,
    pub provenance: ProviderRef,
}

#[derive(Serialize)]
pub struct RerankDocument {
    pub text: String,
}

pub(super) fn client_auth(hub: &Hub, headers: &HeaderMap) -> Result<(), ApiError> {
    match hub.client_token() {
        Some(token) => auth::require(headers, token, "client"),
        None => Ok(()),
    }
}

fn body<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(b)| b).map_err(|e| {
        let shown = crate::secret::redact(&e.body_text());
        ApiError::bad_request(format!("invalid request body: {shown}"))
    })
}

/// The role a request names, checked against the operation of its endpoint.
pub(super) fn role_for(name: &str, op: Op) -> Result<Role, ApiError> {
    let role: Role = name
        .parse()
        .map_err(|e: crate::roles::UnknownRole| ApiError::bad_request(e.to_string()))?;
    if role.op() != op {
        let endpoint = match role.op() {
            Op::Embed => "/v1/embeddings",
            Op::Rerank => "/v1/rerank",
            Op::Chat => "/v1/chat/completions",
        };
        return Err(ApiError::bad_request(format!(
            "role '{role}' is not served here; use {endpoint}"
        )));
    }
    Ok(role)
}

fn check_texts(texts: &[String], what: &str) -> Result<(), ApiError> {
    if texts.is_empty() {
        return Err(ApiError::bad_request(format!("{what} is empty")));
    }
    if texts.len() > MAX_INPUTS {
        return Err(ApiError::bad_request(format!(
            "{what} has {} entries; at most {MAX_INPUTS} per request",
            texts.len()
        )));
    }
    if let Some(i) = texts.iter().position(|t| t.is_empty()) {
        return Err(ApiError::bad_request(format!(
            "{what}[{i}] is an empty string"
        )));
    }
    Ok(())
}

pub async fn embeddings(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<EmbeddingsRequest>, JsonRejection>,
) -> Result<Json<EmbeddingsResponse>, ApiError> {
    client_auth(&hub, &headers)?;
    let req = body(request)?;
    let role = role_for(&req.model, Op::Embed)?;
    let texts = match req.input {
        TextInput::One(t) => vec![t],
        TextInput::Many(ts) => ts,
    };
    check_texts(&texts, "input")?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "encoding_format '{other}' is not supported; use float or base64"
            )));
        }
    };
    let is_query = match req.input_type.as_deref() {
        None | Some("document") => false,
        Some("query") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "input_type '{other}' is not supported; use query or document"
            )));
        }
    };
    if req.dimensions == Some(0) {
        return Err(ApiError::bad_request("dimensions must be at least 1"));
    }
    let shape = Shape::Embed {
        dimensions: req.dimensions,
        is_query,
        instruction: req.instruction,
    };
    let done = hub.run(role, shape, texts).await?;
    let mut data = Vec::with_capacity(done.items.len());
    for (index, served) in done.items.into_iter().enumerate() {
        let ItemOutput::Vector(v) = served.output else {
            return Err(ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "bad_output",
                "a provider returned scores for an embedding request",
            ));
        };
        let embedding = if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            EmbeddingValue::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            EmbeddingValue::Float(v)
        };
        data.push(EmbeddingData {
            object: "embedding",
            index,
            embedding,
            provenance: (*served.provider).clone(),
            space: served.space.as_deref().cloned(),
        });
    }
    Ok(Json(EmbeddingsResponse {
        object: "list",
        data,
        model: role.to_string(),
        usage: Usage {
            prompt_tokens: done.tokens,
            total_tokens: done.tokens,
        },
    }))
}

pub async fn rerank(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<RerankRequest>, JsonRejection>,
) -> Result<Json<RerankResponse>, ApiError> {
    client_auth(&hub, &headers)?;
    let req = body(request)?;
    let role = role_for(req.model.as_deref().unwrap_or("reranker"), Op::Rerank)?;
    if req.query.is_empty() {
        return Err(ApiError::bad_request("query is an empty string"));
    }
    check_texts(&req.documents, "documents")?;
    let keep = req.return_documents.then(|| req.documents.clone());
    let shape = Shape::Rerank {
        query: req.query,
        instruction: req.instruction,
    };
    let done = hub.run(role, shape, req.documents).await?;
    let mut results = Vec::with_capacity(done.items.len());
    for (index, served) in done.items.into_iter().enumerate() {
        let ItemOutput::Score(s) = served.output else {
            return Err(ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "bad_output",
                "a provider returned vectors for a rerank request",
            ));
        };
        results.push(RerankResult {
            index,
            relevance_score: s.probability.unwrap_or(s.score),
            document: keep.as_ref().map(|d| RerankDocument {
                text: d[index].clone(),
            }),
            provenance: (*served.provider).clone(),
        });
    }
    results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
    if let Some(n) = req.top_n {
        results.truncate(n);
    }
    Ok(Json(RerankResponse {
        model: role.to_string(),
        scorer: done.scorer.as_deref().cloned(),
        results,
        usage: Usage {
            prompt_tokens: done.tokens,
            total_tokens: done.tokens,
        },
    }))
}
