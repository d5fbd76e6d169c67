//! Connected agents and their providers, as the hub sees them: credits offered, leases held,
//! counters, the last heartbeat. One entry per agent id; a newer socket supersedes the older.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tokio::sync::mpsc;

use crate::protocol::{Backend, ConfigAck, DeviceInfo, ProviderInfo, ProviderStats};
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
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProviderRef {
    /// `agent_id/provider_id`.
    pub provider: String,
    pub agent: String,
    pub backend: Backend,
    pub model: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
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
    /// Work frames the provider still asked for.
    pub credits: u32,
    pub in_flight: u32,
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
            backend: info.backend,
            model: info.model.clone(),
            revision: info.revision.clone(),
            upstream: info.upstream.clone(),
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
                regime: match info.backend {
                    Backend::Cloud => "cloud".to_string(),
                    Backend::Local => {
                        let device = info.device.as_deref().unwrap_or("?");
                        let kind = device.split(':').next().unwrap_or(device);
                        format!("{}/{kind}", info.dtype.as_deref().unwrap_or("?"))
                    }
                },
                dims: info.dims,
                healthy: true,
            });
        Self {
            info,
            reference,
            route,
            gate_candidate,
            credits: 0,
            in_flight: 0,
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

    /// Not benched (failures) and not paused (rate limits) at `now`.
    pub fn is_available(&self, now: Instant) -> bool {
        self.benched_until.is_none_or(|t| t <= now) && self.paused_until.is_none_or(|t| t <= now)
    }

    pub fn is_healthy(&self, now: Instant) -> bool {
        self.benched_until.is_none_or(|t| t <= now)
    }

    pub fn record_latency(&mut self, latency_ms: f64) {
        const ALPHA: f64 = 0.2;
        self.latency_ewma_ms = Some(match self.latency_ewma_ms {
            Some(prev) => prev + ALPHA * (latency_ms - prev),
            None => latency_ms,
        });
    }
}

/// One connected agent.
#[derive(Debug)]
pub struct AgentEntry {
    pub session: u64,
    pub hostname: String,
    pub version: String,
    pub connected_at: Instant,
    pub tx: AgentTx,
    pub providers: BTreeMap<String, ProviderEntry>,
    pub devices: Vec<DeviceInfo>,
    pub last_config_ack: Option<ConfigAck>,
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
