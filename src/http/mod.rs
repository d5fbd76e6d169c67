//! The HTTP front doors of the hub: the client APIs in the shapes of the clients people use
//! ([`openai_api`], [`cohere_api`], [`tei_api`], [`ollama_api`], chat in [`chat_api`], what
//! they share in [`client_api`]), the admin API ([`admin_api`], projects in [`projects_api`],
//! migrations in [`migrations_api`]), health, readiness and metrics ([`ops`]), the request
//! ids and route latencies around them all ([`request_id`]), and the agents' WebSocket
//! endpoint; the API document and its browser ([`openapi`]: `/openapi.json`, `/docs`, built
//! from the same list as the router). The agent's own small health/metrics server is in
//! [`crate::agent::http`]. Each family's routes answer errors in its own shape
//! ([`error::ErrorShape`]); everything else in OpenAI's.

pub mod admin_api;
pub mod aside;
pub mod auth;
pub mod chat_api;
pub mod client_api;
pub mod cohere_api;
pub mod console;
mod embedding_types;
pub mod error;
pub mod event_stream;
pub mod migrations_api;
pub mod ollama_api;
pub mod openai_api;
pub mod openapi;
pub mod ops;
pub mod projects_api;
pub mod request_id;
pub mod standby;
pub mod tei_api;
pub mod whole_number;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use axum::Router;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::{DefaultBodyLimit, State, WebSocketUpgrade};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::hub::Hub;
use crate::hub::socket::serve_agent;
use error::ApiError;

/// Client request bodies (texts to embed) may be this large.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// A certificate chain and key (PEM) to serve `https://` and `wss://`.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Every route of the hub: the documented routes ([`api_router`]), the agents' WebSocket,
/// `/openapi.json` and `/docs`; a panicking handler answers 500 (the connection stays up), and
/// answers are gzip-compressed for a client that asks (`Accept-Encoding: gzip`; never a stream).
pub fn hub_router(hub: Hub) -> Router {
    let routes = std::sync::Arc::new(request_id::RouteMetrics::default());
    let mut registry = crate::metrics::registry("hub");
    let scraped = hub.clone();
    registry.register_collector(Box::new(crate::metrics::Scrape::new(move |f| {
        scraped.encode_metrics(f)
    })));
    registry.register_collector(Box::new(routes.clone()));
    let (router, doc) = api_router().split_for_parts();
    let docs = utoipa_swagger_ui::SwaggerUi::new("/docs")
        .url("/openapi.json", doc)
        // Swagger UI would send the document to validator.swagger.io: nothing leaves the page.
        .config(utoipa_swagger_ui::Config::default().validator_url("none"));
    router
        .route("/v1/agent", get(agent_socket))
        .merge(docs)
        .fallback(ops::not_found)
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            error::panic_response,
        ))
        .layer(axum::Extension(std::sync::Arc::new(registry)))
        .layer(axum::middleware::from_fn_with_state(
            (hub.clone(), routes),
            request_id::observe,
        ))
        .layer(axum::middleware::from_fn(console::admin_no_store))
        .layer(tower_http::compression::CompressionLayer::new().gzip(true))
        .layer(axum::middleware::from_fn_with_state(
            aside::AsideRelay::new(hub.clone()),
            aside::aside_layer,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(hub)
}

/// The documented routes with the document: each `routes!` mounts a handler on the path its
/// `#[utoipa::path]` names and adds that operation to the document, so neither can go without
/// the other.
pub fn api_router() -> OpenApiRouter<Hub> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        // OpenAI (also without the /v1 prefix, for a base_url that lacks it)
        .routes(routes!(openai_api::embeddings))
        .routes(routes!(openai_api::embeddings_unprefixed))
        .routes(routes!(openai_api::models))
        .routes(routes!(openai_api::model))
        .routes(routes!(chat_api::completions))
        // ours (Cohere v1's shape with provenance)
        .routes(routes!(client_api::rerank_v1))
        // Cohere v2
        .routes(routes!(cohere_api::embed))
        .routes(routes!(cohere_api::rerank))
        // text-embeddings-inference
        .routes(routes!(tei_api::root, ops::health_root))
        .routes(routes!(ops::ping))
        .routes(routes!(tei_api::embed))
        .routes(routes!(tei_api::rerank))
        .routes(routes!(tei_api::similarity))
        .routes(routes!(tei_api::info))
        // Ollama
        .routes(routes!(ollama_api::embed))
        // admin
        .routes(routes!(admin_api::get_config, admin_api::post_config))
        .routes(routes!(admin_api::status))
        .routes(routes!(admin_api::history))
        .routes(routes!(admin_api::post_budget))
        .routes(routes!(admin_api::post_gate_verify))
        .routes(routes!(projects_api::list, projects_api::create))
        .routes(routes!(projects_api::update, projects_api::remove))
        .routes(routes!(projects_api::rotate))
        .routes(routes!(migrations_api::list, migrations_api::open))
        .routes(routes!(migrations_api::step))
        // the operator's console
        .routes(routes!(console::page))
        .routes(routes!(console::script))
        .routes(routes!(console::style))
        .routes(routes!(console::icon))
        // operations
        .routes(routes!(ops::health))
        .routes(routes!(ops::ready))
        .routes(routes!(ops::metrics))
}

/// The read buffer of one agent's socket on the hub.
const AGENT_READ_BUFFER_BYTES: usize = 16 * 1024;

/// `GET /v1/agent`: the fleet token is checked before the upgrade (a request without the token
/// is a 401 whether it asks for an upgrade or not).
async fn agent_socket(
    State(hub): State<Hub>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    auth::require(&headers, hub.fleet_token(), "fleet")?;
    let ws = ws.map_err(|e| {
        ApiError::bad_request(format!(
            "this is the agents' WebSocket endpoint ({}); run `fantom-sidecar agent` against \
             this hub",
            e.body_text()
        ))
    })?;
    let (max, epoch) = {
        let core = hub.core();
        (core.settings.max_frame_bytes, core.epoch)
    };
    let mut response = ws
        .max_message_size(max)
        .max_frame_size(max)
        // tungstenite zero-fills its read buffer up to this size on every read: its default
        // (128 KiB) would be most of an idle agent's cost to the hub. The buffer still grows
        // for a large frame.
        .read_buffer_size(AGENT_READ_BUFFER_BYTES)
        .on_upgrade(move |socket| serve_agent(socket, hub))
        .into_response();
    // A leader on etcd says its epoch before `hello`: an agent that dialled every hub picks
    // the leader with the highest one and says hello there only.
    if let Some(epoch) = epoch {
        response.headers_mut().insert(
            crate::protocol::EPOCH_HEADER,
            axum::http::HeaderValue::from(epoch),
        );
    }
    Ok(response)
}

/// Serves `router` on `listener` (TLS when `tls` is given) until `shutdown` resolves.
pub async fn serve(
    listener: std::net::TcpListener,
    router: Router,
    tls: Option<TlsFiles>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use anyhow::Context;
    listener.set_nonblocking(true)?;
    let app = router.into_make_service_with_connect_info::<SocketAddr>();
    match tls {
        None => {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await?;
        }
        Some(files) => {
            install_crypto_provider();
            let config =
                axum_server::tls_rustls::RustlsConfig::from_pem_file(&files.cert, &files.key)
                    .await
                    .with_context(|| {
                        format!(
                            "cannot load the TLS certificate {} / key {}",
                            files.cert.display(),
                            files.key.display()
                        )
                    })?;
            let handle = axum_server::Handle::new();
            let on_shutdown = handle.clone();
            tokio::spawn(async move {
                shutdown.await;
                on_shutdown.graceful_shutdown(Some(std::time::Duration::from_secs(10)));
            });
            axum_server::from_tcp_rustls(listener, config)?
                .handle(handle)
                .serve(app)
                .await?;
        }
    }
    Ok(())
}

/// rustls needs one process-wide crypto provider; ours is ring (idempotent).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
