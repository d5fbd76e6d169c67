//! The agent's own small HTTP server (`--http`, default 127.0.0.1:8098): `GET /health` and
//! `GET /metrics` (the agent's own registry, [`crate::metrics`]) for the host's monitoring, with
//! each fronted model server's health. No secrets: counters only.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Extension, Json, Router};
use serde_json::json;

use super::Agent;
use super::local_server::Health;
use crate::metrics::{Families, Labels, Registry, Scrape};

pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(Extension(Arc::new(registry(agent.clone()))))
        .with_state(agent)
}

async fn health(State(agent): State<Arc<Agent>>) -> impl IntoResponse {
    let connected = agent.is_connected();
    // An agent without a hub (Fantom masters only) is not unhealthy for lacking one.
    let healthy = connected || !agent.has_hub();
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let providers: Vec<_> = agent.providers().iter().map(|p| p.info()).collect();
    (
        status,
        Json(json!({
            "ok": healthy,
            "status": if healthy { "ok" } else { "disconnected" },
            "agent_id": agent.id(),
            "hub_connected": connected,
            "sessions": agent.sessions(),
            "providers": providers,
            "cloud_key_held": agent.holds_key(),
            "cloud": agent.cloud_settings(),
            "local_servers": local_servers(&agent),
        })),
    )
}

/// Each fronted server and where its health checks leave it.
fn local_servers(agent: &Agent) -> Vec<serde_json::Value> {
    agent
        .servers()
        .iter()
        .map(|s| {
            let (status, reason, revision) = match s.health() {
                Health::Up(c) => ("up", None, c.revision),
                Health::Down(why) => ("down", Some(why), None),
                Health::Unchecked => ("unchecked", None, None),
            };
            json!({"role": s.key(), "url": s.config.base_url(), "kind": s.config.kind.as_str(),
                "model": s.config.model, "unit": s.config.unit, "status": status,
                "reason": reason, "revision": revision})
        })
        .collect()
}

async fn metrics(
    Extension(registry): Extension<Arc<Registry>>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    crate::metrics::response(&registry, &headers)
}

/// The agent's registry: build info, process, and its providers read at each scrape.
fn registry(agent: Arc<Agent>) -> Registry {
    let mut registry = crate::metrics::registry("agent");
    registry.register_collector(Box::new(Scrape::new(move |f| encode(&agent, f))));
    registry
}

fn encode(agent: &Agent, f: &mut Families) -> std::fmt::Result {
    let stats = agent.provider_stats();
    let roles: Vec<String> = agent
        .providers()
        .iter()
        .map(|p| p.info().role.to_string())
        .collect();
    let rows = |value: &dyn Fn(&crate::protocol::ProviderStats) -> Option<f64>| {
        stats
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let labels = vec![
                    ("provider", s.provider.clone()),
                    ("role", roles.get(i).cloned().unwrap_or_default()),
                ];
                Some((labels, value(s)?))
            })
            .collect::<Vec<(Labels, f64)>>()
    };
    f.counter(
        "fantom_agent_items_served_total",
        "Items served.",
        rows(&|s| Some(s.served as f64)),
    )?;
    f.counter(
        "fantom_agent_failures_total",
        "Failed work frames.",
        rows(&|s| Some(s.failures as f64)),
    )?;
    f.gauge(
        "fantom_agent_in_flight",
        "Work frames in progress.",
        rows(&|s| Some(s.in_flight as f64)),
    )?;
    f.gauge(
        "fantom_agent_latency_ewma_seconds",
        "Model-call latency per work frame (EWMA).",
        rows(&|s| s.latency_ewma_ms.map(|ms| ms / 1000.0)),
    )?;
    f.gauge(
        "fantom_agent_latency_p95_seconds",
        "Model-call latency per work frame, p95 of the last 256.",
        rows(&|s| s.latency_p95_ms.map(|ms| ms / 1000.0)),
    )?;
    f.gauge(
        "fantom_agent_hub_connected",
        "1 while a hub session is open.",
        [(Labels::new(), f64::from(u8::from(agent.is_connected())))],
    )?;
    f.gauge(
        "fantom_agent_local_server_up",
        "1 while a fronted model server answers its health check.",
        agent.servers().iter().map(|s| {
            let labels = vec![
                ("server", s.key().to_string()),
                ("kind", s.config.kind.as_str().to_string()),
            ];
            (labels, f64::from(u8::from(s.is_up())))
        }),
    )
}
