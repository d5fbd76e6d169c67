//! OpenAI's shapes: `POST /v1/embeddings` (also `/embeddings`, for a `base_url` without
//! `/v1`), `GET /v1/models` and `GET /v1/models/{id}`. `model` names a role (or the model id a
//! role serves); the models listed are the roles, each with its model and, for an embedding
//! role, its space and width. Token-id input is refused (see [`super::client_api::texts_of`]).

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::client_api::{self, EmbedCall, Usage, client_auth, json_body};
use super::error::ApiError;
use crate::hub::Hub;
use crate::hub::core::SpaceRef;
use crate::hub::registry::ProviderRef;
use crate::hub::status::RoleCatalog;
use crate::roles::Op;

#[derive(Deserialize)]
pub struct EmbeddingsRequest {
    /// A role (`embedding`, `code-embedding`) or the model id one serves.
    pub model: String,
    /// A string or an array of strings (token ids are refused).
    pub input: Value,
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

/// A vector as base64 of its little-endian f32 bytes (OpenAI's and Cohere's layout).
pub(super) fn base64_of(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub async fn embeddings(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<EmbeddingsRequest>, JsonRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let client = client_auth(&hub, &headers)?;
    let req = json_body(request)?;
    let role = client_api::resolve_role(&hub, &req.model, Op::Embed)?;
    let texts = client_api::texts_of(req.input, "input")?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "encoding_format '{}' is not supported; use float or base64",
                crate::secret::redact(other)
            )));
        }
    };
    let is_query = match req.input_type.as_deref() {
        None | Some("document") => false,
        Some("query") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "input_type '{}' is not supported; use query or document",
                crate::secret::redact(other)
            )));
        }
    };
    let done = client_api::embed(
        &hub,
        EmbedCall {
            client,
            role,
            field: "input",
            texts,
            dimensions: req.dimensions,
            is_query,
            instruction: req.instruction,
        },
    )
    .await?;
    let data = done
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, e)| EmbeddingData {
            object: "embedding",
            index,
            embedding: if base64 {
                EmbeddingValue::Base64(base64_of(&e.vector))
            } else {
                EmbeddingValue::Float(e.vector)
            },
            provenance: (*e.provider).clone(),
            space: e.space.as_deref().cloned(),
        })
        .collect();
    Ok((
        done.timing.headers(),
        Json(EmbeddingsResponse {
            object: "list",
            data,
            model: role.to_string(),
            usage: Usage::of(done.tokens),
        }),
    ))
}

#[derive(Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}

/// OpenAI's Model, with our role's catalog entry as an extra field.
#[derive(Serialize)]
pub struct Model {
    pub id: String,
    pub object: &'static str,
    /// When the hub started (Unix seconds): a role has no creation date of its own.
    pub created: u64,
    pub owned_by: &'static str,
    pub x_fantom: RoleCatalog,
}

fn model_of(entry: RoleCatalog, created: u64) -> Model {
    Model {
        id: entry.role.to_string(),
        object: "model",
        created,
        owned_by: "fantom-sidecar",
        x_fantom: entry,
    }
}

fn started_s(hub: &Hub) -> u64 {
    (crate::hub::now_ms() / 1000).saturating_sub(hub.uptime().as_secs())
}

/// `GET /v1/models`: the roles the hub answers for, each with its model.
pub async fn models(
    State(hub): State<Hub>,
    headers: HeaderMap,
) -> Result<Json<ModelList>, ApiError> {
    client_auth(&hub, &headers)?;
    let created = started_s(&hub);
    Ok(Json(ModelList {
        object: "list",
        data: hub
            .catalog()
            .into_iter()
            .map(|e| model_of(e, created))
            .collect(),
    }))
}

/// `GET /v1/models/{id}`: one role, by its name or its model id (404 for one the hub does not
/// answer for).
pub async fn model(
    State(hub): State<Hub>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Model>, ApiError> {
    client_auth(&hub, &headers)?;
    let created = started_s(&hub);
    let id = id.strip_suffix(":latest").unwrap_or(&id);
    hub.catalog()
        .into_iter()
        .find(|e| e.role.as_str() == id || e.model.as_deref() == Some(id))
        .map(|e| Json(model_of(e, created)))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                "no such model here; GET /v1/models lists the roles this hub serves",
            )
        })
}
