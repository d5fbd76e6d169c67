//! The admin API (its own bearer token): `GET/POST /admin/config` (a partial push; `apiKey`
//! is write-only: accepted here, sent to the agents, never stored or returned) and
//! `GET /admin/status`.

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth;
use super::error::ApiError;
use crate::config::push::OpenRouterPush;
use crate::hub::status::StatusView;
use crate::hub::{Hub, PushError, PushResult};
use crate::roles::Role;

/// A push body: Fantom's payload (`{"openrouter": {...}}`) or the bare `openrouter` object.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum PushBody {
    Payload { openrouter: OpenRouterPush },
    Bare(OpenRouterPush),
}

fn admin(hub: &Hub, headers: &HeaderMap) -> Result<(), ApiError> {
    auth::require(headers, hub.admin_token(), "admin")
}

pub async fn get_config(
    State(hub): State<Hub>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    admin(&hub, &headers)?;
    let state = hub.state();
    let policies: serde_json::Map<String, Value> = Role::ALL
        .into_iter()
        .map(|r| (r.to_string(), json!(state.cloud.policy(r))))
        .collect();
    Ok(Json(json!({
        "openrouter": {
            "allowedModels": state.cloud.allowed_models,
            "modeByRole": policies,
            "domain": state.cloud.domain,
        },
        "keyPushed": state.key.is_some(),
        "keyPushedAtMs": state.key.as_ref().map(|k| k.pushed_at_ms),
        "lastPushMs": state.last_push_ms,
    })))
}

pub async fn post_config(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<PushBody>, JsonRejection>,
) -> Result<Json<PushResult>, ApiError> {
    admin(&hub, &headers)?;
    let push = match request {
        Ok(Json(PushBody::Payload { openrouter } | PushBody::Bare(openrouter))) => openrouter,
        // An untagged body that fits neither shape reports only that, never a field's value.
        Err(e) => {
            return Err(ApiError::bad_request(format!(
                "invalid config push: {}",
                e.body_text()
            )));
        }
    };
    match hub.push_config(push) {
        Ok(result) => Ok(Json(result)),
        Err(PushError::Refused(e)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "push_refused",
            e.to_string(),
        )),
        Err(PushError::State(e)) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "state_write",
            e.to_string(),
        )),
    }
}

pub async fn status(
    State(hub): State<Hub>,
    headers: HeaderMap,
) -> Result<Json<StatusView>, ApiError> {
    admin(&hub, &headers)?;
    Ok(Json(hub.status()))
}
