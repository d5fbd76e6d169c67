//! Traces out of the process: with `--otlp-endpoint`, the `tracing` spans of a hub, an agent or
//! `serve` are exported over OTLP/HTTP in protobuf (the collector's default encoding, port
//! 4318's `/v1/traces`) by the OpenTelemetry SDK's batch processor, on a thread of its own.
//!
//! The context crosses two hops as W3C `traceparent` strings:
//! * a client's `traceparent` header is the parent of the hub's `request` span;
//! * the hub keeps each accepted request's context and puts those of a work frame's requests
//!   into the frame (`traces`); a frame serves items of several requests (and a canary), so the
//!   agent's `work` span is a child of the first and links to every one of them, and its
//!   `tokenize`, `batch`, `cloud_call` and `server_call` spans are children of `work`.
//!
//! Without an endpoint nothing is installed: spans stay what they were (log context), and
//! [`traceparent`] is `None`, so frames carry nothing.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The most request contexts one work frame carries (the agent links to each).
pub const MAX_FRAME_TRACES: usize = 64;

/// The installed exporter; [`Exporter::shutdown`] sends what is still batched.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// An exporter to `endpoint` (a collector's base URL, `http://host:4318`, or its full
    /// `/v1/traces` URL) for `service`, and the layer that feeds it `tracing`'s spans.
    pub fn new<S>(
        endpoint: &str,
        service: &'static str,
    ) -> Result<(Self, impl tracing_subscriber::Layer<S>), String>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
        let base = endpoint.trim().trim_end_matches('/');
        let url = if base.ends_with("/v1/traces") {
            base.to_string()
        } else {
            format!("{base}/v1/traces")
        };
        // What is echoed back: never a key-shaped part of what was typed.
        let shown = crate::secret::redact(&url);
        let parsed =
            reqwest::Url::parse(&url).map_err(|e| format!("--otlp-endpoint '{shown}': {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!(
                "--otlp-endpoint '{shown}' must be http:// or https://"
            ));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err("--otlp-endpoint carries credentials: send traces to a collector on this host or network that needs none (credentials in a URL end up in process lists and logs)".into());
        }
        let client = reqwest::blocking::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|e| format!("the OTLP client: {e}"))?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url)
            .build()
            .map_err(|e| format!("the OTLP exporter: {e}"))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .with_attribute(opentelemetry::KeyValue::new(
                "service.version",
                env!("CARGO_PKG_VERSION"),
            ))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("fantom-sidecar");
        let layer = tracing_opentelemetry::layer().with_tracer(tracer);
        Ok((Self { provider }, layer))
    }

    /// Sends the spans still batched and stops the exporter's thread.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("warning: the last spans could not be exported: {e}");
        }
    }
}

/// The W3C `traceparent` of `span`, when it is exported (else `None`).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// The remote context a `traceparent` names (an invalid or absent one: none).
fn remote(traceparent: &str) -> Option<opentelemetry::trace::SpanContext> {
    let carrier = HashMap::from([("traceparent".to_string(), traceparent.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// Makes the client's `traceparent` (if any, and well formed) the parent of `span`.
pub fn adopt_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(sc) = traceparent.and_then(remote) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
    }
}

/// Makes `span` (an agent's work frame) a child of the first of the frame's request contexts
/// and links it to every one of them.
pub fn join_requests(span: &tracing::Span, traces: &[String]) {
    let contexts: Vec<_> = traces.iter().filter_map(|t| remote(t)).collect();
    if let Some(first) = contexts.first() {
        let parent = opentelemetry::Context::new().with_remote_span_context(first.clone());
        let _ = span.set_parent(parent);
    }
    for sc in contexts {
        span.add_link(sc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_traceparent_names_nothing() {
        assert!(remote("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").is_some());
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        ] {
            assert!(remote(bad).is_none(), "{bad}");
        }
        // Without an installed layer a span has no exported context.
        assert!(traceparent(&tracing::info_span!("x")).is_none());
    }
}
