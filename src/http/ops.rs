//! `GET /health` and `GET /metrics` (Prometheus text), open to anyone: they carry counts,
//! never a secret.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde_json::json;

use super::error::ApiError;
use crate::hub::Hub;

pub async fn health(State(hub): State<Hub>) -> impl IntoResponse {
    let agents = hub.core().agents().len();
    Json(json!({"status": "ok", "agents": agents, "uptime_s": hub.uptime().as_secs()}))
}

pub async fn metrics(State(hub): State<Hub>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        hub.metrics_text(),
    )
}

pub async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such endpoint; see /v1/embeddings, /v1/rerank, /admin/*, /health, /metrics",
    )
}
