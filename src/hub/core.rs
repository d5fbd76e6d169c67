//! The hub's state machine: accepted requests, their items in the role queues, leases out to
//! providers, and the dispatcher that forms work for pullers. One mutex guards it all; every
//! operation is short (no I/O: frames go to per-socket channels).
//!
//! Invariants: an accepted item is always in exactly one place (its queue, or one live
//! lease) until its request completes or fails; a result counts only for an item that has
//! none yet (the first completion wins); a lease that comes back (expiry, disconnect,
//! transient failure) returns its items to the front of their queue.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::budget::{self, Budget, BudgetSettings};
use super::gate::{self, Candidate, Gate, GateSettings, Space};
use super::policy::{self, Admission};
use super::queue::{BatchLimits, Item, RequestId, RoleQueue, Shape};
use super::registry::{AgentEntry, AgentTx, Outgoing, ProviderEntry, ProviderRef, SocketCount};
use crate::config::push::CloudSettings;
use crate::protocol::{
    self, AccountLimits, Backend, ConfigAck, Done, Failed, FailureClass, Heartbeat, Hello,
    HubFrame, PROTOCOL_VERSION, ProviderInfo, Score, Welcome, Work, WorkOutput,
};
use crate::roles::Role;

/// Hub behaviour settings.
#[derive(Clone, Debug)]
pub struct HubSettings {
    /// A lease not done by then goes back to the front of its queue.
    pub lease: Duration,
    pub heartbeat_interval: Duration,
    /// Items per role queue; beyond it clients get 429.
    pub queue_capacity: usize,
    /// Leases an item may go through without a result before its request fails.
    pub max_attempts: u32,
    /// How long two consecutive failures bench a provider.
    pub bench: Duration,
    /// Largest frame with vectors.
    pub max_frame_bytes: usize,
    /// How long a client request may wait for all its items.
    pub request_timeout: Duration,
}

impl Default for HubSettings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(120),
            heartbeat_interval: Duration::from_secs(5),
            queue_capacity: 100_000,
            max_attempts: 5,
            bench: Duration::from_secs(30),
            max_frame_bytes: protocol::codec::DEFAULT_MAX_FRAME_BYTES,
            request_timeout: Duration::from_secs(600),
        }
    }
}

/// One item's result.
#[derive(Clone, Debug)]
pub enum ItemOutput {
    Vector(Vec<f32>),
    Score(Score),
    /// A chat completion object, as the upstream returned it.
    Chat(serde_json::Value),
}

#[derive(Clone, Debug)]
pub struct Served {
    pub output: ItemOutput,
    pub provider: Arc<ProviderRef>,
    /// The vector space an embedding belongs to (its provider passed the gate for it).
    pub space: Option<Arc<SpaceRef>>,
}

/// A vector's space, as its provenance names it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SpaceRef {
    pub id: String,
    pub role: Role,
    pub model: String,
    pub dims: usize,
}

/// A request's results, in input order.
#[derive(Debug)]
pub struct Completed {
    pub items: Vec<Served>,
    pub tokens: u64,
}

/// Why an accepted request failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RequestFailure {
    /// A provider said no one can serve this input.
    #[error("{provider} cannot serve this input: {message}")]
    Fatal { provider: String, message: String },
    #[error("an item went through {attempts} leases without a result (last: {last})")]
    TooManyAttempts { attempts: u32, last: String },
    #[error("the hub is shutting down")]
    Stopped,
}

/// Why a request was not accepted.
#[derive(Clone, Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("no provider serves role '{role}' under policy '{policy}'")]
    NoProvider {
        role: Role,
        policy: crate::roles::Policy,
    },
    /// Only the cloud could serve the role, and a hard 402 stopped cloud work.
    #[error("only cloud routes serve role '{role}', and cloud work is stopped: {reason}")]
    CloudStopped { role: Role, reason: String },
    #[error("the {role} queue is full ({depth} items waiting); retry after {retry_after_s} s")]
    QueueFull {
        role: Role,
        depth: usize,
        retry_after_s: u64,
    },
    #[error("{items} items is more than the {role} queue holds ({capacity}); split the request")]
    TooLarge {
        role: Role,
        items: usize,
        capacity: usize,
    },
}

type Reply = oneshot::Sender<Result<Completed, RequestFailure>>;

struct Pending {
    outputs: Vec<Option<Served>>,
    /// For a gated result: the verdict it was made under and its item, so a verdict that
    /// stops passing before the request completes sends the item round again.
    gated: Vec<Option<(String, Item)>>,
    remaining: usize,
    tokens: u64,
    reply: Reply,
}

struct Lease {
    agent: String,
    session: u64,
    provider: String,
    /// Who serves it (kept here: the provider may leave the set while the lease runs).
    reference: Arc<ProviderRef>,
    /// The budget route a cloud lease holds a permit of.
    permit: Option<String>,
    /// The gate verdict an embedding lease was granted under, and its space.
    gate: Option<(String, Arc<SpaceRef>)>,
    role: Role,
    items: Vec<Item>,
    deadline: Instant,
}

/// Counters for `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub requests: BTreeMap<Role, u64>,
    pub items_accepted: BTreeMap<Role, u64>,
    pub items_served: BTreeMap<Role, u64>,
    pub rejected_full: BTreeMap<Role, u64>,
    pub leases_granted: u64,
    pub leases_expired: u64,
    pub leases_lost: u64,
    pub failures: BTreeMap<&'static str, u64>,
    pub late_results: u64,
    pub requests_failed: u64,
}

pub struct Core {
    pub settings: HubSettings,
    pub cloud: CloudSettings,
    pub counters: Counters,
    /// The global cloud budget: permits for cloud leases.
    pub budget: Budget,
    /// The compatibility gate: verdicts of embedding providers.
    pub gate: Gate,
    queues: BTreeMap<Role, RoleQueue>,
    requests: HashMap<RequestId, Pending>,
    leases: HashMap<u64, Lease>,
    agents: BTreeMap<String, AgentEntry>,
    sockets: BTreeMap<String, SocketCount>,
    next_request: RequestId,
    next_lease: u64,
    next_session: u64,
    turn: usize,
}

fn failure_name(class: FailureClass) -> &'static str {
    match class {
        FailureClass::RateLimited => "rate_limited",
        FailureClass::Transient => "transient",
        FailureClass::Fatal => "fatal",
        FailureClass::Refused => "refused",
    }
}

impl Core {
    pub fn new(settings: HubSettings, cloud: CloudSettings) -> Self {
        Self::with_gate(settings, cloud, GateSettings::default(), BTreeMap::new())
    }

    pub fn with_gate(
        settings: HubSettings,
        cloud: CloudSettings,
        gate: GateSettings,
        spaces: BTreeMap<String, Space>,
    ) -> Self {
        let queues = Role::ALL
            .into_iter()
            .map(|r| (r, RoleQueue::new(settings.queue_capacity)))
            .collect();
        Self {
            settings,
            cloud,
            counters: Counters::default(),
            budget: Budget::new(BudgetSettings::default(), rand::random(), Instant::now()),
            gate: Gate::new(gate, spaces),
            queues,
            requests: HashMap::new(),
            leases: HashMap::new(),
            agents: BTreeMap::new(),
            sockets: BTreeMap::new(),
            next_request: 1,
            next_lease: 1,
            next_session: 1,
            turn: 0,
        }
    }

    // ---- clients ------------------------------------------------------------------------

    /// Accepts a request of `texts` (one item each) for `role`, or says why not.
    pub fn submit(
        &mut self,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
    ) -> Result<
        (
            RequestId,
            oneshot::Receiver<Result<Completed, RequestFailure>>,
        ),
        SubmitError,
    > {
        let policy = self.cloud.policy(role);
        if !self.role_has_provider(role) {
            return Err(SubmitError::NoProvider { role, policy });
        }
        if let Some(reason) = self.budget.stopped()
            && !self.role_has_local_provider(role)
        {
            return Err(SubmitError::CloudStopped {
                role,
                reason: reason.to_string(),
            });
        }
        let n = texts.len();
        let queue = &self.queues[&role];
        if n > queue.capacity() {
            return Err(SubmitError::TooLarge {
                role,
                items: n,
                capacity: queue.capacity(),
            });
        }
        if !queue.has_room(n) {
            *self.counters.rejected_full.entry(role).or_default() += 1;
            return Err(SubmitError::QueueFull {
                role,
                depth: queue.len(),
                retry_after_s: self.retry_after_s(role),
            });
        }
        let id = self.next_request;
        self.next_request += 1;
        let (reply, rx) = oneshot::channel();
        self.requests.insert(
            id,
            Pending {
                outputs: vec![None; n],
                gated: std::iter::repeat_with(|| None).take(n).collect(),
                remaining: n,
                tokens: 0,
                reply,
            },
        );
        let shape = Arc::new(shape);
        let items = texts.into_iter().enumerate().map(|(index, text)| Item {
            request: id,
            index: index as u32,
            text,
            shape: shape.clone(),
            attempts: 0,
            solo: false,
            failed_locally: false,
        });
        if let Some(q) = self.queues.get_mut(&role) {
            q.push_back(items);
        }
        *self.counters.requests.entry(role).or_default() += 1;
        *self.counters.items_accepted.entry(role).or_default() += n as u64;
        self.dispatch(role);
        Ok((id, rx))
    }

    /// Forgets a request (its client timed out or went away); its items die where they are.
    pub fn cancel_request(&mut self, id: RequestId) {
        if self.requests.remove(&id).is_some() {
            // Its waiting items leave the queue: they must not hold room others could use.
            for q in self.queues.values_mut() {
                q.remove_request(id);
            }
        }
    }

    /// Whether a connected provider could ever take `role`'s work under its policy.
    fn role_has_provider(&self, role: Role) -> bool {
        let policy = self.cloud.policy(role);
        // Whether anything could ever serve it: a backup cloud provider counts.
        let healthy_local = false;
        self.providers().any(|p| {
            p.role() == role
                && policy::admit(policy, p.info.backend, healthy_local) == Admission::Serve
        })
    }

    /// Whether a connected local provider could take `role`'s work under its policy.
    fn role_has_local_provider(&self, role: Role) -> bool {
        let policy = self.cloud.policy(role);
        self.providers().any(|p| {
            p.role() == role
                && p.info.backend == Backend::Local
                && policy::admit(policy, Backend::Local, true) == Admission::Serve
        })
    }

    /// A retry hint: seconds to drain the queue at the served rate, 1..=60.
    fn retry_after_s(&self, role: Role) -> u64 {
        let (mut items_per_s, depth) = (0.0, self.queues[&role].len() as f64);
        for p in self.providers().filter(|p| p.role() == role) {
            if let Some(ms) = p.latency_ewma_ms {
                items_per_s += p.info.max_batch_items as f64 * 1000.0 / ms.max(1.0);
            }
        }
        if items_per_s <= 0.0 {
            return 1;
        }
        ((depth / items_per_s).ceil() as u64).clamp(1, 60)
    }

    fn providers(&self) -> impl Iterator<Item = &ProviderEntry> {
        self.agents.values().flat_map(|a| a.providers.values())
    }

    // ---- agents ---------------------------------------------------------------------------

    /// Registers an agent's session (superseding an older one of the same id) and sends
    /// `welcome` before anything else can reach the socket.
    pub fn hello(&mut self, hello: Hello, tx: AgentTx) -> Result<u64, String> {
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(format!(
                "protocol version {} is not spoken here (this hub speaks {PROTOCOL_VERSION})",
                hello.protocol_version
            ));
        }
        if hello.agent_id.trim().is_empty() {
            return Err("hello needs a non-empty agent_id".into());
        }
        if hello.agent_id.contains(['/', '|']) {
            return Err(
                "an agent_id may not contain '/' or '|' (they separate provider names)".into(),
            );
        }
        let providers = build_providers(&hello.agent_id, hello.providers)?;
        if let Some(old) = self.agents.remove(&hello.agent_id) {
            tracing::info!(agent = %hello.agent_id, old_session = old.session, "superseding the older session of this agent");
            let _ = old
                .tx
                .send(Outgoing::Close("superseded by a newer session".into()));
            self.requeue_session_leases(&hello.agent_id, old.session);
        }
        self.gate.agent_reconnected(&hello.agent_id);
        let session = self.next_session;
        self.next_session += 1;
        let welcome = HubFrame::Welcome(Welcome {
            session,
            protocol_version: PROTOCOL_VERSION,
            heartbeat_interval_ms: self.settings.heartbeat_interval.as_millis() as u64,
            lease_ms: self.settings.lease.as_millis() as u64,
        });
        let _ = tx.send(Outgoing::Frame(protocol::encode(&welcome)));
        let count = self.sockets.entry(hello.agent_id.clone()).or_default();
        count.open += 1;
        count.total += 1;
        count.max_concurrent = count.max_concurrent.max(count.open);
        self.agents.insert(
            hello.agent_id.clone(),
            AgentEntry {
                session,
                hostname: hello.hostname,
                version: hello.version,
                connected_at: Instant::now(),
                tx,
                providers,
                devices: hello.devices,
                last_config_ack: None,
            },
        );
        self.gate_tick(Instant::now());
        self.dispatch_all();
        Ok(session)
    }

    /// A socket that said hello has ended. Only its own session is removed: a close on an
    /// old socket never tears down a newer one.
    pub fn disconnect(&mut self, agent: &str, session: u64) {
        if let Some(count) = self.sockets.get_mut(agent) {
            count.open = count.open.saturating_sub(1);
        }
        if self.agents.get(agent).is_some_and(|a| a.session == session) {
            self.agents.remove(agent);
            tracing::info!(agent, session, "agent disconnected");
        }
        self.requeue_session_leases(agent, session);
    }

    fn requeue_session_leases(&mut self, agent: &str, session: u64) {
        let lost: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.agent == agent && l.session == session)
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            if let Some(lease) = self.leases.remove(&id) {
                self.counters.leases_lost += 1;
                self.release_permit(&lease, budget::Outcome::Other);
                let role = lease.role;
                let local = lease.reference.backend == Backend::Local;
                let items = mark_failed_locally(lease.items, local);
                self.requeue(role, items, true, "the agent disconnected");
                self.dispatch(role);
            }
        }
    }

    fn session_agent(&mut self, agent: &str, session: u64) -> Result<&mut AgentEntry, String> {
        match self.agents.get_mut(agent) {
            Some(a) if a.session == session => Ok(a),
            _ => Err("this session was superseded or closed".into()),
        }
    }

    pub fn set_providers(
        &mut self,
        agent: &str,
        session: u64,
        infos: Vec<ProviderInfo>,
    ) -> Result<(), String> {
        let mut next = build_providers(agent, infos)?;
        let entry = self.session_agent(agent, session)?;
        for (id, p) in next.iter_mut() {
            if let Some(old) = entry.providers.remove(id)
                && old.info == p.info
            {
                *p = old;
            }
        }
        entry.providers = next;
        self.gate_tick(Instant::now());
        self.dispatch_all();
        Ok(())
    }

    pub fn pull(
        &mut self,
        agent: &str,
        session: u64,
        provider: &str,
        credits: u32,
    ) -> Result<(), String> {
        let entry = self.session_agent(agent, session)?;
        let Some(p) = entry.providers.get_mut(provider) else {
            return Err(format!("pull for unknown provider '{provider}'"));
        };
        p.credits = p.credits.saturating_add(credits).min(1024);
        let role = p.role();
        self.dispatch(role);
        Ok(())
    }

    pub fn heartbeat(&mut self, agent: &str, session: u64, hb: Heartbeat) -> Result<(), String> {
        let entry = self.session_agent(agent, session)?;
        entry.devices = hb.devices;
        for stats in hb.providers {
            if let Some(p) = entry.providers.get_mut(&stats.provider) {
                p.heartbeat = Some(stats);
            }
        }
        Ok(())
    }

    pub fn config_ack(&mut self, agent: &str, session: u64, ack: ConfigAck) -> Result<(), String> {
        self.session_agent(agent, session)?.last_config_ack = Some(ack);
        Ok(())
    }

    /// An agent's answer to `discover`.
    pub fn account_limits(
        &mut self,
        agent: &str,
        session: u64,
        limits: AccountLimits,
    ) -> Result<(), String> {
        self.session_agent(agent, session)?;
        tracing::info!(agent, rpm = ?limits.rpm, funded = ?limits.funded, error = ?limits.error, "account limits discovered");
        self.budget.set_account(limits, Instant::now());
        self.dispatch_all();
        Ok(())
    }

    /// Asks one agent that holds cloud routes for the account's limits, when due (every 10
    /// minutes; at once after a new key).
    pub fn discover_if_due(&mut self, now: Instant) {
        let Some(agent) = self
            .agents
            .values()
            .find(|a| a.providers.values().any(|p| p.route.is_some()))
        else {
            return;
        };
        if self.budget.take_discovery_due(now) {
            agent.send(protocol::encode(&HubFrame::Discover));
        }
    }

    /// The gate's round: probes to send (new providers, retries, the sentinel), sent now.
    pub fn gate_tick(&mut self, now: Instant) {
        let candidates: Vec<Candidate> = self
            .agents
            .values()
            .flat_map(|a| a.providers.values())
            .filter_map(|p| {
                let mut c = p.gate_candidate.clone()?;
                c.healthy = p.is_healthy(now);
                Some(c)
            })
            .collect();
        let cloud = &self.cloud;
        let requests = self.gate.tick(
            now,
            &candidates,
            |r| cloud.policy(r),
            |r| cloud.allowed_models.get(&r).and_then(|m| m.dims),
        );
        for r in requests {
            let sent = r.provider.split_once('/').and_then(|(agent, pid)| {
                let a = self.agents.get(agent)?;
                a.send(protocol::encode(&HubFrame::Probe(protocol::Probe {
                    probe: r.probe.clone(),
                    provider: pid.to_string(),
                    texts: r.texts,
                })))
                .then_some(())
            });
            if sent.is_none() {
                self.gate
                    .on_result(&r.probe, Err("the agent is gone".into()), now);
            }
        }
    }

    /// An agent's answer to a `probe`.
    pub fn probe_result(
        &mut self,
        agent: &str,
        session: u64,
        result: protocol::ProbeResult,
    ) -> Result<(), String> {
        self.session_agent(agent, session)?;
        let answer = match (result.vectors, result.error) {
            (Some(v), None) => Ok(v),
            (_, Some(e)) => Err(e),
            (None, None) => Err("probe_result has neither vectors nor error".into()),
        };
        let from = format!("{agent}/{}", result.provider);
        if !self
            .gate
            .on_answer(&result.probe, &from, answer, Instant::now())
        {
            return Err(format!(
                "probe '{}' was not asked of '{}'",
                result.probe, result.provider
            ));
        }
        self.dispatch_all();
        Ok(())
    }

    /// Sends a frame to every connected agent; returns their ids.
    pub fn broadcast(&self, frame: &str) -> Vec<String> {
        self.agents
            .iter()
            .filter(|(_, a)| a.send(frame.to_string()))
            .map(|(id, _)| id.clone())
            .collect()
    }

    // ---- results ---------------------------------------------------------------------------

    /// Takes the lease `id` if it is live and belongs to this session; `None`: a late result.
    fn take_lease(&mut self, agent: &str, session: u64, id: u64) -> Option<Lease> {
        match self.leases.get(&id) {
            Some(l) if l.agent == agent && l.session == session => self.leases.remove(&id),
            _ => {
                self.counters.late_results += 1;
                None
            }
        }
    }

    fn provider_mut(&mut self, lease: &Lease) -> Option<&mut ProviderEntry> {
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
        let outputs = match check_outputs(&lease, done.output) {
            Ok(outputs) => outputs,
            Err(message) => {
                let role = lease.role;
                self.release_permit(&lease, budget::Outcome::Other);
                self.count_failure(&lease, FailureClass::Transient);
                self.requeue(role, lease.items, true, &message);
                self.dispatch(role);
                return Err(message);
            }
        };
        self.release_permit(
            &lease,
            budget::Outcome::Success {
                latency_ms: done.latency_ms,
            },
        );
        if let Some((key, _)) = &lease.gate
            && !self.gate.passes(key)
        {
            // Suspended (drift) or re-checked since: none of its vectors is returned.
            tracing::warn!(
                agent,
                lease = done.lease,
                "results of a provider that no longer passes the gate are dropped; the items go back"
            );
            if let Some(p) = self.provider_mut(&lease) {
                p.in_flight = p.in_flight.saturating_sub(1);
            }
            let role = lease.role;
            self.requeue(
                role,
                lease.items,
                false,
                "the provider no longer passes the gate",
            );
            self.dispatch(role);
            return Ok(());
        }
        // The provider may have left the set while this lease ran; its results still count.
        if let Some(p) = self.provider_mut(&lease) {
            p.in_flight = p.in_flight.saturating_sub(1);
            p.consecutive_failures = 0;
            p.served_items += lease.items.len() as u64;
            p.record_latency(done.latency_ms);
        }
        self.deliver(lease, outputs, done.tokens)
    }

    /// Returns a cloud lease's budget permit (each lease ends exactly once).
    fn release_permit(&mut self, lease: &Lease, outcome: budget::Outcome) {
        if let Some(route) = &lease.permit {
            self.budget.release(route, outcome, Instant::now());
            // A freed permit goes to the other roles first: one role's backlog (and its
            // agents' instant re-pulls) must not starve another role of the shared budget.
            for role in Role::ALL {
                if role != lease.role {
                    self.dispatch(role);
                }
            }
        }
    }

    fn deliver(
        &mut self,
        lease: Lease,
        outputs: Vec<ItemOutput>,
        tokens: u64,
    ) -> Result<(), String> {
        let reference = lease.reference.clone();
        let n = lease.items.len() as u64;
        let space = lease.gate.as_ref().map(|(_, s)| s.clone());
        if let Some(s) = &space {
            self.gate.count_rows(&s.id, &reference.provider, n);
        }
        *self.counters.items_served.entry(lease.role).or_default() += n;
        let verdict = lease.gate.as_ref().map(|(key, _)| key.clone());
        let role = lease.role;
        for (item, output) in lease.items.into_iter().zip(outputs) {
            let request = item.request;
            let Some(pending) = self.requests.get_mut(&request) else {
                continue;
            };
            let index = item.index as usize;
            if pending.outputs[index].is_some() {
                self.counters.late_results += 1;
                continue;
            }
            pending.outputs[index] = Some(Served {
                output,
                provider: reference.clone(),
                space: space.clone(),
            });
            if let Some(key) = &verdict {
                pending.gated[index] = Some((key.clone(), item));
            }
            pending.remaining -= 1;
            pending.tokens += tokens / n.max(1);
            if pending.remaining == 0 {
                self.complete(request, role);
            }
        }
        Ok(())
    }

    /// Answers a request whose every item has a result, unless a result's verdict stopped
    /// passing meanwhile (drift, a re-check): those items go round again first.
    fn complete(&mut self, request: RequestId, role: Role) {
        let gate = &self.gate;
        let Some(pending) = self.requests.get_mut(&request) else {
            return;
        };
        let mut again = Vec::new();
        for (index, slot) in pending.gated.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|(key, _)| !gate.passes(key))
                && let Some((_, item)) = slot.take()
            {
                pending.outputs[index] = None;
                pending.remaining += 1;
                again.push(item);
            }
        }
        if !again.is_empty() {
            tracing::warn!(
                request,
                items = again.len(),
                "results of a provider that no longer passes the gate go round again"
            );
            self.requeue(role, again, false, "the provider no longer passes the gate");
            self.dispatch(role);
            return;
        }
        if let Some(done) = self.requests.remove(&request) {
            let items = done.outputs.into_iter().flatten().collect();
            let _ = done.reply.send(Ok(Completed {
                items,
                tokens: done.tokens,
            }));
        }
    }

    pub fn failed(&mut self, agent: &str, session: u64, failed: Failed) -> Result<(), String> {
        let Some(lease) = self.take_lease(agent, session, failed.lease) else {
            return Ok(());
        };
        let role = lease.role;
        tracing::debug!(agent, lease = failed.lease, class = failure_name(failed.class), message = %failed.message, "lease failed");
        let outcome = match failed.limit {
            Some(kind) => budget::Outcome::Limited {
                kind,
                retry_after: failed
                    .retry_after_ms
                    .map(|ms| Duration::from_millis(ms.min(300_000))),
            },
            None => budget::Outcome::Other,
        };
        self.release_permit(&lease, outcome);
        if failed.limit.is_some() {
            // A limit is the account's or the upstream's, not this provider's fault.
            self.count_failure(&lease, FailureClass::RateLimited);
            self.requeue(role, lease.items, false, &failed.message);
            self.dispatch(role);
            return Ok(());
        }
        self.count_failure(&lease, failed.class);
        let local = lease.reference.backend == Backend::Local;
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
            FailureClass::Fatal => {
                let provider = lease.reference.provider.clone();
                for item in &lease.items {
                    self.fail_request(
                        item.request,
                        RequestFailure::Fatal {
                            provider: provider.clone(),
                            message: failed.message.clone(),
                        },
                    );
                }
            }
            FailureClass::RateLimited => {
                // Clamped: an agent's number must not overflow the clock or park a provider for long.
                let wait =
                    Duration::from_millis(failed.retry_after_ms.unwrap_or(1000).min(300_000));
                if let Some(p) = self.provider_mut(&lease) {
                    p.paused_until = Some(Instant::now() + wait);
                }
                // (Cloud limits name their kind and went to the budget above.)
                self.requeue(role, lease.items, false, &failed.message);
            }
            FailureClass::Transient | FailureClass::Refused => {
                // A cloud route that refuses (bad key, no endpoint for the pin, a bad answer)
                // says nothing about the items: they keep their attempts; the provider is
                // benched after two in a row.
                let count_attempt = local || failed.class == FailureClass::Transient;
                let items = mark_failed_locally(lease.items, local);
                self.requeue(role, items, count_attempt, &failed.message);
            }
        }
        self.dispatch(role);
        Ok(())
    }

    /// Provider bookkeeping of a failed lease (only `transient` and `refused` count against it).
    fn count_failure(&mut self, lease: &Lease, class: FailureClass) {
        *self
            .counters
            .failures
            .entry(failure_name(class))
            .or_default() += 1;
        let bench = self.settings.bench;
        let Some(p) = self.provider_mut(lease) else {
            return;
        };
        p.in_flight = p.in_flight.saturating_sub(1);
        // Throttling is not the provider's fault, and a fatal input would fail anywhere.
        if matches!(class, FailureClass::RateLimited | FailureClass::Fatal) {
            return;
        }
        p.failures += 1;
        p.consecutive_failures += 1;
        if p.consecutive_failures >= 2 {
            p.benched_until = Some(Instant::now() + bench);
            p.consecutive_failures = 0;
            tracing::warn!(provider = %p.reference.provider, bench_s = bench.as_secs(), "two failures in a row: provider benched");
        }
    }

    fn fail_request(&mut self, id: RequestId, failure: RequestFailure) {
        if let Some(pending) = self.requests.remove(&id) {
            self.counters.requests_failed += 1;
            let _ = pending.reply.send(Err(failure));
        }
    }

    /// Items back to the front of their queue; an item out of attempts fails its request.
    fn requeue(&mut self, role: Role, items: Vec<Item>, count_attempt: bool, why: &str) {
        let max = self.settings.max_attempts;
        let mut kept = Vec::with_capacity(items.len());
        for mut item in items {
            if !self.requests.contains_key(&item.request) {
                continue;
            }
            if count_attempt {
                item.attempts += 1;
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

    /// Leases past their deadline go back to the front; their agents are told to stop.
    pub fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let Some(lease) = self.leases.remove(&id) else {
                continue;
            };
            self.counters.leases_expired += 1;
            tracing::warn!(lease = id, agent = %lease.agent, provider = %lease.provider, "lease expired; its items go back to the front");
            if let Some(a) = self
                .agents
                .get(&lease.agent)
                .filter(|a| a.session == lease.session)
            {
                a.send(protocol::encode(&HubFrame::Cancel {
                    lease: id,
                    reason: "the lease expired".into(),
                }));
            }
            self.release_permit(&lease, budget::Outcome::Other);
            self.count_failure(&lease, FailureClass::Transient);
            let role = lease.role;
            let local = lease.reference.backend == Backend::Local;
            let items = mark_failed_locally(lease.items, local);
            self.requeue(role, items, true, "the lease expired");
            self.dispatch(role);
        }
    }

    // ---- dispatch --------------------------------------------------------------------------

    pub fn dispatch_all(&mut self) {
        for role in Role::ALL {
            self.dispatch(role);
        }
    }

    /// Forms work for providers of `role` that have credits, while the queue has items.
    fn dispatch(&mut self, role: Role) {
        let now = Instant::now();
        let policy = self.cloud.policy(role);
        loop {
            let requests = &self.requests;
            let Some(queue) = self.queues.get_mut(&role) else {
                return;
            };
            queue.drop_dead_head(|r| requests.contains_key(&r));
            if queue.is_empty() {
                return;
            }
            let head_failed_locally = queue.head_failed_locally();
            // Healthy: not benched, and for embedding roles passing the gate (a local provider
            // the gate refused cannot serve, so `backup` must not wait for it).
            let gate = &self.gate;
            let healthy_local = self
                .agents
                .values()
                .flat_map(|a| a.providers.values())
                .any(|p| {
                    p.role() == role
                        && p.info.backend == Backend::Local
                        && p.is_healthy(now)
                        && p.gate_candidate
                            .as_ref()
                            .is_none_or(|c| gate.serving_space(c).is_some())
                });
            // The provider with the most credits; ties go round the fleet in turn.
            let mut best: Option<(u32, usize, &str, &str)> = None;
            let mut k = 0usize;
            for (agent_id, agent) in &self.agents {
                for (pid, p) in &agent.providers {
                    k += 1;
                    if p.role() != role || p.credits == 0 || !p.is_available(now) {
                        continue;
                    }
                    let backup_retry = policy == crate::roles::Policy::Backup
                        && p.info.backend == Backend::Cloud
                        && head_failed_locally;
                    if policy::admit(policy, p.info.backend, healthy_local) != Admission::Serve
                        && !backup_retry
                    {
                        continue;
                    }
                    // Embedding providers serve only with a passing verdict for the space.
                    if let Some(c) = &p.gate_candidate
                        && self.gate.serving_space(c).is_none()
                    {
                        continue;
                    }
                    // Cloud providers also need a permit of the global budget.
                    if let Some(route) = &p.route
                        && self.budget.check(route, now).is_some()
                    {
                        continue;
                    }
                    let rank = k.wrapping_sub(self.turn) % 1024;
                    let better = match best {
                        None => true,
                        Some((c, r, _, _)) => p.credits > c || (p.credits == c && rank < r),
                    };
                    if better {
                        best = Some((p.credits, rank, agent_id, pid));
                    }
                }
            }
            let Some((_, _, agent_id, pid)) = best else {
                return;
            };
            let (agent_id, pid) = (agent_id.to_string(), pid.to_string());
            self.turn = self.turn.wrapping_add(1);
            let Some(agent) = self.agents.get_mut(&agent_id) else {
                return;
            };
            let session = agent.session;
            if agent.tx.is_closed() {
                // The socket is going away; its disconnect will clean up the session.
                if let Some(p) = agent.providers.get_mut(&pid) {
                    p.credits = 0;
                }
                continue;
            }
            let Some(entry) = agent.providers.get(&pid) else {
                return;
            };
            let info = &entry.info;
            let (reference, permit) = (entry.reference.clone(), entry.route.clone());
            let gate = entry.gate_candidate.as_ref().and_then(|c| {
                let sid = self.gate.serving_space(c)?;
                let s = self.gate.space(sid)?;
                Some((
                    gate::verdict_key(c, sid),
                    Arc::new(SpaceRef {
                        id: sid.to_string(),
                        role: s.role,
                        model: s.model.clone(),
                        dims: s.dims,
                    }),
                ))
            });
            let limits = BatchLimits {
                max_items: info.max_batch_items.max(1),
                max_tokens: info.max_batch_tokens.max(1),
            };
            let requests = &self.requests;
            let Some(queue) = self.queues.get_mut(&role) else {
                return;
            };
            let items = queue.take_batch(limits, |r| requests.contains_key(&r));
            let Some(shape) = items.first().map(|i| i.shape.clone()) else {
                return;
            };
            // The permit last, once there is work to hold it (the check above passed).
            if let Some(route) = &permit
                && !self.budget.try_acquire(route, now)
            {
                queue.requeue_front(items);
                return;
            }
            let lease_id = self.next_lease;
            self.next_lease += 1;
            let deadline = now + self.settings.lease;
            let frame = HubFrame::Work(Work {
                lease: lease_id,
                provider: pid.clone(),
                role,
                input: shape.work_input(items.iter().map(|i| i.text.clone()).collect()),
                deadline_ms: super::now_ms().saturating_add(
                    u64::try_from(self.settings.lease.as_millis()).unwrap_or(u64::MAX),
                ),
            });
            let sent = agent.send(protocol::encode(&frame));
            let Some(p) = agent.providers.get_mut(&pid) else {
                queue.requeue_front(items);
                if let Some(route) = &permit {
                    self.budget.release(route, budget::Outcome::Other, now);
                }
                return;
            };
            if !sent {
                // The socket is going away; its disconnect will clean up the session.
                p.credits = 0;
                queue.requeue_front(items);
                if let Some(route) = &permit {
                    self.budget.release(route, budget::Outcome::Other, now);
                }
                continue;
            }
            p.credits -= 1;
            p.in_flight += 1;
            self.counters.leases_granted += 1;
            self.leases.insert(
                lease_id,
                Lease {
                    agent: agent_id,
                    session,
                    provider: pid,
                    reference,
                    permit,
                    gate,
                    role,
                    items,
                    deadline,
                },
            );
        }
    }

    // ---- views -----------------------------------------------------------------------------

    pub fn agents(&self) -> &BTreeMap<String, AgentEntry> {
        &self.agents
    }

    pub fn sockets(&self) -> &BTreeMap<String, SocketCount> {
        &self.sockets
    }

    pub fn queue_depth(&self, role: Role) -> usize {
        self.queues.get(&role).map_or(0, RoleQueue::len)
    }

    /// Leases out and the items on them, per role.
    pub fn leases_by_role(&self) -> BTreeMap<Role, (usize, usize)> {
        let mut out = BTreeMap::new();
        for lease in self.leases.values() {
            let e: &mut (usize, usize) = out.entry(lease.role).or_default();
            e.0 += 1;
            e.1 += lease.items.len();
        }
        out
    }

    pub fn leases_of(&self, agent: &str) -> usize {
        self.leases.values().filter(|l| l.agent == agent).count()
    }

    pub fn requests_waiting(&self) -> usize {
        self.requests.len()
    }

    /// Fails every waiting request (shutdown).
    pub fn fail_all(&mut self) {
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.fail_request(id, RequestFailure::Stopped);
        }
    }
}

/// Items of a lease that failed on a local provider are marked so (`backup` lets the cloud
/// take them).
fn mark_failed_locally(items: Vec<Item>, local: bool) -> Vec<Item> {
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

fn build_providers(
    agent: &str,
    infos: Vec<ProviderInfo>,
) -> Result<BTreeMap<String, ProviderEntry>, String> {
    let mut out = BTreeMap::new();
    for info in infos {
        if info.id.is_empty() {
            return Err("a provider needs a non-empty id".into());
        }
        let id = info.id.clone();
        if out
            .insert(id.clone(), ProviderEntry::new(agent, info))
            .is_some()
        {
            return Err(format!("provider id '{id}' appears twice"));
        }
    }
    Ok(out)
}

/// The lease's outputs, one per item and of the kind its op makes.
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
            Ok(s.into_iter().map(ItemOutput::Score).collect())
        }
        (WorkOutput::Chat(c), Some(Shape::Chat { .. })) => Ok(vec![ItemOutput::Chat(c)]),
        _ => {
            Err("done carries the wrong kind of output for its op; the items were requeued".into())
        }
    }
}
