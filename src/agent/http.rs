//! The agent's own small HTTP server (`--http`, default 127.0.0.1:8098): `GET /health` and
//! `GET /metrics` (Prometheus text) for the host's monitoring, with each fronted model server's
//! health. No secrets: counters only.

use std::fmt::Write;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::Agent;
use super::local_server::Health;

pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
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

async fn metrics(State(agent): State<Arc<Agent>>) -> impl IntoResponse {
    let mut out = String::new();
    let stats = agent.provider_stats();
    let roles: Vec<String> = agent
        .providers()
        .iter()
        .map(|p| p.info().role.to_string())
        .collect();
    let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(usize) -> Option<f64>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, s) in stats.iter().enumerate() {
            if let Some(v) = value(i) {
                let _ = writeln!(
                    out,
                    "{name}{{provider=\"{}\",role=\"{}\"}} {v}",
                    s.provider,
                    roles.get(i).map_or("", String::as_str)
                );
            }
        }
    };
    family(
        "fantom_agent_items_served_total",
        "counter",
        "Items served.",
        &|i| Some(stats[i].served as f64),
    );
    family(
        "fantom_agent_failures_total",
        "counter",
        "Failed work frames.",
        &|i| Some(stats[i].failures as f64),
    );
    family(
        "fantom_agent_in_flight",
        "gauge",
        "Work frames in progress.",
        &|i| Some(stats[i].in_flight as f64),
    );
    family(
        "fantom_agent_latency_ewma_ms",
        "gauge",
        "Model-call latency per work frame (EWMA).",
        &|i| stats[i].latency_ewma_ms,
    );
    family(
        "fantom_agent_latency_p95_ms",
        "gauge",
        "Model-call latency per work frame, p95 of the last 256.",
        &|i| stats[i].latency_p95_ms,
    );
    let _ = writeln!(
        out,
        "# HELP fantom_agent_hub_connected 1 while a hub session is open.\n# TYPE fantom_agent_hub_connected gauge\nfantom_agent_hub_connected {}",
        u8::from(agent.is_connected())
    );
    if !agent.servers().is_empty() {
        let _ = writeln!(
            out,
            "# HELP fantom_agent_local_server_up 1 while a fronted model server answers its health check.\n# TYPE fantom_agent_local_server_up gauge"
        );
        for s in agent.servers().iter() {
            let _ = writeln!(
                out,
                "fantom_agent_local_server_up{{server=\"{}\",kind=\"{}\"}} {}",
                s.key(),
                s.config.kind.as_str(),
                u8::from(s.is_up())
            );
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}
