//! Connected agents and their providers, as the hub sees them: credits offered, leases held,
//! counters, the last heartbeat. One entry per agent id; a newer socket supersedes the older.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tokio::sync::mpsc;

use crate::hub::measured::LatencyMs;
use crate::protocol::{
    Backend, ConfigAck, DeviceInfo, HeldConfig, ProviderInfo, ProviderStats, ScoreActivation,
};
use crate::roles::Op;
use crate::roles::Role;

/// What the hub writes to one agent socket.
#[derive(Debug)]
pub enum Outgoing {
    Frame(String),
    /// Close the socket with this reason (a superseded or refused session).
    Close(String),
}

pub type AgentTx = mpsc::UnboundedSender<Outgoing>;

/// Which provider served a result: every vector carries this as its provenance.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ProviderRef {
    /// `agent_id/provider_id`.
    pub provider: String,
    pub agent: String,
    #[serde(flatten)]
    pub origin: ModelOrigin,
}

/// Where a provider's answers come from (its backend, model, pinned revision or upstream):
/// the part of its identity that its provenance, its scorer and its status view share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ModelOrigin {
    pub backend: Backend,
    pub model: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// The kind of model server a local provider fronts (`vllm`, `ollama`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
}

impl ModelOrigin {
    pub fn of(info: &ProviderInfo) -> Self {
        ModelOrigin {
            backend: info.backend,
            model: info.model.clone(),
            revision: info.revision.clone(),
            upstream: info.upstream.clone(),
            server: info.server.clone(),
        }
    }
}

/// A reranker's scorer identity: providers of one identity produce scores on one scale.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ScorerRef {
    /// `backend model@revision-or-upstream activation`.
    pub id: String,
    #[serde(flatten)]
    pub origin: ModelOrigin,
    /// How its probability comes from its logit (`none`: it reports logits only).
    pub activation: ScoreActivation,
}

impl ScorerRef {
    /// The identity of a reranker provider (`None` for other roles).
    pub fn of(info: &ProviderInfo) -> Option<ScorerRef> {
        if info.role.op() != Op::Rerank {
            return None;
        }
        let activation = info.score_activation.unwrap_or_default();
        let at = match info.backend {
            Backend::Local => info.revision.as_deref().unwrap_or("-"),
            // An unpinned cloud route may be answered by any upstream of the model.
            Backend::Cloud => info.upstream.as_deref().unwrap_or("any upstream"),
        };
        let backend = match info.backend {
            Backend::Local => "local",
            Backend::Cloud => "cloud",
        };
        let activation_name = match activation {
            ScoreActivation::None => "logit",
            ScoreActivation::Sigmoid => "sigmoid",
        };
        // A fronted server's declared quantization is part of what it claims to be.
        let quantization = match (&info.server, &info.dtype) {
            (Some(_), Some(q)) => format!(" {q}"),
            _ => String::new(),
        };
        Some(ScorerRef {
            id: format!(
                "{backend} {}@{at}{quantization} {activation_name}",
                info.model
            ),
            origin: ModelOrigin::of(info),
            activation,
        })
    }
}

/// One provider of a connected agent.
#[derive(Debug)]
pub struct ProviderEntry {
    pub info: ProviderInfo,
    pub reference: Arc<ProviderRef>,
    /// The budget route of a cloud provider (`role:model@upstream`); `None` for local ones.
    pub route: Option<String>,
    /// How the compatibility gate sees an embedding provider; `None` for other roles.
    pub gate_candidate: Option<crate::hub::gate::Candidate>,
    /// The scorer identity a reranker claims; `None` for other roles.
    pub claimed_scorer: Option<Arc<ScorerRef>>,
    /// The scorer it serves as: a cloud reranker's claim at once, a local one's once the
    /// scorer check ([`crate::hub::scorer_check`]) has compared it on the probe pairs (the
    /// claim, or a `~N` variant when it disagrees). `None`: it serves no rerank work.
    pub scorer: Option<Arc<ScorerRef>>,
    /// A cloud route that refuses every call until a push (no endpoint for its pin): why.
    pub refused: Option<String>,
    /// A provider whose output was wrong in itself (NaN or infinity) and that no gate verdict
    /// covers (a reranker, a chat): why. It serves nothing until its agent announces it anew.
    pub defective: Option<String>,
    /// A cloud route that is not the hub's now (another model, pin or width; a policy that
    /// keeps the role local; a key of an older generation, or none). It serves nothing, is
    /// probed by no gate and asked nothing of the account.
    pub stale: Option<Stale>,
    /// Work frames the provider still asked for.
    pub credits: u32,
    pub in_flight: u32,
    /// Of those, leases of batch work (a local provider keeps a credit for interactive work).
    pub batch_in_flight: u32,
    pub served_items: u64,
    pub failures: u64,
    pub consecutive_failures: u32,
    /// Two failures in a row bench a provider until then.
    pub benched_until: Option<Instant>,
    /// A rate-limited provider waits until then (not counted as a failure).
    pub paused_until: Option<Instant>,
    /// Work-frame latency as the agent measured it (EWMA, α 0.2).
    pub latency_ewma_ms: Option<f64>,
    pub heartbeat: Option<ProviderStats>,
}

impl ProviderEntry {
    pub fn new(agent: &str, info: ProviderInfo) -> Self {
        let reference = Arc::new(ProviderRef {
            provider: format!("{agent}/{}", info.id),
            agent: agent.to_string(),
            origin: ModelOrigin::of(&info),
        });
        let route = (info.backend == Backend::Cloud).then(|| match &info.upstream {
            Some(up) => format!("{}:{}@{up}", info.role, info.model),
            None => format!("{}:{}", info.role, info.model),
        });
        let gate_candidate = info
            .role
            .is_embedding()
            .then(|| crate::hub::gate::Candidate {
                provider: reference.provider.clone(),
                role: info.role,
                backend: info.backend,
                model: info.model.clone(),
                revision: info.revision.clone(),
                upstream: info.upstream.clone(),
                regime: match (info.backend, &info.server) {
                    (Backend::Cloud, _) => "cloud".to_string(),
                    (Backend::Local, Some(kind)) => format!("server/{kind}"),
                    (Backend::Local, None) => {
                        let device = info.device.as_deref().unwrap_or("?");
                        let kind = device.split(':').next().unwrap_or(device);
                        format!("{}/{kind}", info.dtype.as_deref().unwrap_or("?"))
                    }
                },
                dims: info.dims,
                fronted: info.server.is_some(),
                healthy: true,
            });
        let claimed_scorer = ScorerRef::of(&info).map(Arc::new);
        let scorer = claimed_scorer
            .clone()
            .filter(|_| info.backend == Backend::Cloud);
        Self {
            info,
            reference,
            route,
            gate_candidate,
            claimed_scorer,
            scorer,
            refused: None,
            defective: None,
            stale: None,
            credits: 0,
            in_flight: 0,
            batch_in_flight: 0,
            served_items: 0,
            failures: 0,
            consecutive_failures: 0,
            benched_until: None,
            paused_until: None,
            latency_ewma_ms: None,
            heartbeat: None,
        }
    }

    pub fn role(&self) -> Role {
        self.info.role
    }

    /// A lease of `class` went out to this provider.
    pub fn lease_granted(&mut self, class: crate::protocol::WorkClass) {
        self.in_flight = self.in_flight.saturating_add(1);
        if class.is_batch() {
            self.batch_in_flight = self.batch_in_flight.saturating_add(1);
        }
    }

    /// A lease of `class` on this provider ended (a result, a failure, taken back).
    pub fn lease_ended(&mut self, class: crate::protocol::WorkClass) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if class.is_batch() {
            self.batch_in_flight = self.batch_in_flight.saturating_sub(1);
        }
    }

    /// Whether a local provider must keep its free credit for interactive work: it offered
    /// two or more frames in all and all but one already carry batch work. A provider of one
    /// frame takes any work.
    pub fn keeps_credit_for_interactive(&self) -> bool {
        let depth = self.credits.saturating_add(self.in_flight);
        self.info.backend == crate::protocol::Backend::Local
            && depth >= 2
            && self.batch_in_flight >= depth - 1
    }

    /// Not benched (failures) and not paused (rate limits) at `now`.
    pub fn is_available(&self, now: Instant) -> bool {
        self.benched_until.is_none_or(|t| t <= now) && self.paused_until.is_none_or(|t| t <= now)
    }

    pub fn is_healthy(&self, now: Instant) -> bool {
        self.benched_until.is_none_or(|t| t <= now)
    }

    pub fn record_latency(&mut self, latency: LatencyMs) {
        const ALPHA: f64 = 0.2;
        let latency_ms = latency.ms();
        self.latency_ewma_ms = Some(match self.latency_ewma_ms {
            Some(prev) => prev + ALPHA * (latency_ms - prev),
            None => latency_ms,
        });
    }
}

/// Why a cloud route serves nothing now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stale {
    pub reason: String,
    /// The current config is on its way to its agent (sent, not yet acknowledged): it may
    /// hold it within a round trip, so work waits rather than fails.
    pub config_on_the_way: bool,
}

/// One connected agent.
#[derive(Debug)]
pub struct AgentEntry {
    pub session: u64,
    pub hostname: String,
    pub version: String,
    pub connected_at: Instant,
    /// When a frame of this session last arrived.
    pub last_seen: Instant,
    /// The agent process's random id (`hello.instance`), where it said one.
    pub instance: Option<String>,
    pub tx: AgentTx,
    pub providers: BTreeMap<String, ProviderEntry>,
    pub devices: Vec<DeviceInfo>,
    pub last_config_ack: Option<ConfigAck>,
    /// The config it says it holds (`hello`, then every heartbeat).
    pub held: HeldConfig,
    /// The revision of the whole config last sent to this session (sent once per revision,
    /// not on every heartbeat).
    pub config_sent: Option<u64>,
    /// A config frame went to it and no `config_ack` came back yet.
    pub config_awaiting_ack: bool,
    /// The agent keeps keyed chats' answers across sessions (`hello.keeps_answers`).
    pub keeps_answers: bool,
    /// It withdrew every provider after serving some (an agent shutting down announces an
    /// empty set and finishes its leases): draining, not idle.
    pub draining: bool,
}

impl AgentEntry {
    pub fn send(&self, frame: String) -> bool {
        self.tx.send(Outgoing::Frame(frame)).is_ok()
    }
}

/// Sockets open per agent id now, and the most ever open at once (status proves "one socket
/// per agent": the maximum stays 1 through reconnects).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct SocketCount {
    pub open: u32,
    pub max_concurrent: u32,
    pub total: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(backend: Backend, revision: Option<&str>, upstream: Option<&str>) -> ProviderInfo {
        ProviderInfo {
            id: "reranker".into(),
            role: Role::Reranker,
            backend,
            model: "m".into(),
            revision: revision.map(str::to_string),
            upstream: upstream.map(str::to_string),
            dims: None,
            dtype: None,
            device: None,
            max_input_tokens: None,
            pooling: None,
            max_batch_items: 8,
            max_batch_tokens: 1024,
            score_activation: Some(ScoreActivation::Sigmoid),
            server: None,
            attention: None,
        }
    }

    #[test]
    fn a_scorer_is_model_revision_or_upstream_and_activation() {
        let a = ScorerRef::of(&info(Backend::Local, Some("r1"), None)).unwrap();
        let b = ScorerRef::of(&info(Backend::Local, Some("r2"), None)).unwrap();
        let c = ScorerRef::of(&info(Backend::Cloud, None, Some("deepinfra"))).unwrap();
        assert_eq!(a.id, "local m@r1 sigmoid");
        assert_ne!(a.id, b.id, "a new revision is a new scorer");
        assert_eq!(c.id, "cloud m@deepinfra sigmoid");
        let mut logits = info(Backend::Local, Some("r1"), None);
        logits.score_activation = Some(ScoreActivation::None);
        assert_ne!(ScorerRef::of(&logits).unwrap().id, a.id);
        let mut embedder = info(Backend::Local, Some("r1"), None);
        embedder.role = Role::Embedding;
        assert!(ScorerRef::of(&embedder).is_none());
    }
}
