//! Keyed chats' answers that agents hand over (`kept`), the hub's word that it holds one
//! (`delivered`), and keyed chats parked while their agent is away.
//!
//! An agent keeps a keyed chat's outcome until a hub says it holds it: the `done` reached
//! this hub, or the agent handed it over here. An answer new to this hub is held for retries
//! ([`crate::hub::replies`]) and its cost counts in the project's day here: the hub that
//! leased it never said it held it, so it never counted it. One this hub already holds
//! counts nothing more.
//!
//! When the socket of an agent that keeps answers drops while it runs a keyed chat, the
//! chat is parked, not sent to another provider (that would pay the upstream twice): the
//! agent's handover answers it. It goes round again only when the agent says the call
//! failed, or does not come back and report it running within [`PARK_FOR_SILENCE_S`]
//! heartbeats and the dial bound; a call it reports running is waited for up to the role's
//! call timeout. A parked cloud chat keeps its budget permit, and a cloud call an agent
//! reports running for an earlier hub takes one: a call under way always counts in flight,
//! so the budget is not over its window across a takeover.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Core, ItemOutput, Lease, Served, Slot};
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

/// Heartbeats a parked chat waits for its agent to come back (its silence bound), besides
/// [`DIAL_BOUND`].
pub const PARK_FOR_SILENCE_S: u32 = 3;
/// How long an agent's dial of every hub may take.
const DIAL_BOUND: Duration = Duration::from_secs(5);

/// A keyed chat whose agent's socket dropped while it ran: its lease, kept whole (its one
/// item, who ran it, its budget permit).
pub(super) struct Parked {
    lease: Lease,
    tag: IdempotencyTag,
    until: Instant,
}

/// A cloud call an agent reported running for an earlier hub: it holds a permit of `route`
/// until its answer comes, the agent leaves, or `until` (the role's call timeout) passes.
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
    /// Parks a lost lease's keyed chat when its agent hands answers over (it keeps its
    /// permit); otherwise gives the lease back (to be requeued).
    pub(super) fn park_lost(&mut self, lease: Lease) -> Option<Lease> {
        let tag = match lease.items.as_slice() {
            [item] if lease.keeps_answer => item.shape.idempotency().cloned(),
            _ => None,
        };
        let unstreamed = |i: &crate::hub::queue::Item| {
            self.requests
                .get(&i.request)
                .is_some_and(|p| p.streamed.is_none())
        };
        let Some(tag) = tag.filter(|_| lease.items.iter().all(unstreamed)) else {
            return Some(lease);
        };
        let until =
            Instant::now() + self.settings.heartbeat_interval * PARK_FOR_SILENCE_S + DIAL_BOUND;
        tracing::info!(agent = %lease.agent, key = %tag.key, "a keyed chat's agent left while it ran: waiting for its handover, not sending it again");
        self.parked.push(Parked { lease, tag, until });
        None
    }

    /// `agent` said hello with the keyed calls it still runs for an earlier session: their
    /// parked chats wait up to the role's call timeout more, and each other cloud call takes
    /// a permit until it ends.
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

    /// Parked chats whose agent did not come back in time go round again; those whose
    /// request ended are let go. Reported calls past their call timeout end.
    pub(super) fn expire_parked(&mut self, now: Instant) {
        self.release_reported(|_, r| r.until <= now);
        if self.parked.is_empty() {
            return;
        }
        let (due, waiting): (Vec<Parked>, Vec<Parked>) =
            std::mem::take(&mut self.parked).into_iter().partition(|p| {
                p.until <= now
                    || p.lease
                        .items
                        .iter()
                        .all(|i| !self.requests.contains_key(&i.request))
            });
        self.parked = waiting;
        for p in due {
            self.release_permit(&p.lease, budget::Outcome::Other);
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
