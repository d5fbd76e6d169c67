//! What a leader that stepped aside answers ([`crate::hub::aside`]): cut off from etcd while
//! another hub leads under a newer epoch (and said so itself when asked), it is a standby in
//! all but name. `/health` names the leader and its epoch as a standby's does, `/ready` and
//! agents' upgrades get 503 `standby` naming the leader, `/metrics` stays its own, and every
//! other request is forwarded to the leader and its answer streamed back
//! ([`super::standby::relay`]), so a client configured with this address keeps working and a
//! key the new leader rotated or removed is refused. A fenced leader that has not stepped aside
//! (a newer leader named that it cannot confirm, or no hub says who leads) answers itself:
//! work with a project key gets 503 `store_unreachable` naming why (`client_api::client_auth`),
//! cloud work the same (the fence), keyless local work is served.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::hub::Hub;
use crate::hub::aside::Aside;

/// The layer's state: the hub and the client that forwards.
#[derive(Clone)]
pub struct AsideRelay {
    pub hub: Hub,
    pub http: reqwest::Client,
    /// Never turns: a stepped-aside leader does not win back in this process.
    pub never: tokio::sync::watch::Receiver<bool>,
}

impl AsideRelay {
    /// Forwards with the peers' trust the hub was given (`Hub::spawn_aside_watch`, before the
    /// router is built).
    pub fn new(hub: Hub) -> Self {
        let http = hub
            .peer_trust()
            .client(None, std::time::Duration::from_secs(5));
        // The sender lives in the receiver's channel for as long as a clone of it does.
        let (tx, never) = tokio::sync::watch::channel(false);
        std::mem::forget(tx);
        Self { hub, http, never }
    }
}

pub async fn aside_layer(
    State(relay): State<AsideRelay>,
    request: Request,
    next: Next,
) -> Response {
    let Some(Aside::Leader { url, epoch }) = relay.hub.aside() else {
        return next.run(request).await;
    };
    let url = url.trim_end_matches('/').to_string();
    match request.uri().path() {
        "/health" => {
            axum::Json(json!({"status": "standby", "leader": url, "epoch": epoch})).into_response()
        }
        "/ready" | "/v1/agent" => super::standby::refusal(
            Some(&url),
            Some(epoch),
            format!(
                "this hub is cut off from etcd and stepped aside; the leader is {url} (epoch {epoch})"
            ),
        ),
        "/metrics" => next.run(request).await,
        _ => {
            super::standby::relay(&relay.http, &url, Some(epoch), request, relay.never.clone())
                .await
        }
    }
}
