//! The fleet protocol (hub ⇄ agent), version 1: every frame as a typed struct.
//!
//! WebSocket text frames of JSON, `type` always the first key (serde writes an internal tag
//! first). [`codec`] turns frames into text and back, with the size limits and the error
//! classes a peer is told about. `docs/protocol.md` has one example of each frame.

pub mod codec;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::push::{OpenRouterPush, RoleOutcome};
pub use crate::model_spec::ScoreActivation;
use crate::roles::Role;

pub use codec::{FrameError, decode_agent, decode_hub, encode};

/// The protocol version this build speaks; `hello` carries it and the hub refuses others.
pub const PROTOCOL_VERSION: u32 = 1;

/// The header a hub leading on etcd answers an agent's upgrade with: its epoch, so that an
/// agent that dialled every hub says `hello` to the leader with the highest one only.
pub const EPOCH_HEADER: &str = "x-fantom-epoch";

/// The slowest link a healthy peer is assumed to have (bytes per second): a large frame may
/// take its size at this rate to write before the peer is taken for stuck.
pub const MIN_LINK_BYTES_PER_S: u64 = 256 * 1024;

/// How long writing a frame of `bytes` may take: the silence bound (three heartbeats) plus the
/// frame's size at [`MIN_LINK_BYTES_PER_S`]. A write that takes longer is a stuck peer.
pub fn write_timeout(heartbeat: std::time::Duration, bytes: usize) -> std::time::Duration {
    let transfer = u64::try_from(bytes).unwrap_or(u64::MAX) / MIN_LINK_BYTES_PER_S;
    heartbeat
        .saturating_mul(3)
        .saturating_add(std::time::Duration::from_secs(transfer))
}

/// Frames an agent sends.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentFrame {
    /// The first frame on a socket: who the agent is and what it can serve.
    Hello(Hello),
    /// The provider set changed (an empty set: the agent is draining).
    Providers {
        providers: Vec<ProviderInfo>,
    },
    Heartbeat(Heartbeat),
    /// A provider can take `credits` more work frames (added to what it already offered).
    Pull(Pull),
    /// One piece of a streamed chat, in order (`seq` from 0); `done` follows the last.
    Chunk(Chunk),
    Done(Done),
    Failed(Failed),
    ConfigAck(ConfigAck),
    ProbeResult(ProbeResult),
    /// The answer to `discover`: what the pushed key's account allows, numbers only.
    Limits(AccountLimits),
    /// A keyed chat's outcome this agent kept (it ran under an earlier session, or its `done`
    /// may never have reached that session's hub): sent to a hub whose `welcome` takes them.
    Kept(KeptAnswer),
}

/// Frames the hub sends.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HubFrame {
    Welcome(Welcome),
    /// Something the agent sent was refused; the socket stays open unless it is closed next.
    /// `code` names refusals an agent acts on (see [`ErrorCode`]).
    Error {
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<ErrorCode>,
    },
    /// A partial config push (DESIGN §4); the only frame that may carry the key.
    Config(ConfigFrame),
    Work(Work),
    Probe(Probe),
    /// Stop working on a lease: it expired or its request is gone; a result is dropped.
    Cancel {
        lease: u64,
        reason: String,
    },
    /// Ask the account's limits with the pushed key (answered by `limits`).
    Discover,
    /// The gate suspended one of this agent's providers (drift): the agent keeps it and
    /// reports it in its next `hello`, so a leader that could not store it is not forgotten.
    Suspended(Suspension),
    /// The hub holds this keyed chat's answer (its `done`, or a `kept` frame): the agent
    /// stops keeping it.
    Delivered(IdempotencyTag),
}

/// A suspension as the hub that made it told the agent (and the agent tells the next hub).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Suspension {
    /// The agent's provider id.
    pub provider: String,
    /// The gate's verdict key (opaque to the agent: provider, model, upstream, width, space).
    pub key: String,
    pub space: String,
    /// The space's generation it was judged for.
    pub generation: u64,
    pub reason: String,
    /// When the hub suspended it (ms since the Unix epoch).
    pub at_ms: u64,
}

/// Refusals an agent acts on rather than just logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// `hello` named an agent id another live process (another `instance`) holds: this
    /// process must not serve under it (it exits, naming the id and the other host).
    AgentIdInUse,
    /// `hello` spoke another protocol version: nothing useful can follow.
    ProtocolVersion,
}

/// What an agent learned about the pushed key's account (`GET /key`, `GET /credits`). Numbers
/// only: never the key, its label or anything that names it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AccountLimits {
    /// Requests per minute, when the account reports a usable one (the deprecated `-1` is
    /// reported as absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<f64>,
    /// Whether the account has money to spend (`None`: nothing said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub funded: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credits_remaining_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_remaining_usd: Option<f64>,
    /// Why discovery failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub agent_id: String,
    pub hostname: String,
    /// The agent's build (crate version).
    pub version: String,
    pub protocol_version: u32,
    pub providers: Vec<ProviderInfo>,
    #[serde(default)]
    pub devices: Vec<DeviceInfo>,
    /// Random per process: the same instance reconnecting supersedes its old socket; another
    /// instance claiming a live id is refused ([`ErrorCode::AgentIdInUse`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The config this agent holds: the revision of the hub's last whole config it applied
    /// (absent: none, or an agent of an older build; either counts as behind) and the
    /// generation of the key it holds (absent: no key).
    #[serde(flatten)]
    pub config: HeldConfig,
    /// Suspensions a hub told this agent of (the last per provider and space, at most
    /// [`MAX_REPORTED_SUSPENSIONS`]): the next leader honours those newer than its verdict.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspensions: Vec<Suspension>,
    /// Keyed chats this agent still runs for an earlier session (at most
    /// [`MAX_KEPT_ANSWERS`]): a retry with one of these keys waits for its `kept` answer
    /// instead of going upstream again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answering: Vec<AnsweringCall>,
    /// This agent finishes a keyed chat when its session ends and hands the answer over
    /// (`kept`): the hub waits for it rather than sending the chat to another provider.
    /// Absent from older builds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keeps_answers: bool,
}

/// A chat a client sent with an `Idempotency-Key`: its project, the key's digest (the hub's
/// `replies::key_id`: the client's value itself never leaves the hub's request handler), and a
/// digest of the request as the hub forwarded it (a retry with another body under the same key
/// is refused).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IdempotencyTag {
    pub project: String,
    pub key: String,
    pub digest: String,
}

/// A keyed chat an agent still runs for an earlier session, and the provider running it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnsweringCall {
    #[serde(flatten)]
    pub tag: IdempotencyTag,
    pub provider: String,
}

/// The most keyed answers an agent keeps (and reports running) at once.
pub const MAX_KEPT_ANSWERS: usize = 64;

/// A keyed chat's outcome as its agent kept it: the completion (absent when the call failed:
/// `error` says why), with what it read and cost.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KeptAnswer {
    #[serde(flatten)]
    pub tag: IdempotencyTag,
    /// The agent's provider that ran it.
    pub provider: String,
    pub backend: Backend,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<WorkOutput>,
    #[serde(default)]
    pub tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// How the call failed (with `error`): a `fatal` one is not run again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<FailureClass>,
}

/// The most suspensions a `hello` carries (and a hub reads).
pub const MAX_REPORTED_SUSPENSIONS: usize = 64;

/// Which of the hub's configs an agent holds (`hello` and every `heartbeat` say it): the hub
/// serves an agent's cloud providers only while it holds the current key generation and
/// routes equal to the hub's, and re-sends the whole config to an agent that is behind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_revision: Option<u64>,
    /// A random id the hub gave the key with the push that carried it (never derived from
    /// the key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_generation: Option<String>,
}

/// Whether a provider computes here or calls a cloud upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Local,
    Cloud,
}

/// One provider: one thing that serves one role on one agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProviderInfo {
    /// Unique within the agent (the hub names it `agent_id/id`).
    pub id: String,
    pub role: Role,
    pub backend: Backend,
    pub model: String,
    /// Local: the resolved revision of the pinned model, or `sha256:…` of an unpinned folder's
    /// files (changed bytes are a new provider identity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Cloud: the pinned upstream provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// Output width of an embedder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dims: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The most tokens of one input (longer ones are truncated, or refused when the agent
    /// runs with `--no-truncate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_input_tokens: Option<usize>,
    /// An embedder's pooling (`mean`, `cls`, `last`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooling: Option<String>,
    /// The most items (texts, documents) one work frame may carry.
    pub max_batch_items: usize,
    /// The most tokens (estimated by the hub) one work frame may carry.
    pub max_batch_tokens: usize,
    /// A reranker's score scale: how its probability comes from its raw logit (`sigmoid`),
    /// or that it has none (`none`). Part of its scorer identity: one rerank request is
    /// scored on one scale only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_activation: Option<ScoreActivation>,
    /// A model server this agent fronts rather than runs (`vllm`, `ollama`, `llama-cpp`,
    /// `tei`, `openai`): local (nothing leaves the host), but its weights are not ours to
    /// pin, so an embedding server never founds a space unless the operator names it the
    /// gate's reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// A local model's attention path: `packed` (no padding token computed: the CPU's kernel,
    /// or the CUDA kernel in bf16/f16) or `padded` (masked matmul over right-padded rows, where
    /// the kernel does not run). Informational: it changes speed, not the vectors' space.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
}

/// A compute device and its memory (absent where the backend cannot tell).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_total_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_free_mb: Option<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Heartbeat {
    pub providers: Vec<ProviderStats>,
    #[serde(default)]
    pub devices: Vec<DeviceInfo>,
    /// The leases whose work is running here: each is renewed for its role's lease length,
    /// so work slower than a lease on a live agent is never taken back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leases: Vec<u64>,
    #[serde(flatten)]
    pub config: HeldConfig,
}

/// A provider's counters since the agent started.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProviderStats {
    pub provider: String,
    pub in_flight: u32,
    /// Items served.
    pub served: u64,
    pub failures: u64,
    /// Latency of the model or upstream call per work item (successes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ewma_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_p50_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_p95_ms: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pull {
    pub provider: String,
    pub credits: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Done {
    pub lease: u64,
    pub output: WorkOutput,
    /// Measured around the model or upstream call alone.
    pub latency_ms: f64,
    /// Tokens the model read (usage reports).
    #[serde(default)]
    pub tokens: u64,
    /// What the call cost, in US dollars, where the upstream reports it (OpenRouter's
    /// `usage.cost`); absent for local work and for answers without a cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

/// One chunk of a streamed chat completion (an OpenAI `chat.completion.chunk` object, as the
/// upstream sent it). The first chunk of a lease binds its request to that lease: from then
/// on a lost lease fails the request (the client has part of an answer) instead of
/// requeueing it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Chunk {
    pub lease: u64,
    pub seq: u64,
    pub data: serde_json::Value,
}

/// What a failure means for the item and for the provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// Upstream throttling: requeue, do not count against the provider.
    RateLimited,
    /// Requeue at the front; counts against the provider (two in a row bench it).
    Transient,
    /// The input cannot be served by anyone: the client request fails with the message.
    Fatal,
    /// The provider will not serve this (draining, gate): requeue, counts like transient.
    Refused,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Failed {
    pub lease: u64,
    pub class: FailureClass,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// Which limit refused the call, when a limit did: the budget's scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<LimitKind>,
    /// Why a cloud route refuses every call until the operator acts, when it does: the hub
    /// fails the work only that route could serve instead of requeueing it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<Refusal>,
    /// What was wrong with the provider's own output, when that is why it failed: the hub
    /// takes the provider out of service (as a drift would) rather than trying it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defect: Option<Defect>,
    pub message: String,
}

/// A provider's output that is wrong in itself, whatever the input: the provider is broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Defect {
    /// The model produced NaN or an infinity (a corrupted weight file, a half-precision
    /// overflow on a GPU). JSON has no such numbers: the agent reports this instead of a frame
    /// no hub could read.
    NonFinite,
}

/// A cloud route's standing refusal: no retry can help until a new push (a new key, a new pin).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// OpenRouter refused the key (HTTP 401/403): every cloud route shares it.
    KeyRejected,
    /// No endpoint matches the route's pinned upstream (HTTP 404 `no_endpoints`).
    NoEndpoint,
}

/// Which limit a cloud call ran into (the budget reacts per kind, DESIGN §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitKind {
    /// OpenRouter's own limit for the key (every route shares it).
    Platform,
    /// The pinned upstream's capacity (this route only).
    Upstream,
    /// The account's in-flight spending budget (transient 402).
    InFlightBudget,
    /// Out of credits (hard 402): cloud work stops until a new key or top-up.
    Credits,
    /// The key's own spending cap (hard 402).
    KeyLimit,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConfigAck {
    pub id: String,
    /// False when the push was refused whole (`reason` says why).
    pub applied: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default)]
    pub roles: BTreeMap<String, RoleOutcome>,
    /// The config the agent holds after it (see [`HeldConfig`]).
    #[serde(flatten)]
    pub config: HeldConfig,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeResult {
    pub probe: String,
    pub provider: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vectors: Option<Vec<Vec<f32>>>,
    /// A reranker's scores of the probe pairs (the answer to a probe with a `query`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scores: Option<Vec<Score>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// With `error`: the provider's output was wrong in itself (see [`Defect`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defect: Option<Defect>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Welcome {
    pub session: u64,
    pub protocol_version: u32,
    /// Heartbeats (which renew running leases) come this often; the hub pings as often, and
    /// three intervals of silence either way end the socket.
    pub heartbeat_interval_ms: u64,
    /// The default lease length (a role may have its own: each work frame's deadline says).
    pub lease_ms: u64,
    /// The hub pings every heartbeat interval: three intervals with nothing from it mean a
    /// dead socket. (Absent from hubs of older builds, which do not ping.)
    #[serde(default)]
    pub pings: bool,
    /// A hub that leads on etcd: its epoch (the leader key's creation revision). An agent
    /// that has seen a higher one refuses this hub: it is a deposed leader that has not yet
    /// noticed. (Absent from a hub on a state file, and from older builds.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
    /// The hub takes `kept` frames (keyed chats' answers an agent kept). Absent from older
    /// builds: an agent sends them none.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub takes_answers: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConfigFrame {
    pub id: String,
    /// Set by this hub: the payload is the hub's whole merged config at this revision, which
    /// the agent holds instead of what it held (absent: a partial push, merged as Fantom's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// The generation of the hub's current key (with `revision`): the frame's key when it
    /// carries one; otherwise an agent holding another generation drops its key (it was
    /// replaced while the agent was away, and the hub cannot send it again: it never stored
    /// it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_generation: Option<String>,
    pub payload: ConfigPayload,
}

/// The push payload, in Fantom's shape; keys other than `openrouter` are ignored.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ConfigPayload {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub openrouter: Option<OpenRouterPush>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Work {
    pub lease: u64,
    pub provider: String,
    pub role: Role,
    #[serde(flatten)]
    pub input: WorkInput,
    /// When the lease expires unless a heartbeat renews it (milliseconds since the Unix
    /// epoch).
    pub deadline_ms: u64,
    /// The longest the provider's call may take (the role's call timeout): past it the work
    /// fails as fatal, so a stuck upstream is never billed again by a retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_timeout_ms: Option<u64>,
    /// The class of the frame's items: an agent's engine serves `interactive` work before
    /// batch work it already holds. Absent means batch (what an older hub sends; an older
    /// agent ignores the field and serves in arrival order, and the hub's bound on the batch
    /// work it grants ahead still holds for it).
    #[serde(default, skip_serializing_if = "WorkClass::is_batch")]
    pub class: WorkClass,
    /// The W3C `traceparent` of each request whose items the frame carries (each once, at most
    /// 64), when the hub exports traces: the agent's spans for the frame link to them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub traces: Vec<String>,
    /// A chat a client sent with an `Idempotency-Key`: the agent finishes it even when the
    /// session ends, keeps its answer a while and hands it to the next hub (`kept`). An older
    /// agent ignores it and keeps nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency: Option<IdempotencyTag>,
}

/// Which class of work a frame carries. Interactive work (queries, reranks, chats, or
/// anything a client marks `X-Priority: interactive`) goes before batch work: first in the
/// hub's queues (with a guard so batch still gets a share) and in an agent's engine.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum WorkClass {
    Interactive,
    #[default]
    Batch,
}

impl WorkClass {
    pub fn is_batch(&self) -> bool {
        *self == WorkClass::Batch
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WorkClass::Interactive => "interactive",
            WorkClass::Batch => "batch",
        }
    }
}

/// What to compute: `op` names the operation, `input` holds its arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "input", rename_all = "snake_case")]
pub enum WorkInput {
    Embed(EmbedInput),
    Rerank(RerankInput),
    /// One chat completion: the client's request body (an OpenAI chat object; the hub sets no
    /// model: the provider's route names it).
    Chat(serde_json::Value),
}

impl WorkInput {
    /// Items in this work frame.
    pub fn items(&self) -> usize {
        match self {
            WorkInput::Embed(e) => e.texts.len(),
            WorkInput::Rerank(r) => r.documents.len(),
            WorkInput::Chat(_) => 1,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EmbedInput {
    pub texts: Vec<String>,
    /// Matryoshka truncation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<usize>,
    /// Apply the model's query template.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_query: bool,
    /// The instruction of instruction-aware models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instruction: Option<String>,
    /// Cut texts past the model's limit even where this agent refuses them for clients
    /// (`no_truncate`): set by the agent for the gate's probe texts, which every provider of
    /// a space must read the way a truncating one does. The hub never sets it in work frames.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncate: bool,
}

impl EmbedInput {
    /// The texts as a model behind an API takes them: a query of an instruction-aware model
    /// carries the instruction in its text (Qwen3-Embedding's query format, as the local
    /// encoder applies it).
    pub fn instructed_texts(self) -> Vec<String> {
        match (&self.instruction, self.is_query) {
            (Some(task), true) => self
                .texts
                .iter()
                .map(|t| format!("Instruct: {task}\nQuery:{t}"))
                .collect(),
            _ => self.texts,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RerankInput {
    pub query: String,
    pub documents: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instruction: Option<String>,
}

/// A result, one entry per input item, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkOutput {
    Embeddings(Vec<Vec<f32>>),
    Scores(Vec<Score>),
    /// The upstream's chat completion object.
    Chat(serde_json::Value),
}

impl WorkOutput {
    pub fn len(&self) -> usize {
        match self {
            WorkOutput::Embeddings(v) => v.len(),
            WorkOutput::Scores(s) => s.len(),
            WorkOutput::Chat(_) => 1,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether every number is finite (a chat's JSON cannot hold any other kind).
    pub fn is_finite(&self) -> bool {
        match self {
            WorkOutput::Embeddings(v) => v.iter().flatten().all(|x| x.is_finite()),
            WorkOutput::Scores(s) => s.iter().all(Score::is_finite),
            WorkOutput::Chat(_) => true,
        }
    }
}

/// A reranker's output for one document.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// The raw relevance logit.
    pub score: f32,
    /// `sigmoid(score)` where the model defines one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probability: Option<f32>,
}

impl Score {
    /// Whether the logit and its probability (where there is one) are finite.
    pub fn is_finite(&self) -> bool {
        self.score.is_finite() && self.probability.is_none_or(f32::is_finite)
    }

    /// A logit and its sigmoid.
    pub fn from_logit(x: f32) -> Score {
        Score {
            score: x,
            probability: Some(1.0 / (1.0 + (-x).exp())),
        }
    }

    /// A probability (a cloud's or a fronted server's) with its logit beside it, so every
    /// scorer's scores share one scale; finite at 0 and 1 (clamped a hair inside).
    pub fn from_probability(p: f32) -> Score {
        let clamped = p.clamp(1e-6, 1.0 - 1e-6);
        Score {
            score: (clamped / (1.0 - clamped)).ln(),
            probability: Some(p),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Probe {
    pub probe: String,
    pub provider: String,
    /// The gate's probe texts; with `query`, the documents scored against it.
    pub texts: Vec<String>,
    /// A reranker's probe: the query of its fixed probe pairs (the scorer check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
}
