//! Keyed chats' answers that agents hand over (`kept`), the hub's word that it holds one
//! (`delivered`), keyed chats parked while their agent's call may still run, and the calls an
//! agent reports running for an earlier session.
//!
//! An agent keeps a keyed chat's outcome until a hub says it holds it: the `done` reached
//! this hub, or the agent handed it over here. An answer new to this hub is held for retries
//! ([`crate::hub::replies`]) and its cost counts in the project's day here: the hub that
//! leased it never said it held it, so it never counted it. One this hub already holds, or
//! counted before its key was pushed out of the table, counts nothing more.
//!
//! A keyed chat's lease on an agent that keeps answers is never sent to another provider
//! while the agent's call may still run (that would pay the upstream twice): when its socket
//! drops, or the lease expires unrenewed (a silent agent), the lease is parked, keeping its
//! budget permit, and the key waits for the agent ([`crate::hub::replies::Replies::call_at`]).
//! The agent's outcome answers it: a `kept` frame from its next session, or the `done` or
//! `failed` of the same session when the agent was only slow (a chunk or a heartbeat of that
//! session takes the lease back live). A streamed chat whose chunks had begun fails at once
//! (the client has part of an answer), but its lease stays parked and its key waits, so a
//! retry gets the whole answer when the agent hands it over. A parked chat goes round again
//! only when the agent says the call failed, or does not come back and report it running
//! within its return bound ([`PARK_FOR_SILENCE_S`] heartbeats and the dial bound); a call it
//! reports running is waited for up to the role's call timeout.
//!
//! An agent that blinks (its socket drops, a new session of it says hello) does not make the
//! hub forget what it may still finish: the calls it reported running, the keys they hold and
//! their permits are waited for until its return bound, then as long as its next `hello`
//! lists them; a call it reported before and no longer lists has ended, and its `kept`
//! outcome, sent right after the `hello`, is waited for a heartbeat. A cloud call an agent
//! reports running for an earlier hub holds a permit: a call under way always counts in
//! flight, so the budget is not over its window across a takeover.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Core, ItemOutput, Lease, RequestFailure, Served, Slot};
use crate::hub::budget;
use crate::hub::projects::DEFAULT_PROJECT;
use crate::hub::queue::RequestId;
use crate::hub::registry::ProviderRef;
use crate::protocol::{
    self, AnsweringCall, Backend, FailureClass, HubFrame, IdempotencyTag, KeptAnswer, WorkOutput,
};

/// A completion as a client gets it: with the provenance of who served it.
pub(super) fn with_provenance(mut completion: Value, served_by: &ProviderRef) -> Value {
    if let Some(o) = completion.as_object_mut() {
        o.insert(
            "provenance".into(),
            serde_json::to_value(served_by).unwrap_or(Value::Null),
        );
    }
    completion
}

/// Heartbeats an agent that left is waited for to come back (its silence bound), besides
/// [`DIAL_BOUND`]: its parked chats, the calls it reported running and the keys waiting for
/// them.
pub const PARK_FOR_SILENCE_S: u32 = 3;
/// How long an agent's dial of every hub may take.
const DIAL_BOUND: Duration = Duration::from_secs(5);

/// A keyed chat whose lease was lost while its agent's call may still run: the lease, kept
/// whole (its id, its one item, who ran it, its budget permit).
pub(super) struct Parked {
    id: u64,
    lease: Lease,
    tag: IdempotencyTag,
    until: Instant,
}

/// The tag of a lease whose call its agent finishes and hands over when the lease is lost: a
/// keyed chat (one item) on an agent that keeps answers.
fn kept_call(lease: &Lease) -> Option<IdempotencyTag> {
    match lease.items.as_slice() {
        [item] if lease.keeps_answer => item.shape.idempotency().cloned(),
        _ => None,
    }
}

/// A cloud call an agent reported running for an earlier session: it holds a permit of
/// `route` until its answer comes, the agent's next `hello` no longer lists it, or `until`
/// passes (the role's call timeout; the agent's return bound once it left).
pub(super) struct Reported {
    pub(super) agent: String,
    route: String,
    until: Instant,
}

impl Core {
    /// A `kept` frame of `agent`'s live session.
    pub fn kept(&mut self, agent: &str, session: u64, kept: KeptAnswer) -> Result<(), String> {
        // Numbers off the wire: a chat is one item; its cost is one call's.
        let kept = KeptAnswer {
            tokens: crate::hub::measured::tokens(kept.tokens, 1),
            cost_usd: crate::hub::measured::cost_usd(kept.cost_usd),
            ..kept
        };
        let provenance = match self.agents.get(agent) {
            Some(a) if a.session == session => a
                .providers
                .get(&kept.provider)
                .and_then(|p| serde_json::to_value(&*p.reference).ok())
                .unwrap_or_else(|| {
                    serde_json::json!({"agent": agent,
                        "provider": format!("{agent}/{}", kept.provider),
                        "backend": kept.backend})
                }),
            _ => return Err("this session was superseded or closed".into()),
        };
        let completion = match kept.output {
            Some(WorkOutput::Chat(Value::Object(mut c))) => {
                c.insert("provenance".into(), provenance);
                Some(Value::Object(c))
            }
            Some(_) => return Err("a kept answer must be a chat completion".into()),
            None => None,
        };
        let answered = completion.is_some();
        // A parked chat of this hub is answered by it (the raw completion: its provenance is
        // added when the request completes).
        let raw = completion.as_ref().map(|c| {
            let mut c = c.clone();
            if let Some(o) = c.as_object_mut() {
                o.remove("provenance");
            }
            c
        });
        let failure = kept
            .error
            .clone()
            .map(|message| (kept.class.unwrap_or(FailureClass::Transient), message));
        self.answer_parked(&kept.tag, raw, kept.tokens, failure);
        self.release_reported(|tag, _| tag == &kept.tag);
        if self.replies.handed_over(&kept.tag, completion) {
            let project: std::sync::Arc<str> = std::sync::Arc::from(kept.tag.project.as_str());
            tracing::info!(agent, project = %project, key = %kept.tag.key, "a keyed chat's answer was handed over; its cost counts here");
            let known = &*project == DEFAULT_PROJECT || self.projects.get(&project).is_some();
            if known && kept.backend == Backend::Cloud {
                self.record_cloud_use(&project, kept.tokens, kept.cost_usd);
            } else if let Some(usage) = self.projects.usage.get_mut(&project) {
                usage.local_tokens = usage.local_tokens.saturating_add(kept.tokens);
            }
        } else if !answered {
            tracing::info!(agent, key = %kept.tag.key, error = ?kept.error, "a keyed chat an agent ran failed; a retry may run it again");
        }
        self.tell_delivered(agent, kept.tag);
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
        Ok(())
    }

    /// Tells `agent` this hub holds the answer of `tag`.
    pub(super) fn tell_delivered(&self, agent: &str, tag: IdempotencyTag) {
        if let Some(a) = self.agents.get(agent) {
            a.send(protocol::encode(&HubFrame::Delivered(tag)));
        }
    }

    /// Wakes what waits on the fleet (a keyed request waiting for a handover).
    pub fn note_change(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }
}

impl Core {
    /// How long an agent that left (or went silent) is waited for to come back and report
    /// what it still runs: its silence bound and the dial bound.
    pub(super) fn return_bound(&self) -> Duration {
        self.settings.heartbeat_interval * PARK_FOR_SILENCE_S + DIAL_BOUND
    }

    /// A lease `id` lost at `now` (`why`) while its call may still run: a keyed chat whose
    /// agent keeps answers is parked (it keeps its permit) and its key waits for the agent,
    /// within the agent's return bound; a streamed one whose chunks had begun fails now, the
    /// rest wait for the handover. Another lease is given back (to be requeued).
    pub(super) fn park_lost(
        &mut self,
        id: u64,
        lease: Lease,
        now: Instant,
        why: &str,
    ) -> Option<Lease> {
        let Some(tag) = kept_call(&lease) else {
            return Some(lease);
        };
        let until = now + self.return_bound();
        self.replies.call_at(&tag, &lease.agent, until);
        let cut: Vec<(RequestId, u64)> = lease
            .items
            .iter()
            .filter_map(|i| {
                let streamed = self.requests.get(&i.request)?.streamed?;
                Some((i.request, streamed.next_seq))
            })
            .collect();
        tracing::info!(agent = %lease.agent, key = %tag.key, reason = why, "a keyed chat's lease was lost while its agent's call may still run: waiting for its handover, not sending it again");
        self.parked.push(Parked {
            id,
            lease,
            tag,
            until,
        });
        for (request, chunks) in cut {
            // Part of its answer is with the client: the request ends here; the call's
            // outcome is still taken when it comes, for a retry of the key.
            self.fail_request(
                request,
                RequestFailure::StreamCut {
                    chunks,
                    why: format!(
                        "{why}; a retry with the same Idempotency-Key gets the whole answer once \
                         its agent hands it over"
                    ),
                },
            );
        }
        None
    }

    /// The parked lease `id` of `agent`'s `session`, taken out: its result came on that
    /// session after all (it was parked when it expired unrenewed).
    pub(super) fn unpark(&mut self, agent: &str, session: u64, id: u64) -> Option<Lease> {
        let i = self
            .parked
            .iter()
            .position(|p| p.id == id && p.lease.agent == agent && p.lease.session == session)?;
        Some(self.parked.swap_remove(i).lease)
    }

    /// A chunk or a heartbeat of `agent`'s live `session` names its parked lease `id` (parked
    /// when it expired unrenewed): the call runs. While its request waits, the lease is live
    /// again; once its request ended, it stays parked for the outcome and is waited for a
    /// lease more. Whether it is live again.
    pub(super) fn resume_parked(
        &mut self,
        agent: &str,
        session: u64,
        id: u64,
        now: Instant,
    ) -> bool {
        // Only the agent's live session renews what it takes back (a frame of a superseded
        // one may still be read).
        if self.agents.get(agent).is_none_or(|a| a.session != session) {
            return false;
        }
        let Some(i) = self
            .parked
            .iter()
            .position(|p| p.id == id && p.lease.agent == agent && p.lease.session == session)
        else {
            return false;
        };
        let lease_for = self.settings.timings(self.parked[i].lease.role).lease;
        let waiting = self.parked[i]
            .lease
            .items
            .iter()
            .all(|item| self.requests.contains_key(&item.request));
        if !waiting {
            let p = &mut self.parked[i];
            p.until = p.until.max(now + lease_for);
            self.replies.call_at(&p.tag, agent, p.until);
            return false;
        }
        let Parked { mut lease, tag, .. } = self.parked.swap_remove(i);
        lease.deadline = now + lease_for;
        // Lost again, it is parked again.
        self.replies.call_ended(&tag, agent);
        self.restore_lease(id, lease);
        true
    }

    /// `agent`'s session ended at `now`: what it may still finish (its parked chats, the
    /// calls it reported running and their permits, the keys waiting for them) is waited for
    /// until its return bound; its next `hello` says which calls still run.
    pub(super) fn agent_away(&mut self, agent: &str, now: Instant) {
        let back_by = now + self.return_bound();
        self.replies.agent_left(agent, back_by);
        for p in self.parked.iter_mut().filter(|p| p.lease.agent == agent) {
            p.until = back_by;
        }
        for r in self.reported.values_mut().filter(|r| r.agent == agent) {
            r.until = back_by;
        }
    }

    /// `agent` said hello with the keyed calls it still runs for an earlier session: their
    /// parked chats wait up to the role's call timeout more, and each other cloud call takes
    /// a permit until it ends (a call it reported before and does not list now gives its
    /// permit back).
    pub(super) fn answering(&mut self, agent: &str, calls: &[AnsweringCall]) {
        let now = Instant::now();
        // A new hello says it all again.
        self.release_reported(|_, r| r.agent == agent);
        for call in calls {
            let role_and_route = self
                .agents
                .get(agent)
                .and_then(|a| a.providers.get(&call.provider))
                .map(|p| (p.role(), p.route.clone()));
            let call_timeout = role_and_route.as_ref().map_or(Duration::ZERO, |(role, _)| {
                self.settings.timings(*role).call_timeout
            });
            let heartbeat = self.settings.heartbeat_interval;
            if let Some(p) = self
                .parked
                .iter_mut()
                .find(|p| p.lease.agent == agent && p.tag == call.tag)
            {
                let call = self.settings.timings(p.lease.role).call_timeout;
                p.until = p.until.max(now + call + heartbeat);
                continue;
            }
            if let Some((_, Some(route))) = role_and_route {
                self.budget.hold_running(&route, now);
                let replaced = self.reported.insert(
                    call.tag.clone(),
                    Reported {
                        agent: agent.to_string(),
                        route,
                        until: now + call_timeout + heartbeat,
                    },
                );
                // Reported twice (two calls of one key): one permit per tag.
                if let Some(old) = replaced {
                    self.budget.release(&old.route, budget::Outcome::Other, now);
                }
            }
        }
    }

    /// Ends the reported calls `which` picks: their permits come back.
    pub(super) fn release_reported(&mut self, which: impl Fn(&IdempotencyTag, &Reported) -> bool) {
        let now = Instant::now();
        let ended: Vec<IdempotencyTag> = self
            .reported
            .iter()
            .filter(|(t, r)| which(t, r))
            .map(|(t, _)| t.clone())
            .collect();
        for tag in ended {
            if let Some(r) = self.reported.remove(&tag) {
                self.budget.release(&r.route, budget::Outcome::Other, now);
            }
        }
    }

    /// Whether a request waits parked for its agent's handover.
    pub(super) fn is_parked(&self, id: RequestId) -> bool {
        self.parked
            .iter()
            .any(|p| p.lease.items.iter().any(|i| i.request == id))
    }

    /// A handed-over outcome answers the chat parked for it (`None`: the call failed, as
    /// `failure` says: a fatal failure fails the request, as a `failed` would; another sends
    /// the chat round again).
    fn answer_parked(
        &mut self,
        tag: &IdempotencyTag,
        completion: Option<Value>,
        tokens: u64,
        failure: Option<(FailureClass, String)>,
    ) {
        let Some(i) = self.parked.iter().position(|p| p.tag == *tag) else {
            return;
        };
        let Parked { mut lease, .. } = self.parked.swap_remove(i);
        self.release_permit(&lease, budget::Outcome::Other);
        if let Some(p) = self.provider_mut(&lease) {
            p.lease_ended(lease.class);
        }
        let role = lease.role;
        let Some(completion) = completion else {
            match failure {
                Some((FailureClass::Fatal, message)) => self.fail_fatally(&lease, &message),
                _ => {
                    self.requeue(
                        role,
                        lease.items,
                        true,
                        "the agent's call of this keyed chat failed",
                    );
                    self.dispatch(role);
                }
            }
            return;
        };
        let Some(item) = lease.items.pop() else {
            return;
        };
        let request = item.request;
        let Some(pending) = self.requests.get_mut(&request) else {
            return;
        };
        let index = item.index as usize;
        let Some(slot) = pending.slots.get_mut(index) else {
            return;
        };
        *slot = Slot::Served {
            served: Served {
                output: ItemOutput::Chat(completion),
                provider: lease.reference.clone(),
                space: None,
            },
            item,
            verdict: None,
        };
        pending.remaining = pending.remaining.saturating_sub(1);
        pending.tokens = pending.tokens.saturating_add(tokens);
        if pending.remaining == 0 {
            self.complete(request);
        }
    }

    /// Parked chats whose agent did not come back in time (or whose call timeout passed) go
    /// round again, or are let go when their request ended meanwhile; the key waits for the
    /// agent no more. Reported calls past their bound end.
    pub(super) fn expire_parked(&mut self, now: Instant) {
        self.release_reported(|_, r| r.until <= now);
        if self.parked.is_empty() {
            return;
        }
        let (due, waiting): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|p| p.until <= now);
        self.parked = waiting;
        for p in due {
            self.release_permit(&p.lease, budget::Outcome::Other);
            if let Some(provider) = self.provider_mut(&p.lease) {
                provider.lease_ended(p.lease.class);
            }
            self.replies.call_ended(&p.tag, &p.lease.agent);
            if p.lease
                .items
                .iter()
                .all(|i| !self.requests.contains_key(&i.request))
            {
                continue;
            }
            tracing::warn!(agent = %p.lease.agent, key = %p.tag.key, "a keyed chat's agent did not hand it over in time; it goes round again");
            let role = p.lease.role;
            self.requeue(
                role,
                p.lease.items,
                true,
                "its agent left while it ran and did not hand it over",
            );
            self.dispatch(role);
        }
    }

    /// Keyed chats parked for their agents' handover.
    pub fn parked_chats(&self) -> usize {
        self.parked.len()
    }
}
