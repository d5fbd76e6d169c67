//! The hub's API contract: the OpenAPI 3.1 document, generated from the handlers'
//! `#[utoipa::path]` attributes and the request and response types (`ToSchema`), served at
//! `GET /openapi.json`, and a browsable `GET /docs` (Swagger UI, its assets compiled into the
//! binary). [`super::hub_router`] builds the router and the document from one list of
//! handlers, so a route cannot be served without being described; the one plain route (the
//! agents' WebSocket) is described by hand here.
//!
//! What is here besides the document: the schemas of the inputs every family shares
//! ([`TextInput`]), the error bodies of each client family and the error responses they come
//! with ([`ClientErrors`] and friends: every status a route can answer is listed, with
//! `Retry-After` where it is sent), and the security schemes (a project key or the client
//! token for the client routes, the admin token for `/admin`).

use std::collections::BTreeMap;

use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
use utoipa::openapi::response::{ResponseBuilder, ResponsesBuilder};
use utoipa::openapi::schema::{ArrayBuilder, Object, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Content, RefOr, Response};
use utoipa::{IntoResponses, Modify, OpenApi, PartialSchema, ToSchema};

/// The document's fixed parts; the paths come from [`super::hub_router`].
#[derive(OpenApi)]
#[openapi(
    info(
        title = "fantom-sidecar hub",
        description = "Embeddings, reranking and chat for Fantom MCP Server, routed across local \
GPUs and OpenRouter, in the shapes of the clients people use (OpenAI, Cohere, \
text-embeddings-inference, Ollama), with the admin and operations routes. Every vector names \
the space it belongs to; vectors of two spaces never share a table. Errors come in the body \
shape of the route's client family.",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    modifiers(&SecuritySchemes, &AgentSocket, &DocumentRoutes),
    tags(
        (name = "openai", description = "OpenAI's embeddings, models and chat completions"),
        (name = "cohere", description = "Cohere's v2 embed and rerank"),
        (name = "tei", description = "text-embeddings-inference's routes"),
        (name = "ollama", description = "Ollama's embed"),
        (name = "fantom", description = "Our own rerank shape (Cohere v1's, with provenance)"),
        (name = "admin", description = "Config pushes, the budget, the gate, projects, status"),
        (name = "operations", description = "Health, readiness, metrics and this document"),
        (name = "console", description = "The operator's console: a page and its files (it signs in with the admin token)"),
        (name = "fleet", description = "The agents' WebSocket"),
    )
)]
pub struct ApiDoc;

/// The name of the client routes' security scheme: a project key (`fsp-…`) or the client token.
pub const CLIENT_AUTH: &str = "client_key";
/// The name of the admin routes' security scheme.
pub const ADMIN_AUTH: &str = "admin_token";

struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        let bearer = |what: &str| {
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(what))
                    .build(),
            )
        };
        components.add_security_scheme(
            CLIENT_AUTH,
            bearer(
                "A project key (`fsp-` and 64 hex digits, from `POST /admin/projects`) or the \
                 hub's client token. Without one a request is the project `default`, unless the \
                 hub requires a key.",
            ),
        );
        components.add_security_scheme(ADMIN_AUTH, bearer("The hub's admin token."));
    }
}

/// `GET /v1/agent`, the one route not built from a handler's attribute (it upgrades to the
/// fleet protocol, docs/protocol.md).
struct AgentSocket;

impl Modify for AgentSocket {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let responses = ResponsesBuilder::new()
            .response(
                "101",
                ResponseBuilder::new()
                    .description("Switching to the fleet protocol (docs/protocol.md)"),
            )
            .response(
                "400",
                error_response::<OpenAiError>("Not a WebSocket upgrade", false),
            )
            .response(
                "401",
                error_response::<OpenAiError>("The fleet token is missing or wrong", false),
            )
            .build();
        let operation = OperationBuilder::new()
            .tag("fleet")
            .operation_id(Some("agent_socket"))
            .summary(Some("An agent's WebSocket (fleet token)"))
            .responses(responses)
            .security(SecurityRequirement::new(
                "fleet_token",
                Vec::<String>::new(),
            ))
            .build();
        doc.paths.paths.insert(
            "/v1/agent".into(),
            PathItem::new(HttpMethod::Get, operation),
        );
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "fleet_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// `GET /openapi.json` and `GET /docs`, served by Swagger UI's router (merged in
/// [`super::hub_router`]), described here.
struct DocumentRoutes;

impl Modify for DocumentRoutes {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let get = |id: &str, summary: &str, ok: Response| {
            let operation = OperationBuilder::new()
                .tag("operations")
                .operation_id(Some(id))
                .summary(Some(summary))
                .responses(ResponsesBuilder::new().response("200", ok).build())
                .build();
            PathItem::new(HttpMethod::Get, operation)
        };
        let json = ResponseBuilder::new()
            .description("This document")
            .content(
                "application/json",
                Content::new(Some(ObjectBuilder::new().schema_type(Type::Object))),
            )
            .build();
        doc.paths.paths.insert(
            "/openapi.json".into(),
            get("openapi_document", "This OpenAPI 3.1 document", json),
        );
        let mut docs = get(
            "docs",
            "Swagger UI on this document (its assets are in the binary)",
            ResponseBuilder::new()
                .description("The page")
                .content("text/html", Content::new(None::<RefOr<Schema>>))
                .build(),
        );
        if let Some(op) = docs.get.as_mut() {
            op.responses.responses.insert(
                "303".into(),
                RefOr::T(
                    ResponseBuilder::new()
                        .description("To /docs/, the page")
                        .build(),
                ),
            );
        }
        doc.paths.paths.insert("/docs".into(), docs);
    }
}

/// A text or a list of texts, none empty (token ids are refused: send the texts). A schema
/// only: the handlers read the field as JSON and check it.
pub struct TextInput;

impl PartialSchema for TextInput {
    fn schema() -> RefOr<Schema> {
        let text = || {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
        };
        OneOfBuilder::new()
            .item(text())
            .item(ArrayBuilder::new().items(text()).min_items(Some(1)))
            .description(Some(
                "A text or a list of texts (token ids are refused: send the texts)",
            ))
            .into()
    }
}

impl ToSchema for TextInput {}

/// The values a string field takes, as a schema (for `#[schema(schema_with = ...)]`).
pub fn one_of(values: &[&str]) -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(values.iter().copied()))
        .build()
}

/// OpenAI's error body (also the admin and operations routes').
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct OpenAiError {
    #[schema(inline)]
    pub error: OpenAiErrorDetail,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct OpenAiErrorDetail {
    pub message: String,
    /// `invalid_request_error`, or `server_error` for a 5xx.
    #[schema(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    /// A stable code: `model_not_found`, `queue_full`, `project_quota`, …
    pub code: String,
}

/// Cohere's error body.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CohereError {
    pub message: String,
    pub code: String,
}

/// text-embeddings-inference's error body, with our stable code.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct TeiError {
    pub error: String,
    #[schema(inline)]
    pub error_type: TeiErrorType,
    pub code: String,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub enum TeiErrorType {
    Unhealthy,
    Backend,
    Overloaded,
    Validation,
    Tokenizer,
    Empty,
}

/// Ollama's error body.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct OllamaError {
    pub error: String,
}

/// The statuses a client route answers besides its success, and why.
const CLIENT_STATUSES: &[(u16, &str, bool)] = &[
    (
        400,
        "The request is malformed or asks for what is not served (the message says what to send instead)",
        false,
    ),
    (
        401,
        "The key is missing (where one is required) or unknown",
        false,
    ),
    (
        404,
        "No role or model of that name is served here (`model_not_found`)",
        false,
    ),
    (
        409,
        "The role's vector space changed while the request waited (`space_changed`): send it \
         again; or a chat with the same Idempotency-Key is still running \
         (`idempotency_key_in_use`) or was answered and its answer is no longer held \
         (`idempotency_key_answered`)",
        false,
    ),
    (
        413,
        "Too many inputs, or an input or request too large",
        false,
    ),
    (
        422,
        "A provider refused the input, or an Idempotency-Key was sent before with another \
         request body (`idempotency_key_reused`)",
        false,
    ),
    (
        429,
        "The queue is full, or a project limit, share or daily allowance is reached, or every \
         Idempotency-Key the hub keeps for the project is a chat still under way \
         (`idempotency_keys_full`)",
        true,
    ),
    (500, "An internal error", false),
    (
        502,
        "Providers failed the request, or a stream was cut",
        false,
    ),
    (
        503,
        "Nothing can serve the role now (the code and message say why), or the hub is stopping",
        true,
    ),
    (504, "The request timed out", false),
];

/// The statuses an admin route answers besides its success.
const ADMIN_STATUSES: &[(u16, &str, bool)] = &[
    (
        400,
        "The body is malformed or asks for what cannot be done",
        false,
    ),
    (401, "The admin token is missing or wrong", false),
    (404, "No such project, role or migration step", false),
    (
        409,
        "The request conflicts with the state (a name taken, a push refused, a migration step that cannot apply now)",
        false,
    ),
    (
        500,
        "An internal error (the state could not be written)",
        false,
    ),
    (503, "The hub is stopping", false),
];

/// One error response with body schema `T`, with `Retry-After` when `retry_after`.
fn error_response<T: PartialSchema>(description: &str, retry_after: bool) -> Response {
    let mut builder = ResponseBuilder::new()
        .description(description)
        .content("application/json", Content::new(Some(T::schema())));
    if retry_after {
        builder = builder.header(
            "Retry-After",
            HeaderBuilder::new()
                .schema(Some(
                    ObjectBuilder::new()
                        .schema_type(Type::Integer)
                        .minimum(Some(0)),
                ))
                .description(Some("Seconds to wait before sending the request again"))
                .build(),
        );
    }
    builder.build()
}

fn error_responses<T: PartialSchema>(
    statuses: &[(u16, &str, bool)],
) -> BTreeMap<String, RefOr<Response>> {
    statuses
        .iter()
        .map(|&(status, why, retry_after)| {
            (
                status.to_string(),
                RefOr::T(error_response::<T>(why, retry_after)),
            )
        })
        .collect()
}

/// The error responses of the OpenAI-shaped client routes.
pub struct ClientErrors;
/// The error responses of Cohere's routes.
pub struct CohereErrors;
/// The error responses of text-embeddings-inference's routes.
pub struct TeiErrors;
/// The error responses of Ollama's route.
pub struct OllamaErrors;
/// The error responses of the admin routes.
pub struct AdminErrors;

impl IntoResponses for ClientErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        error_responses::<OpenAiError>(CLIENT_STATUSES)
    }
}

impl IntoResponses for CohereErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        error_responses::<CohereError>(CLIENT_STATUSES)
    }
}

impl IntoResponses for TeiErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        error_responses::<TeiError>(CLIENT_STATUSES)
    }
}

impl IntoResponses for OllamaErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        error_responses::<OllamaError>(CLIENT_STATUSES)
    }
}

impl IntoResponses for AdminErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        error_responses::<OpenAiError>(ADMIN_STATUSES)
    }
}

/// Any JSON object (bodies whose fields docs/operations.md describes).
#[derive(ToSchema)]
#[schema(value_type = Object)]
#[allow(dead_code)]
pub struct AnyObject(serde_json::Map<String, serde_json::Value>);

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The paths `.route("...")` and `SwaggerUi::new("...")` / `.url("...")` mount in
    /// `src/http/mod.rs`: the routes not made by `routes!`.
    fn plain_routes() -> BTreeSet<String> {
        let source = include_str!("mod.rs");
        let mut out = BTreeSet::new();
        for marker in [".route(\"", "SwaggerUi::new(\"", ".url(\""] {
            for (at, _) in source.match_indices(marker) {
                let rest = &source[at + marker.len()..];
                if let Some(end) = rest.find('"') {
                    out.insert(rest[..end].to_string());
                }
            }
        }
        out
    }

    #[test]
    fn every_route_of_the_router_is_in_the_document() {
        let (_, doc) = crate::http::api_router().split_for_parts();
        let documented: BTreeSet<&String> = doc.paths.paths.keys().collect();
        let plain = plain_routes();
        assert!(plain.contains("/v1/agent"), "{plain:?}");
        for path in &plain {
            assert!(
                documented.contains(path),
                "{path} is served but not in the document"
            );
        }
        // What `routes!` mounts is documented by construction; every operation says what it
        // answers.
        for (path, item) in &doc.paths.paths {
            for op in [&item.get, &item.post, &item.patch, &item.delete]
                .into_iter()
                .flatten()
            {
                assert!(
                    !op.responses.responses.is_empty(),
                    "{path} documents no answer"
                );
            }
        }
        let json = doc.to_json().unwrap();
        assert!(json.contains("\"openapi\":\"3.1.0\""));
    }
}
