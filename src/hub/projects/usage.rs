//! What each project uses, and the rules that share the hub between projects:
//!
//! * **room**: the role queue's capacity and the bytes the hub holds are shared out. A
//!   project may fill [`SOLO_ROOM`] of either alone; the rest is kept for projects under
//!   their weighted share of what is held, so a flood never leaves another project without
//!   room ([`room_for`]);
//! * **cloud permits**: while several projects have cloud work waiting, no new permit goes to
//!   a project at or over its weighted share of the budget's permits (a project alone may use
//!   them all; permits are held for a whole call, nothing is preempted) ([`CloudShare`]);
//! * **limits**: `max_queued_items`, `max_cloud_in_flight`, and the daily cloud allowances,
//!   which run per UTC day ([`ProjectUsage::quota_hit`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ProjectLimits;
use crate::metrics::histogram::{self, Histogram};

/// Milliseconds in a UTC day.
const DAY_MS: u64 = 86_400_000;

/// One project's cloud use in one UTC day (persisted: a restart does not reset it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DayUsage {
    /// Days since the Unix epoch (UTC).
    pub day: u64,
    pub cloud_tokens: u64,
    pub cloud_usd: f64,
    /// Cloud calls that reported no cost (their tokens count; their cost could not).
    pub calls_without_cost: u64,
}

impl DayUsage {
    pub fn is_empty(&self) -> bool {
        self.cloud_tokens == 0 && self.cloud_usd == 0.0 && self.calls_without_cost == 0
    }

    /// Starts a new day's count when `now_ms` is past this one.
    fn roll(&mut self, now_ms: u64) {
        let today = now_ms / DAY_MS;
        if self.day != today {
            *self = DayUsage {
                day: today,
                ..DayUsage::default()
            };
        }
    }
}

/// A daily allowance a project is past.
#[derive(Clone, Debug, PartialEq)]
pub struct QuotaHit {
    /// `cloud_tokens_per_day` or `cloud_usd_per_day`.
    pub limit: &'static str,
    pub used: String,
    pub allowed: String,
    /// Seconds until the UTC day ends (the allowance's reset).
    pub reset_s: u64,
}

/// Why a project's request was not admitted.
#[derive(Clone, Debug, thiserror::Error)]
pub enum AdmitRefusal {
    #[error(
        "project '{project}' has {held} items accepted and not yet answered; {items} more would pass its limit max_queued_items = {limit}; retry after {retry_after_s} s, or raise the limit (PATCH /admin/projects/{project})"
    )]
    QueuedItems {
        project: String,
        held: u64,
        items: usize,
        limit: u64,
        retry_after_s: u64,
    },
    #[error(
        "project '{project}' holds {held} of the {what} shared by every project ({limit}); the rest is kept for projects under their share; retry after {retry_after_s} s"
    )]
    Share {
        project: String,
        what: &'static str,
        held: usize,
        limit: usize,
        retry_after_s: u64,
    },
    #[error(
        "project '{project}' used its daily cloud allowance {limit} ({used} of {allowed}) and this work only the cloud can serve; it resets at 00:00 UTC, in {retry_after_s} s"
    )]
    Quota {
        project: String,
        limit: &'static str,
        used: String,
        allowed: String,
        retry_after_s: u64,
    },
}

impl AdmitRefusal {
    pub fn retry_after_s(&self) -> u64 {
        match self {
            AdmitRefusal::QueuedItems { retry_after_s, .. }
            | AdmitRefusal::Share { retry_after_s, .. }
            | AdmitRefusal::Quota { retry_after_s, .. } => *retry_after_s,
        }
    }

    /// The error code clients see.
    pub fn code(&self) -> &'static str {
        match self {
            AdmitRefusal::QueuedItems { .. } => "project_limit",
            AdmitRefusal::Share { .. } => "project_share",
            AdmitRefusal::Quota { .. } => "project_quota",
        }
    }
}

/// One project's live accounting.
#[derive(Debug)]
pub struct ProjectUsage {
    pub requests: u64,
    pub texts: u64,
    pub local_tokens: u64,
    pub cloud_tokens: u64,
    pub cloud_calls: u64,
    pub cloud_usd: f64,
    pub calls_without_cost: u64,
    /// Requests refused by a project rule, by code (`project_limit`, `project_share`,
    /// `project_quota`).
    pub refused: BTreeMap<&'static str, u64>,
    /// Items accepted and not yet answered (waiting or on a lease), over every role.
    pub held_items: u64,
    /// Input bytes of its accepted requests not yet answered.
    pub held_bytes: usize,
    /// Cloud leases it holds now.
    pub cloud_in_flight: u32,
    /// Seconds from acceptance to a request's first lease.
    pub queue_seconds: Histogram,
    pub day: DayUsage,
}

impl Default for ProjectUsage {
    fn default() -> Self {
        Self {
            requests: 0,
            texts: 0,
            local_tokens: 0,
            cloud_tokens: 0,
            cloud_calls: 0,
            cloud_usd: 0.0,
            calls_without_cost: 0,
            refused: BTreeMap::new(),
            held_items: 0,
            held_bytes: 0,
            cloud_in_flight: 0,
            queue_seconds: Histogram::new(histogram::SECONDS),
            day: DayUsage::default(),
        }
    }
}

impl ProjectUsage {
    /// The daily allowance this project is past, if any.
    pub fn quota_hit(&mut self, limits: &ProjectLimits, now_ms: u64) -> Option<QuotaHit> {
        self.day.roll(now_ms);
        let reset_s = ((self.day.day + 1) * DAY_MS)
            .saturating_sub(now_ms)
            .div_ceil(1000)
            .max(1);
        if let Some(allowed) = limits.cloud_tokens_per_day
            && self.day.cloud_tokens >= allowed
        {
            return Some(QuotaHit {
                limit: "cloud_tokens_per_day",
                used: format!("{} tokens", self.day.cloud_tokens),
                allowed: format!("{allowed} tokens"),
                reset_s,
            });
        }
        if let Some(allowed) = limits.cloud_usd_per_day
            && self.day.cloud_usd >= allowed
        {
            return Some(QuotaHit {
                limit: "cloud_usd_per_day",
                used: format!("${:.4}", self.day.cloud_usd),
                allowed: format!("${allowed:.4}"),
                reset_s,
            });
        }
        None
    }

    /// A cloud call of this project ended with `tokens` read and `cost_usd` reported (a call
    /// without a cost counts its tokens and is counted as such).
    pub fn record_cloud(&mut self, tokens: u64, cost_usd: Option<f64>, now_ms: u64) {
        self.day.roll(now_ms);
        self.cloud_calls = self.cloud_calls.saturating_add(1);
        self.cloud_tokens = self.cloud_tokens.saturating_add(tokens);
        self.day.cloud_tokens = self.day.cloud_tokens.saturating_add(tokens);
        match cost_usd.filter(|c| c.is_finite() && (0.0..=MAX_CALL_USD).contains(c)) {
            Some(usd) => {
                self.cloud_usd = add_usd(self.cloud_usd, usd);
                self.day.cloud_usd = add_usd(self.day.cloud_usd, usd);
            }
            None => {
                if let Some(c) = cost_usd.filter(|c| *c != 0.0) {
                    tracing::warn!(
                        cost_usd = c,
                        "an upstream reported a cost no call can have; counted as a call without a cost"
                    );
                }
                self.calls_without_cost = self.calls_without_cost.saturating_add(1);
                self.day.calls_without_cost = self.day.calls_without_cost.saturating_add(1);
            }
        }
    }
}

/// The most one cloud call may report (US dollars): more is an upstream's error, and is
/// counted as a call without a cost rather than summed.
pub const MAX_CALL_USD: f64 = 1_000_000.0;

/// The most a sum of costs holds: a persisted number stays finite whatever upstreams report.
pub const MAX_TOTAL_USD: f64 = 1e15;

/// `a + b`, held at [`MAX_TOTAL_USD`] (both are finite and non-negative).
fn add_usd(a: f64, b: f64) -> f64 {
    (a + b).clamp(0.0, MAX_TOTAL_USD)
}

/// The share of the hub's room a project may fill alone; the rest waits for projects under
/// their weighted share of what is held.
pub const SOLO_ROOM: f64 = 0.75;

/// Whether `mine + n` of a shared room of `capacity`, of which `total` is held, is within
/// what a project of `weight` may hold: anything up to [`SOLO_ROOM`] of the room (or any
/// request that fits an empty room); beyond that, only while other projects hold some and its
/// holding stays within its weighted share of the holders (`holders_weight` counts every
/// project holding some, it included). A hub with no project but `default` shares nothing
/// (the caller skips the rule).
pub fn room_for(
    capacity: usize,
    total: usize,
    mine: usize,
    n: usize,
    weight: u32,
    holders_weight: u32,
) -> bool {
    let after = total.saturating_add(n);
    if after > capacity {
        return false;
    }
    // Within the solo room, or into an empty hub (a request larger than the solo room is
    // refused only while others hold some: a retry can then succeed).
    if after as f64 <= SOLO_ROOM * capacity as f64 || total == 0 {
        return true;
    }
    let others_hold = mine < total;
    let share = capacity as f64 * f64::from(weight) / f64::from(holders_weight.max(weight).max(1));
    others_hold && (mine.saturating_add(n)) as f64 <= share
}

/// The projects with cloud work waiting (and their weights), and the budget's permits: who
/// may take a new permit.
#[derive(Debug, Default)]
pub struct CloudShare {
    pub waiting: BTreeMap<Arc<str>, u32>,
    pub permits: u32,
}

impl CloudShare {
    /// Whether `project` (holding `in_flight` cloud leases) may take one more: alone, always;
    /// while others wait, only below its weighted share of the permits.
    pub fn allows(&self, project: &str, weight: u32, in_flight: u32) -> bool {
        let others: u32 = self
            .waiting
            .iter()
            .filter(|(p, _)| &***p != project)
            .map(|(_, w)| *w)
            .sum();
        if others == 0 || in_flight == 0 {
            return true;
        }
        let share = f64::from(self.permits) * f64::from(weight) / f64::from(weight + others);
        f64::from(in_flight) < share
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_costs_never_make_the_days_usage_unstorable() {
        let mut u = ProjectUsage::default();
        u.record_cloud(10, Some(1e308), 0);
        u.record_cloud(10, Some(1e308), 0);
        u.record_cloud(10, Some(f64::INFINITY), 0);
        u.record_cloud(10, Some(-1.0), 0);
        assert_eq!(u.day.cloud_usd, 0.0);
        assert_eq!(u.day.calls_without_cost, 4);
        for _ in 0..3 {
            u.record_cloud(1, Some(MAX_CALL_USD), 0);
        }
        assert_eq!(u.day.cloud_usd, 3.0 * MAX_CALL_USD);
        u.day.cloud_usd = MAX_TOTAL_USD;
        u.record_cloud(1, Some(MAX_CALL_USD), 0);
        assert_eq!(u.day.cloud_usd, MAX_TOTAL_USD, "held at the bound");
        let day = std::collections::BTreeMap::from([("alpha".to_string(), u.day.clone())]);
        let stored = crate::hub::store::parts::encode("usage", &day).unwrap();
        assert_eq!(
            serde_json::from_slice::<BTreeMap<String, DayUsage>>(&stored).unwrap(),
            day
        );
    }

    #[test]
    fn a_flood_leaves_room_for_the_others() {
        // Alone, a project fills three quarters of the room.
        assert!(room_for(100, 0, 0, 75, 1, 1));
        assert!(!room_for(100, 75, 75, 1, 1, 1));
        assert!(
            room_for(100, 0, 0, 90, 1, 1),
            "one large request into an empty room"
        );
        // Another project under its share gets the rest.
        assert!(room_for(100, 75, 0, 20, 1, 2));
        assert!(!room_for(100, 95, 20, 40, 1, 2), "past the room");
        // The flood does not, while it is over its share.
        assert!(!room_for(100, 80, 75, 1, 1, 2));
        // A heavier project's share is larger.
        assert!(room_for(100, 80, 5, 10, 3, 4));
    }

    #[test]
    fn a_project_waits_at_its_share_of_permits_while_others_wait() {
        let mut share = CloudShare {
            waiting: BTreeMap::new(),
            permits: 8,
        };
        share.waiting.insert(Arc::from("a"), 1);
        assert!(share.allows("a", 1, 7), "alone: every permit");
        share.waiting.insert(Arc::from("b"), 1);
        assert!(share.allows("a", 1, 3));
        assert!(!share.allows("a", 1, 4), "at its share of 4");
        assert!(
            share.allows("b", 1, 0),
            "the one under its share always may"
        );
        share.waiting.insert(Arc::from("b"), 3);
        assert!(!share.allows("a", 1, 2), "1/4 of 8");
        assert!(share.allows("b", 3, 5));
    }

    #[test]
    fn allowances_run_per_utc_day() {
        let limits = ProjectLimits {
            cloud_tokens_per_day: Some(100),
            cloud_usd_per_day: Some(0.5),
            ..ProjectLimits::default()
        };
        let mut u = ProjectUsage::default();
        let noon = 20_000 * DAY_MS + DAY_MS / 2;
        u.record_cloud(60, Some(0.1), noon);
        assert_eq!(u.quota_hit(&limits, noon), None);
        u.record_cloud(40, None, noon);
        let hit = u.quota_hit(&limits, noon).unwrap();
        assert_eq!(hit.limit, "cloud_tokens_per_day");
        assert_eq!(hit.reset_s, DAY_MS / 2 / 1000);
        assert_eq!(u.day.calls_without_cost, 1);
        // The next UTC day starts over; the totals stay.
        assert_eq!(u.quota_hit(&limits, noon + DAY_MS), None);
        assert_eq!(u.cloud_tokens, 100);
        u.record_cloud(1, Some(0.6), noon + DAY_MS);
        assert_eq!(
            u.quota_hit(&limits, noon + DAY_MS).unwrap().limit,
            "cloud_usd_per_day"
        );
    }
}
