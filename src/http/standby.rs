//! What a standby hub answers while another leads (`--etcd-endpoints`), so that a client
//! configured with any hub's address keeps working:
//!
//! * `/health` is 200 (the process is up) and names the leader; `/ready` is 503 (a load
//!   balancer sends nothing here);
//! * `/v1/agent` refuses the upgrade with 503 `standby` naming the leader (agents dial it
//!   themselves, and only at an address of their own `hub_urls`);
//! * every other request is **forwarded** to the leader's advertised address: method, path,
//!   query, headers (the client's bearer token among them: every hub of a store holds the same
//!   tokens) and body, and the leader's answer streamed back as it comes (a streamed chat
//!   too). Without a leader, or when the leader cannot be reached, it is 503 `standby` with
//!   `Retry-After: 1`.
//!
//! It serves until this hub wins the election; then the hub's own router takes the listener.
//! Winning ends every forward still in flight at once (503 `standby`, "send it again"): a
//! forward to a leader that stalled (the reason this hub won) would otherwise never end, and
//! the standby surface could not hand over its listener.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use tokio::sync::watch;

use crate::hub::store::etcd::election::LeaderRecord;

/// The leader a standby last saw (none yet: no hub leads).
pub type SeenLeader = Arc<Mutex<Option<LeaderRecord>>>;

#[derive(Clone)]
struct Standby {
    leader: SeenLeader,
    http: reqwest::Client,
    /// Turns true when this hub wins the election.
    won: watch::Receiver<bool>,
}

/// The standby surface; `won` turns true when this hub leads.
pub fn router(leader: SeenLeader, won: watch::Receiver<bool>) -> Router {
    let http = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(5))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap_or_default();
    let standby = Standby { leader, http, won };
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(refuse_now))
        .route("/v1/agent", get(refuse_now))
        .fallback(forward)
        .layer(axum::extract::DefaultBodyLimit::max(super::MAX_BODY_BYTES))
        .with_state(standby)
}

impl Standby {
    fn leader_url(&self) -> Option<String> {
        self.leader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|l| l.url.trim_end_matches('/').to_string())
    }
}

async fn health(State(s): State<Standby>) -> Response {
    axum::Json(json!({"status": "standby", "leader": s.leader_url()})).into_response()
}

async fn refuse_now(State(s): State<Standby>) -> Response {
    let message = match s.leader_url() {
        Some(url) => format!("this hub is a standby; the leader is {url}"),
        None => "this hub is a standby and no hub leads yet; try again shortly".to_string(),
    };
    refuse(&s, message)
}

fn refuse(s: &Standby, message: String) -> Response {
    let mut response = (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({"error": {"code": "standby", "message": message,
            "leader": s.leader_url()}})),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// Marks a forwarded request (to the leader) and its answer (to the client).
const FORWARDED_BY: HeaderName = HeaderName::from_static("x-fantom-forwarded-by");

/// Why a forward in flight ended: this hub leads now.
const WON: &str = "this hub was a standby and leads now; send the request again";

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1), and the ones
/// the client library sets itself.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !hop_by_hop(name) {
            to.append(name.clone(), value.clone());
        }
    }
}

async fn forward(State(s): State<Standby>, request: Request) -> Response {
    let Some(leader) = s.leader_url() else {
        return refuse(
            &s,
            "this hub is a standby and no hub leads yet; try again shortly".into(),
        );
    };
    let (parts, body) = request.into_parts();
    // A forwarded request reaching a standby again would go round (a leader advertised at an
    // address that is this hub's own, say): one hop only.
    if parts.headers.contains_key(FORWARDED_BY) {
        return refuse(
            &s,
            format!(
                "a request forwarded to the leader {leader} reached a standby: check the leader's --advertise-url"
            ),
        );
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let body = match axum::body::to_bytes(body, super::MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                axum::Json(json!({"error": {"code": "body_too_large", "message": e.to_string()}})),
            )
                .into_response();
        }
    };
    let mut headers = HeaderMap::new();
    copy_headers(&parts.headers, &mut headers);
    headers.insert(FORWARDED_BY, HeaderValue::from_static("standby"));
    let send = s
        .http
        .request(parts.method.clone(), format!("{leader}{path}"))
        .headers(headers)
        .body(body)
        .send();
    let mut won = s.won.clone();
    let sent = tokio::select! {
        sent = send => sent,
        _ = won.wait_for(|w| *w) => return refuse(&s, WON.into()),
    };
    let upstream = match sent {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(leader = %leader, error = %e.without_url(), "a standby cannot reach the leader to forward a request");
            return refuse(
                &s,
                format!(
                    "this hub is a standby and the leader {leader} cannot be reached now; try again shortly"
                ),
            );
        }
    };
    let mut response = Response::builder().status(upstream.status());
    if let Some(h) = response.headers_mut() {
        copy_headers(upstream.headers(), h);
        h.insert(FORWARDED_BY, HeaderValue::from_static("standby"));
    }
    // The answer streams back chunk by chunk as the leader sends it (a chat's events too).
    let stream = futures_util::stream::unfold(Some((upstream, won)), |state| async move {
        let (mut upstream, mut won) = state?;
        let next = tokio::select! {
            next = upstream.chunk() => next,
            _ = won.wait_for(|w| *w) => return Some((Err(std::io::Error::other(WON)), None)),
        };
        match next {
            Ok(Some(bytes)) => Some((Ok(bytes), Some((upstream, won)))),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e.without_url())), None)),
        }
    });
    response
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}
