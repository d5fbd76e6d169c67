//! What comes back from leases: `done` (its canary taken out and judged by the gate, the rest
//! checked, then delivered to the items' requests, usage without the canary's share),
//! `failed` (requeued, failed, or a standing refusal that takes a provider out), expiry,
//! requeueing, and the completion of a request.
//!
//! A keyed chat's lease that expires unrenewed on an agent that keeps answers is parked, not
//! requeued (`handed_over`): a `done`, `failed` or `chunk` of that same session still takes it
//! back, as for a live lease.
//!
//! A result counts only for an item that has none yet, and only when its lease was granted
//! under the request's binding: the same space (and a verdict that still passes when the
//! request completes), or the same scorer.

use std::time::{Duration, Instant};

use super::{
    Binding, Canary, Completed, Core, Counters, ItemOutput, Lease, RequestFailure, Served, Slot,
};
use crate::hub::budget;
use crate::hub::measured::{self, LatencyMs};
use crate::hub::queue::{Item, RequestId, Shape, estimate_tokens};
use crate::hub::registry::ProviderEntry;
use crate::metrics::histogram;
use crate::protocol::{
    self, Backend, Chunk, Done, Failed, FailureClass, HubFrame, Refusal, WorkOutput,
};
use crate::roles::Role;

pub(super) fn failure_name(class: FailureClass) -> &'static str {
    match class {
        FailureClass::RateLimited => "rate_limited",
        FailureClass::Transient => "transient",
        FailureClass::Fatal => "fatal",
        FailureClass::Refused => "refused",
    }
}

/// The longest pause an agent's `retry_after_ms` may cause (a number off the wire).
const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

impl Core {
    /// Takes lease `id` out of the live leases; its queue flow hears that its frame landed.
    pub(super) fn remove_lease(&mut self, id: u64) -> Option<Lease> {
        let lease = self.leases.remove(&id)?;
        if let Some(q) = self.queues.get_mut(&lease.role) {
            q.landed(&lease.flow);
        }
        Some(lease)
    }

    /// Puts a lease taken out back among the live ones (a parked lease resumed).
    pub(super) fn restore_lease(&mut self, id: u64, lease: Lease) {
        if let Some(q) = self.queues.get_mut(&lease.role) {
            q.resumed(&lease.flow);
        }
        self.leases.insert(id, lease);
    }

    /// Takes the lease `id` if it is live and belongs to this session, or parked from this
    /// session (a keyed chat whose lease expired while its call ran); `None`: a late result.
    fn take_lease(&mut self, agent: &str, session: u64, id: u64) -> Option<Lease> {
        match self.leases.get(&id) {
            Some(l) if l.agent == agent && l.session == session => self.remove_lease(id),
            _ => {
                let parked = self.unpark(agent, session, id);
                if parked.is_none() {
                    self.counters.late_results += 1;
                }
                parked
            }
        }
    }

    pub(super) fn provider_mut(&mut self, lease: &Lease) -> Option<&mut ProviderEntry> {
        self.agents
            .get_mut(&lease.agent)
            .filter(|a| a.session == lease.session)
            .and_then(|a| a.providers.get_mut(&lease.provider))
    }

    pub fn done(&mut self, agent: &str, session: u64, done: Done) -> Result<(), String> {
        let Some(lease) = self.take_lease(agent, session, done.lease) else {
            tracing::debug!(agent, lease = done.lease, "late result dropped");
            return Ok(());
        };
        // A keyed chat's outcome reached this hub: the agent stops keeping it.
        let keyed = lease
            .items
            .first()
            .and_then(|i| i.shape.idempotency().cloned());
        if let Some(tag) = &keyed {
            self.tell_delivered(agent, tag.clone());
        }
        // Numbers off the wire, bounded where they enter: a latency by the call timeout the
        // lease ran under, tokens per item, a cost per call.
        let latency = LatencyMs::measured(
            done.latency_ms,
            self.settings.timings(lease.role).call_timeout,
        );
        let done = Done {
            tokens: measured::tokens(done.tokens, lease.items.len()),
            cost_usd: measured::cost_usd(done.cost_usd),
            ..done
        };
        let checked = take_canary(&lease, done.output).and_then(|(output, canary)| {
            check_outputs(&lease, output).map(|outputs| (outputs, canary))
        });
        let (outputs, canary) = match checked {
            Ok(outputs) => outputs,
            Err(message) => {
                let role = lease.role;
                self.release_permit(&lease, budget::Outcome::Other);
                let benched = self.count_failure(&lease, FailureClass::Transient);
                self.requeue(role, lease.items, true, &message);
                self.settle(role, benched);
                return Err(message);
            }
        };
        self.release_permit(
            &lease,
            match latency {
                Some(latency) => budget::Outcome::Success { latency },
                None => budget::Outcome::Other,
            },
        );
        // The canary first: a drifted one suspends the provider, and then none of the
        // lease's vectors is returned (below).
        if let (Some((key, _)), Some((c, vector))) = (&lease.gate, &canary) {
            let dimensions = match lease.items.first().map(|i| &*i.shape) {
                Some(Shape::Embed { dimensions, .. }) => *dimensions,
                _ => None,
            };
            if self
                .gate
                .check_canary(key, c.probe, vector, dimensions)
                .is_some()
            {
                *self
                    .counters
                    .canary_failures
                    .entry(lease.reference.provider.clone())
                    .or_default() += 1;
            }
        }
        if let Some((key, space)) = &lease.gate
            && (!self.gate.passes(key) || self.gate.generation(&space.id) != Some(space.generation))
        {
            // Suspended (drift), re-checked, or its space retired since: none of its vectors
            // is returned.
            tracing::warn!(
                agent,
                lease = done.lease,
                "results of a provider that no longer passes the gate are dropped; the items go back"
            );
            if let Some(p) = self.provider_mut(&lease) {
                p.lease_ended(lease.class);
            }
            let role = lease.role;
            self.requeue(
                role,
                lease.items,
                false,
                "the provider no longer passes the gate",
            );
            self.dispatch_all();
            return Ok(());
        }
        // The provider may have left the set while this lease ran; its results still count.
        if let Some(p) = self.provider_mut(&lease) {
            p.lease_ended(lease.class);
            p.consecutive_failures = 0;
            p.served_items = p.served_items.saturating_add(lease.items.len() as u64);
            if let Some(latency) = latency {
                p.record_latency(latency);
            }
        }
        let tokens = match &canary {
            Some((c, _)) => {
                let max_input = self
                    .provider_mut(&lease)
                    .and_then(|p| p.info.max_input_tokens);
                let own = canary_share(&lease, c.probe, done.tokens, max_input);
                *self
                    .counters
                    .canary_tokens
                    .entry(lease.reference.provider.clone())
                    .or_default() += own;
                done.tokens.saturating_sub(own)
            }
            None => done.tokens,
        };
        // The project pays for its own items; a canary's share is the gate's line.
        let (project, cloud) = (lease.project.clone(), lease.permit.is_some());
        // A keyed chat's answer is held for retries now, under the lock: an agent's `kept`
        // of it (sent again after a lost `delivered`) then finds it and counts nothing more.
        if let (Some(tag), Some(ItemOutput::Chat(completion))) = (&keyed, outputs.first()) {
            let answer = super::handed_over::with_provenance(completion.clone(), &lease.reference);
            self.replies
                .answered(&crate::hub::replies::ReplyId::of(tag), &tag.digest, answer);
        }
        self.deliver(lease, outputs, tokens);
        if cloud {
            // Without token counts the whole cost is the project's (no canary share known).
            let cost = done.cost_usd.map(|c| match done.tokens {
                0 => c,
                all => c * tokens as f64 / all as f64,
            });
            self.record_cloud_use(&project, tokens, cost);
        } else if let Some(usage) = self.projects.usage.get_mut(&project) {
            usage.local_tokens = usage.local_tokens.saturating_add(tokens);
        }
        Ok(())
    }

    /// Fails every request of `lease`: its provider cannot serve this input (`message`).
    pub(super) fn fail_fatally(&mut self, lease: &Lease, message: &str) {
        let provider = lease.reference.provider.clone();
        for item in &lease.items {
            self.fail_request(
                item.request,
                RequestFailure::Fatal {
                    provider: provider.clone(),
                    message: message.to_string(),
                },
            );
        }
    }

    /// Returns a cloud lease's budget permit (each lease ends exactly once).
    pub(super) fn release_permit(&mut self, lease: &Lease, outcome: budget::Outcome) {
        if let Some(route) = &lease.permit {
            self.budget.release(route, outcome, Instant::now());
            if let Some(usage) = self.projects.usage.get_mut(&lease.project) {
                usage.cloud_in_flight = usage.cloud_in_flight.saturating_sub(1);
            }
            // A freed permit goes to the other roles first: one role's backlog (and its
            // agents' instant re-pulls) must not starve another role of the shared budget.
            for role in Role::ALL {
                if role != lease.role {
                    self.dispatch(role);
                }
            }
        }
    }

    fn deliver(&mut self, lease: Lease, outputs: Vec<ItemOutput>, tokens: u64) {
        let reference = lease.reference.clone();
        let n = lease.items.len() as u64;
        let space = lease.gate.as_ref().map(|(_, s)| s.clone());
        if let Some(s) = &space {
            self.gate.count_rows(&s.id, &reference.provider, n);
            self.gate
                .count_project_rows(&s.id, &lease.project, n, tokens);
        }
        let served_counter = self.counters.items_served.entry(lease.role).or_default();
        *served_counter = served_counter.saturating_add(n);
        let verdict = lease.gate.as_ref().map(|(key, _)| key.clone());
        let role = lease.role;
        let per_item = tokens / n.max(1);
        let mut unbound = Vec::new();
        for (item, output) in lease.items.into_iter().zip(outputs) {
            let request = item.request;
            let Some(pending) = self.requests.get_mut(&request) else {
                continue;
            };
            // A rerank request re-bound while this lease ran takes no score from it.
            if let Binding::Scorer(bound) = &pending.binding
                && bound.as_ref().map(|b| &b.id) != lease.scorer.as_ref().map(|s| &s.id)
            {
                unbound.push(item);
                continue;
            }
            let index = item.index as usize;
            let Some(slot) = pending.slots.get_mut(index) else {
                continue;
            };
            if matches!(slot, Slot::Served { .. }) {
                self.counters.late_results += 1;
                continue;
            }
            *slot = Slot::Served {
                served: Served {
                    output,
                    provider: reference.clone(),
                    space: space.clone(),
                },
                item,
                verdict: verdict.clone(),
            };
            pending.remaining = pending.remaining.saturating_sub(1);
            pending.tokens = pending.tokens.saturating_add(per_item);
            if pending.remaining == 0 {
                self.complete(request);
            }
        }
        if !unbound.is_empty() {
            self.requeue(
                role,
                unbound,
                false,
                "its request is scored by another scorer",
            );
            self.dispatch(role);
        }
    }

    /// Answers a request whose every item has a result, unless a result's verdict stopped
    /// passing meanwhile (drift, a re-check): those items go round again first.
    pub(super) fn complete(&mut self, request: RequestId) {
        let gate = &self.gate;
        let Some(pending) = self.requests.get_mut(&request) else {
            return;
        };
        let mut again = Vec::new();
        for slot in &mut pending.slots {
            let stale =
                matches!(slot, Slot::Served { verdict: Some(key), .. } if !gate.passes(key));
            if stale && let Slot::Served { item, .. } = std::mem::replace(slot, Slot::Waiting) {
                again.push(item);
            }
        }
        if !again.is_empty() {
            pending.remaining += again.len();
            let role = pending.role;
            tracing::warn!(
                request,
                request_id = pending.request_id.as_deref(),
                items = again.len(),
                "results of a provider that no longer passes the gate go round again"
            );
            self.requeue(role, again, false, "the provider no longer passes the gate");
            self.dispatch(role);
            return;
        }
        if let Some(done) = self.take_request(request) {
            let scorer = match done.binding {
                Binding::Scorer(s) => s,
                _ => None,
            };
            let items = done
                .slots
                .into_iter()
                .filter_map(|s| match s {
                    Slot::Served { served, .. } => Some(served),
                    Slot::Waiting => None,
                })
                .collect();
            let now = Instant::now();
            let leased = done.first_lease_at.unwrap_or(now);
            Counters::observe(
                &mut self.counters.request_tokens,
                done.role,
                histogram::TOKENS,
                done.tokens as f64,
            );
            let _ = done.reply.send(Ok(Completed {
                items,
                tokens: done.tokens,
                scorer,
                queue_time: leased.saturating_duration_since(done.accepted_at),
                inference_time: now.saturating_duration_since(leased),
            }));
        }
    }

    /// A chunk of a streamed chat: the first one binds the request to its lease; each goes
    /// to the client in order (a repeat is dropped, a gap fails the request).
    pub fn chunk(&mut self, agent: &str, session: u64, chunk: Chunk) -> Result<(), String> {
        if !self.leases.contains_key(&chunk.lease) {
            // A keyed chat parked when its lease expired unrenewed: its call runs after all.
            self.resume_parked(agent, session, chunk.lease, Instant::now());
        }
        let Some(lease) = self.leases.get(&chunk.lease) else {
            self.counters.late_results += 1;
            return Ok(());
        };
        if lease.agent != agent || lease.session != session {
            return Err(format!("lease {} is not this session's", chunk.lease));
        }
        let Some(request) = lease.items.first().map(|i| i.request) else {
            return Ok(());
        };
        let Some(pending) = self.requests.get_mut(&request) else {
            return Ok(());
        };
        if pending.streamed.is_some_and(|s| s.lease != chunk.lease) {
            return Err(format!(
                "the request of lease {} streams from another lease",
                chunk.lease
            ));
        }
        let next = pending.streamed.map_or(0, |s| s.next_seq);
        if chunk.seq < next {
            return Ok(());
        }
        if chunk.seq > next {
            let message = format!("chunk {} came when {next} was due", chunk.seq);
            self.fail_request(
                request,
                RequestFailure::StreamCut {
                    chunks: next,
                    why: message.clone(),
                },
            );
            return Err(message);
        }
        pending.streamed = Some(super::Streamed {
            lease: chunk.lease,
            next_seq: next.saturating_add(1),
        });
        if let Some(tx) = &pending.stream {
            let _ = tx.send(chunk.data);
        }
        Ok(())
    }

    pub fn failed(&mut self, agent: &str, session: u64, mut failed: Failed) -> Result<(), String> {
        let Some(lease) = self.take_lease(agent, session, failed.lease) else {
            return Ok(());
        };
        // A keyed chat's failure reached this hub: the agent keeps it no longer (a stale one
        // must not reach the next hub as the outcome of a later call), and its key waits for
        // no call of it there.
        if let Some(tag) = lease
            .items
            .first()
            .and_then(|i| i.shape.idempotency().cloned())
        {
            self.replies.call_ended(&tag, agent);
            self.tell_delivered(agent, tag);
        }
        let role = lease.role;
        // Only a cloud lease can meet an account's limit or a standing refusal: a local one
        // that says so is failing, and counts as any transient failure (its attempt counts,
        // so a faulty agent cannot bounce a request until its timeout).
        if lease.reference.origin.backend == Backend::Local
            && (failed.limit.is_some() || failed.refusal.is_some())
        {
            failed.class = FailureClass::Transient;
            failed.limit = None;
            failed.refusal = None;
        }
        tracing::debug!(agent, lease = failed.lease, class = failure_name(failed.class), message = %failed.message, "lease failed");
        let retry_after = failed
            .retry_after_ms
            .map(|ms| Duration::from_millis(ms).min(MAX_RETRY_AFTER));
        let outcome = match failed.limit {
            Some(kind) => budget::Outcome::Limited { kind, retry_after },
            None => budget::Outcome::Other,
        };
        self.release_permit(&lease, outcome);
        if failed.limit.is_some() {
            // A limit is the account's or the upstream's, not this provider's fault. A hard 402
            // stopped cloud work: what only the cloud could serve fails now (reconcile).
            self.count_failure(&lease, FailureClass::RateLimited);
            self.requeue(role, lease.items, false, &failed.message);
            self.dispatch_all();
            return Ok(());
        }
        if let Some(refusal) = failed.refusal
            && lease.reference.origin.backend == Backend::Cloud
        {
            // A standing refusal: no retry helps until the operator acts. The provider (or, for
            // a rejected key, every cloud route) is out; its items go to whoever else can serve
            // them, and what nobody else can fails now with the reason.
            self.count_failure(&lease, FailureClass::RateLimited);
            match refusal {
                Refusal::KeyRejected if lease.key_generation != self.config.key_generation => {
                    // A key the hub has replaced since: its refusal stops nothing current.
                    tracing::warn!(provider = %lease.reference.provider, "a key of an older generation was refused; the current key is not affected");
                }
                Refusal::KeyRejected => self.budget.reject_key(&failed.message),
                Refusal::NoEndpoint => {
                    tracing::error!(provider = %lease.reference.provider, reason = %failed.message, "no endpoint for the route's pinned upstream: it serves nothing until a push");
                    if let Some(p) = self.provider_mut(&lease) {
                        p.refused = Some(format!(
                            "no endpoint for the pinned upstream ({})",
                            failed.message
                        ));
                    }
                }
            }
            self.requeue(role, lease.items, false, &failed.message);
            self.dispatch_all();
            return Ok(());
        }
        if failed.defect.is_some() {
            // Output wrong in itself: the provider is broken, whatever the input. It is taken
            // out (a gated embedder suspended as a drift is), and the items are failed or
            // tried alone elsewhere as any fatal failure's are.
            failed.class = FailureClass::Fatal;
            self.take_out_defective(&lease, &failed.message);
        }
        let benched = self.count_failure(&lease, failed.class);
        let local = lease.reference.origin.backend == Backend::Local;
        match failed.class {
            FailureClass::Fatal if lease.items.len() > 1 => {
                // One item may be at fault: each goes again on its own, so only its request fails.
                let items = lease
                    .items
                    .into_iter()
                    .map(|mut i| {
                        i.solo = true;
                        i
                    })
                    .collect();
                self.requeue(role, items, false, &failed.message);
            }
            FailureClass::Fatal => self.fail_fatally(&lease, &failed.message),
            FailureClass::RateLimited => {
                // Clamped: an agent's number must not overflow the clock or park a provider for long.
                let wait = retry_after.unwrap_or(Duration::from_secs(1));
                if let Some(p) = self.provider_mut(&lease) {
                    p.paused_until = Some(Instant::now() + wait);
                }
                // (Cloud limits name their kind and went to the budget above.)
                self.requeue(role, lease.items, false, &failed.message);
            }
            FailureClass::Transient | FailureClass::Refused => {
                // A cloud route that refuses (a bad answer) says nothing about the items: they
                // keep their attempts; the provider is benched after two in a row.
                let count_attempt = local || failed.class == FailureClass::Transient;
                let items = mark_failed_locally(lease.items, local);
                self.requeue(role, items, count_attempt, &failed.message);
            }
        }
        self.settle(role, benched);
        Ok(())
    }

    /// Takes the provider of `lease` out of service: its output was wrong in itself. A gated
    /// embedder's verdict is suspended (it outlives the agent's reconnects, as a drift's
    /// does); any other provider serves nothing until its agent announces it anew.
    fn take_out_defective(&mut self, lease: &Lease, why: &str) {
        tracing::error!(provider = %lease.reference.provider, reason = %why, "a provider's output was wrong in itself: it is taken out of service");
        if let Some((key, _)) = &lease.gate
            && self.gate.suspend(key, why.to_string(), "output")
        {
            return;
        }
        if let Some(p) = self.provider_mut(lease) {
            p.defective = Some(why.to_string());
        }
    }

    /// Dispatches `role` after a failure; everything, with a reconcile first, when a provider
    /// was benched (it may have been the last that could serve some request).
    fn settle(&mut self, role: Role, benched: bool) {
        if benched {
            self.dispatch_all();
        } else {
            self.dispatch(role);
        }
    }

    /// Provider bookkeeping of a failed lease (only `transient` and `refused` count against
    /// it); whether it was benched now.
    pub(super) fn count_failure(&mut self, lease: &Lease, class: FailureClass) -> bool {
        let counter = self
            .counters
            .failures
            .entry(failure_name(class))
            .or_default();
        *counter = counter.saturating_add(1);
        let bench = self.settings.bench;
        let Some(p) = self.provider_mut(lease) else {
            return false;
        };
        p.lease_ended(lease.class);
        // Throttling is not the provider's fault, and a fatal input would fail anywhere.
        if matches!(class, FailureClass::RateLimited | FailureClass::Fatal) {
            return false;
        }
        p.failures = p.failures.saturating_add(1);
        p.consecutive_failures = p.consecutive_failures.saturating_add(1);
        if p.consecutive_failures >= 2 {
            p.benched_until = Some(Instant::now() + bench);
            p.consecutive_failures = 0;
            tracing::warn!(provider = %p.reference.provider, bench_s = bench.as_secs(), "two failures in a row: provider benched");
            return true;
        }
        false
    }

    pub(super) fn fail_request(&mut self, id: RequestId, failure: RequestFailure) {
        if let Some(pending) = self.take_request(id) {
            self.counters.requests_failed += 1;
            tracing::info!(request = id, request_id = pending.request_id.as_deref(), role = %pending.role, reason = %failure, "request failed");
            let _ = pending.reply.send(Err(failure));
            // Its waiting items leave the queue at the role's next dispatch (one pass for
            // every request failed meanwhile): they must not hold room or the scan window.
            self.purge.insert(pending.role);
            self.cancel_orphaned_leases("the request failed");
        }
    }

    /// Takes back every lease whose items all belong to requests that are gone: the agent is
    /// told to stop (an upstream call is dropped, a batch not yet started is skipped), and a
    /// cloud permit comes back at once.
    pub(super) fn cancel_orphaned_leases(&mut self, reason: &str) {
        let requests = &self.requests;
        let orphaned: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.items.iter().all(|i| !requests.contains_key(&i.request)))
            .map(|(id, _)| *id)
            .collect();
        for (_, lease) in self.take_back(orphaned, reason) {
            self.cancelled(&lease);
        }
    }

    /// The bookkeeping of a lease taken back because of its requests (not the provider's
    /// fault): its in-flight count and its permit.
    fn cancelled(&mut self, lease: &Lease) {
        self.counters.leases_cancelled += 1;
        if let Some(p) = self.provider_mut(lease) {
            p.lease_ended(lease.class);
        }
        self.release_permit(lease, budget::Outcome::Other);
    }

    /// Takes back the leases carrying only items of request `id` (or of gone requests) and
    /// tells their agents to stop; their items of `id`, to send round again.
    pub(super) fn take_back_leases_of(&mut self, id: RequestId, reason: &str) -> Vec<Item> {
        let requests = &self.requests;
        let ids: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| {
                l.items.iter().any(|i| i.request == id)
                    && l.items
                        .iter()
                        .all(|i| i.request == id || !requests.contains_key(&i.request))
            })
            .map(|(lease, _)| *lease)
            .collect();
        let mut items = Vec::new();
        for (_, lease) in self.take_back(ids, reason) {
            self.cancelled(&lease);
            items.extend(lease.items.into_iter().filter(|i| i.request == id));
        }
        items
    }

    /// Takes the leases `ids` out and tells their agents to stop them (`cancel`).
    fn take_back(&mut self, ids: Vec<u64>, reason: &str) -> Vec<(u64, Lease)> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let Some(lease) = self.remove_lease(id) else {
                continue;
            };
            if let Some(a) = self
                .agents
                .get(&lease.agent)
                .filter(|a| a.session == lease.session)
            {
                a.send(protocol::encode(&HubFrame::Cancel {
                    lease: id,
                    reason: reason.to_string(),
                }));
            }
            out.push((id, lease));
        }
        out
    }

    /// Items back to the front of their queue; an item out of attempts fails its request.
    pub(super) fn requeue(&mut self, role: Role, items: Vec<Item>, count_attempt: bool, why: &str) {
        let max = self.settings.max_attempts;
        let mut kept = Vec::with_capacity(items.len());
        for mut item in items {
            let Some(pending) = self.requests.get(&item.request) else {
                continue;
            };
            if let Some(streamed) = pending.streamed {
                // Part of its answer is with the client already: never served twice.
                self.fail_request(
                    item.request,
                    RequestFailure::StreamCut {
                        chunks: streamed.next_seq,
                        why: why.to_string(),
                    },
                );
                continue;
            }
            if count_attempt {
                item.attempts = item.attempts.saturating_add(1);
            }
            if item.attempts >= max {
                self.fail_request(
                    item.request,
                    RequestFailure::TooManyAttempts {
                        attempts: item.attempts,
                        last: why.to_string(),
                    },
                );
            } else {
                kept.push(item);
            }
        }
        if let Some(q) = self.queues.get_mut(&role) {
            q.requeue_front(kept);
        }
    }

    /// Leases past their deadline go back to the front; their agents are told to stop. A
    /// keyed chat whose agent keeps answers is parked instead, its agent not told: a silent
    /// agent's call may still run, and its outcome answers it (`handed_over`).
    pub fn expire(&mut self, now: Instant) {
        self.expire_parked(now);
        let (mut keyed, mut expired) = (Vec::new(), Vec::new());
        for (id, l) in self.leases.iter().filter(|(_, l)| l.deadline <= now) {
            if l.keeps_answer {
                keyed.push(*id);
            } else {
                expired.push(*id);
            }
        }
        for id in keyed {
            let Some(lease) = self.remove_lease(id) else {
                continue;
            };
            let (agent, provider) = (lease.agent.clone(), lease.provider.clone());
            match self.park_lost(id, lease, now, "its lease expired unrenewed") {
                None => {
                    self.counters.leases_expired += 1;
                    tracing::warn!(lease = id, agent = %agent, provider = %provider, "a keyed chat's lease expired unrenewed; it waits for its agent's outcome");
                }
                // Not a call its agent finishes on its own: taken back as any other.
                Some(lease) => {
                    self.restore_lease(id, lease);
                    expired.push(id);
                }
            }
        }
        self.expire_taken_back(expired);
    }

    /// Takes back the expired leases `ids`: their agents are told to stop, their items go
    /// back to the front.
    fn expire_taken_back(&mut self, ids: Vec<u64>) {
        for (id, lease) in self.take_back(ids, "the lease expired") {
            self.counters.leases_expired += 1;
            tracing::warn!(lease = id, agent = %lease.agent, provider = %lease.provider, "lease expired; its items go back to the front");
            self.release_permit(&lease, budget::Outcome::Other);
            let benched = self.count_failure(&lease, FailureClass::Transient);
            let role = lease.role;
            let local = lease.reference.origin.backend == Backend::Local;
            let items = mark_failed_locally(lease.items, local);
            self.requeue(role, items, true, "the lease expired");
            self.settle(role, benched);
        }
    }
}

/// Items of a lease that failed on a local provider are marked so (`backup` lets the cloud
/// take them).
pub(super) fn mark_failed_locally(items: Vec<Item>, local: bool) -> Vec<Item> {
    if !local {
        return items;
    }
    items
        .into_iter()
        .map(|mut i| {
            i.failed_locally = true;
            i
        })
        .collect()
}

/// The lease's outputs, one per item and of the kind its op makes.
/// A canary and the vector it came back with.
type CanaryVector = (Canary, Vec<f32>);

/// Takes the canary's vector out of a lease's output (where it was put), leaving the clients'.
/// A lease that carried a canary and came back with anything but one vector per text sent is
/// refused whole (an answer that dropped one would otherwise skip the check, and its vectors
/// could be shifted onto the wrong texts).
fn take_canary(
    lease: &Lease,
    output: WorkOutput,
) -> Result<(WorkOutput, Option<CanaryVector>), String> {
    match (lease.canary, output) {
        (None, output) => Ok((output, None)),
        (Some(c), WorkOutput::Embeddings(mut v))
            if v.len() == lease.items.len() + 1 && c.position < v.len() =>
        {
            let vector = v.remove(c.position);
            Ok((WorkOutput::Embeddings(v), Some((c, vector))))
        }
        (Some(_), output) => Err(format!(
            "done has {} outputs for {} texts sent (a canary among them); the items were requeued",
            output.len(),
            lease.items.len() + 1
        )),
    }
}

/// The canary's share of a frame's tokens, by the hub's estimate of each text's length capped
/// at the provider's longest input (an agent reports one count per frame); never counted in
/// a client's usage.
fn canary_share(lease: &Lease, probe: usize, tokens: u64, max_input: Option<usize>) -> u64 {
    let est = |t: &str| estimate_tokens(t).min(max_input.unwrap_or(usize::MAX)) as u128;
    let own = est(crate::hub::gate::measure::probe_text(probe));
    let all = own + lease.items.iter().map(|i| est(&i.text)).sum::<u128>();
    u64::try_from(u128::from(tokens) * own / all.max(1)).unwrap_or(tokens)
}

fn check_outputs(lease: &Lease, output: WorkOutput) -> Result<Vec<ItemOutput>, String> {
    let n = lease.items.len();
    if output.len() != n {
        return Err(format!(
            "done has {} outputs for {n} items; the items were requeued",
            output.len()
        ));
    }
    let shape = lease.items.first().map(|i| &*i.shape);
    match (output, shape) {
        (WorkOutput::Embeddings(v), Some(Shape::Embed { dimensions, .. })) => {
            if v.iter().flatten().any(|x| !x.is_finite()) {
                return Err("done carries a non-finite number; the items were requeued".into());
            }
            // A gated lease's vectors have the space's width (or the width the client asked).
            if let Some((_, space)) = &lease.gate {
                let want = dimensions.map_or(space.dims, |d| d.min(space.dims));
                if let Some(bad) = v.iter().find(|x| x.len() != want) {
                    return Err(format!(
                        "done carries a vector of {} dims where the space {} wants {want}; the items were requeued",
                        bad.len(),
                        space.id
                    ));
                }
            }
            Ok(v.into_iter().map(ItemOutput::Vector).collect())
        }
        (WorkOutput::Scores(s), Some(Shape::Rerank { .. })) => {
            if s.iter()
                .any(|x| !x.score.is_finite() || x.probability.is_some_and(|p| !p.is_finite()))
            {
                return Err("done carries a non-finite score; the items were requeued".into());
            }
            Ok(s.into_iter().map(ItemOutput::Score).collect())
        }
        (WorkOutput::Chat(c), Some(Shape::Chat { .. })) => Ok(vec![ItemOutput::Chat(c)]),
        _ => {
            Err("done carries the wrong kind of output for its op; the items were requeued".into())
        }
    }
}
