//! A provider's counters on the agent: in flight, served, failures, and the latency of the
//! model call as an EWMA (α 0.2) and p50/p95 over the last [`WINDOW`] work frames. Only
//! successes feed the latency: an error's latency says nothing about capacity.

use std::collections::VecDeque;

use crate::protocol::ProviderStats;

pub const WINDOW: usize = 256;
const ALPHA: f64 = 0.2;

#[derive(Debug, Default)]
pub struct ProviderCounters {
    pub in_flight: u32,
    pub served_items: u64,
    pub failures: u64,
    ewma_ms: Option<f64>,
    window: VecDeque<f64>,
}

impl ProviderCounters {
    pub fn record_success(&mut self, items: usize, latency_ms: f64) {
        self.served_items += items as u64;
        self.ewma_ms = Some(match self.ewma_ms {
            Some(prev) => prev + ALPHA * (latency_ms - prev),
            None => latency_ms,
        });
        if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back(latency_ms);
    }

    /// The `q` quantile (nearest rank) of the window.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        if self.window.is_empty() {
            return None;
        }
        let mut sorted: Vec<f64> = self.window.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        Some(sorted[rank - 1])
    }

    pub fn snapshot(&self, provider: &str) -> ProviderStats {
        ProviderStats {
            provider: provider.to_string(),
            in_flight: self.in_flight,
            served: self.served_items,
            failures: self.failures,
            latency_ewma_ms: self.ewma_ms,
            latency_p50_ms: self.quantile_ms(0.5),
            latency_p95_ms: self.quantile_ms(0.95),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ewma_and_quantiles_follow_successes() {
        let mut c = ProviderCounters::default();
        assert_eq!(c.snapshot("p").latency_p50_ms, None);
        for ms in 1..=100 {
            c.record_success(2, ms as f64);
        }
        let s = c.snapshot("p");
        assert_eq!(s.served, 200);
        assert_eq!(s.latency_p50_ms, Some(50.0));
        assert_eq!(s.latency_p95_ms, Some(95.0));
        let ewma = s.latency_ewma_ms.unwrap();
        assert!(ewma > 90.0 && ewma < 100.0, "{ewma}");
        for _ in 0..WINDOW {
            c.record_success(1, 7.0);
        }
        assert_eq!(
            c.quantile_ms(0.95),
            Some(7.0),
            "old latencies leave the window"
        );
    }
}
