//! Prometheus histograms: fixed upper bounds, cumulative buckets, a sum and a count, rendered
//! in the text exposition format (`<name>_bucket{le=...}`, `<name>_sum`, `<name>_count`).
//! The hub's queue, batch and token histograms and the HTTP routes' latency histograms use it;
//! units are in the metric's name (`_seconds`, `_items`, `_tokens`), as Prometheus asks.

use std::fmt::Write as _;

/// Upper bounds for durations in seconds: 1 ms to 60 s.
pub const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Upper bounds for counts (items per work frame, texts per request): 1 to 8192.
pub const COUNTS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 8192.0,
];

/// Upper bounds for tokens per request: 8 to 1 M.
pub const TOKENS: &[f64] = &[
    8.0, 32.0, 128.0, 512.0, 2048.0, 8192.0, 32768.0, 131072.0, 1048576.0,
];

/// One histogram series (one set of labels).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative; summed when rendered).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            self.counts[i] += 1;
        }
        self.sum += value;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// The series' lines; `labels` is the inside of the braces (`role="embedding"`), or empty.
    pub fn render(&self, name: &str, labels: &str, out: &mut String) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            cumulative += n;
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// A histogram family's `# HELP` and `# TYPE` lines, then each series.
pub fn render_family<'a>(
    out: &mut String,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (String, &'a Histogram)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (labels, h) in series {
        h.render(name, &labels, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_inf_counts_everything() {
        let mut h = Histogram::new(&[1.0, 10.0]);
        for v in [0.5, 1.0, 5.0, 50.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render("x_seconds", "role=\"a\"", &mut out);
        assert_eq!(
            out,
            "x_seconds_bucket{role=\"a\",le=\"1\"} 2\n\
             x_seconds_bucket{role=\"a\",le=\"10\"} 3\n\
             x_seconds_bucket{role=\"a\",le=\"+Inf\"} 4\n\
             x_seconds_sum{role=\"a\"} 56.5\n\
             x_seconds_count{role=\"a\"} 4\n"
        );
        let mut bare = String::new();
        Histogram::new(&[1.0]).render("y", "", &mut bare);
        assert!(bare.starts_with("y_bucket{le=\"1\"} 0\n"), "{bare}");
        assert!(bare.contains("y_count 0\n"), "{bare}");
    }
}
