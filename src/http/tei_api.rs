//! text-embeddings-inference's shapes, for `huggingface_hub.InferenceClient`, LangChain's and
//! LlamaIndex's Hugging Face integrations: `POST /embed`, `POST /rerank`, `POST /similarity`,
//! `GET /info`, and `POST /`, which TEI answers by its one model's kind and a hub of many
//! roles answers by the body: `inputs.source_sentence` is a similarity, `query` + `texts` a
//! rerank, a string `inputs` with `parameters` a text classification (refused: no classifier
//! is served), anything else an embedding. `GET /` and `GET /ping` answer as `/health`. TEI has no `model`; here an optional `model` field (or
//! `?model=` on `/info`) names a role or model id, and each route has a default role
//! (`embedding` for embeddings and similarity, `reranker` for rerank).
//!
//! The answers are TEI's bare arrays, so provenance travels in headers: `x-fantom-space` (the
//! vectors' space) and `x-fantom-providers` (who served them). Errors are TEI's
//! `{"error", "error_type"}`.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};

use super::client_api::{self, Client, EmbedCall, Embedded, client_auth};
use super::error::{ApiError, ErrorShape, Shaped};
use super::openapi::{TeiErrors, TextInput};
use crate::hub::Hub;
use crate::roles::{Op, Role};

const SHAPE: ErrorShape = ErrorShape::Tei;

/// TEI's embed body (unknown fields, such as `parameters`, are ignored as TEI does).
#[derive(Deserialize, ToSchema)]
#[schema(as = TeiEmbedRequest)]
#[schema(example = json!({"inputs": ["What is Deep Learning?"], "prompt_name": "query"}))]
pub struct EmbedRequest {
    /// Ours: a role or the model id one serves (default `embedding`).
    #[serde(default)]
    pub model: Option<String>,
    /// A text or a list of texts (token ids are refused).
    #[schema(value_type = TextInput)]
    pub inputs: Value,
    /// Only `true` is served.
    #[serde(default)]
    pub normalize: Option<bool>,
    #[serde(flatten)]
    pub parameters: TextParameters,
    /// Matryoshka width: the first `dimensions` entries, re-normalised.
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    #[schema(minimum = 1)]
    pub dimensions: Option<usize>,
    /// Refused: TEI's `/embed` answers floats only. Quantized types (int8, uint8, binary,
    /// ubinary) are served by `/v2/embed` and as `/v1/embeddings`' extension.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub embedding_types: Option<Value>,
}

#[derive(Deserialize, ToSchema)]
#[schema(as = TeiRerankRequest)]
#[schema(example = json!({"query": "What is Deep Learning?", "texts": ["Deep Learning is ...", "Tea is a drink"], "return_text": true}))]
pub struct RerankRequest {
    /// Ours: a role or the model id one serves (default `reranker`).
    #[serde(default)]
    pub model: Option<String>,
    pub query: String,
    pub texts: Vec<String>,
    #[serde(default)]
    pub raw_scores: bool,
    #[serde(default)]
    pub return_text: bool,
    #[serde(default)]
    pub truncate: Option<bool>,
    #[serde(default)]
    #[schema(schema_with = truncation_directions)]
    pub truncation_direction: Option<String>,
}

#[derive(Deserialize, ToSchema)]
pub struct SimilarityInputs {
    pub source_sentence: String,
    pub sentences: Vec<String>,
}

/// How texts are prepared: `/embed`'s fields, and `/similarity`'s `parameters`.
#[derive(Deserialize, Default, ToSchema)]
pub struct TextParameters {
    /// Only `true` (the default) is served: a long input is cut at the model's limit.
    #[serde(default)]
    pub truncate: Option<bool>,
    /// Only `right` (the default) is served.
    #[serde(default)]
    #[schema(schema_with = truncation_directions)]
    pub truncation_direction: Option<String>,
    /// `query` applies the model's query template; `document`/`passage` or none do not.
    #[serde(default)]
    #[schema(schema_with = prompt_names)]
    pub prompt_name: Option<String>,
}

impl TextParameters {
    /// Whether the query template applies; a refusal for what is not served.
    fn is_query(&self) -> Result<bool, ApiError> {
        check_truncation(self.truncate, self.truncation_direction.as_deref())?;
        wants_query_template(self.prompt_name.as_deref())
    }
}

#[derive(Deserialize, ToSchema)]
#[schema(example = json!({"inputs": {"source_sentence": "What is Deep Learning?", "sentences": ["What is Machine Learning?"]}}))]
pub struct SimilarityRequest {
    /// Ours: a role or the model id one serves (default `embedding`).
    #[serde(default)]
    pub model: Option<String>,
    pub inputs: SimilarityInputs,
    #[serde(default)]
    pub parameters: Option<TextParameters>,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "invalid request body: {}",
            crate::secret::redact(&e.to_string())
        ))
    })
}

/// The role a TEI body names, else the route's default.
fn role_of(hub: &Hub, model: Option<&str>, op: Op, default: Role) -> Result<Role, ApiError> {
    match model {
        None => Ok(default),
        Some(name) => client_api::resolve_role(hub, name, op),
    }
}

/// TEI's truncation as we serve it: on (the default), cutting the end of a long input.
fn check_truncation(truncate: Option<bool>, direction: Option<&str>) -> Result<(), ApiError> {
    if truncate == Some(false) {
        return Err(ApiError::bad_request(
            "truncate=false is not served per request: a long input is cut at the model's limit \
             (GET /info shows max_input_length); leave truncate out or send true",
        ));
    }
    match direction {
        None => Ok(()),
        Some(d) if d.eq_ignore_ascii_case("right") => Ok(()),
        Some(_) => Err(ApiError::bad_request(
            "truncation_direction: only right is served (a long input loses its end)",
        )),
    }
}

/// Whether `prompt_name` asks for the model's query template.
fn wants_query_template(prompt_name: Option<&str>) -> Result<bool, ApiError> {
    match prompt_name {
        None | Some("document" | "passage") => Ok(false),
        Some("query") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "prompt_name '{}' is not served; use query, document, or leave it out",
            crate::secret::redact(other)
        ))),
    }
}

fn truncation_directions() -> utoipa::openapi::Object {
    super::openapi::one_of(&["right", "Right"])
}

fn prompt_names() -> utoipa::openapi::Object {
    super::openapi::one_of(&["query", "document", "passage"])
}

/// Where the answer came from, for a bare-array body.
fn provenance_headers(done: &Embedded) -> HeaderMap {
    let mut headers = done.timing.headers();
    if let Some(space) = done.vectors.first().and_then(|e| e.space.as_deref())
        && let Ok(v) = HeaderValue::from_str(&space.id)
    {
        headers.insert("x-fantom-space", v);
    }
    let mut providers: Vec<&str> = done
        .vectors
        .iter()
        .map(|e| e.provider.provider.as_str())
        .collect();
    providers.sort_unstable();
    providers.dedup();
    if let Ok(v) = HeaderValue::from_str(&providers.join(",")) {
        headers.insert("x-fantom-providers", v);
    }
    headers
}

async fn run_embed(hub: &Hub, client: Client, req: EmbedRequest) -> Result<Response, ApiError> {
    let role = role_of(hub, req.model.as_deref(), Op::Embed, Role::Embedding)?;
    if req.embedding_types.is_some() {
        return Err(ApiError::bad_request(
            "embedding_types is not served on TEI's /embed, which answers floats only: ask \
             POST /v2/embed (Cohere's embedding_types) or POST /v1/embeddings (our \
             embedding_types extension) for int8, uint8, binary or ubinary",
        ));
    }
    if req.normalize == Some(false) {
        return Err(ApiError::bad_request(
            "normalize=false is not served: a space's vectors are as its pinned model makes them \
             (unit length for every pinned embedder); leave normalize out or send true",
        ));
    }
    let is_query = req.parameters.is_query()?;
    let texts = client_api::texts_of(req.inputs, "inputs")?;
    let done = client_api::embed(
        hub,
        EmbedCall {
            client,
            role,
            field: "inputs",
            texts,
            dimensions: req.dimensions,
            is_query,
            instruction: None,
            space: None,
        },
    )
    .await?;
    let headers = provenance_headers(&done);
    let vectors: Vec<Vec<f32>> = done.vectors.into_iter().map(|e| e.vector).collect();
    Ok((headers, Json(vectors)).into_response())
}

async fn run_rerank(hub: &Hub, client: Client, req: RerankRequest) -> Result<Response, ApiError> {
    let role = role_of(hub, req.model.as_deref(), Op::Rerank, Role::Reranker)?;
    check_truncation(req.truncate, req.truncation_direction.as_deref())?;
    let keep = req.return_text.then(|| req.texts.clone());
    let done =
        client_api::rerank(hub, &client, role, req.query, ("texts", req.texts), None).await?;
    let mut headers = done.timing.headers();
    if let Some(scorer) = &done.scorer
        && let Ok(v) = HeaderValue::from_str(&scorer.id)
    {
        headers.insert("x-fantom-scorer", v);
    }
    let results: Vec<Value> = done
        .results
        .iter()
        .map(|r| {
            let score = if req.raw_scores { r.raw } else { r.relevance };
            let mut item = json!({"index": r.index, "score": score});
            if let Some(texts) = &keep {
                item["text"] = json!(texts[r.index]);
            }
            item
        })
        .collect();
    Ok((headers, Json(results)).into_response())
}

async fn run_similarity(
    hub: &Hub,
    client: Client,
    req: SimilarityRequest,
) -> Result<Response, ApiError> {
    let role = role_of(hub, req.model.as_deref(), Op::Embed, Role::Embedding)?;
    let is_query = req.parameters.unwrap_or_default().is_query()?;
    if req.inputs.sentences.is_empty() {
        return Err(ApiError::bad_request("inputs.sentences is empty"));
    }
    let mut texts = vec![req.inputs.source_sentence];
    texts.extend(req.inputs.sentences);
    // One request: the source and the sentences are embedded in one space.
    let done = client_api::embed(
        hub,
        EmbedCall {
            client,
            role,
            field: "inputs",
            texts,
            dimensions: None,
            is_query,
            instruction: None,
            space: None,
        },
    )
    .await?;
    let headers = provenance_headers(&done);
    let (source, others) = done
        .vectors
        .split_first()
        .ok_or_else(|| ApiError::bad_request("nothing to compare"))?;
    let cosines: Vec<f32> = others
        .iter()
        .map(|e| cosine(&source.vector, &e.vector))
        .collect();
    Ok((headers, Json(cosines)).into_response())
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

/// Runs a TEI handler: client token, then the body, errors in TEI's shape.
async fn answer<T, F>(hub: Hub, headers: HeaderMap, body: Bytes, run: F) -> Result<Response, Shaped>
where
    T: serde::de::DeserializeOwned,
    F: AsyncFnOnce(&Hub, Client, T) -> Result<Response, ApiError>,
{
    let result = async {
        let client = client_auth(&hub, &headers)?;
        run(&hub, client, parse::<T>(&body)?).await
    };
    result.await.map_err(|e| e.shaped(SHAPE))
}

/// Embeds texts; the vectors' space and providers are in `x-fantom-space` and
/// `x-fantom-providers`.
#[utoipa::path(post, path = "/embed", tag = "tei", request_body = EmbedRequest,
    responses((status = 200, body = Vec<Vec<f32>>, headers(
        ("x-fantom-space" = String, description = "The vectors' space"),
        ("x-fantom-providers" = String, description = "Who served them"))), TeiErrors),
    security((), ("client_key" = [])))]
pub async fn embed(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Shaped> {
    answer(hub, headers, body, run_embed).await
}

/// Ranks texts against a query, best first; the scorer is in `x-fantom-scorer`.
#[utoipa::path(post, path = "/rerank", tag = "tei", request_body = RerankRequest,
    responses((status = 200, body = Vec<TeiRank>), TeiErrors),
    security((), ("client_key" = [])))]
pub async fn rerank(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Shaped> {
    answer(hub, headers, body, run_rerank).await
}

/// The cosine of `source_sentence` with each sentence (all embedded in one space).
#[utoipa::path(post, path = "/similarity", tag = "tei", request_body = SimilarityRequest,
    responses((status = 200, body = Vec<f32>), TeiErrors),
    security((), ("client_key" = [])))]
pub async fn similarity(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Shaped> {
    answer(hub, headers, body, run_similarity).await
}

/// `POST /`: dispatched on the body (see the module comment).
#[utoipa::path(post, path = "/", tag = "tei", request_body = TeiRootRequest,
    responses((status = 200, body = TeiRootAnswer), TeiErrors),
    security((), ("client_key" = [])))]
pub async fn root(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Shaped> {
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return answer(hub, headers, body, run_embed).await,
    };
    let inputs = value.get("inputs");
    if inputs.is_some_and(|i| i.get("source_sentence").is_some()) {
        answer(hub, headers, body, run_similarity).await
    } else if value.get("query").is_some() && value.get("texts").is_some() {
        answer(hub, headers, body, run_rerank).await
    } else if value.get("parameters").is_some() && inputs.is_some_and(Value::is_string) {
        // What `text_classification` sends (older embedding integrations send `parameters`
        // with an array of inputs: those embed).
        client_auth(&hub, &headers).map_err(|e| e.shaped(SHAPE))?;
        Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "no_classifier",
            "this server serves no text classifier: to score texts against a query, POST /rerank \
             with {\"query\", \"texts\"}; to embed, POST /embed with {\"inputs\"}",
        )
        .shaped(SHAPE))
    } else {
        answer(hub, headers, body, run_embed).await
    }
}

/// The roles the hub answers for, for an error that names them.
fn served_roles(hub: &Hub) -> String {
    let roles: Vec<String> = hub.catalog().iter().map(|c| c.role.to_string()).collect();
    if roles.is_empty() {
        "none yet: GET /ready says why".into()
    } else {
        roles.join(", ")
    }
}

#[derive(Deserialize, IntoParams)]
pub struct InfoQuery {
    /// A role or the model id one serves (default `embedding`).
    #[serde(default)]
    pub model: Option<String>,
}

/// TEI's `Info`, every field its schema requires, for one role. The hub does not tokenize (its
/// agents do): `tokenization_workers` counts the role's providers. A number not known for a
/// cloud or fronted provider is 0 (`x_fantom` has the role's entry as it is known).
#[derive(Serialize, ToSchema)]
pub struct TeiInfo {
    pub model_id: String,
    pub model_sha: Option<String>,
    pub model_dtype: String,
    pub served_model_name: String,
    #[schema(value_type = Object)]
    pub model_type: Value,
    /// The role queue's capacity in items: past it, 429.
    pub max_concurrent_requests: usize,
    pub max_input_length: usize,
    pub max_batch_tokens: usize,
    pub max_batch_requests: Option<usize>,
    pub max_client_batch_size: usize,
    /// Always true: a long input is cut at the model's limit.
    pub auto_truncate: bool,
    pub tokenization_workers: usize,
    pub version: &'static str,
    pub x_fantom: crate::hub::status::RoleCatalog,
}

/// One ranked text.
#[derive(ToSchema)]
#[allow(dead_code)] // schemas only: the answers are built as JSON in the handlers
pub struct TeiRank {
    pub index: usize,
    /// A probability, or the raw logit with `raw_scores`.
    pub score: f32,
    /// With `return_text`.
    pub text: Option<String>,
}

/// What `POST /` takes: an embed, similarity or rerank body.
#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub enum TeiRootRequest {
    Embed(EmbedRequest),
    Similarity(SimilarityRequest),
    Rerank(RerankRequest),
}

/// What `POST /` answers: vectors, similarities or ranks, as the body asked.
#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub enum TeiRootAnswer {
    Vectors(Vec<Vec<f32>>),
    Similarities(Vec<f32>),
    Ranks(Vec<TeiRank>),
}

/// `GET /info`: TEI's fields for one role (`?model=`, default `embedding`).
#[utoipa::path(get, path = "/info", tag = "tei", params(InfoQuery),
    responses((status = 200, body = TeiInfo), TeiErrors),
    security((), ("client_key" = [])))]
pub async fn info(
    State(hub): State<Hub>,
    headers: HeaderMap,
    Query(q): Query<InfoQuery>,
) -> Result<Json<TeiInfo>, Shaped> {
    let run = || -> Result<Json<TeiInfo>, ApiError> {
        client_auth(&hub, &headers)?;
        let role = match q.model.as_deref() {
            None => Role::Embedding,
            Some(name) => name.parse::<Role>().or_else(|_| {
                client_api::resolve_role(&hub, name, Op::Embed)
                    .or_else(|_| client_api::resolve_role(&hub, name, Op::Rerank))
            })?,
        };
        let entry = hub
            .catalog()
            .into_iter()
            .find(|c| c.role == role)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "model_not_found",
                    format!(
                        "role {role} is not served here; name one with ?model= ({})",
                        served_roles(&hub)
                    ),
                )
            })?;
        let model_type = match role.op() {
            Op::Rerank => {
                json!({"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}})
            }
            _ => json!({"embedding": {"pooling": entry.pooling}}),
        };
        let settings = &hub.core().settings;
        Ok(Json(TeiInfo {
            model_id: entry.model.clone().unwrap_or_else(|| role.to_string()),
            model_sha: entry.revision.clone(),
            model_dtype: entry.dtype.clone().unwrap_or_else(|| "unknown".into()),
            served_model_name: role.to_string(),
            model_type,
            max_concurrent_requests: settings.queue_capacity,
            max_input_length: entry.max_input_tokens.unwrap_or(0),
            max_batch_tokens: entry.max_batch_tokens.unwrap_or(0),
            max_batch_requests: entry.max_batch_items,
            max_client_batch_size: settings.limits.max_inputs,
            auto_truncate: true,
            tokenization_workers: entry.providers,
            version: env!("CARGO_PKG_VERSION"),
            x_fantom: entry,
        }))
    };
    run().map_err(|e| e.shaped(SHAPE))
}
