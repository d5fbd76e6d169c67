//! Histograms kept under the hub's own locks: fixed upper bounds, per-bucket counts, a sum and
//! a count, encoded at scrape time by the client library ([`super::Families::histogram`]).
//! The hub's queue, batch and token histograms and the HTTP routes' latency histograms use it;
//! units are in the metric's name (`_seconds`, `_items`, `_tokens`), as Prometheus asks.

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

    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, observations in that bucket alone)`, the last bound `+Inf`: what the
    /// client library's encoder takes (it makes them cumulative).
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        let finite: u64 = self.counts.iter().sum();
        self.bounds
            .iter()
            .copied()
            .zip(self.counts.iter().copied())
            .chain([(f64::INFINITY, self.count - finite)])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_their_own_observations_and_inf_the_rest() {
        let mut h = Histogram::new(&[1.0, 10.0]);
        for v in [0.5, 1.0, 5.0, 50.0] {
            h.observe(v);
        }
        assert_eq!(h.buckets(), vec![(1.0, 2), (10.0, 1), (f64::INFINITY, 1)]);
        assert_eq!((h.count(), h.sum()), (4, 56.5));
    }
}
