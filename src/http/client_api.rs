//! What every client family's routes share (OpenAI's, Cohere's, TEI's, Ollama's): the client
//! token, the body, the role a request names (a role name, or the model id a role serves),
//! the inputs (strings only: token ids are refused), and one embed or rerank run through the
//! hub with its timings (TEI's `x-queue-time`, `x-inference-time`, `x-total-time`). Also our
//! own `POST /v1/rerank` (Cohere/TEI shape). Every vector and score keeps its provenance.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::auth;
use super::error::ApiError;
use crate::hub::Hub;
use crate::hub::core::{Completed, ItemOutput, ScorerRef, SpaceRef};
use crate::hub::gate::SpacePin;
use crate::hub::projects::Caller;
use crate::hub::queue::Shape;
use crate::hub::registry::ProviderRef;
use crate::protocol::WorkClass;
use crate::roles::{Op, Role};

#[derive(Serialize, utoipa::ToSchema)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
}

impl Usage {
    pub fn of(tokens: u64) -> Self {
        Self {
            prompt_tokens: tokens,
            total_tokens: tokens,
        }
    }
}

/// Who sent a client request: its project (from its bearer token, and its sub-project from
/// `X-FantomMCP-Project` where its key may name one), and the class it asked for with
/// `X-Priority`, if any.
pub(super) struct Client {
    caller: Caller,
    priority: Option<WorkClass>,
    /// The space its embedding request is pinned to (`X-Fantom-Space`).
    space: Option<SpacePin>,
}

impl Client {
    /// The caller of a request of `class` by its nature (a query, a rerank or a chat is
    /// interactive), unless the client asked for another class.
    pub fn caller(&self, class: WorkClass) -> Caller {
        let mut caller = self.caller.clone();
        caller.class = self.priority.unwrap_or(class);
        caller
    }

    /// Refuses a pin on a request that has no vector space (a rerank, a chat).
    pub fn unpinned(&self, what: &str) -> Result<(), ApiError> {
        match self.space {
            Some(_) => Err(ApiError::bad_request(format!(
                "X-Fantom-Space pins embedding requests to a vector space; a {what} has none: send it without the header"
            ))),
            None => Ok(()),
        }
    }

    /// The caller of an embedding request (a query is interactive).
    pub fn embedding(&self, is_query: bool) -> Caller {
        self.caller(if is_query {
            WorkClass::Interactive
        } else {
            WorkClass::Batch
        })
    }
}

/// The sub-project header Fantom's master sends.
pub const PROJECT_HEADER: &str = "x-fantommcp-project";
/// The client's class for its request: `interactive` or `batch`.
pub const PRIORITY_HEADER: &str = "x-priority";
/// The space an embedding request must be served in: `<id>` or `<id>@<generation>`.
pub const SPACE_HEADER: &str = "x-fantom-space";

/// A space pin from a header or a body field; the error never echoes what was sent.
fn pin_of(raw: &str, field: &str) -> Result<SpacePin, ApiError> {
    SpacePin::parse(raw).map_err(|why| {
        ApiError::bad_request(format!("{field}: {why} (the value sent was not kept)"))
    })
}

/// Identifies the client: a project key, the client token (`default`), or no token where
/// the hub requires neither. An unknown key is refused (401), never taken as `default`; no
/// presented value is ever echoed. The request's span and log lines carry the project.
pub(super) fn client_auth(hub: &Hub, headers: &HeaderMap) -> Result<Client, ApiError> {
    let priority = match headers
        .get(PRIORITY_HEADER)
        .map(|v| v.to_str().map(str::trim))
    {
        None => None,
        Some(Ok(v)) if v.eq_ignore_ascii_case("interactive") => Some(WorkClass::Interactive),
        Some(Ok(v)) if v.eq_ignore_ascii_case("batch") => Some(WorkClass::Batch),
        Some(_) => {
            return Err(ApiError::bad_request(
                "X-Priority is 'interactive' or 'batch' (the value sent was not kept)",
            ));
        }
    };
    let space = match headers.get(SPACE_HEADER).map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => Some(pin_of(v, "X-Fantom-Space")?),
        Some(Err(_)) => {
            return Err(ApiError::bad_request(
                "X-Fantom-Space: a space pin is printable ASCII (the value sent was not kept)",
            ));
        }
    };
    let sub = headers
        .get(PROJECT_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    let identified = hub.identify(auth::bearer(headers), sub, WorkClass::Batch);
    // A leader cut off from etcd that cannot say no newer leader exists (no hub answered,
    // another names a newer leader it cannot confirm, or it just stepped aside for one) holds
    // a key table that may be out of date both ways: a project's key, or a key it does not
    // know (made by the new leader), waits with the reason (keyless local work goes on).
    if let Some(aside) = hub.aside() {
        let keyed = match &identified {
            Ok(caller) => &*caller.project != crate::hub::projects::DEFAULT_PROJECT,
            Err(e) => *e == crate::hub::project_admin::Unidentified::UnknownKey,
        };
        if keyed {
            let mut err = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unreachable",
                aside.keyed_refusal(),
            );
            err.retry_after_s = Some(5);
            return Err(err);
        }
    }
    let caller = identified
        .map_err(|e| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string()))?;
    let span = tracing::Span::current();
    span.record("project", &*caller.project);
    if let Some(sub) = &caller.sub_project {
        span.record("sub_project", &**sub);
    }
    Ok(Client {
        caller,
        priority,
        space,
    })
}

/// The JSON body, or a 400 that shows what was wrong (secrets redacted).
pub(super) fn json_body<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(b)| b).map_err(|e| {
        let shown = crate::secret::redact(&e.body_text());
        ApiError::bad_request(format!("invalid request body: {shown}"))
    })
}

/// The role a request names, checked against the operation of its endpoint.
pub(super) fn role_for(name: &str, op: Op) -> Result<Role, ApiError> {
    let role: Role = name
        .parse()
        .map_err(|e: crate::roles::UnknownRole| model_not_found(&e.to_string()))?;
    check_op(role, op)?;
    Ok(role)
}

fn check_op(role: Role, op: Op) -> Result<(), ApiError> {
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
    Ok(())
}

/// The role a client's `model` names: a role name, or the model id one of the hub's roles of
/// `op` serves (the first such role in role order; Ollama's `:latest` tag is ignored).
/// `None` when neither matches.
pub(super) fn role_named(hub: &Hub, name: &str, op: Op) -> Result<Option<Role>, ApiError> {
    let name = name.strip_suffix(":latest").unwrap_or(name);
    if let Ok(role) = name.parse::<Role>() {
        check_op(role, op)?;
        return Ok(Some(role));
    }
    Ok(hub
        .catalog()
        .into_iter()
        .find(|c| c.role.op() == op && c.model.as_deref() == Some(name))
        .map(|c| c.role))
}

/// As [`role_named`], with a 404 `model_not_found` naming the roles when `name` is neither a
/// role nor a model (OpenAI's answer for a model it does not serve).
pub(super) fn resolve_role(hub: &Hub, name: &str, op: Op) -> Result<Role, ApiError> {
    role_named(hub, name, op)?.ok_or_else(|| {
        let unknown = crate::roles::UnknownRole(name.to_string());
        model_not_found(&format!(
            "{unknown}, or the model id one serves (GET /v1/models lists them)"
        ))
    })
}

/// 404 `model_not_found`, the message redacted (a key pasted into `model` is never echoed).
fn model_not_found(message: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "model_not_found",
        crate::secret::redact(message),
    )
}

/// The inputs of a request: a string or an array of strings. Token ids (an array of
/// integers, or of arrays of them) are refused with the reason: ids are the client's
/// tokenizer's, not the model's, and would embed as another text.
pub(super) fn texts_of(value: Value, field: &str) -> Result<Vec<String>, ApiError> {
    let is_ids = |v: &Value| match v {
        Value::Number(_) => true,
        Value::Array(a) => a.iter().all(Value::is_number),
        _ => false,
    };
    match value {
        Value::String(s) => Ok(vec![s]),
        Value::Array(items) if !items.is_empty() && items.iter().all(is_ids) => {
            Err(token_ids_refused(field))
        }
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s),
                _ => Err(ApiError::bad_request(format!(
                    "{field}[{i}] is not a string; {field} is a string or an array of strings \
                     (token ids are not served: send the texts)"
                ))),
            })
            .collect(),
        _ => Err(ApiError::bad_request(format!(
            "{field} must be a string or an array of strings"
        ))),
    }
}

fn token_ids_refused(field: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "token_ids_refused",
        format!(
            "{field} holds token ids: this server embeds text only. Token ids belong to the \
             client's tokenizer (LangChain's OpenAIEmbeddings sends tiktoken ids by default), \
             not to the served model's, and would be embedded as other text into a table that \
             lives for months. Send the texts themselves; with LangChain, pass \
             OpenAIEmbeddings(check_embedding_ctx_length=False)"
        ),
    )
}

fn check_texts(texts: &[String], what: &str) -> Result<(), ApiError> {
    if texts.is_empty() {
        return Err(ApiError::bad_request(format!("{what} is empty")));
    }
    if let Some(i) = texts.iter().position(|t| t.is_empty()) {
        return Err(ApiError::bad_request(format!(
            "{what}[{i}] is an empty string"
        )));
    }
    Ok(())
}

/// How long a request spent, for TEI's timing headers (milliseconds).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub queue: Duration,
    pub inference: Duration,
    pub total: Duration,
}

impl Timing {
    fn of(done: &Completed, started: Instant) -> Self {
        Self {
            queue: done.queue_time,
            inference: done.inference_time,
            total: started.elapsed(),
        }
    }

    /// `x-queue-time`, `x-inference-time`, `x-total-time`, in whole milliseconds as TEI sends.
    pub fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, d) in [
            ("x-queue-time", self.queue),
            ("x-inference-time", self.inference),
            ("x-total-time", self.total),
        ] {
            headers.insert(name, HeaderValue::from(d.as_millis() as u64));
        }
        headers
    }
}

/// An embedding request as every family's route reduces it.
pub(super) struct EmbedCall {
    /// Who sent it (a query is interactive unless the client said otherwise).
    pub client: Client,
    pub role: Role,
    /// The request's field the texts came in (`input`, `texts`, `inputs`), for its errors.
    pub field: &'static str,
    pub texts: Vec<String>,
    pub dimensions: Option<usize>,
    pub is_query: bool,
    pub instruction: Option<String>,
    /// The body's `space` (OpenAI's and Cohere's bodies), as sent.
    pub space: Option<String>,
}

pub(super) struct Embedding {
    pub vector: Vec<f32>,
    pub provider: Arc<ProviderRef>,
    pub space: Option<Arc<SpaceRef>>,
}

pub(super) struct Embedded {
    pub vectors: Vec<Embedding>,
    pub tokens: u64,
    pub timing: Timing,
}

/// Runs an embedding request through the hub: every vector of one space, in input order.
pub(super) async fn embed(hub: &Hub, call: EmbedCall) -> Result<Embedded, ApiError> {
    let started = Instant::now();
    check_texts(&call.texts, call.field)?;
    if call.dimensions == Some(0) {
        return Err(ApiError::bad_request("dimensions must be at least 1"));
    }
    // Pinned by the header or the body: both may be sent, naming one space.
    let pin = match (call.client.space.clone(), call.space.as_deref()) {
        (header, None) => header,
        (None, Some(body)) => Some(pin_of(body, "space")?),
        (Some(header), Some(body)) => {
            if pin_of(body, "space")? != header {
                return Err(ApiError::bad_request(
                    "X-Fantom-Space and the body's space name different spaces: send one",
                ));
            }
            Some(header)
        }
    };
    let caller = call.client.embedding(call.is_query);
    let shape = Shape::Embed {
        dimensions: call.dimensions,
        is_query: call.is_query,
        instruction: call.instruction,
    };
    let done = hub
        .run_in(caller, call.role, shape, call.texts, pin)
        .await?;
    let timing = Timing::of(&done, started);
    let vectors = done
        .items
        .into_iter()
        .map(|served| match served.output {
            ItemOutput::Vector(vector) => Ok(Embedding {
                vector,
                provider: served.provider,
                space: served.space,
            }),
            _ => Err(bad_output("scores", "an embedding")),
        })
        .collect::<Result<_, _>>()?;
    Ok(Embedded {
        vectors,
        tokens: done.tokens,
        timing,
    })
}

fn bad_output(what: &str, request: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "bad_output",
        format!("a provider returned {what} for {request} request"),
    )
}

pub(super) struct Ranked {
    pub index: usize,
    /// The scorer's probability where it defines one, else its raw score.
    pub relevance: f32,
    /// The raw logit.
    pub raw: f32,
    pub provider: Arc<ProviderRef>,
}

pub(super) struct Reranked {
    /// Best first.
    pub results: Vec<Ranked>,
    pub scorer: Option<Arc<ScorerRef>>,
    pub tokens: u64,
    pub timing: Timing,
}

/// Runs a rerank request through the hub: every score from one scorer, sorted best first.
pub(super) async fn rerank(
    hub: &Hub,
    client: &Client,
    role: Role,
    query: String,
    (field, documents): (&'static str, Vec<String>),
    instruction: Option<String>,
) -> Result<Reranked, ApiError> {
    let started = Instant::now();
    client.unpinned("rerank")?;
    if query.is_empty() {
        return Err(ApiError::bad_request("query is an empty string"));
    }
    check_texts(&documents, field)?;
    let shape = Shape::Rerank { query, instruction };
    let done = hub
        .run(
            client.caller(WorkClass::Interactive),
            role,
            shape,
            documents,
        )
        .await?;
    let timing = Timing::of(&done, started);
    let mut results = done
        .items
        .into_iter()
        .enumerate()
        .map(|(index, served)| match served.output {
            ItemOutput::Score(s) => Ok(Ranked {
                index,
                relevance: s.probability.unwrap_or(s.score),
                raw: s.score,
                provider: served.provider,
            }),
            _ => Err(bad_output("vectors", "a rerank")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    results.sort_by(|a, b| b.relevance.total_cmp(&a.relevance));
    Ok(Reranked {
        results,
        scorer: done.scorer,
        tokens: done.tokens,
        timing,
    })
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(example = json!({"query": "how are tokens counted?", "documents": ["tokens are counted per input", "the weather is fine"], "top_n": 2, "return_documents": true}))]
pub struct RerankRequest {
    /// A role; `reranker` when absent.
    #[serde(default)]
    pub model: Option<String>,
    pub query: String,
    pub documents: Vec<String>,
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    pub top_n: Option<usize>,
    #[serde(default)]
    pub return_documents: bool,
    #[serde(default)]
    pub instruction: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct RerankResponse {
    pub model: String,
    /// The one scorer every score came from (a request is never scored on two scales).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scorer: Option<ScorerRef>,
    pub results: Vec<RerankResult>,
    pub usage: Usage,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct RerankResult {
    pub index: usize,
    /// The scorer's probability where it defines one (cross-encoders with a sigmoid, Qwen3,
    /// cloud rerankers), else its raw logit; one scale per response.
    pub relevance_score: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<RerankDocument>,
    pub provenance: ProviderRef,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct RerankDocument {
    pub text: String,
}

/// `POST /v1/rerank`: our own shape (Cohere's v1 with provenance).
#[utoipa::path(post, path = "/v1/rerank", tag = "fantom", request_body = RerankRequest,
    responses((status = 200, body = RerankResponse), super::openapi::ClientErrors),
    security((), ("client_key" = [])))]
pub async fn rerank_v1(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<RerankRequest>, JsonRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let client = client_auth(&hub, &headers)?;
    let req = json_body(request)?;
    let role = resolve_role(&hub, req.model.as_deref().unwrap_or("reranker"), Op::Rerank)?;
    let keep = req.return_documents.then(|| req.documents.clone());
    let mut done = rerank(
        &hub,
        &client,
        role,
        req.query,
        ("documents", req.documents),
        req.instruction,
    )
    .await?;
    if let Some(n) = req.top_n {
        done.results.truncate(n);
    }
    let results = done
        .results
        .into_iter()
        .map(|r| RerankResult {
            index: r.index,
            relevance_score: r.relevance,
            document: keep.as_ref().map(|d| RerankDocument {
                text: d[r.index].clone(),
            }),
            provenance: (*r.provider).clone(),
        })
        .collect();
    Ok((
        done.timing.headers(),
        Json(RerankResponse {
            model: role.to_string(),
            scorer: done.scorer.as_deref().cloned(),
            results,
            usage: Usage::of(done.tokens),
        }),
    ))
}
