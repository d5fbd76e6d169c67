//! `GET /health` (liveness: the process is up; also `GET /` and `GET /ping`, as TEI answers),
//! `GET /ready` (readiness: every role that gates it can serve a new request now, else 503 with
//! the reason per role; what a load balancer or a Kubernetes readiness probe asks) and `GET /metrics` (Prometheus text), open
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

/// 200 when every role that gates readiness (the configured `ready_roles`; without them,
/// every role a connected provider or a cloud route offers) has a provider that may serve it
/// (for an embedding role: one that passed the gate for its space); 503 otherwise, and while
/// no role gates at all. The other roles are reported, and do not gate.
pub async fn ready(State(hub): State<Hub>) -> impl IntoResponse {
    let catalog = hub.catalog();
    let mut roles = Map::new();
    let mut all = catalog.iter().any(|e| e.gates_ready);
    for entry in catalog {
        let mut view = json!({"ready": entry.unservable.is_none(), "providers": entry.providers,
                              "gates": entry.gates_ready});
        if let Some(u) = &entry.unservable {
            all &= !entry.gates_ready;
            view["code"] = Value::from(u.code);
            view["message"] = Value::from(u.message.clone());
        }
        roles.insert(entry.role.to_string(), view);
    }
    let mut body = json!({"status": if all { "ready" } else { "not_ready" }, "roles": roles});
    if roles_empty(&body) {
        body["message"] = Value::from(
            "no role yet: no agent is connected, no cloud route is configured, and no ready_roles are set",
        );
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
