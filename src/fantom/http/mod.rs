//! The agent's HTTP surface for Fantom masters (§3.1–§3.3), on the agent port (8098) and on
//! each configured role port:
//!
//! * [`agent_api`]: `/api/status`, `/api/health`, `/api/masters`, `/start|/stop|/acquire|/release`;
//! * [`role_api`]: the role containers' endpoints the master calls directly (`/api/embed`,
//!   `/v1/embeddings`, `/v1/rerank`, `/v1/score`), answered by the local models;
//! * [`chat_proxy`]: `/api/v1/chat/completions` and `/api/v1/models` on the calling master's
//!   key and sandbox model.
//!
//! Every route here takes the bearer token when one is configured (the agent's
//! `http_token_file`, or a master's `auth_token_file`, §3), and what a token may do is
//! [`access`]'s: a master's token acts on its own slot only. The agent's own `/health` and
//! `/metrics` stay open for the host's monitoring.

pub mod access;
pub mod agent_api;
pub mod chat_proxy;
pub mod role_api;

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::sidecar::Sidecar;
use crate::roles::Role;

/// The largest request body (a batch of texts to embed, a long chat): 32 MiB.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// The routes of the agent port: everything for masters, every local role.
pub fn agent_port_router(sidecar: Arc<Sidecar>) -> Router {
    agent_api::router(sidecar.clone())
        .merge(role_api::router(sidecar.clone(), None))
        .merge(chat_proxy::router(sidecar.clone()))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(sidecar, require_bearer))
}

/// The routes of one role port: the role endpoints of the roles on it, and `/api/health`.
pub fn role_port_router(sidecar: Arc<Sidecar>, roles: Vec<Role>) -> Router {
    role_api::router(sidecar.clone(), Some(roles))
        .merge(agent_api::health_router())
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(sidecar, require_bearer))
}

/// 401 unless the request carries an accepted bearer token (when any is configured); the
/// handlers find who called ([`access::Caller`]) in the request's extensions.
async fn require_bearer(
    State(sidecar): State<Arc<Sidecar>>,
    mut request: Request,
    next: Next,
) -> Response {
    let caller = sidecar.caller(crate::http::auth::bearer(request.headers()));
    if sidecar.auth_required() && caller == access::Caller::Nobody {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized: this agent needs 'Authorization: Bearer <token>' (the registry entry's authToken)",
        )
        .into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// A refused request: its status and JSON body.
#[derive(Debug)]
pub struct Refusal {
    pub status: StatusCode,
    pub body: serde_json::Value,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body)).into_response()
    }
}

/// `{"error": message}` with `status`: the shape Ollama, vLLM and the Node sidecar answer.
pub fn error(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        body: json!({ "error": message.into() }),
    }
}

/// Reads a JSON body, or says in a 400 what is wrong with it.
pub fn json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Refusal> {
    serde_json::from_slice(body).map_err(|e| {
        let shown = crate::secret::redact(&e.to_string());
        error(
            StatusCode::BAD_REQUEST,
            format!("invalid JSON body: {shown}"),
        )
    })
}
