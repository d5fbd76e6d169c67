//! What the hub's HTTP layer does around every request: its `X-Request-Id` (the client's, when
//! it is a plain token of at most 128 characters that holds no secret, else one generated
//! here), echoed on the response; a tracing span carrying it, so every log line about the request names it (the
//! hub keeps it with the request it accepts, [`crate::hub::REQUEST_ID`], for the lines logged
//! away from the handler); and the per-route latency histogram in `/metrics`
//! (`fantom_http_request_duration_seconds{route, status}`; a streamed answer counts until its
//! headers). A client's `traceparent` is the parent of the request's span ([`crate::traces`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use crate::hub::Hub;
use crate::metrics::Families;
use crate::metrics::histogram::{self, Histogram};
use crate::secret::Secret;

pub const HEADER: &str = "x-request-id";

/// The longest client-chosen id kept (a longer or odd one is replaced, never echoed).
const MAX_LEN: usize = 128;

/// Latency per route and status.
#[derive(Debug, Default)]
pub struct RouteMetrics {
    series: Mutex<BTreeMap<(String, u16), Histogram>>,
}

impl RouteMetrics {
    fn observe(&self, route: String, status: u16, seconds: f64) {
        self.series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((route, status))
            .or_insert_with(|| Histogram::new(histogram::SECONDS))
            .observe(seconds);
    }
}

/// Encoded at each scrape of the hub's registry.
impl prometheus_client::collector::Collector for RouteMetrics {
    fn encode(&self, encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let series = self
            .series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Families::from(encoder).histogram(
            "fantom_http_request_duration_seconds",
            "Seconds from a request's arrival to its response headers, by route and status.",
            series.iter().map(|((route, status), h)| {
                (
                    vec![("route", route.clone()), ("status", status.to_string())],
                    h,
                )
            }),
        )
    }
}

/// The client's id when it is fit to echo, else a new one. Fit: at most 128 characters of
/// letters, digits and `-_.:`, holding none of the hub's tokens and no key-shaped part,
/// except that hex and UUID shapes (nginx's `$request_id`, W3C trace ids, our own) are kept
/// whatever their look.
fn id_of(request: &Request, known: &[&Secret]) -> Arc<str> {
    let given = request
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| fits(v, known));
    match given {
        Some(v) => Arc::from(v),
        None => Arc::from(format!("{:032x}", rand::random::<u128>()).as_str()),
    }
}

fn fits(v: &str, known: &[&Secret]) -> bool {
    let plain = !v.is_empty()
        && v.len() <= MAX_LEN
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if !plain || crate::secret::holds_key(v, known) && !hex_like(v) {
        return false;
    }
    // A hex id may look like a key; it must still not be one of ours.
    !known
        .iter()
        .any(|k| !k.is_empty() && v.contains(k.expose()))
}

fn hex_like(v: &str) -> bool {
    v.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// The id of the request being served on this task (empty outside one).
pub fn current() -> String {
    crate::hub::REQUEST_ID
        .try_with(|id| id.to_string())
        .unwrap_or_default()
}

/// The middleware: id, span, latency.
pub async fn observe(
    State((hub, metrics)): State<(Hub, Arc<RouteMetrics>)>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let id = {
        let mut known = vec![hub.admin_token(), hub.fleet_token()];
        known.extend(hub.client_token());
        id_of(&request, &known)
    };
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let span = tracing::info_span!("request", request_id = %id, method = %request.method(), route = %route, project = tracing::field::Empty, sub_project = tracing::field::Empty);
    // A client's W3C trace context is the parent of ours (exported with --otlp-endpoint).
    let client_trace = request
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok());
    crate::traces::adopt_parent(&span, client_trace);
    let mut response = crate::hub::REQUEST_ID
        .scope(id.clone(), next.run(request).instrument(span.clone()))
        .await;
    let status = response.status().as_u16();
    let seconds = started.elapsed().as_secs_f64();
    span.in_scope(|| {
        let ms = seconds * 1000.0;
        if status >= 400 {
            tracing::info!(status, ms, "request answered with an error");
        } else {
            tracing::debug!(status, ms, "request answered");
        }
    });
    metrics.observe(route, status, seconds);
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(HEADER, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_proxies_send_are_kept_and_secrets_never() {
        let ours = Secret::new("fleet-token-0123456789");
        let known = [&ours];
        for kept in [
            "trace-ok-1",
            "0af7651916cd43dd8448eb211c80319c", // W3C trace id, nginx $request_id
            "123e4567-e89b-12d3-a456-426614174000", // a UUID
            "req:42.a_b",
        ] {
            assert!(fits(kept, &known), "{kept}");
        }
        for refused in [
            "",
            "has space",
            "sk-or-v1-0123456789abcdef0123456789abcdef",
            "trace:sk-or-v1-0123456789abcdef0123456789abcdef",
            "x-fleet-token-0123456789",
            &"a".repeat(129),
        ] {
            assert!(!fits(refused, &known), "{refused}");
        }
    }
}
