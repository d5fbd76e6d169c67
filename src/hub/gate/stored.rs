//! Verdicts as a shared store keeps them: hubs on etcd hand the gate's judgements to the next
//! leader, so a failover does not probe (and pay for) every provider again. Only settled
//! verdicts travel (a pass, a refusal, a suspension), each with the generation of the space it
//! was judged for: a verdict of a space that was retired and founded again is dropped, never
//! carried into the new generation. Probes in flight and failures stay behind.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::measure::Evidence;
use super::{Gate, Verdict, VerdictEntry};
use crate::roles::Role;

/// A settled verdict, as stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredVerdict {
    pub provider: String,
    pub role: Role,
    pub space: String,
    /// The generation of `space` it was judged for.
    pub generation: u64,
    pub verdict: Verdict,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<Evidence>,
    pub reference: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked_at_ms: Option<u64>,
    pub checks: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caught_by: Option<String>,
    /// When its agent left (ms since the epoch), if it was gone: the next leader forgets it
    /// on the same clock ([`Gate::forget_departed`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub left_at_ms: Option<u64>,
}

impl Gate {
    /// The settled verdicts, by verdict key.
    pub fn stored_verdicts(&self) -> BTreeMap<String, StoredVerdict> {
        self.verdicts
            .iter()
            .filter(|(_, e)| {
                matches!(
                    e.verdict,
                    Verdict::Pass | Verdict::Refused { .. } | Verdict::Suspended { .. }
                )
            })
            .filter_map(|(key, e)| {
                let generation = self.generation(&e.space)?;
                Some((
                    key.clone(),
                    StoredVerdict {
                        provider: e.provider.clone(),
                        role: e.role,
                        space: e.space.clone(),
                        generation,
                        verdict: e.verdict.clone(),
                        evidence: e.evidence.clone(),
                        reference: e.reference.clone(),
                        checked_at_ms: e.checked_at_ms,
                        checks: e.checks,
                        caught_by: e.caught_by.map(str::to_string),
                        left_at_ms: self.departed_at_ms(&e.provider),
                    },
                ))
            })
            .collect()
    }

    /// Takes the verdicts a previous leader settled, for the spaces (and generations) this
    /// gate holds; a pass is re-probed by the sentinel one period from now. Returns how many
    /// were taken.
    pub fn restore_verdicts(
        &mut self,
        stored: &BTreeMap<String, StoredVerdict>,
        now: Instant,
    ) -> usize {
        let mut taken = 0;
        for (key, v) in stored {
            if self.generation(&v.space) != Some(v.generation) || self.verdicts.contains_key(key) {
                continue;
            }
            let next_check = (v.verdict == Verdict::Pass).then(|| now + self.settings.sentinel);
            // Gone since it said, or (connected to the old leader) gone until its agent
            // reconnects here.
            if let Some(agent) = v.provider.split('/').next() {
                self.departed
                    .entry(agent.to_string())
                    .or_insert_with(|| v.left_at_ms.unwrap_or_else(super::now_ms));
            }
            self.verdicts.insert(
                key.clone(),
                VerdictEntry {
                    provider: v.provider.clone(),
                    role: v.role,
                    space: v.space.clone(),
                    verdict: v.verdict.clone(),
                    evidence: v.evidence.clone(),
                    reference: v.reference.clone(),
                    checked_at_ms: v.checked_at_ms,
                    checks: v.checks,
                    caught_by: match v.caught_by.as_deref() {
                        Some("sentinel") => Some("sentinel"),
                        Some("canary") => Some("canary"),
                        Some("agent") => Some("agent"),
                        _ => None,
                    },
                    next_check,
                    sentinel_failures: 0,
                    probe: None,
                    untold: false,
                },
            );
            taken += 1;
        }
        taken
    }
}
