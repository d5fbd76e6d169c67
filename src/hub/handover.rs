//! What a leader on a shared store (etcd) hands to the next: the gate's settled verdicts, so a
//! failover does not probe and pay for every cloud provider again, and what the cloud budget
//! learned (the account's limits, the latency, the limits a 429 taught). Both are checkpointed
//! every few seconds when they changed, never per call, and never from the dispatch path; a
//! suspension is written at the next tick (a quarter second), and its agent is told of it
//! (`gate/reported`), so a suspension outlives a leader that dies before the write.
//! The budget's RPM window is not checkpointed: a new leader counts it as full for one window
//! ([`crate::hub::budget::Budget::take_over`]). A hub on a state file hands nothing over: it
//! starts as it always did.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::core::Core;
use super::state::HubState;
use super::{Hub, now_ms};

/// How often the handover is checkpointed at most.
const HANDOVER_CHECKPOINT_MS: u64 = 5_000;

/// A new leader starts from what the last one handed over.
pub(super) fn take_over(core: &mut Core, state: &HubState, now: Instant) {
    let taken = core.gate.restore_verdicts(&state.verdicts, now);
    core.budget
        .take_over(state.budget.as_ref(), state.key_generation.as_deref(), now);
    tracing::info!(
        verdicts = taken,
        budget = state.budget.is_some(),
        "took over: verdicts and the budget's window as the last leader left them; the RPM window counts as full for a minute"
    );
}

impl Hub {
    /// When this hub last wrote its handover (ms since the Unix epoch), if it has.
    pub(super) fn handover_saved_ms(&self) -> Option<u64> {
        Some(self.inner.handover_saved_ms.load(Ordering::Relaxed)).filter(|&ms| ms > 0)
    }

    /// Writes the handover when it changed and the last write is a few seconds old.
    pub(super) async fn checkpoint_handover_if_due(&self) {
        if !self.inner.store.is_shared() {
            return;
        }
        let now = now_ms();
        let last = self.inner.handover_tried_ms.load(Ordering::Relaxed);
        // A suspension is stored at once: a new leader must never restore the pass before it.
        let urgent = self.core().gate.take_urgent();
        if (!urgent && now.saturating_sub(last) < HANDOVER_CHECKPOINT_MS)
            || self.inner.store.fence().check(Instant::now()).is_err()
        {
            if urgent {
                self.core().gate.mark_urgent();
            }
            return;
        }
        let (verdicts, budget) = {
            let key_generation = self.lock_state().key_generation.clone();
            let core = self.core();
            (
                core.gate.stored_verdicts(),
                core.budget.checkpoint(key_generation.as_deref()),
            )
        };
        {
            let state = self.lock_state();
            if state.verdicts == verdicts && state.budget.as_ref() == Some(&budget) {
                return;
            }
        }
        self.inner.handover_tried_ms.store(now, Ordering::Relaxed);
        let _writing = self.inner.state_writes.lock().await;
        let mut next = self.state();
        next.verdicts = verdicts;
        next.budget = Some(budget);
        match self.persist(next).await {
            Ok(next) => {
                *self.lock_state() = next;
                self.inner
                    .handover_saved_ms
                    .store(now_ms(), Ordering::Relaxed);
            }
            Err(e) => {
                if urgent {
                    self.core().gate.mark_urgent();
                }
                tracing::warn!(error = %e, "the handover could not be saved; trying again")
            }
        }
    }
}
