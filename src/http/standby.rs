//! What a standby hub answers while another leads (`--etcd-endpoints`), so that a client
//! configured with any hub's address keeps working:
//!
//! * `/health` is 200 (the process is up) and names the leader; `/ready` is 503 (a load
//!   balancer sends nothing here);
//! * `/v1/agent` refuses the upgrade with 503 `standby` naming the leader (agents dial it
//!   themselves, and only at an address of their own `hub_urls`);
//! * `/metrics` and `/admin/status` answer for **this** hub: its own process, build and HA
//!   series (`fantom_hub_ha_leader` 0, the epoch it sees), so that Prometheus scraping every
//!   hub counts the leader once and sees each standby, even while no hub leads. Status checks
//!   the admin token itself (every hub of a store holds the same), names this hub a standby
//!   and the leader, and carries the leader's own document (its `ha` as `leader_ha`) when the
//!   leader answers, or why it did not;
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

use crate::hub::store::HaView;
use crate::hub::store::etcd::election::LeaderRecord;
use crate::secret::Secret;

/// The leader a standby last saw, with the epoch it leads under (none yet: no hub leads).
pub type SeenLeader = Arc<Mutex<Option<(LeaderRecord, i64)>>>;

/// What a standby knows of itself: the admin token it checks and its store, for its status.
#[derive(Clone)]
pub struct StandbySelf {
    pub admin_token: Secret,
    /// The store as `HaView::store` names it (endpoints and prefix; never a credential).
    pub store: String,
    /// What the leader's certificate is trusted by (`--peer-ca-file`).
    pub peer_trust: crate::hub::peer_http::PeerTrust,
}

#[derive(Clone)]
struct Standby {
    leader: SeenLeader,
    http: reqwest::Client,
    /// Turns true when this hub wins the election.
    won: watch::Receiver<bool>,
    me: Arc<StandbySelf>,
    metrics: Arc<crate::metrics::Registry>,
}

/// The standby surface; `won` turns true when this hub leads.
pub fn router(leader: SeenLeader, won: watch::Receiver<bool>, me: StandbySelf) -> Router {
    let http = me.peer_trust.client(None, Duration::from_secs(5));
    let me = Arc::new(me);
    let mut metrics = crate::metrics::registry("hub");
    {
        let (leader, me) = (leader.clone(), me.clone());
        metrics.register_collector(Box::new(crate::metrics::Scrape::new(move |f| {
            crate::hub::metrics::encode_ha(f, &ha_view(&leader, &me))
        })));
    }
    let standby = Standby {
        leader,
        http,
        won,
        me,
        metrics: Arc::new(metrics),
    };
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(refuse_now))
        .route("/v1/agent", get(refuse_now))
        .route("/metrics", get(own_metrics))
        .route("/admin/status", get(own_status))
        .fallback(forward)
        .layer(axum::extract::DefaultBodyLimit::max(super::MAX_BODY_BYTES))
        .with_state(standby)
}

/// A standby's own HA view: the leader it sees and that leader's epoch.
fn ha_view(leader: &SeenLeader, me: &StandbySelf) -> HaView {
    let seen = leader
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    HaView {
        role: "standby",
        store: me.store.clone(),
        leader: seen
            .as_ref()
            .map(|(l, _)| l.url.trim_end_matches('/').to_string()),
        epoch: seen.map(|(_, epoch)| epoch),
        lease_ttl_s: None,
        lease_renewals: None,
        set_aside: Vec::new(),
        peers: None,
        aside: None,
        fenced: None,
        handover_saved_ms: None,
    }
}

impl Standby {
    fn leader_url(&self) -> Option<String> {
        self.leader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|(l, _)| l.url.trim_end_matches('/').to_string())
    }

    fn epoch(&self) -> Option<i64> {
        self.leader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|(_, epoch)| *epoch)
    }
}

async fn health(State(s): State<Standby>) -> Response {
    axum::Json(json!({"status": "standby", "leader": s.leader_url(), "epoch": s.epoch()}))
        .into_response()
}

/// This hub's own series (never the leader's: a scraper of every hub counts each once).
async fn own_metrics(State(s): State<Standby>, headers: HeaderMap) -> Response {
    crate::metrics::response(&s.metrics, &headers)
}

/// This hub's own status (`ha`: a standby and the leader it sees), with the leader's document
/// when the leader answers in time, else why not. The admin token is checked here first.
async fn own_status(State(s): State<Standby>, headers: HeaderMap) -> Response {
    if let Err(e) = super::auth::require(&headers, &s.me.admin_token, "admin") {
        return e.into_response();
    }
    let mut body = json!({});
    match s.leader_url() {
        None => body["leader_unreachable"] = json!("no hub leads yet"),
        Some(leader) => {
            // Only the token: an `Accept-Encoding` passed on would have the leader compress an
            // answer this client does not decode.
            let mut forwarded = HeaderMap::new();
            if let Some(auth) = headers.get(header::AUTHORIZATION) {
                forwarded.insert(header::AUTHORIZATION, auth.clone());
            }
            forwarded.insert(FORWARDED_BY, HeaderValue::from_static("standby"));
            let answer = s
                .http
                .get(format!("{leader}/admin/status"))
                .headers(forwarded)
                .timeout(Duration::from_secs(3))
                .send()
                .await;
            let read = match answer {
                Ok(r) if r.status().is_success() => r
                    .json::<serde_json::Value>()
                    .await
                    .map_err(|e| format!("its answer could not be read: {}", e.without_url())),
                Ok(r) => Err(format!("it answered {}", r.status())),
                Err(e) => Err(format!("{leader} cannot be reached: {}", e.without_url())),
            };
            match read {
                Ok(serde_json::Value::Object(mut leader_doc)) => {
                    if let Some(ha) = leader_doc.remove("ha") {
                        leader_doc.insert("leader_ha".into(), ha);
                    }
                    body = serde_json::Value::Object(leader_doc);
                }
                Ok(_) => body["leader_unreachable"] = json!("the leader's status is not an object"),
                Err(why) => body["leader_unreachable"] = json!(why),
            }
        }
    }
    body["ha"] = serde_json::to_value(ha_view(&s.leader, &s.me)).unwrap_or_default();
    let mut response = axum::Json(body).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

async fn refuse_now(State(s): State<Standby>) -> Response {
    let message = match s.leader_url() {
        Some(url) => format!("this hub is a standby; the leader is {url}"),
        None => "this hub is a standby and no hub leads yet; try again shortly".to_string(),
    };
    refuse(&s, message)
}

fn refuse(s: &Standby, message: String) -> Response {
    refusal(s.leader_url().as_deref(), s.epoch(), message)
}

/// 503 `standby` naming the leader and its epoch, with `Retry-After: 1`.
pub(super) fn refusal(leader: Option<&str>, epoch: Option<i64>, message: String) -> Response {
    let mut response = (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({"error": {"code": "standby", "message": message,
            "leader": leader, "epoch": epoch}})),
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
    relay(&s.http, &leader, s.epoch(), request, s.won.clone()).await
}

/// Forwards `request` to `leader` and streams its answer back; ends at once (503, "send it
/// again") when `won` turns true. What a standby does, and a leader that stepped aside.
pub(super) async fn relay(
    http: &reqwest::Client,
    leader: &str,
    epoch: Option<i64>,
    request: Request,
    won: watch::Receiver<bool>,
) -> Response {
    let refuse = |message: String| refusal(Some(leader), epoch, message);
    let (parts, body) = request.into_parts();
    // A forwarded request reaching a standby again would go round (a leader advertised at an
    // address that is this hub's own, say): one hop only.
    if parts.headers.contains_key(FORWARDED_BY) {
        return refuse(format!(
            "a request forwarded to the leader {leader} reached a standby: check the leader's --advertise-url"
        ));
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
    let send = http
        .request(parts.method.clone(), format!("{leader}{path}"))
        .headers(headers)
        .body(body)
        .send();
    let mut won = won;
    let sent = tokio::select! {
        sent = send => sent,
        _ = won.wait_for(|w| *w) => return refuse(WON.into()),
    };
    let upstream = match sent {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(leader = %leader, error = %e.without_url(), "a standby cannot reach the leader to forward a request");
            return refuse(format!(
                "this hub is a standby and the leader {leader} cannot be reached now; try again shortly"
            ));
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
