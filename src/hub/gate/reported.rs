//! Suspensions that outlive the leader that made them. A suspension (drift caught by a canary
//! or the sentinel) is told to the agent whose provider it is ([`Gate::take_suspensions`]), and
//! the hub writes the verdicts at once rather than at the next checkpoint. If the leader dies,
//! or is fenced, before the write lands, the agent reports the suspension in its next `hello`
//! and the next leader honours it ([`Gate::honour_reported`]): a verdict judged before the
//! suspension (a pass the store handed over) is suspended; a key it has not judged yet is
//! suspended at its first judgement. Only an operator's verify lifts it
//! ([`Gate::reverify`]); a verdict judged after the suspension (a verify that passed) stands.
//! What waits for a first judgement is bounded per agent (its newest
//! [`MAX_REPORTED_SUSPENSIONS`]) and forgotten with the agent.

use super::{Gate, Suspension, Verdict, suspend};
use crate::protocol::MAX_REPORTED_SUSPENSIONS;

impl Gate {
    /// Suspensions made since the last call, as the agents are told them (the agent's id, the
    /// notice). Non-empty: the verdicts are to be stored now.
    pub fn take_suspensions(&mut self) -> Vec<(String, Suspension)> {
        let mut told = Vec::new();
        for (key, e) in self.verdicts.iter_mut().filter(|(_, e)| e.untold) {
            e.untold = false;
            let (Some(generation), Verdict::Suspended { reason }) =
                (self.spaces.get(&e.space).map(|s| s.generation), &e.verdict)
            else {
                continue;
            };
            let Some((agent, provider)) = e.provider.split_once('/') else {
                continue;
            };
            self.urgent = true;
            told.push((
                agent.to_string(),
                Suspension {
                    provider: provider.to_string(),
                    key: key.clone(),
                    space: e.space.clone(),
                    generation,
                    reason: reason.clone(),
                    at_ms: e.checked_at_ms.unwrap_or(0),
                },
            ));
        }
        told
    }

    /// A suspension agent `agent` reports (made by an earlier leader): honoured when it is of
    /// this agent's provider, for a space of the same generation, and newer than this gate's
    /// own verdict of it. Whether it changed anything (the verdicts are then to be stored).
    pub fn honour_reported(&mut self, agent: &str, s: &Suspension) -> bool {
        let provider = format!("{agent}/{}", s.provider);
        // A verify of this provider (or of all, under "") after the suspension lifted it.
        let verified = [provider.as_str(), ""]
            .iter()
            .filter_map(|p| self.verified_at_ms.get(*p))
            .any(|at| *at >= s.at_ms);
        if !s.key.starts_with(&format!("{provider}|"))
            || self.generation(&s.space) != Some(s.generation)
            || verified
        {
            return false;
        }
        let reason = format!(
            "suspended by an earlier leader (reported by its agent): {}",
            s.reason
        );
        match self.verdicts.get_mut(&s.key) {
            Some(e) => {
                let judged_before = e.checked_at_ms.is_none_or(|at| at < s.at_ms);
                let lifts = matches!(
                    e.verdict,
                    Verdict::Suspended { .. } | Verdict::Refused { .. }
                );
                if !judged_before || lifts {
                    return false;
                }
                suspend(&mut self.events, e, reason, "agent");
                e.checked_at_ms = Some(s.at_ms);
                // The agent knows already.
                e.untold = false;
                self.urgent = true;
                true
            }
            None => {
                self.reported.insert(s.key.clone(), s.clone());
                self.bound_reported(agent);
                false
            }
        }
    }

    /// Keeps at most [`MAX_REPORTED_SUSPENSIONS`] of `agent`'s reported suspensions (the
    /// newest): an agent that says hello again and again with other keys holds no more.
    fn bound_reported(&mut self, agent: &str) {
        let prefix = format!("{agent}/");
        let mut mine: Vec<(u64, String)> = self
            .reported
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .map(|(k, s)| (s.at_ms, k.clone()))
            .collect();
        if mine.len() <= MAX_REPORTED_SUSPENSIONS {
            return;
        }
        mine.sort();
        let excess = mine.len() - MAX_REPORTED_SUSPENSIONS;
        for (_, key) in mine.into_iter().take(excess) {
            self.reported.remove(&key);
        }
    }

    /// Forgets what `agent` reported (it departed long enough ago to be forgotten; it reports
    /// its suspensions again in its next `hello`).
    pub(super) fn forget_reported(&mut self, agent: &str) {
        let prefix = format!("{agent}/");
        self.reported.retain(|k, _| !k.starts_with(&prefix));
    }

    /// How many reported suspensions wait for a first judgement (all agents).
    pub fn reported_waiting(&self) -> usize {
        self.reported.len()
    }

    /// Whether the verdicts are to be stored now (a suspension since the last store); reset.
    pub fn take_urgent(&mut self) -> bool {
        std::mem::take(&mut self.urgent)
    }

    /// The store did not take them: they are tried again at the next tick.
    pub fn mark_urgent(&mut self) {
        self.urgent = true;
    }

    /// The verdict a first judgement of `key` records: a suspension an agent reported wins
    /// over a pass.
    pub(super) fn unless_reported(&mut self, key: &str, verdict: Verdict) -> Verdict {
        let report = self.reported.remove(key);
        let current = report
            .as_ref()
            .is_some_and(|s| self.generation(&s.space) == Some(s.generation));
        match (report.filter(|_| current), &verdict) {
            (Some(s), Verdict::Pass) => Verdict::Suspended {
                reason: format!(
                    "suspended by an earlier leader (reported by its agent): {}",
                    s.reason
                ),
            },
            _ => verdict,
        }
    }
}
