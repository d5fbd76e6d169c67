//! The admin API (its own bearer token): `GET/POST /admin/config` (a partial push; `apiKey`
//! is write-only: accepted here, sent to the agents, never stored or returned) and
//! `GET /admin/status`.

use super::openapi::{AdminErrors, AnyObject};
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use super::auth;
use super::error::ApiError;
use crate::config::push::OpenRouterPush;
use crate::hub::status::StatusView;
use crate::hub::{Hub, PushError, PushResult};
use crate::roles::Role;
use crate::secret::redact;

/// Reads a push body: Fantom's payload (`{"openrouter": {...}}`) or the bare `openrouter`
/// object. Errors quote no value (a misplaced key must not come back in a response).
fn parse_push(body: &[u8]) -> Result<OpenRouterPush, String> {
    let mut object: serde_json::Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| redact(&e.to_string()))?;
    let push = match object.remove("openrouter") {
        Some(inner) => inner,
        None => Value::Object(object),
    };
    serde_json::from_value(push).map_err(|e| redact(&e.to_string()))
}

pub(super) fn admin(hub: &Hub, headers: &HeaderMap) -> Result<(), ApiError> {
    auth::require(headers, hub.admin_token(), "admin")
}

/// The cloud config in force (never the key), and Fantom's defaults for unmapped roles.
#[utoipa::path(get, path = "/admin/config", tag = "admin",
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
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
    // Fantom's defaults for the roles no push mapped: proposed, never in force until a push
    // takes them.
    let proposed: serde_json::Map<String, Value> = crate::config::push::seed_defaults()
        .into_iter()
        .filter(|(role, _)| !state.cloud.allowed_models.contains_key(role))
        .map(|(role, m)| (role.to_string(), json!(m)))
        .collect();
    Ok(Json(json!({
        "openrouter": {
            "allowedModels": state.cloud.allowed_models,
            "modeByRole": policies,
            "domain": state.cloud.domain,
        },
        "defaults": {
            "inForce": false,
            "allowedModels": proposed,
            "take": "push {\"useDefaults\": true} to map these roles to them (roles already mapped keep their model)",
        },
        "revision": state.config_revision,
        "keyGeneration": state.key_generation,
        "keyPushed": state.key.is_some(),
        "keyPushedAtMs": state.key.as_ref().map(|k| k.pushed_at_ms),
        "lastPushMs": state.last_push_ms,
    })))
}

/// A config push, partial and merged (Fantom's `{"openrouter": {...}}` or the bare object; the
/// key is write-only). docs/operations.md lists its fields.
#[utoipa::path(post, path = "/admin/config", tag = "admin", request_body = AnyObject,
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn post_config(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<PushResult>, ApiError> {
    admin(&hub, &headers)?;
    let push = parse_push(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid config push: {e}")))?;
    match hub.push_config(push).await {
        Ok(result) => Ok(Json(result)),
        Err(PushError::Refused(e)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "push_refused",
            e.to_string(),
        )),
        Err(PushError::State(e)) => Err(ApiError::state_write(&e)),
    }
}

/// `POST /admin/budget`: `{"permits": 1..=256}` overrides the cloud budget's ceiling at
/// once; `{"permits": null}` returns it to what the account allows. Persisted.
#[utoipa::path(post, path = "/admin/budget", tag = "admin", request_body = BudgetRequest,
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn post_budget(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    admin(&hub, &headers)?;
    let value: Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!("invalid budget body: {}", redact(&e.to_string())))
    })?;
    let permits = match value.get("permits") {
        Some(Value::Null) => None,
        Some(v) => match v.as_number().and_then(super::whole_number::of) {
            Some(n @ 1..=256) => Some(n as u32),
            _ => {
                return Err(ApiError::bad_request(
                    "permits must be an integer in 1..=256, or null",
                ));
            }
        },
        None => {
            return Err(ApiError::bad_request(
                "send {\"permits\": N} (1..=256) or {\"permits\": null}",
            ));
        }
    };
    hub.set_budget_override(permits)
        .await
        .map_err(|e| ApiError::state_write(&e))?;
    Ok(Json(
        json!({ "override": permits, "budget": hub.status().budget }),
    ))
}

/// `POST /admin/gate/verify`: forgets verdicts (`{"provider": "agent/id"}` for one provider,
/// `{}` for all) so they are probed and judged again now; `{"retire_space": id}` also forgets
/// that space's fingerprint, which the role's reference then makes again.
#[utoipa::path(post, path = "/admin/gate/verify", tag = "admin", request_body = GateVerifyRequest,
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn post_gate_verify(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    admin(&hub, &headers)?;
    let value: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad_request(format!("invalid body: {}", redact(&e.to_string())))
        })?
    };
    let provider = match value.get("provider") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(p.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "provider must be a string (agent/provider)",
            ));
        }
    };
    let retire = match value.get("retire_space") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "retire_space must be a space id string",
            ));
        }
    };
    let mut core = hub.core();
    // Fenced, nothing could be probed again or stored: refused, not half done.
    if let Err(fenced) = core.fence.check(std::time::Instant::now()) {
        return Err(ApiError::state_write(
            &crate::hub::state::StateError::Fenced(fenced.0),
        ));
    }
    if let Some(space) = &retire
        && !core.gate.retire(space)
    {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "no_such_space",
            format!("no space '{space}'"),
        ));
    }
    let cleared = core.gate.reverify(provider.as_deref());
    core.gate_tick(std::time::Instant::now());
    // Requests admitted under a retired generation fail now with `space_changed`.
    core.dispatch_all();
    Ok(Json(json!({ "cleared": cleared, "retired": retire })))
}

/// Everything the hub knows: agents, providers, queues, the budget, the gate, projects.
#[utoipa::path(get, path = "/admin/status", tag = "admin",
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn status(
    State(hub): State<Hub>,
    headers: HeaderMap,
) -> Result<Json<StatusView>, ApiError> {
    admin(&hub, &headers)?;
    Ok(Json(hub.status()))
}

/// `GET /admin/history`'s query.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
pub struct HistoryQuery {
    /// Only the samples after this moment (ms since the Unix epoch): what a page that has the
    /// rest asks for.
    since_ms: Option<u64>,
}

/// The console's charts: this hub's samples of the budget, the queues and the agents, every
/// 0.5 s for the last 15 minutes (kept in memory: empty after a restart or a takeover).
#[utoipa::path(get, path = "/admin/history", tag = "admin", params(HistoryQuery),
    responses((status = 200, body = crate::hub::history::HistoryView), AdminErrors),
    security(("admin_token" = [])))]
pub async fn history(
    State(hub): State<Hub>,
    headers: HeaderMap,
    query: Result<axum::extract::Query<HistoryQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<crate::hub::history::HistoryView>, ApiError> {
    admin(&hub, &headers)?;
    let axum::extract::Query(query) = query.map_err(|e| {
        ApiError::bad_request(format!(
            "since_ms must be a whole number of milliseconds: {}",
            crate::secret::redact(&e.body_text())
        ))
    })?;
    Ok(Json(hub.history().view(query.since_ms)))
}

/// `POST /admin/budget`'s body.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // a schema only: the body is read as JSON
pub struct BudgetRequest {
    /// The ceiling on cloud calls in flight, 1..=256; null returns it to what the account allows.
    #[schema(minimum = 1, maximum = 256)]
    permits: Option<u32>,
}

/// `POST /admin/gate/verify`'s body (`{}` forgets every verdict).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct GateVerifyRequest {
    /// One provider (`agent/provider`) to judge again.
    provider: Option<String>,
    /// A space id to retire.
    retire_space: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_bodies_parse_in_both_shapes_and_errors_quote_no_value() {
        let wrapped = parse_push(br#"{"openrouter":{"domain":"code"}}"#).unwrap();
        let bare = parse_push(br#"{"domain":"code"}"#).unwrap();
        assert_eq!(wrapped.domain, bare.domain);
        let err = parse_push(br#"{"openrouter":{"allowedModels":"sk-or-v1-oops"}}"#).unwrap_err();
        assert!(!err.contains("sk-or"), "{err}");
        assert!(err.contains("invalid type"), "{err}");
        assert!(parse_push(b"[1]").is_err());
    }
}
