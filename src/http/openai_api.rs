//! OpenAI's shapes: `POST /v1/embeddings` (also `/embeddings`, for a `base_url` without
//! `/v1`), `GET /v1/models` and `GET /v1/models/{id}`. `model` names a role (or the model id a
//! role serves); the models listed are the roles, each with its model and, for an embedding
//! role, its space and width. Token-id input is refused (see [`super::client_api::texts_of`]).
//! Our extension `embedding_types` (int8, uint8, binary, ubinary) answers quantized vectors in
//! each item's `embeddings_by_type`, beside `embedding`, never in it.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::client_api::{self, EmbedCall, Usage, client_auth, json_body};
use super::embedding_types;
use super::error::ApiError;
use super::openapi::{ClientErrors, TextInput};
use crate::hub::Hub;
use crate::hub::core::SpaceRef;
use crate::hub::registry::ProviderRef;
use crate::hub::status::RoleCatalog;
use crate::quantize::EmbeddingType;
use crate::roles::Op;

#[derive(Deserialize, ToSchema)]
#[schema(example = json!({"model": "embedding", "input": ["fn main() {}", "a question about parsing"]}))]
pub struct EmbeddingsRequest {
    /// A role (`embedding`, `code-embedding`) or the model id one serves.
    pub model: String,
    /// A string or an array of strings (token ids are refused).
    #[schema(value_type = TextInput)]
    pub input: Value,
    /// Matryoshka width: the first `dimensions` entries, re-normalised.
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    #[schema(minimum = 1)]
    pub dimensions: Option<usize>,
    /// `float` (default) or `base64` (little-endian f32).
    #[serde(default)]
    #[schema(schema_with = encoding_formats)]
    pub encoding_format: Option<String>,
    /// `query` applies the model's query template; `document` (default) does not.
    #[serde(default)]
    #[schema(schema_with = input_types)]
    pub input_type: Option<String>,
    /// The instruction of instruction-aware models (with `input_type: query`).
    #[serde(default)]
    pub instruction: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    /// Ours (send it with the SDK's `extra_body`): quantized types, each answered in the
    /// items' `embeddings_by_type`: `int8`, `uint8` (the space's scale at this width),
    /// `binary`, `ubinary` (sign bits). `embedding` stays as `encoding_format` says.
    #[serde(default)]
    #[schema(schema_with = quantized_types)]
    pub embedding_types: Option<Vec<String>>,
    /// Ours (send it with the SDK's `extra_body`): the space the vectors must come from,
    /// `<id>` or `<id>@<generation>` (as `X-Fantom-Space`): one of the role's live spaces
    /// (current, a migration's next, the previous one), else 409.
    #[serde(default)]
    pub space: Option<String>,
}

fn quantized_types() -> utoipa::openapi::schema::Array {
    utoipa::openapi::schema::ArrayBuilder::new()
        .items(super::openapi::one_of(&[
            "int8", "uint8", "binary", "ubinary",
        ]))
        .build()
}

fn encoding_formats() -> utoipa::openapi::Object {
    super::openapi::one_of(&["float", "base64"])
}

fn input_types() -> utoipa::openapi::Object {
    super::openapi::one_of(&["query", "document"])
}

#[derive(Serialize, ToSchema)]
pub struct EmbeddingsResponse {
    pub object: &'static str,
    pub data: Vec<EmbeddingData>,
    pub model: String,
    pub usage: Usage,
}

#[derive(Serialize, ToSchema)]
pub struct EmbeddingData {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingValue,
    pub provenance: ProviderRef,
    /// The vector space (role, model, dims) whose gate the provider passed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub space: Option<SpaceRef>,
    /// Ours: the quantized types the request's `embedding_types` asked for, by name.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub embeddings_by_type: Option<serde_json::Map<String, Value>>,
}

/// The vector: numbers, or base64 of its little-endian f32 bytes.
#[derive(Serialize, ToSchema)]
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

/// Embeds texts (OpenAI's shape); every vector names its provider and space.
#[utoipa::path(post, path = "/v1/embeddings", tag = "openai", request_body = EmbeddingsRequest,
    responses((status = 200, body = EmbeddingsResponse), ClientErrors),
    security((), ("client_key" = [])))]
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
    let quantized = embedding_types::parse(
        req.embedding_types.as_deref().unwrap_or_default(),
        EmbeddingType::is_quantized,
        "int8, uint8, binary or ubinary (the float vector is `embedding`, as encoding_format says)",
    )?;
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
            space: req.space,
        },
    )
    .await?;
    let scale = embedding_types::scale_for(&hub, &done, &quantized).await?;
    let data = done
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, e)| EmbeddingData {
            object: "embedding",
            index,
            embeddings_by_type: (!quantized.is_empty()).then(|| {
                quantized
                    .iter()
                    .map(|&t| {
                        let encoded = embedding_types::encode(t, &e.vector, scale);
                        (t.as_str().to_string(), encoded)
                    })
                    .collect()
            }),
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

/// `/v1/embeddings` for a `base_url` without `/v1`.
#[utoipa::path(post, path = "/embeddings", tag = "openai", request_body = EmbeddingsRequest,
    responses((status = 200, body = EmbeddingsResponse), ClientErrors),
    security((), ("client_key" = [])))]
pub async fn embeddings_unprefixed(
    hub: State<Hub>,
    headers: HeaderMap,
    request: Result<Json<EmbeddingsRequest>, JsonRejection>,
) -> Result<impl IntoResponse, ApiError> {
    embeddings(hub, headers, request).await
}

#[derive(Serialize, ToSchema)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}

/// OpenAI's Model, with our role's catalog entry as an extra field.
#[derive(Serialize, ToSchema)]
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
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, body = ModelList), ClientErrors),
    security((), ("client_key" = [])))]
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
#[utoipa::path(get, path = "/v1/models/{id}", tag = "openai",
    params(("id" = String, Path, description = "A role or the model id one serves")),
    responses((status = 200, body = Model), ClientErrors),
    security((), ("client_key" = [])))]
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
