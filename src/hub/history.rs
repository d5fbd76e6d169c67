//! The console's charts: a bounded ring of samples each hub keeps in memory.
//!
//! Every [`SAMPLE_EVERY`] the hub's maintenance tick records the budget (its ceiling, its
//! limit, the calls in flight, the 429s so far, whether it cools down or is stopped), the
//! queue depth of each role and the agents connected. The ring holds [`KEEP_FOR`] of them at
//! most ([`MAX_SAMPLES`]), a fixed set of series, so `GET /admin/history` answers at most
//! about [`MAX_HISTORY_BYTES`]. Nothing is stored: after a restart or a takeover the ring
//! starts empty, and the page says so. No Prometheus is needed for the console.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use serde::Serialize;

use crate::roles::Role;

/// How often a sample is taken.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// How far back the ring reaches.
pub const KEEP_FOR: Duration = Duration::from_secs(15 * 60);
/// The most samples held: [`KEEP_FOR`] at [`SAMPLE_EVERY`].
pub const MAX_SAMPLES: usize = (KEEP_FOR.as_millis() / SAMPLE_EVERY.as_millis()) as usize;
/// An upper bound of the history's JSON (a sample is under 320 bytes: fixed fields, five
/// roles).
pub const MAX_HISTORY_BYTES: usize = MAX_SAMPLES * 320 + 1024;

/// One moment of the hub.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Sample {
    /// When (ms since the Unix epoch).
    pub t_ms: u64,
    /// The budget's ceiling (the account's, or the override).
    pub ceiling: u32,
    /// The calls in flight it allows now (under the ceiling after a 429).
    pub limit: u32,
    pub in_flight: u32,
    /// 429s and other throttles the budget met so far (a rise is a 429).
    pub throttles: u64,
    /// The budget cools down after a throttle.
    pub cooling: bool,
    /// Cloud work is stopped (a hard 402, a rejected key).
    pub stopped: bool,
    /// Items waiting in each role's queue.
    #[schema(value_type = Object)]
    pub queue_depth: BTreeMap<Role, usize>,
    /// Agents with an open session.
    pub agents: usize,
}

/// `GET /admin/history`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct HistoryView {
    /// The sampling period (ms) and how far back the ring reaches (s).
    pub every_ms: u64,
    pub keep_s: u64,
    /// Oldest first; empty after a restart or a takeover.
    pub samples: Vec<Sample>,
}

/// The ring.
#[derive(Debug, Default)]
pub struct History {
    samples: VecDeque<Sample>,
}

impl History {
    /// Adds `sample`; the oldest go past [`MAX_SAMPLES`] or older than [`KEEP_FOR`].
    pub fn push(&mut self, sample: Sample) {
        let keep_ms = u64::try_from(KEEP_FOR.as_millis()).unwrap_or(u64::MAX);
        let oldest = sample.t_ms.saturating_sub(keep_ms);
        self.samples.push_back(sample);
        while self.samples.len() > MAX_SAMPLES
            || self.samples.front().is_some_and(|s| s.t_ms < oldest)
        {
            self.samples.pop_front();
        }
    }

    /// The samples newer than `since_ms` (all without it).
    pub fn view(&self, since_ms: Option<u64>) -> HistoryView {
        let since = since_ms.unwrap_or(0);
        HistoryView {
            every_ms: u64::try_from(SAMPLE_EVERY.as_millis()).unwrap_or(u64::MAX),
            keep_s: KEEP_FOR.as_secs(),
            samples: self
                .samples
                .iter()
                .filter(|s| s.t_ms > since)
                .cloned()
                .collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_ms: u64) -> Sample {
        Sample {
            t_ms,
            ceiling: 256,
            limit: 200,
            in_flight: 3,
            throttles: 1,
            cooling: false,
            stopped: false,
            queue_depth: Role::ALL.into_iter().map(|r| (r, 100_000)).collect(),
            agents: 1000,
        }
    }

    #[test]
    fn the_ring_keeps_fifteen_minutes_at_most_and_its_json_stays_under_the_bound() {
        let mut h = History::default();
        let every = SAMPLE_EVERY.as_millis() as u64;
        for i in 0..(MAX_SAMPLES as u64 + 50) {
            h.push(sample(1_700_000_000_000 + i * every));
        }
        assert_eq!(h.len(), MAX_SAMPLES);
        let json = serde_json::to_string(&h.view(None)).unwrap();
        assert!(json.len() <= MAX_HISTORY_BYTES, "{}", json.len());
        // A gap (a hub that was busy) drops what is older than the window.
        let last = h.view(None).samples.last().unwrap().t_ms;
        h.push(sample(last + KEEP_FOR.as_millis() as u64 + 1));
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn since_gives_only_the_newer_samples() {
        let mut h = History::default();
        for t in [1_000, 1_500, 2_000] {
            h.push(sample(t));
        }
        let newer: Vec<u64> = h.view(Some(1_500)).samples.iter().map(|s| s.t_ms).collect();
        assert_eq!(newer, [2_000]);
    }
}
