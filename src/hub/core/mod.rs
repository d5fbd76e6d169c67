//! The hub's state machine: accepted requests, their items in the role queues, leases out to
//! providers, and the dispatcher that forms work for pullers. One mutex guards it all; every
//! operation is short (no I/O: frames go to per-socket channels).
//!
//! * this file: the state, admission ([`Core::submit`]: the request limits and the bytes
//!   held), cancellation;
//! * `agents`: the agents' frames (`hello` with one live process per id, heartbeats that
//!   renew leases);
//! * [`binding`]: what each request is bound to (one space, one scorer) and whether anything
//!   can still serve it;
//! * [`dispatch`]: forming work frames for providers with credits;
//! * `probe_permits`: the budget permits the gate's probes to cloud embedders hold or claim;
//! * `project_rules`: the projects' limits, shares and allowances at admission and dispatch;
//! * [`results`]: `done`, `chunk`, `failed`, expiry, requeueing and completion;
//! * `handed_over`: keyed chats parked while their agent's call may still run, the answers
//!   agents hand over, the calls they report running.
//!
//! Invariants: an accepted item is always in exactly one place (its queue, or one live
//! lease, or parked for its agent's handover) until its request completes or fails; a result
//! counts only for an item that has none yet (the first completion wins) and only from a
//! provider of the request's binding; a lease that comes back (expiry, disconnect, transient
//! failure) returns its items to the front of their queue, except a streamed chat's after its
//! first chunk, which fails, and a keyed chat's whose agent may still run its call (expiry,
//! disconnect), which is parked for that agent's outcome (`handed_over`); a request nothing
//! can serve any more fails at once with the reason.

mod agents;
pub mod binding;
mod config_sync;
mod dispatch;
mod handed_over;
mod probe_permits;
mod project_rules;
mod results;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use self::binding::Outlook;
pub use self::binding::{Binding, Unservable, UnservableCode};
pub use self::config_sync::ConfigRevision;
use super::budget::{Budget, BudgetSettings};
use super::gate::{Candidate, Gate, GateSettings, Live, Space, SpacePin};
use super::projects::{AdmitRefusal, Caller, Projects};
use super::queue::{Item, RequestId, RoleQueue, Shape};
pub use super::registry::ScorerRef;
use super::registry::{AgentEntry, ProviderEntry, ProviderRef, SocketCount};
use crate::config::hub::{ReplyLimits, RequestLimits};
use crate::config::push::CloudSettings;
use crate::config::timings::RoleTimings;
use crate::metrics::histogram::Histogram;
use crate::metrics::recent::Recent;
use crate::protocol::{self, Score};
use crate::roles::{Op, Policy, Role};

/// Hub behaviour settings.
#[derive(Clone, Debug)]
pub struct HubSettings {
    /// Each role's lease, request timeout and call timeout.
    pub timings: BTreeMap<Role, RoleTimings>,
    /// Heartbeats renew leases; three intervals of silence end a socket.
    pub heartbeat_interval: Duration,
    /// Items per role queue; beyond it clients get 429.
    pub queue_capacity: usize,
    /// Leases an item may go through without a result before its request fails.
    pub max_attempts: u32,
    /// How long two consecutive failures bench a provider.
    pub bench: Duration,
    /// Largest frame with vectors.
    pub max_frame_bytes: usize,
    /// Inputs per request, characters per input, bytes held by all accepted requests.
    pub limits: RequestLimits,
    /// How long a request may wait to be admitted while the only hope is a gate probe under
    /// way (or a provider that just left); then it is answered 503 with `Retry-After`.
    pub admission_wait: Duration,
    /// How long accepted work waits for a provider that left (a restart, a network blip)
    /// before it fails for want of one.
    pub vanish_grace: Duration,
    /// Roles `/ready` waits for (when empty: every role a connected provider or a cloud route
    /// offers).
    pub ready_roles: BTreeSet<Role>,
    /// A local provider with work in flight keeps its last credit for interactive work, so
    /// batch work queued ahead on its agent is bounded to the frames it runs (on by default;
    /// the fairness benchmark turns it off for the queue of before).
    pub interactive_reserve: bool,
    /// How long after this hub began to serve a keyed chat it has no record of waits for
    /// the agents to come over with the answers they kept (`hub::replies`): agents of a
    /// leader that froze or was cut off arrive within about a heartbeat of the win, their
    /// dial bounded by 5 s. Zero for `serve`, whose agent is the same process.
    pub handover_window: Duration,
    /// What each project's `Idempotency-Key` table holds (`hub::replies`).
    pub replies: ReplyLimits,
}

impl Default for HubSettings {
    fn default() -> Self {
        Self {
            timings: Role::ALL
                .into_iter()
                .map(|r| (r, RoleTimings::default_for(r)))
                .collect(),
            heartbeat_interval: Duration::from_secs(5),
            queue_capacity: 100_000,
            max_attempts: 5,
            bench: Duration::from_secs(30),
            max_frame_bytes: protocol::codec::DEFAULT_MAX_FRAME_BYTES,
            limits: RequestLimits::default(),
            admission_wait: Duration::from_secs(10),
            vanish_grace: Duration::from_secs(15),
            ready_roles: BTreeSet::new(),
            interactive_reserve: true,
            handover_window: Duration::from_secs(5 + 5),
            replies: ReplyLimits::default(),
        }
    }
}

impl HubSettings {
    /// `role`'s timings (its defaults where the table lacks it).
    pub fn timings(&self, role: Role) -> RoleTimings {
        self.timings
            .get(&role)
            .copied()
            .unwrap_or_else(|| RoleTimings::default_for(role))
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
#[derive(Clone, Debug, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct SpaceRef {
    pub id: String,
    /// Which founding of the id (see [`Space::generation`]): a request admitted under one
    /// generation completes under it or fails with `space_changed`.
    pub generation: u64,
    pub role: Role,
    pub model: String,
    pub dims: usize,
}

/// Whether one role can serve a new request now, and whether that gates the hub's readiness.
#[derive(Clone, Debug)]
pub struct Readiness {
    pub gates: bool,
    pub unservable: Option<Unservable>,
}

/// A request's results, in input order.
#[derive(Debug)]
pub struct Completed {
    pub items: Vec<Served>,
    pub tokens: u64,
    /// The one scorer every score of a rerank request came from.
    pub scorer: Option<Arc<ScorerRef>>,
    /// From acceptance to its first lease (time in the role queue).
    pub queue_time: Duration,
    /// From its first lease to its last result (providers' work and the fleet's round trips).
    pub inference_time: Duration,
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
    /// Its project passed a daily allowance and only the cloud could serve it.
    #[error(transparent)]
    Project(AdmitRefusal),
    /// A streamed chat lost its lease after chunks went out: the client has part of an
    /// answer, so it is not served again (a retry would bill and send a second answer).
    #[error("the stream was cut after {chunks} chunks: {why}; send the request again")]
    StreamCut { chunks: u64, why: String },
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
    #[error(
        "role '{0}' has no vector spaces: X-Fantom-Space (or a body's space) pins embedding requests only"
    )]
    PinNotEmbedding(Role),
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
    #[error(
        "{items} inputs is more than one request may carry ({limit}, the hub's max_inputs); split the request"
    )]
    TooManyInputs { items: usize, limit: usize },
    #[error(
        "input {index} has {chars} characters, more than one input may have ({limit}, the hub's max_input_chars); split or truncate it"
    )]
    InputTooLong {
        index: usize,
        chars: usize,
        limit: usize,
    },
    #[error(
        "input {index} needs a work frame of about {bytes} bytes, more than a frame may carry ({limit} bytes); split or truncate it"
    )]
    InputTooLargeForFrame {
        index: usize,
        bytes: usize,
        limit: usize,
    },
    /// A rule of the request's project (its limit, its share of the room, its allowance).
    #[error(transparent)]
    Project(AdmitRefusal),
    #[error(
        "the request holds {bytes} bytes of input, more than the hub holds for all requests ({limit}, max_held_mb); split the request"
    )]
    TooManyBytes { bytes: usize, limit: usize },
    #[error(
        "the hub holds {held} bytes of accepted input and this request's {bytes} would pass its limit ({limit}); retry after {retry_after_s} s"
    )]
    HeldBytesFull {
        held: usize,
        bytes: usize,
        limit: usize,
        retry_after_s: u64,
    },
}

/// Bytes of a work frame around its one input: the frame's keys, lease, provider, deadline.
const FRAME_OVERHEAD_BYTES: usize = 1024;

/// The length of `s` as a JSON string (quotes and escapes included).
fn json_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..0x20 => 6,
            _ => 1,
        })
        .sum::<usize>()
}

type Reply = oneshot::Sender<Result<Completed, RequestFailure>>;

/// An accepted request: its id, and where its outcome arrives.
pub type Accepted = (
    RequestId,
    oneshot::Receiver<Result<Completed, RequestFailure>>,
);

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
    /// Whose request it is (its project's accounting and flow).
    caller: Arc<Caller>,
    /// Input bytes this request holds (counted in [`Core::held_bytes`] until it ends).
    bytes: usize,
    binding: Binding,
    slots: Vec<Slot>,
    remaining: usize,
    tokens: u64,
    reply: Reply,
    /// A streamed chat's chunks go here as they arrive.
    stream: Option<ChunkTx>,
    /// Once a chunk went out: the lease that streams it and the next chunk's number. From
    /// then on the request is that lease's: losing it fails the request, never requeues it.
    streamed: Option<Streamed>,
    /// The client's `X-Request-Id`, for the log lines about this request.
    request_id: Option<Arc<str>>,
    /// The request span's W3C trace context (traces exported): work frames carry it.
    pub(super) traceparent: Option<Arc<str>>,
    accepted_at: Instant,
    /// When its first item went out on a lease.
    first_lease_at: Option<Instant>,
}

/// Where an accepted request came from, for its log lines and its trace.
#[derive(Clone, Debug, Default)]
pub struct Origin {
    /// The client's `X-Request-Id` (or ours).
    pub request_id: Option<Arc<str>>,
    /// The W3C `traceparent` of the request's span, when traces are exported.
    pub traceparent: Option<Arc<str>>,
}

/// Where a streamed chat's chunks go (the client's SSE response).
pub type ChunkTx = tokio::sync::mpsc::UnboundedSender<serde_json::Value>;

#[derive(Clone, Copy, Debug)]
struct Streamed {
    lease: u64,
    next_seq: u64,
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
    /// The project whose items it carries (a work frame holds one project's items).
    project: Arc<str>,
    /// The queue flow it was taken from (its project and sub-project): told when it lands.
    flow: Arc<crate::hub::projects::Caller>,
    /// The class of its items.
    class: crate::protocol::WorkClass,
    agent: String,
    session: u64,
    provider: String,
    /// Who serves it (kept here: the provider may leave the set while the lease runs).
    reference: Arc<ProviderRef>,
    /// The budget route a cloud lease holds a permit of.
    permit: Option<String>,
    /// The key generation a cloud lease was granted under (its agent's): a refusal of the
    /// key from an older generation stops nothing.
    key_generation: Option<String>,
    /// The gate verdict an embedding lease was granted under, and its space.
    gate: Option<(String, Arc<SpaceRef>)>,
    /// The scorer a rerank lease's scores come from.
    scorer: Option<Arc<ScorerRef>>,
    role: Role,
    items: Vec<Item>,
    deadline: Instant,
    /// The probe text riding in this embedding work frame, and where.
    canary: Option<Canary>,
    /// A keyed chat whose agent keeps its answer across sessions: lost with its socket, it
    /// waits for the agent's handover ([`handed_over`]).
    keeps_answer: bool,
}

/// A canary: probe text `probe` of the gate's set, at `position` among the frame's texts.
#[derive(Clone, Copy, Debug)]
struct Canary {
    probe: usize,
    position: usize,
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
    /// Lease renewals by heartbeats (work still running on a live agent).
    pub leases_renewed: u64,
    pub leases_expired: u64,
    pub leases_lost: u64,
    /// Leases taken back because their requests went away (the agent was told to stop).
    pub leases_cancelled: u64,
    pub failures: BTreeMap<&'static str, u64>,
    pub late_results: u64,
    pub requests_failed: u64,
    /// Rerank requests scored again whole because their scorer went away.
    pub rescored: u64,
    /// Per role: seconds from acceptance to a request's first lease.
    pub queue_seconds: BTreeMap<Role, Histogram>,
    /// Per role: the same waits of the last minute, in ms (for status' quantiles).
    pub recent_waits_ms: BTreeMap<Role, Recent>,
    /// Per role: requests refused at admission, by the code their client was told.
    pub refused: BTreeMap<Role, BTreeMap<&'static str, u64>>,
    /// Per role: accepted requests that ended without an answer, by the code their client
    /// was told (a timeout, provider failures, a cut stream).
    pub failed: BTreeMap<Role, BTreeMap<&'static str, u64>>,
    /// Per role: items per work frame granted.
    pub batch_items: BTreeMap<Role, Histogram>,
    /// Per role: tokens of each completed request.
    pub request_tokens: BTreeMap<Role, Histogram>,
    /// Per provider: canaries sent in work frames, their tokens (a share of the frame's,
    /// never counted in a client's usage), and canaries that came back drifted.
    pub canary_texts: BTreeMap<String, u64>,
    pub canary_tokens: BTreeMap<String, u64>,
    pub canary_failures: BTreeMap<String, u64>,
}

impl Counters {
    pub(super) fn observe(
        map: &mut BTreeMap<Role, Histogram>,
        role: Role,
        bounds: &'static [f64],
        value: f64,
    ) {
        map.entry(role)
            .or_insert_with(|| Histogram::new(bounds))
            .observe(value);
    }
}

pub struct Core {
    pub settings: HubSettings,
    pub cloud: CloudSettings,
    /// The revision of `cloud` and the generation of the key pushed with it.
    config: ConfigRevision,
    pub counters: Counters,
    /// The global cloud budget: permits for cloud leases.
    pub budget: Budget,
    /// The compatibility gate: verdicts of embedding providers.
    pub gate: Gate,
    /// The scorer check: which scorer each local reranker serves as.
    pub scorer_check: crate::hub::scorer_check::ScorerCheck,
    /// The projects, their settings and their live accounting.
    pub projects: Projects,
    /// Closed while a leader on etcd cannot renew its lead: no cloud permits, no founding, no
    /// passing verdicts (never closed on a state file).
    pub fence: crate::hub::store::fence::Fence,
    /// The epoch this hub leads under on etcd (sent in `welcome`).
    pub epoch: Option<i64>,
    /// Keyed chats: the keys seen, the answers a retry gets again.
    pub replies: crate::hub::replies::Replies,
    /// Keyed chats whose agent's socket dropped while they ran: waiting for its handover.
    parked: Vec<handed_over::Parked>,
    /// Cloud calls agents reported running for an earlier hub, holding budget permits.
    reported: HashMap<crate::protocol::IdempotencyTag, handed_over::Reported>,
    queues: BTreeMap<Role, RoleQueue>,
    requests: HashMap<RequestId, Pending>,
    /// Input bytes of every accepted request not yet answered.
    held_bytes: usize,
    leases: HashMap<u64, Lease>,
    /// The budget permits the gate's probes to cloud providers hold, and the scopes they wait
    /// on: probe texts go through the shared key like any work.
    probe_permits: probe_permits::ProbePermits,
    agents: BTreeMap<String, AgentEntry>,
    sockets: BTreeMap<String, SocketCount>,
    /// When a provider of each role last left (work waits [`HubSettings::vanish_grace`]).
    vanished: BTreeMap<Role, Instant>,
    /// Roles whose queue holds items of failed requests (swept at their next dispatch).
    purge: std::collections::BTreeSet<Role>,
    /// Bumped whenever who-can-serve-what may have changed (admission waits on it).
    changes: watch::Sender<u64>,
    next_request: RequestId,
    next_lease: u64,
    /// The next canary's probe text (they rotate through the set).
    next_canary: usize,
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
        let (handover, reply_limits) = (settings.handover_window, settings.replies);
        Self {
            settings,
            cloud,
            config: ConfigRevision::default(),
            counters: Counters::default(),
            budget: Budget::new(BudgetSettings::default(), rand::random(), Instant::now()),
            gate: Gate::new(gate, spaces),
            scorer_check: Default::default(),
            projects: Projects::default(),
            fence: Default::default(),
            epoch: None,
            replies: crate::hub::replies::Replies::new(handover, reply_limits),
            parked: Vec::new(),
            reported: HashMap::new(),
            queues,
            requests: HashMap::new(),
            held_bytes: 0,
            leases: HashMap::new(),
            probe_permits: probe_permits::ProbePermits::default(),
            agents: BTreeMap::new(),
            sockets: BTreeMap::new(),
            vanished: BTreeMap::new(),
            purge: std::collections::BTreeSet::new(),
            changes: watch::channel(0).0,
            next_request: 1,
            next_lease: 1,
            next_canary: 0,
            next_session: 1,
            turn: 0,
        }
    }

    // ---- clients ------------------------------------------------------------------------

    /// Accepts a request of `default` (batch class) of `texts` (one item each) for `role`,
    /// bound to what may serve it (an embedding request: the role's current space), or says
    /// why not.
    pub fn submit(
        &mut self,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
    ) -> Result<Accepted, SubmitError> {
        let caller = Caller::default_project(crate::protocol::WorkClass::Batch);
        self.submit_as(caller, role, shape, texts)
    }

    /// As [`Core::submit`], for `caller`.
    pub fn submit_as(
        &mut self,
        caller: Caller,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
    ) -> Result<Accepted, SubmitError> {
        let binding = self.admit(role, &shape)?;
        self.enqueue(caller, role, binding, shape, texts, Origin::default())
    }

    /// What a request of `role` would be bound to, if something can serve it now.
    pub fn admit(&mut self, role: Role, shape: &Shape) -> Result<Binding, SubmitError> {
        self.admit_in(role, shape, None)
    }

    /// As [`Core::admit`], for a request `pin`ned to one of the role's live spaces.
    pub fn admit_in(
        &mut self,
        role: Role,
        shape: &Shape,
        pin: Option<&SpacePin>,
    ) -> Result<Binding, SubmitError> {
        let now = Instant::now();
        if pin.is_some() && role.op() != Op::Embed {
            return Err(SubmitError::PinNotEmbedding(role));
        }
        let binding = match role.op() {
            Op::Embed => {
                let space = match pin {
                    Some(pin) => self.pinned_space(role, pin)?,
                    None => self.admitted_space(role, now)?,
                };
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
            Outlook::Never(why) => Err(SubmitError::Unservable(why)),
        }
    }

    /// Queues an admitted request (see [`Core::admit`]).
    pub fn enqueue(
        &mut self,
        caller: Caller,
        role: Role,
        binding: Binding,
        shape: Shape,
        texts: Vec<String>,
        origin: Origin,
    ) -> Result<Accepted, SubmitError> {
        let n = texts.len();
        let bytes = self.check_limits(&shape, &texts)?;
        let caller = Arc::new(caller);
        if let Err(refusal) = self.check_project(&caller, role, &binding, n, bytes) {
            *self
                .projects
                .usage
                .entry(caller.project.clone())
                .or_default()
                .refused
                .entry(refusal.code())
                .or_default() += 1;
            return Err(SubmitError::Project(refusal));
        }
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
        let limit = self.settings.limits.max_held_bytes;
        if self.held_bytes.saturating_add(bytes) > limit {
            *self.counters.rejected_full.entry(role).or_default() += 1;
            return Err(SubmitError::HeldBytesFull {
                held: self.held_bytes,
                bytes,
                limit,
                retry_after_s: self.retry_after_s(role),
            });
        }
        self.held_bytes += bytes;
        let usage = self
            .projects
            .usage
            .entry(caller.project.clone())
            .or_default();
        usage.held_items = usage.held_items.saturating_add(n as u64);
        usage.held_bytes = usage.held_bytes.saturating_add(bytes);
        usage.requests += 1;
        usage.texts = usage.texts.saturating_add(n as u64);
        let id = self.next_request;
        self.next_request += 1;
        let (reply, rx) = oneshot::channel();
        self.requests.insert(
            id,
            Pending {
                role,
                caller: caller.clone(),
                bytes,
                binding,
                slots: std::iter::repeat_with(|| Slot::Waiting).take(n).collect(),
                remaining: n,
                tokens: 0,
                reply,
                stream: None,
                streamed: None,
                request_id: origin.request_id,
                traceparent: origin.traceparent,
                accepted_at: Instant::now(),
                first_lease_at: None,
            },
        );
        let shape = Arc::new(shape);
        let items = texts.into_iter().enumerate().map(|(index, text)| Item {
            request: id,
            index: u32::try_from(index).unwrap_or(u32::MAX),
            text,
            shape: shape.clone(),
            caller: caller.clone(),
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

    /// The request's input bytes, if it is within the per-request limits: inputs, characters
    /// per input, one input per work frame, and no more than every request together may hold.
    pub fn check_limits(&self, shape: &Shape, texts: &[String]) -> Result<usize, SubmitError> {
        let limits = self.settings.limits;
        if texts.len() > limits.max_inputs {
            return Err(SubmitError::TooManyInputs {
                items: texts.len(),
                limit: limits.max_inputs,
            });
        }
        // An embedding frame may also carry a canary (one probe text).
        let canary = match shape {
            Shape::Embed { .. } => (0..super::gate::measure::probe_count())
                .map(|i| json_len(super::gate::measure::probe_text(i)))
                .max()
                .unwrap_or(0),
            _ => 0,
        };
        let shared = shape.shared_json_bytes();
        let frame_limit = self.settings.max_frame_bytes;
        let mut bytes = shared;
        for (index, text) in texts.iter().enumerate() {
            // Bytes first: a text is never shorter in bytes than in characters.
            if text.len() > limits.max_input_chars {
                let chars = text.chars().count();
                if chars > limits.max_input_chars {
                    return Err(SubmitError::InputTooLong {
                        index,
                        chars,
                        limit: limits.max_input_chars,
                    });
                }
            }
            let frame = FRAME_OVERHEAD_BYTES + shared + canary + json_len(text);
            if frame > frame_limit {
                return Err(SubmitError::InputTooLargeForFrame {
                    index,
                    bytes: frame,
                    limit: frame_limit,
                });
            }
            bytes = bytes.saturating_add(text.len());
        }
        if bytes > limits.max_held_bytes {
            return Err(SubmitError::TooManyBytes {
                bytes,
                limit: limits.max_held_bytes,
            });
        }
        Ok(bytes)
    }

    /// Sends the chunks of request `id` (a chat that asked to stream) to `tx`.
    pub fn stream_to(&mut self, id: RequestId, tx: ChunkTx) {
        if let Some(p) = self.requests.get_mut(&id) {
            p.stream = Some(tx);
        }
    }

    /// Removes a request that ended (answered, failed, cancelled); its bytes are free again.
    fn take_request(&mut self, id: RequestId) -> Option<Pending> {
        let pending = self.requests.remove(&id)?;
        self.held_bytes = self.held_bytes.saturating_sub(pending.bytes);
        if let Some(usage) = self.projects.usage.get_mut(&pending.caller.project) {
            usage.held_items = usage.held_items.saturating_sub(pending.slots.len() as u64);
            usage.held_bytes = usage.held_bytes.saturating_sub(pending.bytes);
        }
        Some(pending)
    }

    /// Input bytes accepted requests hold now.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The live space of `role` a pinned request names, or why it cannot be served there.
    fn pinned_space(&self, role: Role, pin: &SpacePin) -> Result<Arc<SpaceRef>, SubmitError> {
        let live = self.gate.live().get(&role);
        let Some(which) = live.and_then(|l| l.which(&pin.id)) else {
            let served = live.map_or_else(
                || "none yet".to_string(),
                |l| {
                    let mut named = format!("current {}", l.current);
                    match l.next.as_ref().map(|m| (&m.space, &m.founder)) {
                        Some((Some(next), _)) => named.push_str(&format!(", next {next}")),
                        Some((None, founder)) => named.push_str(&format!(
                            ", next (founded by {}, not named yet)",
                            crate::hub::gate::describe(founder)
                        )),
                        None => {}
                    }
                    if let Some(p) = &l.previous {
                        named.push_str(&format!(", previous {}", p.space));
                    }
                    named
                },
            );
            return Err(SubmitError::Unservable(Unservable {
                code: UnservableCode::SpaceNotServed,
                message: format!(
                    "the request is pinned to a space role '{role}' does not serve (its spaces: {served}); pin one of those, or send it unpinned to be served in the current space"
                ),
                retry_after_s: None,
            }));
        };
        let Some(space) = self.gate.space(&pin.id) else {
            // Named, its fingerprint on its way (a migration's next, a retired space again).
            return Err(SubmitError::NotYet(Unservable {
                code: UnservableCode::Probing,
                message: format!(
                    "the {} space {} of role '{role}' is being fingerprinted by its reference",
                    live_name(which),
                    pin.id
                ),
                retry_after_s: Some(1),
            }));
        };
        if let Some(generation) = pin.generation
            && generation != space.generation
        {
            return Err(SubmitError::Unservable(Unservable {
                code: UnservableCode::SpaceNotServed,
                message: format!(
                    "the request is pinned to a generation of {} that was retired (the space's generation is {}): rows of a retired generation are re-embedded, never compared with the new one; pin {}@{} or send it unpinned",
                    pin.id, space.generation, pin.id, space.generation
                ),
                retry_after_s: None,
            }));
        }
        Ok(Arc::new(SpaceRef {
            id: space.id(),
            generation: space.generation,
            role: space.role,
            model: space.model.clone(),
            dims: space.dims,
        }))
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
                generation: space.generation,
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
        let candidates: Vec<Candidate> = self
            .providers()
            .filter(|p| p.role() == role && p.stale.is_none())
            .filter_map(|p| {
                let mut c = p.gate_candidate.clone()?;
                c.healthy = p.is_healthy(now);
                Some(c)
            })
            .collect();
        if !candidates.is_empty() {
            let refs: Vec<&Candidate> = candidates.iter().collect();
            if !self.gate.has_reference(policy, &refs) {
                let who = match (policy, &self.gate.settings.reference) {
                    (Policy::Cloud, _) => {
                        "a cloud route (the first one anchors the space)".to_string()
                    }
                    (_, Some(named)) => format!("the configured reference {named}"),
                    _ => "a local provider".to_string(),
                };
                return Err(SubmitError::Unservable(Unservable {
                    code: UnservableCode::GateRefused,
                    message: format!(
                        "role '{role}' has no vector space, and nothing connected can found one: under policy '{policy}' its reference is {who}, and none is connected and healthy; connect one, or push a policy whose reference is connected"
                    ),
                    retry_after_s: None,
                }));
            }
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
            // A provider that just left may come back: waiting a little may help.
            Outlook::Soon(u) => return Err(SubmitError::NotYet(u)),
            Outlook::Never(u) => u,
        };
        if why.code == UnservableCode::Probing {
            return Err(SubmitError::NotYet(why));
        }
        if why.code == UnservableCode::NoProvider && !refusals.is_empty() {
            why.message = format!("{}; {}", why.message, refusals.join("; "));
        }
        Err(SubmitError::Unservable(why))
    }

    /// A request refused at admission because nothing could serve it (for `/metrics`).
    pub fn count_unservable(&mut self, why: &Unservable) {
        *self
            .counters
            .rejected_unservable
            .entry(why.code.as_str())
            .or_default() += 1;
    }

    /// Forgets, a while after their agent left ([`crate::hub::gate::GateSettings::forget_departed`]),
    /// what the hub keeps per provider and agent: the gate's passing and probe-failed verdicts
    /// and rows, the canary counters, the scorer check's state, the agent's socket count. An
    /// autoscaled fleet whose hosts get new names leaves nothing behind; suspended and refused
    /// verdicts stay until an operator's verify.
    pub fn forget_departed(&mut self) {
        let agents = &self.agents;
        let gone = self
            .gate
            .forget_departed(crate::hub::now_ms(), &|a| agents.contains_key(a));
        let c = &mut self.counters;
        for p in &gone.providers {
            c.canary_texts.remove(p);
            c.canary_tokens.remove(p);
            c.canary_failures.remove(p);
        }
        for agent in &gone.agents {
            let prefix = format!("{agent}/");
            let mine = |p: &String| p.starts_with(&prefix);
            c.canary_texts.retain(|p, _| !mine(p));
            c.canary_tokens.retain(|p, _| !mine(p));
            c.canary_failures.retain(|p, _| !mine(p));
            self.scorer_check.forget_agent(agent);
            self.sockets.remove(agent);
        }
    }

    /// A request of `role` refused at admission, by the code its client was told.
    pub fn count_refused(&mut self, role: Role, code: &'static str) {
        let n = self.counters.refused.entry(role).or_default();
        *n.entry(code).or_default() += 1;
    }

    /// An accepted request of `role` that ended without an answer, by its code.
    pub fn count_failed(&mut self, role: Role, code: &'static str) {
        let n = self.counters.failed.entry(role).or_default();
        *n.entry(code).or_default() += 1;
    }

    /// A receiver that changes whenever who can serve what may have changed.
    pub fn watch_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Forgets a request (its client timed out or went away); its waiting items leave the
    /// queue, and leases that carry nothing else are taken back (the agent is told to stop,
    /// a cloud permit comes back at once).
    pub fn cancel_request(&mut self, id: RequestId) {
        if self.take_request(id).is_some() {
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

    /// Every connected provider.
    pub fn providers(&self) -> impl Iterator<Item = &ProviderEntry> {
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

    /// Each role readiness answers for (the configured `ready_roles`, every role a connected
    /// provider or a cloud route offers), whether it gates readiness (with `ready_roles` set,
    /// only those do; else every role listed), and why a new request of it would not be served
    /// now (`None`: it would be).
    pub fn readiness(&self) -> BTreeMap<Role, Readiness> {
        let configured = &self.settings.ready_roles;
        let offered = self
            .providers()
            .map(ProviderEntry::role)
            .chain(self.cloud.allowed_models.keys().copied());
        configured
            .iter()
            .copied()
            .chain(offered)
            .map(|role| {
                let gates = configured.is_empty() || configured.contains(&role);
                let unservable = self.role_outlook(role);
                (role, Readiness { gates, unservable })
            })
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

    /// Items waiting in `role`'s queue, per class and project (classes with none left out).
    pub fn waiting(
        &self,
        role: Role,
    ) -> BTreeMap<crate::protocol::WorkClass, BTreeMap<String, usize>> {
        use crate::protocol::WorkClass;
        let Some(q) = self.queues.get(&role) else {
            return BTreeMap::new();
        };
        [WorkClass::Interactive, WorkClass::Batch]
            .into_iter()
            .map(|class| {
                let per: BTreeMap<String, usize> = q
                    .waiting_in(class)
                    .into_iter()
                    .map(|(p, n)| (p.to_string(), n))
                    .collect();
                (class, per)
            })
            .filter(|(_, per)| !per.is_empty())
            .collect()
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

#[cfg(test)]
mod tests;

/// How a live space is named in messages.
fn live_name(which: Live) -> &'static str {
    match which {
        Live::Current => "current",
        Live::Next => "next",
        Live::Previous => "previous",
    }
}
