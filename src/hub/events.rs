//! The hub's recent events, for an operator: what the gate and the budget did and when
//! (a provider suspended, a verdict refused, an operator's verify; a 429 that halved the
//! budget and started a cooldown, cloud work stopped and resumed, the override set). The
//! gate and the budget each keep a bounded ring ([`EventRing`], [`MAX_EVENTS`]); `/admin/status`
//! shows both, newest last, and the console puts them in time on its Spaces and Budget views.
//! Like the history, nothing is stored: the ring starts empty after a restart or a takeover
//! (the verdicts and the budget's checkpoint say where things stand; this says how they got
//! there).

use std::collections::VecDeque;

use serde::Serialize;

/// The most events one ring holds: a storm of 429s keeps its latest.
pub const MAX_EVENTS: usize = 256;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A provider that passed drifted (the sentinel, a canary, or an earlier leader's
    /// suspension its agent reported): it serves nothing until an operator's verify.
    Suspended,
    /// A provider's probe was judged and refused for a space.
    Refused,
    /// An operator asked for verdicts to be judged again (`POST /admin/gate/verify`).
    Verify,
    /// A migration of an embedding role opened, cut over, closed its previous space or was
    /// aborted (`/admin/migrations`).
    Migration,
    /// A throttle (a 429) halved the budget's limit and started a cooldown.
    Cooldown,
    /// A 429 ended the start: the limit went to one under the wall it found, with no cooldown.
    Wall,
    /// Cloud work stopped: a hard 402, or the key refused.
    Stopped,
    /// Cloud work resumed after a stop (money again, a new key).
    Resumed,
    /// The operator's override was set or cleared.
    Override,
}

/// One event.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Event {
    /// When (ms since the Unix epoch).
    pub t_ms: u64,
    pub kind: EventKind,
    /// What it is about: a provider (`agent/provider`), a cloud route, or `budget`.
    pub subject: String,
    /// What happened, in words (a reason an upstream or a probe gave is text, never markup).
    pub detail: String,
}

/// A bounded ring of events, oldest first.
#[derive(Debug, Default)]
pub struct EventRing {
    events: VecDeque<Event>,
}

impl EventRing {
    /// Records an event now; the oldest leaves past [`MAX_EVENTS`].
    pub fn push(&mut self, kind: EventKind, subject: impl Into<String>, detail: impl Into<String>) {
        self.push_at(super::now_ms(), kind, subject.into(), detail.into());
    }

    fn push_at(&mut self, t_ms: u64, kind: EventKind, subject: String, detail: String) {
        self.events.push_back(Event {
            t_ms,
            kind,
            subject,
            detail,
        });
        while self.events.len() > MAX_EVENTS {
            self.events.pop_front();
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

/// The events of several rings in one timeline, oldest first.
pub fn merged<'a>(rings: impl IntoIterator<Item = &'a EventRing>) -> Vec<Event> {
    let mut all: Vec<Event> = rings.into_iter().flat_map(|r| r.iter().cloned()).collect();
    // Stable: events of one ring at the same millisecond keep their order.
    all.sort_by_key(|e| e.t_ms);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_keeps_its_latest_events_and_merged_rings_read_in_time() {
        let mut gate = EventRing::default();
        for i in 0..(MAX_EVENTS as u64 + 10) {
            gate.push_at(
                1_000 + 2 * i,
                EventKind::Suspended,
                format!("p{i}"),
                "x".into(),
            );
        }
        assert_eq!(gate.len(), MAX_EVENTS);
        assert_eq!(gate.iter().next().unwrap().subject, "p10");
        let mut budget = EventRing::default();
        budget.push_at(1_021, EventKind::Cooldown, "budget".into(), "429".into());
        let all = merged([&gate, &budget]);
        assert_eq!(all.len(), MAX_EVENTS + 1);
        assert!(all.windows(2).all(|w| w[0].t_ms <= w[1].t_ms));
        let at = all
            .iter()
            .position(|e| e.kind == EventKind::Cooldown)
            .unwrap();
        assert_eq!(all[at - 1].t_ms, 1_020);
        assert_eq!(all[at + 1].t_ms, 1_022);
    }
}
