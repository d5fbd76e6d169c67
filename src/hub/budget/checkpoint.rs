//! What the budget learned, as a shared store keeps it (`BudgetCheckpoint`), and the two ends
//! of a handover: [`Budget::checkpoint`] on the leader, [`Budget::take_over`] on the next.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::Budget;
use super::limiter::Limiter;
use crate::hub::measured::{self, LatencyMs};
use crate::protocol::AccountLimits;

/// What the budget learned, as a shared store keeps it (checkpointed every few seconds, never
/// per call): a hub that takes the lead starts from it instead of from nothing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BudgetCheckpoint {
    /// The key generation it was learned under: another key's account is not this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_generation: Option<String>,
    pub account: AccountLimits,
    pub latency_ewma_ms: f64,
    pub global: LimiterCheckpoint,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub routes: BTreeMap<String, LimiterCheckpoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_rejected: Option<String>,
}

fn round_to_50(ms: f64) -> f64 {
    (ms / 50.0).round() * 50.0
}

/// One scope's learned limit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LimiterCheckpoint {
    pub limit: u32,
    /// The ceiling a start was growing the limit towards, when one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_target: Option<u32>,
    /// The limit a 429 came at, while it is remembered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_bad: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ewma_ms: Option<f64>,
}

impl LimiterCheckpoint {
    fn of(l: &Limiter) -> Self {
        Self {
            limit: l.limit,
            start_target: l.start_target,
            last_bad: l.last_bad.map(|(bad, _)| bad),
            // In 50 ms steps: a checkpoint changes when something was learnt, not per call.
            latency_ewma_ms: l.latency_ewma_ms.map(round_to_50),
        }
    }

    /// Laid over a fresh limiter: a remembered wall counts from now (a halving just happened,
    /// as far as the ramp can tell), so the new leader does not walk into it again.
    fn restore(&self, l: &mut Limiter, hard_ceiling: u32, now: Instant) {
        // Numbers another hub stored: each within what this hub could have learnt itself.
        l.limit = self.limit.clamp(1, hard_ceiling);
        l.start_target = self
            .start_target
            .map(|t| t.min(hard_ceiling))
            .filter(|&t| t > l.limit);
        l.latency_ewma_ms = self
            .latency_ewma_ms
            .and_then(LatencyMs::restored)
            .map(LatencyMs::ms);
        if let Some(bad) = self.last_bad.map(|b| b.clamp(1, hard_ceiling)) {
            l.last_bad = Some((bad, now));
            l.halved_to = l.limit;
            l.last_halving = Some(now);
        }
    }
}

impl Budget {
    /// What it learned, for a shared store.
    pub fn checkpoint(&self, key_generation: Option<&str>) -> BudgetCheckpoint {
        BudgetCheckpoint {
            key_generation: key_generation.map(str::to_string),
            account: AccountLimits {
                error: None,
                ..self.account.clone()
            },
            latency_ewma_ms: round_to_50(self.latency_ewma_ms),
            global: LimiterCheckpoint::of(&self.global),
            routes: self
                .routes
                .iter()
                .map(|(r, l)| (r.clone(), LimiterCheckpoint::of(l)))
                .collect(),
            stopped: self.stopped.clone(),
            key_rejected: self.key_rejected.clone(),
        }
    }

    /// A hub takes the lead over a shared store: it starts from what the last leader learned
    /// (when it was learned under the key this hub holds), and counts the RPM window as full
    /// until one window has passed, since the last leader's starts were never checkpointed.
    pub fn take_over(
        &mut self,
        checkpoint: Option<&BudgetCheckpoint>,
        key_generation: Option<&str>,
        now: Instant,
    ) {
        self.took_over = Some(now);
        let Some(cp) = checkpoint.filter(|c| c.key_generation.as_deref() == key_generation) else {
            return;
        };
        self.account = measured::account(cp.account.clone());
        self.last_discovery = Some(now);
        if let Some(latency) = LatencyMs::restored(cp.latency_ewma_ms).filter(|l| l.ms() > 0.0) {
            self.latency_ewma_ms = latency.ms();
        }
        self.stopped = cp.stopped.clone();
        self.key_rejected = cp.key_rejected.clone();
        let hard = self.settings.hard_ceiling;
        cp.global.restore(&mut self.global, hard, now);
        for (route, l) in &cp.routes {
            let mut limiter =
                Limiter::new(l.limit.clamp(1, hard), self.settings.backoff_initial, now);
            l.restore(&mut limiter, hard, now);
            self.routes.insert(route.clone(), limiter);
        }
        self.tick(now);
    }
}
