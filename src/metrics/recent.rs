//! Quantiles of what happened lately: a bounded ring of timestamped observations, read over a
//! trailing window. The hub keeps one per role for the time requests waited in its queue, so
//! `/admin/status` (and the console) can say "p50 40 ms, p99 900 ms over the last minute"
//! without Prometheus. A histogram since start ([`super::histogram`]) answers a scraper; this
//! answers "now".

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

/// The most observations one ring holds: a busy role's minute keeps its latest.
pub const MAX_RECENT: usize = 2048;

/// The trailing window quantiles are read over.
pub const RECENT_WINDOW: Duration = Duration::from_secs(60);

/// A bounded ring of `(when, value)`.
#[derive(Clone, Debug, Default)]
pub struct Recent {
    values: VecDeque<(Instant, f64)>,
}

/// The quantiles of a window, in the unit observed (milliseconds for waits).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Quantiles {
    /// Observations in the window (at most [`MAX_RECENT`]).
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    /// How far back the window reaches (s).
    pub window_s: u64,
}

impl Recent {
    pub fn observe(&mut self, at: Instant, value: f64) {
        if !value.is_finite() {
            return;
        }
        self.values.push_back((at, value));
        while self.values.len() > MAX_RECENT {
            self.values.pop_front();
        }
    }

    /// The quantiles of the observations of the last [`RECENT_WINDOW`] before `now` (none
    /// when there were none). Nearest rank, as a reader checking by hand would count.
    pub fn quantiles(&mut self, now: Instant) -> Option<Quantiles> {
        while self
            .values
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > RECENT_WINDOW)
        {
            self.values.pop_front();
        }
        let mut v: Vec<f64> = self.values.iter().map(|(_, x)| *x).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let rank = |q: f64| {
            let r = (q * v.len() as f64).ceil() as usize;
            v[r.clamp(1, v.len()) - 1]
        };
        Some(Quantiles {
            count: v.len(),
            p50: rank(0.50),
            p99: rank(0.99),
            max: v[v.len() - 1],
            window_s: RECENT_WINDOW.as_secs(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_count_the_last_minute_by_nearest_rank_and_the_ring_stays_bounded() {
        let t0 = Instant::now();
        let mut r = Recent::default();
        assert_eq!(r.quantiles(t0), None);
        // 100 old waits of 10 s leave the window; 1..=100 ms stay in it.
        for _ in 0..100 {
            r.observe(t0, 10_000.0);
        }
        let later = t0 + RECENT_WINDOW + Duration::from_secs(1);
        for ms in 1..=100 {
            r.observe(later, ms as f64);
        }
        r.observe(later, f64::NAN);
        let q = r.quantiles(later).unwrap();
        assert_eq!((q.count, q.p50, q.p99, q.max), (100, 50.0, 99.0, 100.0));
        for i in 0..(MAX_RECENT + 10) {
            r.observe(later, i as f64);
        }
        assert_eq!(r.quantiles(later).unwrap().count, MAX_RECENT);
        // A quiet minute: nothing to say.
        assert_eq!(r.quantiles(later + RECENT_WINDOW * 2), None);
    }
}
