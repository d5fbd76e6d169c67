//! The hub's state machine: accepted requests, their items in the role queues, leases out to
//! providers, and the dispatcher that forms work for pullers. One mutex guards it all; every
//! operation is short (no I/O: frames go to per-socket channels).
//!
//! * this file: the state, admission ([`Core::submit`]), cancellation and the agents' frames;
//! * [`binding`]: what each request is bound to (one space, one scorer) and whether anything
//!   can still serve it;
//! * [`dispatch`]: forming work frames for providers with credits;
//! * [`results`]: `done`, `failed`, expiry, requeueing and completion.
//!
//! Invariants: an accepted item is always in exactly one place (its queue, or one live
//! lease) until its request completes or fails; a result counts only for an item that has
//! none yet (the first completion wins) and only from a provider of the request's binding; a
//! lease that comes back (expiry, disconnect, transient failure) returns its items to the
//! front of their queue; a request nothing can serve any more fails at once with the reason.

pub mod binding;
mod dispatch;
mod results;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use self::binding::Outlook;
pub use self::binding::{Binding, Unservable, UnservableCode};
use super::budget::{self, Budget, BudgetSettings};
use super::gate::{Candidate, Gate, GateSettings, Space};
use super::queue::{Item, RequestId, RoleQueue, Shape};
pub use super::registry::ScorerRef;
use super::registry::{AgentEntry, AgentTx, Outgoing, ProviderEntry, ProviderRef, SocketCount};
use crate::config::push::CloudSettings;
use crate::protocol::{
    self, AccountLimits, Backend, ConfigAck, Heartbeat, Hello, HubFrame, PROTOCOL_VERSION,
    ProviderInfo, Score, Welcome,
};
use crate::roles::{Op, Role};

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
    /// How long a request may wait to be admitted while the only hope is a gate probe under
    /// way (or a provider that just left); then it is answered 503 with `Retry-After`.
    pub admission_wait: Duration,
    /// How long accepted work waits for a provider that left (a restart, a network blip)
    /// before it fails for want of one.
    pub vanish_grace: Duration,
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
            admission_wait: Duration::from_secs(10),
            vanish_grace: Duration::from_secs(15),
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
    /// The one scorer every score of a rerank request came from.
    pub scorer: Option<Arc<ScorerRef>>,
}

/// Why an accepted request failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RequestFailure {
    /// A provider said no one can serve this input.
    #[error("{provider} cannot serve this input: {message}")]
    Fatal { provider: String, message: String },
    #[error("an item went through {attempts} leases without a result (last: {last})")]
    TooManyAttempts { attempts: u32, last: String },
    /// Nothing connected can serve it any more (the providers of its binding are gone,
    /// refused, stopped or benched).
    #[error(transparent)]
    Unservable(Unservable),
    #[error("the hub is shutting down")]
    Stopped,
}

/// Why a request was not accepted.
#[derive(Clone, Debug, thiserror::Error)]
pub enum SubmitError {
    /// Nothing can serve the role now (the reasons, and a retry hint when one helps).
    #[error(transparent)]
    Unservable(Unservable),
    /// Not yet: a gate probe is under way or a provider just left ([`crate::hub::Hub::run`]
    /// waits a little and asks again, then answers [`SubmitError::Unservable`]).
    #[error(transparent)]
    NotYet(Unservable),
    #[error("dimensions {dimensions} is wider than the space {space} ({width} dims)")]
    DimensionsTooLarge {
        dimensions: usize,
        space: String,
        width: usize,
    },
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

/// One item's place in its request.
enum Slot {
    Waiting,
    /// A result, the item it answers (kept: a re-check or a re-score sends it round again)
    /// and, for embeddings, the verdict it was served under.
    Served {
        served: Served,
        item: Item,
        verdict: Option<String>,
    },
}

struct Pending {
    role: Role,
    binding: Binding,
    slots: Vec<Slot>,
    remaining: usize,
    tokens: u64,
    reply: Reply,
}

impl Pending {
    /// Drops every result so far; the items they answered, to send round again.
    fn take_results(&mut self) -> Vec<Item> {
        let mut again = Vec::new();
        for slot in &mut self.slots {
            if let Slot::Served { item, .. } = std::mem::replace(slot, Slot::Waiting) {
                again.push(item);
            }
        }
        self.remaining += again.len();
        self.tokens = 0;
        again
    }
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
    /// The scorer a rerank lease's scores come from.
    scorer: Option<Arc<ScorerRef>>,
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
    /// Requests refused at admission because nothing could serve them, by reason.
    pub rejected_unservable: BTreeMap<&'static str, u64>,
    pub leases_granted: u64,
    pub leases_expired: u64,
    pub leases_lost: u64,
    /// Leases taken back because their requests went away (the agent was told to stop).
    pub leases_cancelled: u64,
    pub failures: BTreeMap<&'static str, u64>,
    pub late_results: u64,
    pub requests_failed: u64,
    /// Rerank requests scored again whole because their scorer went away.
    pub rescored: u64,
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
    /// When a provider of each role last left (work waits [`HubSettings::vanish_grace`]).
    vanished: BTreeMap<Role, Instant>,
    /// Bumped whenever who-can-serve-what may have changed (admission waits on it).
    changes: watch::Sender<u64>,
    next_request: RequestId,
    next_lease: u64,
    next_session: u64,
    turn: usize,
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
            vanished: BTreeMap::new(),
            changes: watch::channel(0).0,
            next_request: 1,
            next_lease: 1,
            next_session: 1,
            turn: 0,
        }
    }

    // ---- clients ------------------------------------------------------------------------

    /// Accepts a request of `texts` (one item each) for `role`, bound to what may serve it
    /// (an embedding request: the role's current space), or says why not.
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
        let binding = self.admit(role, &shape)?;
        self.enqueue(role, binding, shape, texts)
    }

    /// What a request of `role` would be bound to, if something can serve it now.
    pub fn admit(&mut self, role: Role, shape: &Shape) -> Result<Binding, SubmitError> {
        let now = Instant::now();
        let binding = match role.op() {
            Op::Embed => {
                let space = self.admitted_space(role, now)?;
                if let Shape::Embed {
                    dimensions: Some(d),
                    ..
                } = shape
                    && *d > space.dims
                {
                    return Err(SubmitError::DimensionsTooLarge {
                        dimensions: *d,
                        space: space.id.clone(),
                        width: space.dims,
                    });
                }
                Binding::Space(space)
            }
            Op::Rerank => Binding::Scorer(None),
            Op::Chat => Binding::Any,
        };
        match self.outlook(role, &binding, now) {
            Outlook::Serve => Ok(binding),
            Outlook::Soon(why) => Err(SubmitError::NotYet(why)),
            Outlook::Never(why) => {
                *self
                    .counters
                    .rejected_unservable
                    .entry(why.code.as_str())
                    .or_default() += 1;
                Err(SubmitError::Unservable(why))
            }
        }
    }

    /// Queues an admitted request (see [`Core::admit`]).
    pub fn enqueue(
        &mut self,
        role: Role,
        binding: Binding,
        shape: Shape,
        texts: Vec<String>,
    ) -> Result<
        (
            RequestId,
            oneshot::Receiver<Result<Completed, RequestFailure>>,
        ),
        SubmitError,
    > {
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
                role,
                binding,
                slots: std::iter::repeat_with(|| Slot::Waiting).take(n).collect(),
                remaining: n,
                tokens: 0,
                reply,
            },
        );
        let shape = Arc::new(shape);
        let items = texts.into_iter().enumerate().map(|(index, text)| Item {
            request: id,
            index: u32::try_from(index).unwrap_or(u32::MAX),
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

    /// The space an embedding request of `role` is admitted under: the role's current one.
    fn admitted_space(&self, role: Role, now: Instant) -> Result<Arc<SpaceRef>, SubmitError> {
        if let Some(space) = self
            .gate
            .current_id(role)
            .and_then(|id| self.gate.space(id))
        {
            return Ok(Arc::new(SpaceRef {
                id: space.id(),
                role: space.role,
                model: space.model.clone(),
                dims: space.dims,
            }));
        }
        // No space yet: being founded (wait a little), or nothing can found one (say why).
        let providers: Vec<&str> = self
            .providers()
            .filter(|p| p.role() == role)
            .map(|p| p.reference.provider.as_str())
            .collect();
        let policy = self.cloud.policy(role);
        if self.gate.founding(role) {
            return Err(SubmitError::NotYet(Unservable {
                code: UnservableCode::Probing,
                message: format!(
                    "the vector space of role '{role}' is being fingerprinted by its reference"
                ),
                retry_after_s: Some(1),
            }));
        }
        let refusals = self.gate.refusals(role, &providers);
        let mut why = match self.outlook(role, &Binding::Any, now) {
            Outlook::Serve if refusals.is_empty() => Unservable {
                code: UnservableCode::Probing,
                message: format!(
                    "role '{role}' has no vector space yet: its reference has not answered the gate"
                ),
                retry_after_s: Some(1),
            },
            Outlook::Serve => Unservable {
                code: UnservableCode::GateRefused,
                message: format!(
                    "role '{role}' has no vector space under policy '{policy}' (a space is founded by its reference and is exactly as wide as the table): {}",
                    refusals.join("; ")
                ),
                retry_after_s: None,
            },
            Outlook::Soon(u) | Outlook::Never(u) => u,
        };
        if why.code == UnservableCode::Probing {
            return Err(SubmitError::NotYet(why));
        }
        if why.code == UnservableCode::NoProvider && !refusals.is_empty() {
            why.message = format!("{}; {}", why.message, refusals.join("; "));
        }
        Err(SubmitError::Unservable(why))
    }

    /// A receiver that changes whenever who can serve what may have changed.
    pub fn watch_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Forgets a request (its client timed out or went away); its waiting items leave the
    /// queue, and leases that carry nothing else are taken back (the agent is told to stop,
    /// a cloud permit comes back at once).
    pub fn cancel_request(&mut self, id: RequestId) {
        if self.requests.remove(&id).is_some() {
            // Its waiting items leave the queue: they must not hold room others could use.
            for q in self.queues.values_mut() {
                q.remove_request(id);
            }
            self.cancel_orphaned_leases("the request is gone (its client went away)");
        }
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

    /// Whether the role can be served now, and if not why (status shows it).
    pub fn role_outlook(&self, role: Role) -> Option<Unservable> {
        let now = Instant::now();
        let binding = match role.op() {
            Op::Embed => match self.admitted_space(role, now) {
                Ok(space) => Binding::Space(space),
                Err(SubmitError::NotYet(u) | SubmitError::Unservable(u)) => return Some(u),
                Err(_) => return None,
            },
            Op::Rerank => Binding::Scorer(None),
            Op::Chat => Binding::Any,
        };
        match self.outlook(role, &binding, now) {
            Outlook::Serve => None,
            Outlook::Soon(u) | Outlook::Never(u) => Some(u),
        }
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
        if self.agents.get(agent).is_some_and(|a| a.session == session)
            && let Some(gone) = self.agents.remove(agent)
        {
            tracing::info!(agent, session, "agent disconnected");
            self.note_vanished(gone.providers.values());
        }
        self.requeue_session_leases(agent, session);
        self.dispatch_all();
    }

    /// Providers left the fleet: work they could serve waits a grace for them to come back.
    fn note_vanished<'a>(&mut self, gone: impl Iterator<Item = &'a ProviderEntry>) {
        let now = Instant::now();
        for p in gone {
            self.vanished.insert(p.role(), now);
        }
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
                let items = results::mark_failed_locally(lease.items, local);
                self.requeue(role, items, true, "the agent disconnected");
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
        // What is left of the old set was removed or changed.
        let gone = std::mem::replace(&mut entry.providers, next);
        self.note_vanished(gone.values());
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
        // A new space or verdict: the gate's round decides the role's space now.
        self.gate_tick(Instant::now());
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

    /// A push arrived: routes refused for their pin may be fixed by it, so they are asked again.
    pub fn push_applied(&mut self) {
        for p in self
            .agents
            .values_mut()
            .flat_map(|a| a.providers.values_mut())
        {
            p.refused = None;
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

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::protocol::{Done, Pull, WorkOutput};

    fn provider(id: &str, role: Role, model: &str, max_items: usize) -> ProviderInfo {
        ProviderInfo {
            id: id.into(),
            role,
            backend: Backend::Local,
            model: model.into(),
            revision: Some("r1".into()),
            upstream: None,
            dims: role.is_embedding().then_some(2),
            dtype: None,
            device: None,
            max_batch_items: max_items,
            max_batch_tokens: 1 << 20,
            score_activation: (role.op() == Op::Rerank)
                .then_some(crate::protocol::ScoreActivation::Sigmoid),
        }
    }

    /// An agent with one provider and credits; its frames arrive on the receiver.
    fn connect(
        core: &mut Core,
        agent: &str,
        info: ProviderInfo,
        credits: u32,
    ) -> (u64, mpsc::UnboundedReceiver<Outgoing>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let pid = info.id.clone();
        let session = core
            .hello(
                Hello {
                    agent_id: agent.into(),
                    hostname: "h".into(),
                    version: "0".into(),
                    protocol_version: PROTOCOL_VERSION,
                    providers: vec![info],
                    devices: Vec::new(),
                },
                tx,
            )
            .unwrap();
        let pull = Pull {
            provider: pid,
            credits,
        };
        core.pull(agent, session, &pull.provider, pull.credits)
            .unwrap();
        (session, rx)
    }

    /// The next work frame on `rx`, as JSON.
    fn next_work(rx: &mut mpsc::UnboundedReceiver<Outgoing>) -> serde_json::Value {
        while let Ok(out) = rx.try_recv() {
            if let Outgoing::Frame(text) = out {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                if v["type"] == "work" {
                    return v;
                }
            }
        }
        panic!("no work frame")
    }

    fn scores(work: &serde_json::Value, p: f32) -> WorkOutput {
        let n = work["input"]["documents"].as_array().unwrap().len();
        WorkOutput::Scores(vec![
            Score {
                score: (p / (1.0 - p)).ln(),
                probability: Some(p),
            };
            n
        ])
    }

    #[test]
    fn a_rerank_request_is_scored_by_the_scorer_of_its_first_lease_only() {
        let mut core = Core::new(HubSettings::default(), CloudSettings::default());
        let (sa, mut a) = connect(&mut core, "a", provider("r", Role::Reranker, "ma", 2), 1);
        let shape = Shape::Rerank {
            query: "q".into(),
            instruction: None,
        };
        let docs: Vec<String> = (0..4).map(|i| format!("d{i}")).collect();
        let (_, mut reply) = core.submit(Role::Reranker, shape, docs).unwrap();
        let first = next_work(&mut a);
        // b has more credits, but the request is a's now.
        let (_, mut b) = connect(&mut core, "b", provider("r", Role::Reranker, "mb", 8), 4);
        assert!(matches!(b.try_recv(), Ok(Outgoing::Frame(f)) if f.contains("welcome")));
        assert!(b.try_recv().is_err(), "b got nothing of a's request");
        let lease = first["lease"].as_u64().unwrap();
        core.done(
            "a",
            sa,
            Done {
                lease,
                output: scores(&first, 0.7),
                latency_ms: f64::NAN,
                tokens: u64::MAX,
            },
        )
        .unwrap();
        core.pull("a", sa, "r", 1).unwrap();
        let second = next_work(&mut a);
        core.done(
            "a",
            sa,
            Done {
                lease: second["lease"].as_u64().unwrap(),
                output: scores(&second, 0.6),
                latency_ms: 1.0,
                tokens: u64::MAX,
            },
        )
        .unwrap();
        let done = reply.try_recv().unwrap().unwrap();
        let scorer = done.scorer.expect("the response names its scorer");
        assert_eq!(scorer.id, "local ma@r1 sigmoid");
        assert!(done.items.iter().all(|s| s.provider.agent == "a"));
        assert_eq!(done.tokens, u64::MAX, "token counts saturate, never wrap");
    }

    #[test]
    fn two_equal_chats_are_two_leases() {
        let mut core = Core::new(HubSettings::default(), CloudSettings::default());
        let mut info = provider("chat", Role::RlmSandbox, "m", 8);
        info.dims = None;
        let (_, mut rx) = connect(&mut core, "a", info, 4);
        let body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
        for _ in 0..2 {
            let shape = Shape::Chat { body: body.clone() };
            core.submit(Role::RlmSandbox, shape, vec![String::new()])
                .unwrap();
        }
        let (one, two) = (next_work(&mut rx), next_work(&mut rx));
        assert_ne!(one["lease"], two["lease"]);
    }
}
