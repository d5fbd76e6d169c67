//! `GET /health` (liveness: the process is up; also `GET /` and `GET /ping`, as TEI answers),
//! `GET /ready` (readiness: every role that gates it can serve a new request now, else 503 with
//! the reason per role; what a load balancer or a Kubernetes readiness probe asks) and
//! `GET /metrics` (the hub's registry, [`crate::metrics`]), open to anyone: they carry counts and reasons, never a
//! secret.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use crate::hub::Hub;

/// The process is up.
#[derive(Serialize, ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: &'static str,
    /// Agents connected now.
    pub agents: usize,
    pub uptime_s: u64,
    /// A leader on etcd: the epoch it leads under (agents ask who leads: a standby answers
    /// `{"status": "standby", "leader": …, "epoch": …}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
}

fn health_of(hub: &Hub) -> Json<Health> {
    let (agents, epoch) = {
        let core = hub.core();
        (core.agents().len(), core.epoch)
    };
    Json(Health {
        status: "ok",
        agents,
        uptime_s: hub.uptime().as_secs(),
        epoch,
    })
}

/// Liveness: the process is up.
#[utoipa::path(get, path = "/health", tag = "operations",
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn health(State(hub): State<Hub>) -> Json<Health> {
    health_of(&hub)
}

/// Liveness, as TEI answers `GET /`.
#[utoipa::path(get, path = "/", tag = "operations",
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn health_root(State(hub): State<Hub>) -> Json<Health> {
    health_of(&hub)
}

/// Liveness, as TEI answers `GET /ping`.
#[utoipa::path(get, path = "/ping", tag = "operations",
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn ping(State(hub): State<Hub>) -> Json<Health> {
    health_of(&hub)
}

/// Readiness: whether each role can serve a new request now.
#[derive(Serialize, ToSchema)]
pub struct Readiness {
    /// `ready` or `not_ready`.
    pub status: &'static str,
    /// Every role readiness answers for.
    pub roles: BTreeMap<String, RoleReadiness>,
    /// Why there is no role yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<&'static str>,
    /// A leader on etcd that cannot renew its lead: why no cloud work, new space or config
    /// write goes through (roles served locally stay ready).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct RoleReadiness {
    pub ready: bool,
    /// Connected providers of the role.
    pub providers: usize,
    /// Whether this role's readiness gates the hub's.
    pub gates: bool,
    /// Why a new request of the role would not be served now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// 200 when every role that gates readiness (the configured `ready_roles`; without them,
/// every role a connected provider or a cloud route offers) has a provider that may serve it
/// (for an embedding role: one that passed the gate for its space); 503 otherwise, and while
/// no role gates at all. The other roles are reported, and do not gate.
#[utoipa::path(get, path = "/ready", tag = "operations", responses(
    (status = 200, description = "Every role that gates readiness can serve", body = Readiness),
    (status = 503, description = "A role that gates readiness cannot serve (or none gates yet)",
        body = Readiness)))]
pub async fn ready(State(hub): State<Hub>) -> (StatusCode, Json<Readiness>) {
    let catalog = hub.catalog();
    let mut roles = BTreeMap::new();
    let mut all = catalog.iter().any(|e| e.gates_ready);
    for entry in catalog {
        let mut view = RoleReadiness {
            ready: entry.unservable.is_none(),
            providers: entry.providers,
            gates: entry.gates_ready,
            code: None,
            message: None,
        };
        if let Some(u) = entry.unservable {
            all &= !entry.gates_ready;
            view.code = Some(u.code);
            view.message = Some(u.message);
        }
        roles.insert(entry.role.to_string(), view);
    }
    let message = roles.is_empty().then_some(
        "no role yet: no agent is connected, no cloud route is configured, and no ready_roles are set",
    );
    // A fenced leader still serves local work that passes: it says why nothing else moves.
    let store = hub
        .store()
        .fence()
        .check(std::time::Instant::now())
        .err()
        .map(|f| f.0);
    let status = if all {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = Readiness {
        status: if all { "ready" } else { "not_ready" },
        roles,
        message,
        store,
    };
    (status, Json(body))
}

/// The hub's metrics and its routes' latencies, in Prometheus' text format.
#[utoipa::path(get, path = "/metrics", tag = "operations", responses(
    (status = 200, description = "OpenMetrics 1.0 text for a scraper whose Accept names it (Prometheus does), else Prometheus' text format 0.0.4",
        content((String = "text/plain"), (String = "application/openmetrics-text")))))]
pub async fn metrics(
    Extension(registry): Extension<Arc<crate::metrics::Registry>>,
    headers: axum::http::HeaderMap,
) -> Response {
    crate::metrics::response(&registry, &headers)
}

pub async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such endpoint; see /v1/embeddings, /v1/models, /v1/rerank, /v1/chat/completions, \
         /v2/embed, /v2/rerank, /embed, /rerank, /info, /api/embed, /admin/*, /health, /ready, \
         /metrics; GET /openapi.json describes them all (GET /docs to browse)",
    )
}
