//! Prometheus metrics through the official Rust client library (`prometheus-client`), one
//! [`Registry`] per instance: `serve` runs a hub and an agent in one process, and each keeps its
//! own (the hub's on its `/metrics`, the agent's on `--http`), never a process-global recorder.
//!
//! Most of our series are views of state the hub or agent already keeps under its own lock
//! (queue depths, leases, the budget, the gate's verdicts), so they are read at scrape time by a
//! [`Scrape`] collector that writes [`Families`]; the library does the encoding (OpenMetrics
//! text for a scraper that asks for it, else Prometheus' text format 0.0.4; label values
//! escaped). Units are base units in the name (`_seconds`, `_bytes`), as Prometheus asks. Every registry also carries `fantom_build_info` and the `process_*` series
//! ([`process`]).

pub mod histogram;
pub mod process;
pub mod recent;

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
pub use prometheus_client::registry::Registry;

use histogram::Histogram;

/// OpenMetrics 1.0 text: what Prometheus asks for first.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Prometheus' text format 0.0.4: for every other client (curl, TEI's contract).
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// One series' labels: names are fixed by our code, values are escaped by the library.
pub type Labels = Vec<(&'static str, String)>;

/// A registry for one instance (`component`: `hub` or `agent`) with the build-info and process
/// series already in it.
pub fn registry(component: &'static str) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape::new(move |f: &mut Families| {
        f.gauge(
            "fantom_build_info",
            "Always 1; the labels say which build runs (version, component, whether CUDA is compiled in).",
            [(
                vec![
                    ("version", env!("CARGO_PKG_VERSION").to_string()),
                    ("component", component.to_string()),
                    ("cuda", cfg!(feature = "cuda").to_string()),
                ],
                1.0,
            )],
        )
    })));
    registry.register_collector(Box::new(Scrape::new(process::encode)));
    registry
}

/// The registry's series and their content type, as the scraper's `Accept` asks: OpenMetrics
/// text (ending `# EOF`) for a client that names it, else Prometheus' text format 0.0.4.
pub fn render(registry: &Registry, accept: Option<&str>) -> (&'static str, String) {
    let mut out = String::new();
    let openmetrics = accept.is_some_and(|a| a.contains("application/openmetrics-text"));
    let (kind, encoded) = if openmetrics {
        (
            OPENMETRICS,
            prometheus_client::encoding::text::encode(&mut out, registry),
        )
    } else {
        (
            PROMETHEUS_TEXT,
            prometheus_client::encoding::prometheus_text::encode(&mut out, registry),
        )
    };
    if let Err(e) = encoded {
        tracing::warn!(error = %e, "a metrics family could not be encoded");
    }
    (kind, out)
}

/// `/metrics` for a registry: the body in the format the request's `Accept` names.
pub fn response(registry: &Registry, headers: &axum::http::HeaderMap) -> axum::response::Response {
    use axum::response::IntoResponse;
    let accept = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let (kind, body) = render(registry, accept);
    ([(axum::http::header::CONTENT_TYPE, kind)], body).into_response()
}

/// A collector that writes its families at each scrape from a closure.
pub struct Scrape<F>(F);

impl<F> Scrape<F>
where
    F: Fn(&mut Families) -> fmt::Result + Send + Sync + 'static,
{
    pub fn new(write: F) -> Self {
        Self(write)
    }
}

impl<F> fmt::Debug for Scrape<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Scrape")
    }
}

impl<F> prometheus_client::collector::Collector for Scrape<F>
where
    F: Fn(&mut Families) -> fmt::Result + Send + Sync + 'static,
{
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        (self.0)(&mut Families { encoder })
    }
}

impl<'a> From<DescriptorEncoder<'a>> for Families<'a> {
    fn from(encoder: DescriptorEncoder<'a>) -> Self {
        Self { encoder }
    }
}

/// The families of one scrape, each written whole: its descriptor, then one line per series.
pub struct Families<'a> {
    encoder: DescriptorEncoder<'a>,
}

impl Families<'_> {
    /// A counter; `name` is the exposed name, ending `_total`.
    pub fn counter(
        &mut self,
        name: &str,
        help: &str,
        rows: impl IntoIterator<Item = (Labels, f64)>,
    ) -> fmt::Result {
        let family = name.strip_suffix("_total").unwrap_or(name);
        let mut metric = self
            .encoder
            .encode_descriptor(family, help, None, MetricType::Counter)?;
        for (labels, value) in rows {
            ConstCounter::new(value).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// A gauge.
    pub fn gauge(
        &mut self,
        name: &str,
        help: &str,
        rows: impl IntoIterator<Item = (Labels, f64)>,
    ) -> fmt::Result {
        let mut metric = self
            .encoder
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (labels, value) in rows {
            ConstGauge::new(value).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// A histogram with fixed buckets.
    pub fn histogram<'h>(
        &mut self,
        name: &str,
        help: &str,
        rows: impl IntoIterator<Item = (Labels, &'h Histogram)>,
    ) -> fmt::Result {
        let mut metric = self
            .encoder
            .encode_descriptor(name, help, None, MetricType::Histogram)?;
        for (labels, h) in rows {
            metric.encode_family(&labels)?.encode_histogram::<Labels>(
                h.sum(),
                h.count(),
                &h.buckets(),
                None,
            )?;
        }
        Ok(())
    }
}

/// A label set of one label.
pub fn label(name: &'static str, value: impl ToString) -> Labels {
    vec![(name, value.to_string())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_encoded_by_the_library_with_values_escaped() {
        let mut registry = registry("hub");
        registry.register_collector(Box::new(Scrape::new(|f: &mut Families| {
            f.counter(
                "x_requests_total",
                "Requests.",
                [(label("provider", "a\"b\\c\nd"), 3.0)],
            )?;
            f.gauge("x_latency_seconds", "Latency.", [(Labels::new(), 0.25)])?;
            let mut h = Histogram::new(&[1.0, 10.0]);
            for v in [0.5, 5.0, 50.0] {
                h.observe(v);
            }
            f.histogram(
                "x_wait_seconds",
                "Wait.",
                [(label("role", "embedding"), &h)],
            )
        })));
        let (kind, text) = render(
            &registry,
            Some("application/openmetrics-text; version=1.0.0"),
        );
        assert_eq!(kind, OPENMETRICS);
        let (plain, old) = render(&registry, None);
        assert_eq!(plain, PROMETHEUS_TEXT);
        assert!(
            old.contains("x_requests_total{provider=\"a\\\"b\\\\c\\nd\"} 3"),
            "{old}"
        );
        assert!(!old.contains("# EOF"), "{old}");
        assert!(
            text.contains("x_requests_total{provider=\"a\\\"b\\\\c\\nd\"} 3"),
            "{text}"
        );
        assert!(text.contains("# TYPE x_requests counter"), "{text}");
        assert!(text.contains("x_latency_seconds 0.25"), "{text}");
        assert!(
            text.contains("x_wait_seconds_bucket{le=\"10.0\",role=\"embedding\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("x_wait_seconds_bucket{le=\"+Inf\",role=\"embedding\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("fantom_build_info{version=\"") && text.contains("component=\"hub\""),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        #[cfg(target_os = "linux")]
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(text.contains(&format!("\n{name} ")), "{name}: {text}");
        }
    }
}
