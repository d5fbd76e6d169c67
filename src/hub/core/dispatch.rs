//! The dispatcher: forms work frames for providers that asked for work (credits), while their
//! role's queue has items they may serve.
//!
//! Who may take an item: a provider of its role with credits, not benched or paused, not
//! refused; allowed by the role's policy (`backup` sends the cloud only what no healthy local
//! provider of the item's binding can take, or what failed locally); of the item's binding
//! (passing its request's space, or of its request's scorer); and, for the cloud, holding a
//! permit of the global budget. Providers are tried most credits first, ties round the fleet
//! in turn; each takes the first items that fit it, so a request waiting for its own scorer
//! never holds up the others. A gated embedding frame of documents also carries a canary, one
//! of the gate's probe texts at a random place (it takes one of the frame's item places).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::binding::Binding;
use super::{Canary, Core, Counters, Lease};
use crate::hub::budget;
use crate::hub::gate;
use crate::hub::policy::{self, Admission};
use crate::hub::queue::{BatchLimits, Frame, Item, Shape};
use crate::hub::registry::ProviderEntry;
use crate::metrics::histogram;
use crate::protocol::{self, Backend, HubFrame, Work};
use crate::roles::{Policy, Role};

/// What one provider was offered.
enum Offer {
    Granted,
    /// No item in reach fits it.
    Nothing,
}

impl Core {
    /// Settles the fleet after a change: fails or re-binds what nothing can serve any more,
    /// then dispatches every role; waiting admissions are woken.
    pub fn dispatch_all(&mut self) {
        self.reconcile(Instant::now());
        for role in Role::ALL {
            self.dispatch(role);
        }
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Forms work for providers of `role` that have credits, while the queue has items.
    pub(super) fn dispatch(&mut self, role: Role) {
        // The role's policy, and those of its other live spaces (a migration's next, the
        // previous one): each item is held to its own space's in `offer`.
        let policy = self.cloud.policy(role);
        let backends = self.backends_of(role);
        // Offered this round with nothing that fits them: not asked again (the queue only
        // shrinks, and a binding only narrows who may take an item).
        let mut passed: Vec<(String, String)> = Vec::new();
        if self.purge.remove(&role) {
            let requests = &self.requests;
            if let Some(q) = self.queues.get_mut(&role) {
                q.retain_live(|r| requests.contains_key(&r));
            }
        }
        loop {
            let now = Instant::now();
            if self.queues.get(&role).is_none_or(|q| q.is_empty()) {
                return;
            }
            let Some((agent, pid)) = self.best_pick(role, backends, now, &passed) else {
                return;
            };
            if let Offer::Nothing = self.offer(role, policy, &agent, &pid, now) {
                passed.push((agent, pid));
            }
        }
    }

    /// The provider of `role` that should take work next: most credits, ties in turn round the
    /// fleet; one that could take work now (credits, not benched or paused, not refused, its
    /// policy, a budget permit for the cloud), and not in `passed`.
    fn best_pick(
        &mut self,
        role: Role,
        backends: Backends,
        now: Instant,
        passed: &[(String, String)],
    ) -> Option<(String, String)> {
        let mut best: Option<(u32, usize, &str, &str)> = None;
        let mut k = 0usize;
        for (agent_id, agent) in &self.agents {
            for (pid, p) in &agent.providers {
                k += 1;
                if p.role() != role || p.credits == 0 || !p.is_available(now) {
                    continue;
                }
                if !backends.allow(p.info.backend) || p.refused.is_some() || p.stale.is_some() {
                    continue;
                }
                let rank = k.wrapping_sub(self.turn) % 1024;
                let better =
                    best.is_none_or(|(c, r, _, _)| p.credits > c || (p.credits == c && rank < r));
                if !better || passed.iter().any(|(a, q)| a == agent_id && q == pid) {
                    continue;
                }
                // Cloud providers also need a permit of the global budget, and leave one a
                // waiting gate probe claimed to it.
                if let Some(route) = &p.route
                    && (self.fence.check(now).is_err()
                        || self.probe_permits.claims(route, now)
                        || self.budget.check(route, now).is_some())
                {
                    continue;
                }
                best = Some((p.credits, rank, agent_id, pid));
            }
        }
        best.map(|(_, _, a, p)| (a.to_string(), p.to_string()))
    }

    /// Offers `agent/pid` the first items that fit it; grants a lease when some do.
    fn offer(
        &mut self,
        role: Role,
        policy: Policy,
        agent_id: &str,
        pid: &str,
        now: Instant,
    ) -> Offer {
        let closed = match self.agents.get(agent_id) {
            Some(a) => a.tx.is_closed(),
            None => return Offer::Nothing,
        };
        if closed {
            // The socket is going away; its disconnect will clean up the session.
            if let Some(p) = self
                .agents
                .get_mut(agent_id)
                .and_then(|a| a.providers.get_mut(pid))
            {
                p.credits = 0;
            }
            return Offer::Nothing;
        }
        // Cloud permits: who may take one (per project, decided once per offer).
        let is_cloud = self
            .agents
            .get(agent_id)
            .and_then(|a| a.providers.get(pid))
            .is_some_and(|p| p.info.backend == Backend::Cloud);
        let mut cloud_ok: HashMap<Arc<str>, bool> = HashMap::new();
        if is_cloud {
            let share = self.cloud_share();
            for project in share.waiting.keys() {
                let ok = self.cloud_allows(project, &share);
                cloud_ok.insert(project.clone(), ok);
            }
        }
        let reserve = self.settings.interactive_reserve;
        let Core {
            agents,
            queues,
            requests,
            gate,
            ..
        } = self;
        let (agents, requests, gate) = (&*agents, &*requests, &*gate);
        let Some(entry) = agents.get(agent_id).and_then(|a| a.providers.get(pid)) else {
            return Offer::Nothing;
        };
        let Some(queue) = queues.get_mut(&role) else {
            return Offer::Nothing;
        };
        // A canary takes one place in an embedding provider's work frame.
        let canary_room = usize::from(
            entry
                .gate_candidate
                .as_ref()
                .is_some_and(|c| gate.carries_canary(c)),
        );
        let limits = BatchLimits {
            max_items: entry
                .info
                .max_batch_items
                .saturating_sub(canary_room)
                .max(1),
            max_tokens: entry.info.max_batch_tokens.max(1),
        };
        // A local provider keeps its last credit for interactive work while it has work in
        // flight: batch work queued ahead on the agent is bounded to what it runs now, so a
        // query waits at most for the engine batch under way (see docs/operations.md).
        let keep_for_interactive = reserve && entry.keeps_credit_for_interactive();
        let mut local_serves: HashMap<String, bool> = HashMap::new();
        let mut batch_space: Option<String> = None;
        let mut last_space: Option<(*const super::SpaceRef, bool)> = None;
        let fits = |item: &Item| {
            if is_cloud && !cloud_ok.get(&item.caller.project).copied().unwrap_or(true) {
                return false;
            }
            let Some(req) = requests.get(&item.request) else {
                return false;
            };
            // One work frame, one space.
            if let (Binding::Space(s), Some(first)) = (&req.binding, &batch_space)
                && s.id != *first
            {
                return false;
            }
            // Items of one request share its space: its verdict is looked up once.
            let admits = match &req.binding {
                Binding::Space(space) => match last_space {
                    Some((at, ok)) if std::ptr::eq(at, Arc::as_ptr(space)) => ok,
                    _ => {
                        let ok = req.binding.admits(entry, gate);
                        last_space = Some((Arc::as_ptr(space), ok));
                        ok
                    }
                },
                other => other.admits(entry, gate),
            };
            if !admits {
                return false;
            }
            // Who may serve it: its space's policy (a migration's next or the previous space
            // has its own), else the role's.
            let policy = match &req.binding {
                Binding::Space(s) => gate.space_policy(role, &s.id).unwrap_or(policy),
                _ => policy,
            };
            if !policy::allows(policy, entry.info.backend) {
                return false;
            }
            let admitted = match (policy, entry.info.backend) {
                (Policy::Backup, Backend::Cloud) => {
                    item.failed_locally
                        || matches!(&req.binding, Binding::Scorer(Some(x)) if x.origin.backend == Backend::Cloud)
                        || {
                            let healthy_local =
                                *local_serves.entry(req.binding.key()).or_insert_with(|| {
                                    healthy_local(agents, role, &req.binding, gate, now)
                                });
                            policy::admit(policy, Backend::Cloud, healthy_local) == Admission::Serve
                        }
                }
                _ => true,
            };
            if admitted
                && batch_space.is_none()
                && let Binding::Space(s) = &req.binding
            {
                batch_space = Some(s.id.clone());
            }
            admitted
        };
        let Some(frame) = queue.take_frame(
            limits,
            |r| requests.contains_key(&r),
            fits,
            keep_for_interactive,
        ) else {
            return Offer::Nothing;
        };
        if frame.items.is_empty() {
            return Offer::Nothing;
        }
        self.grant(role, agent_id, pid, frame, now);
        Offer::Granted
    }

    /// Sends a frame's items to `agent_id/pid` as one lease, of the class the queue gave it
    /// (the first lease of a rerank request binds it to this provider's scorer).
    fn grant(&mut self, role: Role, agent_id: &str, pid: &str, frame: Frame, now: Instant) {
        let Frame { items, class } = frame;
        let Some((agent, entry)) = self
            .agents
            .get(agent_id)
            .and_then(|a| Some((a, a.providers.get(pid)?)))
        else {
            self.requeue(role, items, false, "the provider left");
            return;
        };
        let (reference, permit, scorer, max_input) = (
            entry.reference.clone(),
            entry.route.clone(),
            entry.scorer.clone(),
            entry.info.max_input_tokens,
        );
        // A cloud lease remembers the key generation it was granted under.
        let key_generation = permit
            .as_ref()
            .and_then(|_| agent.held.key_generation.clone());
        let gate = self.lease_space(entry, &items);
        let Some((shape, caller)) = items.first().map(|i| (i.shape.clone(), i.caller.clone()))
        else {
            return;
        };
        // A gated embedding frame of documents carries a canary (a query template changes the
        // text, so its vector has nothing to be compared with), at full width and at every
        // Matryoshka width from `MIN_CANARY_DIMS` up (judged on the fingerprint's first
        // entries); narrower frames are watched by the sentinel alone.
        let wants_canary = gate.as_ref().is_some_and(|(_, space)| {
            matches!(
                &*shape,
                Shape::Embed {
                    is_query: false,
                    instruction: None,
                    dimensions,
                } if dimensions.is_none_or(|d| d >= space.dims.min(gate::measure::MIN_CANARY_DIMS))
            )
        }) && entry
            .gate_candidate
            .as_ref()
            .is_some_and(|c| self.gate.carries_canary(c));
        // The permit last, once there is work to hold it (the check in `best_pick` passed).
        if let Some(route) = &permit
            && (self.fence.check(now).is_err() || !self.budget.try_acquire(route, now))
        {
            self.requeue(role, items, false, "no budget permit");
            return;
        }
        let lease_id = self.next_lease;
        self.next_lease += 1;
        let timings = self.settings.timings(role);
        let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let mut texts: Vec<String> = items.iter().map(|i| i.text.clone()).collect();
        // The next probe text in turn that reaches this provider whole.
        let count = gate::measure::probe_count().max(1);
        let canary_probe = (0..count)
            .map(|k| self.next_canary.wrapping_add(k) % count)
            .find(|&i| gate::measure::fits_whole(i, max_input));
        let canary = canary_probe.filter(|_| wants_canary).map(|probe| {
            self.next_canary = probe.wrapping_add(1);
            let position = rand::random_range(0..=texts.len());
            texts.insert(position, gate::measure::probe_text(probe).to_string());
            Canary { probe, position }
        });
        // The trace contexts of the requests it serves (each once): the agent's spans link to them.
        let mut traces: Vec<String> = Vec::new();
        for item in &items {
            let Some(tp) = self
                .requests
                .get(&item.request)
                .and_then(|r| r.traceparent.as_deref())
            else {
                continue;
            };
            if traces.len() < crate::traces::MAX_FRAME_TRACES && !traces.iter().any(|t| t == tp) {
                traces.push(tp.to_string());
            }
        }
        let frame = HubFrame::Work(Work {
            lease: lease_id,
            traces,
            provider: pid.to_string(),
            role,
            input: shape.work_input(texts),
            deadline_ms: crate::hub::now_ms().saturating_add(ms(timings.lease)),
            call_timeout_ms: Some(ms(timings.call_timeout)),
            class,
            idempotency: shape.idempotency().cloned(),
        });
        let keeps_answer = shape.idempotency().is_some()
            && self.agents.get(agent_id).is_some_and(|a| a.keeps_answers);
        let (session, sent) = match self.agents.get(agent_id) {
            Some(a) => (a.session, a.send(protocol::encode(&frame))),
            None => (0, false),
        };
        let provider = self
            .agents
            .get_mut(agent_id)
            .and_then(|a| a.providers.get_mut(pid));
        if !sent {
            // The socket is going away; its disconnect will clean up the session.
            if let Some(p) = provider {
                p.credits = 0;
            }
            if let Some(route) = &permit {
                self.budget.release(route, budget::Outcome::Other, now);
            }
            self.requeue(role, items, false, "the socket is closing");
            return;
        }
        if let Some(p) = provider {
            p.credits = p.credits.saturating_sub(1);
            p.lease_granted(class);
        }
        self.turn = self.turn.wrapping_add(1);
        self.counters.leases_granted += 1;
        if permit.is_some() {
            let usage = self
                .projects
                .usage
                .entry(caller.project.clone())
                .or_default();
            usage.cloud_in_flight = usage.cloud_in_flight.saturating_add(1);
        }
        if canary.is_some() {
            *self
                .counters
                .canary_texts
                .entry(reference.provider.clone())
                .or_default() += 1;
        }
        Counters::observe(
            &mut self.counters.batch_items,
            role,
            histogram::COUNTS,
            items.len() as f64,
        );
        for item in &items {
            if let Some(req) = self.requests.get_mut(&item.request)
                && req.first_lease_at.is_none()
            {
                req.first_lease_at = Some(now);
                let waited = now.saturating_duration_since(req.accepted_at);
                Counters::observe(
                    &mut self.counters.queue_seconds,
                    role,
                    histogram::SECONDS,
                    waited.as_secs_f64(),
                );
                self.counters
                    .recent_waits_ms
                    .entry(role)
                    .or_default()
                    .observe(now, waited.as_secs_f64() * 1000.0);
                if let Some(usage) = self.projects.usage.get_mut(&req.caller.project) {
                    usage.queue_seconds.observe(waited.as_secs_f64());
                }
            }
        }
        if let Some(scorer) = &scorer {
            for item in &items {
                if let Some(req) = self.requests.get_mut(&item.request)
                    && let Binding::Scorer(bound @ None) = &mut req.binding
                {
                    *bound = Some(scorer.clone());
                }
            }
        }
        self.leases.insert(
            lease_id,
            Lease {
                project: caller.project.clone(),
                flow: caller.clone(),
                class,
                agent: agent_id.to_string(),
                session,
                provider: pid.to_string(),
                reference,
                permit,
                key_generation,
                gate,
                scorer,
                role,
                items,
                deadline: now + timings.lease,
                canary,
                keeps_answer,
            },
        );
    }

    /// Which backends any of `role`'s policies (the role's, its other live spaces') lets serve
    /// it.
    pub(super) fn backends_of(&self, role: Role) -> Backends {
        let mut policies = vec![self.cloud.policy(role)];
        if let Some(l) = self.gate.live().get(&role) {
            policies.extend(l.next.as_ref().map(|m| m.policy));
            policies.extend(l.previous.as_ref().map(|p| p.policy));
        }
        let any = |b| policies.iter().any(|p| policy::allows(*p, b));
        Backends {
            local: any(Backend::Local),
            cloud: any(Backend::Cloud),
        }
    }

    /// Who may serve items of `binding`: its space's own policy (a migration's next space,
    /// the previous one), else the role's.
    pub(super) fn policy_for(&self, role: Role, binding: &Binding) -> Policy {
        match binding {
            Binding::Space(s) => self
                .gate
                .space_policy(role, &s.id)
                .unwrap_or_else(|| self.cloud.policy(role)),
            _ => self.cloud.policy(role),
        }
    }

    /// The verdict and space an embedding lease is granted under: its requests' space.
    fn lease_space(
        &self,
        entry: &ProviderEntry,
        items: &[Item],
    ) -> Option<(String, Arc<super::SpaceRef>)> {
        let c = entry.gate_candidate.as_ref()?;
        let req = self.requests.get(&items.first()?.request)?;
        match &req.binding {
            Binding::Space(s) => Some((gate::verdict_key(c, &s.id), s.clone())),
            _ => None,
        }
    }
}

/// Which backends may serve a role in at least one of its live spaces.
#[derive(Clone, Copy, Debug)]
pub(super) struct Backends {
    pub local: bool,
    pub cloud: bool,
}

impl Backends {
    pub fn allow(self, backend: Backend) -> bool {
        match backend {
            Backend::Local => self.local,
            Backend::Cloud => self.cloud,
        }
    }
}

/// Whether a healthy local provider of `role` could take items of `binding` (under `backup`
/// the cloud waits for it).
fn healthy_local(
    agents: &std::collections::BTreeMap<String, crate::hub::registry::AgentEntry>,
    role: Role,
    binding: &Binding,
    gate: &gate::Gate,
    now: Instant,
) -> bool {
    agents.values().flat_map(|a| a.providers.values()).any(|p| {
        p.role() == role
            && p.info.backend == Backend::Local
            && p.is_healthy(now)
            && p.refused.is_none()
            && binding.admits(p, gate)
    })
}
