//! The leader's fence: whether this hub may still do what only one hub at a time may do
//! (grant a cloud permit, found a vector space, give a passing verdict, write the store).
//!
//! A hub on a state file is never fenced. A hub that leads on etcd holds the lead only as long
//! as its lease is known to be alive: each renewal that etcd answers moves the fence's
//! deadline to the moment the renewal was sent plus two thirds of the TTL (etcd expires the
//! lease a full TTL after it last saw one, so another hub can win only after this deadline).
//! Every check compares the clock with that deadline, so a leader that was frozen (SIGSTOP, a
//! stalled VM) and wakes up grants nothing, even before its renewal task has run. Past the
//! deadline the hub is **fenced**, not deposed: local work that already passes goes on (local
//! GPUs are outside the budget and the gate has judged them), and a renewal that etcd answers
//! later (the lease still lives: no other hub can have won) lifts the fence. A lease that is
//! gone, or a write refused under the epoch, deposes it for good.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Why the fence is closed (what a refused client, `/ready` and status are told).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Fenced(pub String);

/// Shared by the election's renewal task, the store and the hub's core.
#[derive(Clone, Debug, Default)]
pub struct Fence(Option<Arc<Leased>>);

#[derive(Debug)]
struct Leased {
    base: Instant,
    /// Milliseconds after `base` until which the lease is known to be alive.
    valid_until_ms: AtomicU64,
    /// Set once: the lease is gone or etcd refused a write under the epoch.
    deposed: OnceLock<String>,
    /// Renewals etcd answered (with the leader key read back at this epoch).
    renewals: AtomicU64,
}

impl Fence {
    /// A hub that holds its store alone (a locked state file): never fenced.
    pub fn open() -> Self {
        Self(None)
    }

    /// A leader whose lease is known alive until `valid_until`.
    pub fn leased(valid_until: Instant) -> Self {
        let base = Instant::now();
        let fence = Self(Some(Arc::new(Leased {
            base,
            valid_until_ms: AtomicU64::new(0),
            deposed: OnceLock::new(),
            renewals: AtomicU64::new(0),
        })));
        fence.renewed(valid_until);
        fence
    }

    /// etcd answered a renewal: the lease is alive until `valid_until` (never moves back).
    pub fn renewed(&self, valid_until: Instant) {
        if let Some(l) = &self.0 {
            l.renewals.fetch_add(1, Ordering::Relaxed);
            let ms = valid_until.saturating_duration_since(l.base).as_millis();
            l.valid_until_ms
                .fetch_max(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::SeqCst);
        }
    }

    /// Renewals etcd answered since this hub won (`None` for a state file). The grant's own
    /// deadline counts as the first.
    pub fn renewals(&self) -> Option<u64> {
        self.0.as_ref().map(|l| l.renewals.load(Ordering::Relaxed))
    }

    /// Until when the lease is known alive (`None` for a state file).
    pub fn valid_until(&self) -> Option<Instant> {
        self.0
            .as_ref()
            .map(|l| l.base + Duration::from_millis(l.valid_until_ms.load(Ordering::SeqCst)))
    }

    /// The lead is lost for good: nothing is granted or written again.
    pub fn depose(&self, why: &str) {
        if let Some(l) = &self.0 {
            let _ = l.deposed.set(why.to_string());
        }
    }

    /// `Ok` while this hub may grant, found, pass and write; else why not.
    pub fn check(&self, now: Instant) -> Result<(), Fenced> {
        let Some(l) = &self.0 else {
            return Ok(());
        };
        if let Some(why) = l.deposed.get() {
            return Err(Fenced(format!("this hub no longer leads ({why})")));
        }
        let until = l.base + Duration::from_millis(l.valid_until_ms.load(Ordering::SeqCst));
        if now < until {
            return Ok(());
        }
        Err(Fenced(format!(
            "the hub cannot reach etcd to renew its lead (for {} s): no cloud permits, new \
             vector spaces or int8 scales, passing verdicts or config writes until it can",
            now.saturating_duration_since(until).as_secs() + 1
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_fences_at_its_deadline_a_renewal_lifts_it_and_a_deposal_is_for_good() {
        assert!(Fence::open().check(Instant::now()).is_ok());
        let t0 = Instant::now();
        let fence = Fence::leased(t0 + Duration::from_secs(3));
        assert!(fence.check(t0 + Duration::from_secs(2)).is_ok());
        let why = fence.check(t0 + Duration::from_secs(4)).unwrap_err();
        assert!(why.0.contains("cannot reach etcd"), "{why}");
        // A late answer from etcd: the lease lived, the fence opens again.
        fence.renewed(t0 + Duration::from_secs(6));
        assert!(fence.check(t0 + Duration::from_secs(4)).is_ok());
        // An older renewal never moves it back.
        fence.renewed(t0 + Duration::from_secs(1));
        assert!(fence.check(t0 + Duration::from_secs(5)).is_ok());
        fence.depose("the leader's lease is gone");
        fence.renewed(t0 + Duration::from_secs(60));
        let why = fence.check(t0).unwrap_err();
        assert!(why.0.contains("no longer leads"), "{why}");
    }
}
