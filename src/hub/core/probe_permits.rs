//! The budget permits of the gate's probes to cloud embedders.
//!
//! A probe's twelve texts go upstream on the shared key like any work, so a probe to a cloud
//! provider holds one of the budget's permits while it is out. Work takes a freed permit at
//! once (every lease that ends dispatches), so a probe that merely waited for one could wait
//! for ever under steady cloud load: the sentinel would never run and drift would go unseen.
//! A probe that finds its scope full therefore **claims** it: until the gate's next round (a
//! maintenance tick away), no lease is granted a permit of that scope, and the round takes the
//! permit that frees. Claims last one round and are made again while the probe still waits;
//! a claim older than [`CLAIM_TTL`] is ignored (a round held up by a slow store write must not
//! hold cloud work up with it). A probe claims nothing while its route is held for more than
//! capacity (a stopped budget, a cooldown): a freed permit would not start it either.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::hub::budget::{GLOBAL_SCOPE, Hold};

/// How long a claim keeps permits from work: four maintenance ticks.
pub(super) const CLAIM_TTL: Duration = Duration::from_secs(1);

/// Permits held by probes, and the scopes probes wait on.
#[derive(Debug, Default)]
pub(super) struct ProbePermits {
    /// Probe id → the route whose permit it holds.
    held: HashMap<String, String>,
    /// Budget scopes (`global` or a route) whose next permit is a waiting probe's, and since
    /// when.
    claimed: BTreeMap<String, Instant>,
}

impl ProbePermits {
    /// `probe` holds a permit of `route` from now on.
    pub fn hold(&mut self, probe: &str, route: &str) {
        self.held.insert(probe.to_string(), route.to_string());
    }

    /// Removes the probes `is_out` no longer says are out, returning the routes of their
    /// permits (to be released).
    pub fn take_done(&mut self, is_out: impl Fn(&str) -> bool) -> Vec<String> {
        let done: Vec<String> = self
            .held
            .keys()
            .filter(|probe| !is_out(probe))
            .cloned()
            .collect();
        done.into_iter()
            .filter_map(|probe| self.held.remove(&probe))
            .collect()
    }

    /// A probe could not start for `hold` (and for nothing but capacity): a full scope is
    /// claimed for it.
    pub fn claim(&mut self, hold: &Hold, now: Instant) {
        let scope = match hold {
            Hold::Full { scope, .. } => scope.clone(),
            Hold::RpmWindow { .. } => GLOBAL_SCOPE.to_string(),
            Hold::Stopped(_) | Hold::CoolingDown { .. } => return,
        };
        self.claimed.entry(scope).or_insert(now);
    }

    /// A new round: the claims of the last one end (a probe still waiting claims again);
    /// whether there were any (permits they kept from work may be free now).
    pub fn end_claims(&mut self) -> bool {
        let had = !self.claimed.is_empty();
        self.claimed.clear();
        had
    }

    /// Whether a lease on `route` must leave the next permit to a waiting probe.
    pub fn claims(&self, route: &str, now: Instant) -> bool {
        let live = |scope: &str| {
            self.claimed
                .get(scope)
                .is_some_and(|&at| now.saturating_duration_since(at) < CLAIM_TTL)
        };
        live(GLOBAL_SCOPE) || live(route)
    }

    /// Probes holding a permit now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_scope_is_claimed_for_one_round_and_a_stopped_budget_is_not() {
        let mut p = ProbePermits::default();
        let now = Instant::now();
        p.claim(&Hold::Stopped("402".into()), now);
        assert!(
            !p.claims("embedding:m@x", now),
            "no lease could start either"
        );
        let full = Hold::Full {
            scope: "embedding:m@x".into(),
            limit: 1,
        };
        p.claim(&full, now);
        assert!(p.claims("embedding:m@x", now));
        assert!(
            !p.claims("chat:c", now),
            "another route's permits are not claimed"
        );
        p.claim(&Hold::RpmWindow { rpm: 60 }, now);
        assert!(p.claims("chat:c", now), "a full window is every route's");
        assert!(p.end_claims());
        assert!(!p.claims("embedding:m@x", now) && !p.claims("chat:c", now));
        assert!(!p.end_claims());
        // A round that does not come (held up elsewhere) holds no work up past the TTL.
        p.claim(&full, now);
        assert!(!p.claims("embedding:m@x", now + CLAIM_TTL));
    }

    #[test]
    fn only_probes_no_longer_out_give_their_permits_back() {
        let mut p = ProbePermits::default();
        p.hold("p-1", "r1");
        p.hold("p-2", "r2");
        assert_eq!(p.take_done(|probe| probe == "p-2"), vec!["r1".to_string()]);
        assert_eq!(p.held(), 1);
        assert!(p.take_done(|_| true).is_empty());
    }
}
