//! The sidecar agent's own routes (§3.1): the status snapshot with each slot's virtual
//! containers, health, the master registry (`/api/masters`), and the container actions over
//! HTTP (the master's fallback when it has no relay socket).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::access::{Caller, not_yours};
use super::{error, json_body};
use crate::agent::local_server::UnitError;
use crate::fantom::containers::{ContainerError, ContainerVerb};
use crate::fantom::frames::ContainerAction;
use crate::fantom::sidecar::Sidecar;
use crate::fantom::slots::relay_url;
use crate::secret::Secret;

pub fn router(sidecar: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/api/status", get(status))
        .route("/status", get(status))
        .route("/api/masters", get(list_masters).post(add_master))
        .route("/api/masters/{url}", delete(remove_master))
        .route("/start", container(ContainerVerb::Start))
        .route("/stop", container(ContainerVerb::Stop))
        .route("/acquire", container(ContainerVerb::Acquire))
        .route("/release", container(ContainerVerb::Release))
        .with_state(sidecar)
        .merge(health_router())
}

/// `GET /api/health`: any 2xx is healthy to the master. No `capabilities`: that would replace
/// the ones it derives from heartbeats.
pub fn health_router() -> Router {
    Router::new().route("/api/health", get(|| async { Json(json!({ "ok": true })) }))
}

/// The agent and the slots the caller may see (a master: its own; the operator: all).
async fn status(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(caller): Extension<Caller>,
) -> Response {
    Json(sidecar.status_for(&caller)).into_response()
}

async fn list_masters(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(caller): Extension<Caller>,
) -> Response {
    Json(json!({ "masters": sidecar.slots.snapshot(caller.shown()) })).into_response()
}

/// The shortest token `POST /api/masters` installs (an empty one would match an empty bearer).
const MIN_TOKEN_CHARS: usize = 16;

/// `POST /api/masters` ("Register as master").
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewMaster {
    server_url: Option<String>,
    ws_port: Option<u16>,
    auth_token: Option<Secret>,
}

/// Adds a slot (the operator), or changes one (its master, or the operator). A slot's token
/// is installed only by a caller that already holds a token here.
async fn add_master(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Response {
    if let Err(refusal) = caller.may_change() {
        return refusal.into_response();
    }
    let new: NewMaster = match json_body(&body) {
        Ok(new) => new,
        Err(refusal) => return refusal.into_response(),
    };
    let Some(server_url) = new.server_url.filter(|u| !u.trim().is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "serverUrl is required").into_response();
    };
    if !(server_url.starts_with("http://") || server_url.starts_with("https://"))
        || relay_url(&server_url, new.ws_port).is_none()
    {
        return error(
            StatusCode::BAD_REQUEST,
            "serverUrl must be an http(s) URL with a host",
        )
        .into_response();
    }
    if !caller.owns(&server_url) {
        return not_yours("add or change").into_response();
    }
    if new
        .auth_token
        .as_ref()
        .is_some_and(|t| t.char_count() < MIN_TOKEN_CHARS)
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!("authToken must be at least {MIN_TOKEN_CHARS} characters"),
        )
        .into_response();
    }
    if new.ws_port == Some(0) {
        return error(StatusCode::BAD_REQUEST, "wsPort 0").into_response();
    }
    let (created, generation) = sidecar.slots.add(&server_url, new.ws_port, new.auth_token);
    if created {
        sidecar.spawn_relay(server_url.clone(), generation);
    }
    let ws_port = sidecar
        .slots
        .with_slot(&server_url, |s| s.effective_ws_port())
        .unwrap_or_default();
    tracing::info!(master = %server_url, ws_port, created, "master registered through the API");
    Json(json!({ "ok": true, "serverUrl": server_url, "wsPort": ws_port, "created": created }))
        .into_response()
}

/// `DELETE /api/masters/<encodeURIComponent(serverUrl)>` (the path segment arrives decoded):
/// its master, or the operator.
async fn remove_master(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(caller): Extension<Caller>,
    Path(url): Path<String>,
) -> Response {
    if let Err(refusal) = caller.may_change() {
        return refusal.into_response();
    }
    if !caller.owns(&url) {
        return not_yours("remove").into_response();
    }
    let removed = sidecar.slots.remove(&url);
    tracing::info!(master = %url, removed, "master unregistered through the API");
    Json(json!({ "ok": true, "removed": removed })).into_response()
}

/// The route of one container verb.
fn container(verb: ContainerVerb) -> MethodRouter<Arc<Sidecar>> {
    post(
        move |State(s): State<Arc<Sidecar>>, Extension(c): Extension<Caller>, body: Bytes| async move {
            act(&s, &c, verb, &body).await
        },
    )
}

/// A container action: the host's models are shared, so any master's token (or the
/// operator's) may act; never a caller without one.
async fn act(sidecar: &Sidecar, caller: &Caller, verb: ContainerVerb, body: &[u8]) -> Response {
    if let Err(refusal) = caller.may_change() {
        return refusal.into_response();
    }
    let args: ContainerAction = match json_body(body) {
        Ok(args) => args,
        Err(refusal) => return refusal.into_response(),
    };
    match sidecar
        .containers
        .act(verb, &args.role, args.model.as_deref())
        .await
    {
        Ok(report) => {
            tracing::info!(action = verb.as_str(), role = %args.role, status = report.status, "container action");
            Json(report).into_response()
        }
        Err(e) => {
            let status = match e {
                ContainerError::NoContainer(_) => StatusCode::NOT_FOUND,
                ContainerError::ModelMismatch { .. } => StatusCode::CONFLICT,
                ContainerError::Stopped(_) => StatusCode::SERVICE_UNAVAILABLE,
                ContainerError::Load { .. } => StatusCode::INTERNAL_SERVER_ERROR,
                ContainerError::Unit(UnitError::Unmanaged(_))
                | ContainerError::SharedWithHub(_) => StatusCode::CONFLICT,
                ContainerError::Unit(UnitError::Failed { .. }) => StatusCode::BAD_GATEWAY,
            };
            error(status, e.to_string()).into_response()
        }
    }
}
