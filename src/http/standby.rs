//! What a standby hub answers while another leads (`--etcd-endpoints`): `/health` is 200 (the
//! process is up), `/ready` is 503 (load balancers send nothing here), and every other path
//! is 503 `standby` naming the leader and its address, with `Retry-After: 1`. It serves until
//! this hub wins the election; then the hub's own router takes the same listener.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::hub::store::etcd::election::LeaderRecord;

/// The leader a standby last saw (none yet: no hub leads).
pub type SeenLeader = Arc<Mutex<Option<LeaderRecord>>>;

pub fn router(leader: SeenLeader) -> Router {
    let on_health = leader.clone();
    let on_ready = leader.clone();
    Router::new()
        .route(
            "/health",
            get(move || async move {
                axum::Json(json!({"status": "standby", "leader": url_of(&on_health)}))
            }),
        )
        .route("/ready", get(move || async move { refuse(&on_ready) }))
        .fallback(move || async move { refuse(&leader) })
}

fn url_of(leader: &SeenLeader) -> Option<String> {
    leader
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .map(|l| l.url.clone())
}

fn refuse(leader: &SeenLeader) -> Response {
    let message = match url_of(leader) {
        Some(url) => format!("this hub is a standby; the leader is {url}"),
        None => "this hub is a standby and no hub leads yet; try again shortly".to_string(),
    };
    let mut response = (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({"error": {"code": "standby", "message": message,
            "leader": url_of(leader)}})),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}
