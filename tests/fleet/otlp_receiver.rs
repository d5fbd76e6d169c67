//! An OpenTelemetry collector's OTLP/HTTP trace receiver, in-repo: a real HTTP server on
//! `127.0.0.1` (random port) that takes `POST /v1/traces` in protobuf (the collector's default
//! encoding), decodes each `ExportTraceServiceRequest` with the OpenTelemetry project's own
//! message types, and keeps every span with its service, ids, parent and links. Waits are on a
//! change counter, bounded.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message;
use tokio::sync::watch;

/// One received span; ids in lowercase hex (a root's parent is empty).
#[derive(Clone, Debug)]
pub struct Span {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// `(trace_id, span_id)` of each link.
    pub links: Vec<(String, String)>,
}

struct Received {
    spans: Mutex<Vec<Span>>,
    changes: watch::Sender<u64>,
}

pub struct OtlpReceiver {
    pub url: String,
    received: Arc<Received>,
    _task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let received = Arc::new(Received {
            spans: Mutex::new(Vec::new()),
            changes: watch::channel(0).0,
        });
        let router = axum::Router::new()
            .route("/v1/traces", post(traces))
            .with_state(received.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        OtlpReceiver {
            url,
            received,
            _task: task,
        }
    }

    pub fn spans(&self) -> Vec<Span> {
        self.received.spans.lock().unwrap().clone()
    }

    /// Waits (bounded by the tests' patience) until `pick` finds what it wants in the spans.
    pub async fn wait_for<T>(&self, what: &str, pick: impl Fn(&[Span]) -> Option<T>) -> T {
        let mut changes = self.received.changes.subscribe();
        let deadline = tokio::time::Instant::now() + crate::support::PATIENCE;
        loop {
            if let Some(found) = pick(&self.spans()) {
                return found;
            }
            let waited = tokio::time::timeout_at(deadline, changes.changed()).await;
            assert!(
                waited.is_ok(),
                "gave up waiting for: {what}; spans: {:#?}",
                self.spans()
            );
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn traces(State(r): State<Arc<Received>>, body: Bytes) -> Response {
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(req) => req,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let mut got = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|res| &res.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                any_value::Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for s in scope.spans {
                got.push(Span {
                    service: service.clone(),
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    links: s
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                });
            }
        }
    }
    r.spans.lock().unwrap().extend(got);
    r.changes.send_modify(|n| *n += 1);
    (
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
        .into_response()
}
