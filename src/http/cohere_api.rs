//! Cohere's v2 shapes (`cohere.ClientV2`): `POST /v2/embed` and `POST /v2/rerank`. `model`
//! names a role or the model id one serves; `input_type: search_query` applies the model's
//! query template; `embedding_types` float, base64 (little-endian f32, as OpenAI's), int8 and
//! uint8 (with the space's scale), binary and ubinary (sign bits), each asked one answered
//! (`super::embedding_types`). Our provenance goes in an extra `x_fantom` object (the SDK
//! keeps unknown fields). Errors are Cohere's `{"message"}`.

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::client_api::{self, EmbedCall, client_auth, json_body};
use super::embedding_types;
use super::error::{ApiError, ErrorShape, Shaped};
use super::openapi::CohereErrors;
use super::request_id;
use crate::hub::Hub;
use crate::quantize::EmbeddingType;
use crate::roles::Op;
use utoipa::ToSchema;

const SHAPE: ErrorShape = ErrorShape::Cohere;

#[derive(Deserialize, ToSchema)]
#[schema(as = CohereEmbedRequest)]
#[schema(example = json!({"model": "embedding", "texts": ["fn main() {}"], "input_type": "search_document", "embedding_types": ["float"]}))]
pub struct EmbedRequest {
    /// A role (`embedding`, `code-embedding`) or the model id one serves.
    pub model: String,
    /// `search_query` applies the model's query template; `search_document` (default),
    /// `classification` and `clustering` do not.
    #[serde(default)]
    #[schema(schema_with = input_types)]
    pub input_type: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<super::openapi::TextInput>)]
    pub texts: Option<Value>,
    /// Refused: only texts are embedded here.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub images: Option<Value>,
    /// Refused: only texts are embedded here.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub inputs: Option<Value>,
    /// `float` (default), `base64`, `int8`, `uint8`, `binary`, `ubinary`: each one asked is
    /// answered. int8/uint8 use one scale per space and width, fixed when first asked and
    /// never changed, so codes of one space stay comparable.
    #[serde(default)]
    #[schema(schema_with = embedding_types)]
    pub embedding_types: Option<Vec<String>>,
    /// `END` (Cohere's default and ours: a long input loses its end); others are refused.
    #[serde(default)]
    #[schema(schema_with = truncations)]
    pub truncate: Option<String>,
    /// Refused: inputs are cut at the model's own limit.
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    pub max_tokens: Option<u64>,
    /// Matryoshka width (the first `output_dimension` entries, re-normalised).
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    pub output_dimension: Option<usize>,
    /// Ours: the space the vectors must come from, `<id>` or `<id>@<generation>` (as
    /// `X-Fantom-Space`): one of the role's live spaces, else 409.
    #[serde(default)]
    pub space: Option<String>,
}

fn input_types() -> utoipa::openapi::Object {
    super::openapi::one_of(&[
        "search_query",
        "search_document",
        "classification",
        "clustering",
    ])
}

fn embedding_types() -> utoipa::openapi::schema::Array {
    utoipa::openapi::schema::ArrayBuilder::new()
        .items(super::openapi::one_of(&[
            "float", "base64", "int8", "uint8", "binary", "ubinary",
        ]))
        .build()
}

fn truncations() -> utoipa::openapi::Object {
    super::openapi::one_of(&["END"])
}

fn cohere_meta(tokens_field: &str, tokens: u64) -> Value {
    json!({"api_version": {"version": "2"}, "billed_units": {tokens_field: tokens}})
}

/// Cohere's `truncate` as we serve it: only `END` (what the engine does to a long input).
fn check_truncate(truncate: Option<&str>) -> Result<(), ApiError> {
    match truncate {
        None => Ok(()),
        Some(t) if t.eq_ignore_ascii_case("END") => Ok(()),
        Some(_) => Err(ApiError::bad_request(
            "truncate: only END is served (an input longer than the model's limit loses its end; \
             GET /info shows the limit). Leave truncate out or send END",
        )),
    }
}

/// Embeds texts (Cohere's v2 shape), with provenance in `x_fantom`.
#[utoipa::path(post, path = "/v2/embed", tag = "cohere", request_body = EmbedRequest,
    responses((status = 200, body = CohereEmbedResponse), CohereErrors),
    security((), ("client_key" = [])))]
pub async fn embed(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<EmbedRequest>, JsonRejection>,
) -> Result<impl IntoResponse, Shaped> {
    run_embed(&hub, &headers, request)
        .await
        .map_err(|e| e.shaped(SHAPE))
}

async fn run_embed(
    hub: &Hub,
    headers: &HeaderMap,
    request: Result<Json<EmbedRequest>, JsonRejection>,
) -> Result<impl IntoResponse + use<>, ApiError> {
    let client = client_auth(hub, headers)?;
    let req = json_body(request)?;
    let role = client_api::resolve_role(hub, &req.model, Op::Embed)?;
    if req.images.is_some() || req.inputs.is_some() {
        return Err(ApiError::bad_request(
            "only texts are embedded here: send them as `texts` (images and mixed `inputs` are not served)",
        ));
    }
    let is_query = match req.input_type.as_deref() {
        Some("search_query") => true,
        None | Some("search_document" | "classification" | "clustering") => false,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "input_type '{}' is not served; use search_document or search_query",
                crate::secret::redact(other)
            )));
        }
    };
    check_truncate(req.truncate.as_deref())?;
    if req.max_tokens.is_some() {
        return Err(ApiError::bad_request(
            "max_tokens is not served: inputs are cut at the model's own limit (GET /info)",
        ));
    }
    let types = match req.embedding_types {
        Some(t) if !t.is_empty() => embedding_types::parse(
            &t,
            |_| true,
            "float, base64, int8, uint8, binary or ubinary",
        )?,
        _ => vec![EmbeddingType::Float],
    };
    let texts = client_api::texts_of(
        req.texts
            .ok_or_else(|| ApiError::bad_request("texts is missing"))?,
        "texts",
    )?;
    let shown = texts.clone();
    let done = client_api::embed(
        hub,
        EmbedCall {
            client,
            role,
            field: "texts",
            texts,
            dimensions: req.output_dimension,
            is_query,
            instruction: None,
            space: req.space,
        },
    )
    .await?;
    let scale = embedding_types::scale_for(hub, &done, &types).await?;
    let mut embeddings = Map::new();
    for &t in &types {
        let rows: Vec<Value> = done
            .vectors
            .iter()
            .map(|e| embedding_types::encode(t, &e.vector, scale))
            .collect();
        embeddings.insert(t.as_str().to_string(), Value::Array(rows));
    }
    let provenance: Vec<_> = done.vectors.iter().map(|e| &*e.provider).collect();
    let space = done.vectors.first().and_then(|e| e.space.as_deref());
    let body = json!({
        "id": request_id::current(),
        "response_type": "embeddings_by_type",
        "embeddings": embeddings,
        "texts": shown,
        "meta": cohere_meta("input_tokens", done.tokens),
        "x_fantom": {"role": role, "space": space, "provenance": provenance},
    });
    Ok((done.timing.headers(), Json(body)))
}

#[derive(Deserialize, ToSchema)]
#[schema(as = CohereRerankRequest)]
#[schema(example = json!({"model": "reranker", "query": "how are tokens counted?", "documents": ["tokens are counted per input", "the weather is fine"], "top_n": 1}))]
pub struct RerankRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub query: String,
    /// Strings (v2), or `{"text": ...}` objects (v1 clients).
    #[schema(value_type = Vec<CohereDocument>)]
    pub documents: Vec<Value>,
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    pub top_n: Option<usize>,
    /// Not in the v2 SDK; accepted (v1 clients send it).
    #[serde(default)]
    pub return_documents: bool,
    /// Accepted and not applied: documents are cut at the scorer's own limit.
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    pub max_tokens_per_doc: Option<u64>,
}

/// Ranks documents against a query (Cohere's v2 shape), with provenance in `x_fantom`.
#[utoipa::path(post, path = "/v2/rerank", tag = "cohere", request_body = RerankRequest,
    responses((status = 200, body = CohereRerankResponse), CohereErrors),
    security((), ("client_key" = [])))]
pub async fn rerank(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<RerankRequest>, JsonRejection>,
) -> Result<impl IntoResponse, Shaped> {
    run_rerank(&hub, &headers, request)
        .await
        .map_err(|e| e.shaped(SHAPE))
}

async fn run_rerank(
    hub: &Hub,
    headers: &HeaderMap,
    request: Result<Json<RerankRequest>, JsonRejection>,
) -> Result<impl IntoResponse + use<>, ApiError> {
    let client = client_auth(hub, headers)?;
    let req = json_body(request)?;
    let role =
        client_api::resolve_role(hub, req.model.as_deref().unwrap_or("reranker"), Op::Rerank)?;
    if req.top_n == Some(0) {
        return Err(ApiError::bad_request("top_n must be at least 1"));
    }
    // v2 sends strings; v1 clients may send `{"text": ...}` objects.
    let documents = req
        .documents
        .into_iter()
        .enumerate()
        .map(|(i, d)| match d {
            Value::String(s) => Ok(s),
            Value::Object(mut o) => match o.remove("text") {
                Some(Value::String(s)) => Ok(s),
                _ => Err(ApiError::bad_request(format!("documents[{i}] has no text"))),
            },
            _ => Err(ApiError::bad_request(format!(
                "documents[{i}] is not a string"
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let keep = req.return_documents.then(|| documents.clone());
    let mut done = client_api::rerank(
        hub,
        &client,
        role,
        req.query,
        ("documents", documents),
        None,
    )
    .await?;
    if let Some(n) = req.top_n {
        done.results.truncate(n);
    }
    let results: Vec<Value> = done
        .results
        .iter()
        .map(|r| {
            let mut item = json!({"index": r.index, "relevance_score": r.relevance});
            if let Some(docs) = &keep {
                item["document"] = json!({"text": docs[r.index]});
            }
            item
        })
        .collect();
    let provenance: Vec<_> = done.results.iter().map(|r| &*r.provider).collect();
    let body = json!({
        "id": request_id::current(),
        "results": results,
        "meta": cohere_meta("search_units", 1),
        "x_fantom": {"role": role, "scorer": done.scorer.as_deref(), "provenance": provenance, "tokens": done.tokens},
    });
    Ok((done.timing.headers(), Json(body)))
}

/// A document to rank: a string, or an object with `text`.
#[derive(ToSchema)]
#[allow(dead_code)] // schemas only: the bodies are built as JSON in the handlers
#[serde(untagged)]
pub enum CohereDocument {
    Text(String),
    Object { text: String },
}

/// Cohere's `embeddings_by_type` answer.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereEmbedResponse {
    /// The request id.
    id: String,
    /// `embeddings_by_type`.
    response_type: String,
    /// One list per type asked for.
    embeddings: CohereEmbeddings,
    texts: Vec<String>,
    meta: CohereMeta,
    /// The role, the space and each vector's provider.
    x_fantom: CohereEmbedProvenance,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereEmbeddings {
    float: Option<Vec<Vec<f32>>>,
    /// Base64 of each vector's little-endian f32 bytes.
    base64: Option<Vec<String>>,
    /// `clamp(round(v × 127 / r), −128, 127)` with the space's scale `r` at this width.
    int8: Option<Vec<Vec<i8>>>,
    /// The int8 codes + 128.
    uint8: Option<Vec<Vec<u8>>>,
    /// The sign bits (`v > 0`), eight to a byte, most significant first, zero-padded; − 128.
    binary: Option<Vec<Vec<i8>>>,
    /// The sign bits as bytes 0..=255.
    ubinary: Option<Vec<Vec<u8>>>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereMeta {
    #[schema(value_type = Object)]
    api_version: Value,
    /// `input_tokens` (embed) or `search_units` (rerank).
    #[schema(value_type = Object)]
    billed_units: Value,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereEmbedProvenance {
    role: crate::roles::Role,
    space: Option<crate::hub::core::SpaceRef>,
    provenance: Vec<crate::hub::registry::ProviderRef>,
}

/// Cohere's rerank answer.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereRerankResponse {
    id: String,
    results: Vec<CohereRerankResult>,
    meta: CohereMeta,
    x_fantom: CohereRerankProvenance,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereRerankResult {
    index: usize,
    relevance_score: f32,
    document: Option<super::client_api::RerankDocument>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereRerankProvenance {
    role: crate::roles::Role,
    scorer: Option<crate::hub::registry::ScorerRef>,
    provenance: Vec<crate::hub::registry::ProviderRef>,
    tokens: u64,
}
