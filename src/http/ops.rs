//! `GET /health` (liveness: the process is up), `GET /ready` (readiness: every role the hub
//! answers for can serve a new request now, else 503 with the reason per role; what a load
//! balancer or a Kubernetes readiness probe asks) and `GET /metrics` (Prometheus text), open
//! to anyone: they carry counts and reasons, never a secret.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use crate::hub::Hub;

pub async fn health(State(hub): State<Hub>) -> impl IntoResponse {
    let agents = hub.core().agents().len();
    Json(json!({"status": "ok", "agents": agents, "uptime_s": hub.uptime().as_secs()}))
}

/// 200 when every role the hub answers for (those configured with `ready_roles`, those a
/// provider or a cloud route has offered) has a provider that may serve it (for an embedding
/// role: one that passed the gate for its space); 503 otherwise, and while there is no role
/// at all.
pub async fn ready(State(hub): State<Hub>) -> impl IntoResponse {
    let catalog = hub.catalog();
    let mut roles = Map::new();
    let mut all = !catalog.is_empty();
    for entry in catalog {
        let view = match &entry.unservable {
            None => json!({"ready": true, "providers": entry.providers}),
            Some(u) => {
                all = false;
                json!({"ready": false, "providers": entry.providers, "code": u.code, "message": u.message})
            }
        };
        roles.insert(entry.role.to_string(), view);
    }
    let mut body = json!({"status": if all { "ready" } else { "not_ready" }, "roles": roles});
    if roles_empty(&body) {
        body["message"] =
            Value::from("no role yet: no agent has connected and no cloud route is configured");
    }
    let status = if all {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

fn roles_empty(body: &Value) -> bool {
    body["roles"].as_object().is_none_or(Map::is_empty)
}

pub fn metrics_text(hub: &Hub, routes: &super::request_id::RouteMetrics) -> Response {
    let mut text = hub.metrics_text();
    routes.render(&mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such endpoint; see /v1/embeddings, /v1/models, /v1/rerank, /v1/chat/completions, \
         /v2/embed, /v2/rerank, /embed, /rerank, /info, /api/embed, /admin/*, /health, /ready, \
         /metrics",
    )
}
