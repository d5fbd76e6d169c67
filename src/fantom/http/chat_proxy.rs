//! The OpenRouter chat proxy a master calls on this agent (§3.3):
//! `POST /api/v1/chat/completions` and `GET /api/v1/models`, on the key and the sandbox model
//! (`allowedModels["rlm-sandbox"]`) of the calling master's slot.
//!
//! Whose key is spent is the caller's token's: a master's token spends its own slot's key
//! whatever header it carries, and `X-FantomMCP-Master` (else `X-SoundSuite-Master`, byte for
//! byte a slot's `serverUrl`) only selects among the slots that token owns (another one: 403).
//! The operator's token may name any slot. With no token configured at all, nothing here
//! answers ([`super::access`]). The caller's `model` is replaced by the slot's: the sidecar
//! decides which model answers. Status codes as Fantom expects them: 400 (bad JSON,
//! `stream: true`), 409 (no header while several of the caller's slots hold keys), 404 (unknown
//! master or nothing pushed), 503 (no sandbox model). The project and tools-token headers are
//! neither used nor logged.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{Value, json};

use super::Refusal;
use super::access::{Caller, NO_TOKEN};
use crate::fantom::commands::{SlotRoute, SlotRouteError, metered, slot_route};
use crate::fantom::sidecar::Sidecar;
use crate::roles::Role;

/// The headers that name the calling master, in the order they are read.
pub const MASTER_HEADERS: [&str; 2] = ["x-fantommcp-master", "x-soundsuite-master"];

pub fn router(sidecar: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/api/v1/chat/completions", post(chat))
        .route("/api/v1/models", get(models))
        .with_state(sidecar)
}

/// `{"error":{"message":…}}` with `status`.
fn failure(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        body: json!({"error": {"message": message.into()}}),
    }
}

/// The slot whose key this call spends: the one the header names, if the token owns it; else
/// the one slot of the token's that holds a key.
fn caller(sidecar: &Sidecar, who: &Caller, headers: &HeaderMap) -> Result<String, Refusal> {
    if *who == Caller::Nobody {
        return Err(failure(StatusCode::FORBIDDEN, NO_TOKEN));
    }
    let named = MASTER_HEADERS
        .iter()
        .find_map(|h| headers.get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty());
    if let Some(url) = named {
        if !who.owns(url) {
            return Err(failure(
                StatusCode::FORBIDDEN,
                "this token is another master's: the header may name only a slot the token owns (the operator's http_token may name any)",
            ));
        }
        return Ok(url.to_string());
    }
    let keyed: Vec<String> = sidecar
        .slots
        .keyed()
        .into_iter()
        .filter(|url| who.owns(url))
        .collect();
    match keyed.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(failure(
            StatusCode::NOT_FOUND,
            "no config pushed: no master has pushed an OpenRouter key to this agent",
        )),
        _ => Err(failure(
            StatusCode::CONFLICT,
            "several masters pushed keys to this agent: name yours in X-FantomMCP-Master",
        )),
    }
}

/// The caller's sandbox route, or the status that says why there is none.
fn sandbox(sidecar: &Sidecar, master: &str) -> Result<SlotRoute, Refusal> {
    slot_route(&sidecar.slots, master, Role::RlmSandbox, None, None).map_err(|e| match e {
        SlotRouteError::NoSlot(_) | SlotRouteError::NoKey => failure(
            StatusCode::NOT_FOUND,
            format!("no config pushed for master {master}"),
        ),
        SlotRouteError::NoModel(_) => failure(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no model configured under rlm-sandbox for master {master}"),
        ),
        other => failure(StatusCode::SERVICE_UNAVAILABLE, other.to_string()),
    })
}

async fn chat(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(body @ Value::Object(_)) => body,
        Ok(_) => {
            return failure(StatusCode::BAD_REQUEST, "the body must be a JSON object")
                .into_response();
        }
        Err(e) => {
            let shown = crate::secret::redact(&e.to_string());
            return failure(
                StatusCode::BAD_REQUEST,
                format!("invalid JSON body: {shown}"),
            )
            .into_response();
        }
    };
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return failure(
            StatusCode::BAD_REQUEST,
            "stream: true is not supported on this route",
        )
        .into_response();
    }
    let master = match caller(&sidecar, &who, &headers) {
        Ok(master) => master,
        Err(refusal) => return refusal.into_response(),
    };
    let SlotRoute { client, route } = match sandbox(&sidecar, &master) {
        Ok(route) => route,
        Err(refusal) => return refusal.into_response(),
    };
    let key = Role::RlmSandbox.as_str();
    match metered(&sidecar.slots, &master, key, client.chat(&route, body)).await {
        Ok(done) => {
            tracing::info!(master = %master, model = %route.model(), tokens = done.tokens, "chat proxied");
            Json(done.response).into_response()
        }
        Err(e) => {
            tracing::warn!(master = %master, error = %e, "chat proxy call failed");
            // OpenRouter refusing the key is not the master's credentials failing here.
            let status = match e.http_status() {
                401 | 403 => StatusCode::BAD_GATEWAY,
                code => StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY),
            };
            failure(status, e.to_string()).into_response()
        }
    }
}

async fn models(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
) -> Response {
    let master = match caller(&sidecar, &who, &headers) {
        Ok(master) => master,
        Err(refusal) => return refusal.into_response(),
    };
    match sandbox(&sidecar, &master) {
        Ok(SlotRoute { route, .. }) => Json(json!({
            "object": "list",
            "data": [{"id": route.model(), "object": "model", "owned_by": "openrouter"}],
        }))
        .into_response(),
        Err(refusal) => refusal.into_response(),
    }
}
