//! The HTTP front doors of the hub: the client APIs in the shapes of the clients people use
//! ([`openai_api`], [`cohere_api`], [`tei_api`], [`ollama_api`], chat in [`chat_api`], what
//! they share in [`client_api`]), the admin API ([`admin_api`], projects in [`projects_api`]),
//! health, readiness and metrics
//! ([`ops`]), the request ids and route latencies around them all ([`request_id`]), and the
//! agents' WebSocket endpoint; the agent's own small health/metrics server is in
//! [`crate::agent::http`]. Each family's routes answer errors in its own shape
//! ([`error::ErrorShape`]); everything else in OpenAI's.

pub mod admin_api;
pub mod auth;
pub mod chat_api;
pub mod client_api;
pub mod cohere_api;
pub mod error;
pub mod ollama_api;
pub mod openai_api;
pub mod ops;
pub mod projects_api;
pub mod request_id;
pub mod tei_api;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State, WebSocketUpgrade};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

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

/// Every route of the hub.
pub fn hub_router(hub: Hub) -> Router {
    let routes = std::sync::Arc::new(request_id::RouteMetrics::default());
    let metrics = {
        let routes = routes.clone();
        move |State(hub): State<Hub>| async move { ops::metrics_text(&hub, &routes) }
    };
    Router::new()
        .route("/v1/agent", get(agent_socket))
        // OpenAI (also without the /v1 prefix, for a base_url that lacks it)
        .route("/v1/embeddings", post(openai_api::embeddings))
        .route("/embeddings", post(openai_api::embeddings))
        .route("/v1/models", get(openai_api::models))
        .route("/v1/models/{id}", get(openai_api::model))
        .route("/v1/chat/completions", post(chat_api::completions))
        // ours (Cohere v1's shape with provenance)
        .route("/v1/rerank", post(client_api::rerank_v1))
        // Cohere v2
        .route("/v2/embed", post(cohere_api::embed))
        .route("/v2/rerank", post(cohere_api::rerank))
        // text-embeddings-inference
        .route("/", post(tei_api::root).get(ops::health))
        .route("/ping", get(ops::health))
        .route("/embed", post(tei_api::embed))
        .route("/rerank", post(tei_api::rerank))
        .route("/similarity", post(tei_api::similarity))
        .route("/info", get(tei_api::info))
        // Ollama
        .route("/api/embed", post(ollama_api::embed))
        .route(
            "/admin/config",
            get(admin_api::get_config).post(admin_api::post_config),
        )
        .route("/admin/status", get(admin_api::status))
        .route("/admin/budget", post(admin_api::post_budget))
        .route("/admin/gate/verify", post(admin_api::post_gate_verify))
        .route(
            "/admin/projects",
            get(projects_api::list).post(projects_api::create),
        )
        .route(
            "/admin/projects/{name}",
            axum::routing::patch(projects_api::update).delete(projects_api::remove),
        )
        .route("/admin/projects/{name}/rotate", post(projects_api::rotate))
        .route("/health", get(ops::health))
        .route("/ready", get(ops::ready))
        .route("/metrics", get(metrics))
        .fallback(ops::not_found)
        .layer(axum::middleware::from_fn_with_state(
            (hub.clone(), routes),
            request_id::observe,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(hub)
}

/// The read buffer of one agent's socket on the hub.
const AGENT_READ_BUFFER_BYTES: usize = 16 * 1024;

/// `GET /v1/agent`: the fleet token is checked before the upgrade.
async fn agent_socket(
    State(hub): State<Hub>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    auth::require(&headers, hub.fleet_token(), "fleet")?;
    let max = hub.core().settings.max_frame_bytes;
    Ok(ws
        .max_message_size(max)
        .max_frame_size(max)
        // tungstenite zero-fills its read buffer up to this size on every read: its default
        // (128 KiB) would be most of an idle agent's cost to the hub. The buffer still grows
        // for a large frame.
        .read_buffer_size(AGENT_READ_BUFFER_BYTES)
        .on_upgrade(move |socket| serve_agent(socket, hub))
        .into_response())
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
