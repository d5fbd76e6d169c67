//! Views of the hub: for operators, the `/admin/status` document and the Prometheus text of
//! `/metrics` (counters, gauges and the queue, batch and token histograms); for clients, the
//! role catalog behind `/v1/models`, TEI's `/info`, model-id lookup and `/ready`. Each reads
//! one snapshot under the core's lock; none can see a secret (the core holds none).

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use super::Hub;
use super::budget::BudgetView;
use super::registry::{ModelOrigin, SocketCount};

use crate::metrics::recent::Quantiles;
use crate::protocol::{ConfigAck, DeviceInfo, HeldConfig, ProviderStats, WorkClass};
use crate::roles::{Policy, Role};

#[derive(Debug, Serialize)]
pub struct StatusView {
    pub uptime_s: u64,
    pub agents: Vec<AgentView>,
    /// Sockets per agent id since start (`max_concurrent` stays 1 when agents behave).
    pub sockets: BTreeMap<String, SocketCount>,
    pub roles: BTreeMap<Role, RoleView>,
    pub requests_waiting: usize,
    /// Input bytes accepted requests hold (bounded by the hub's `max_held_mb`).
    pub held_bytes: usize,
    pub config: ConfigView,
    pub settings: SettingsView,
    /// The global cloud budget (DESIGN §5).
    pub budget: BudgetView,
    /// The compatibility gate: spaces, verdicts with their evidence (DESIGN §6).
    pub gate: super::gate::GateView,
    /// Each embedding role's live spaces (current, and around a migration next and previous)
    /// with who passes each and what each served.
    pub migrations: Vec<super::migration::MigrationView>,
    /// The scorer check: which scorer each local reranker serves as, after the probe pairs.
    pub scorers: Vec<super::scorer_check::ScorerCheckView>,
    /// Each project: settings and accounting (never a key).
    pub projects: Vec<super::project_admin::ProjectView>,
    /// Where the state is kept and, with etcd, this hub's lead.
    pub ha: super::store::HaView,
    /// What the gate and the budget did lately (suspensions, refusals, verifies; cooldowns,
    /// walls a start found, stops, overrides), oldest first; empty after a restart or a takeover.
    pub events: Vec<super::events::Event>,
}

#[derive(Debug, Serialize)]
pub struct AgentView {
    pub id: String,
    pub session: u64,
    pub hostname: String,
    pub version: String,
    pub connected_s: u64,
    pub leases: usize,
    pub providers: Vec<ProviderView>,
    pub devices: Vec<DeviceInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_config_ack: Option<ConfigAck>,
    /// The config revision and key generation the agent says it holds.
    pub holds: HeldConfig,
    /// Whether it holds the hub's current key (when one was pushed): without it, its cloud
    /// routes serve nothing until a push with the key reaches it.
    pub needs_key_push: bool,
    /// It withdrew every provider and finishes its leases (shutting down).
    pub draining: bool,
}

#[derive(Debug, Serialize)]
pub struct ProviderView {
    pub provider: String,
    pub role: Role,
    #[serde(flatten)]
    pub origin: ModelOrigin,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dims: Option<usize>,
    /// The work frame limits it announced (a local model's token budget is what its engine
    /// sized at start: configured, default, or from free device memory).
    pub max_batch_items: usize,
    pub max_batch_tokens: usize,
    /// A local model's attention path (`packed` or `padded`), as its agent announced it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
    pub credits: u32,
    pub in_flight: u32,
    pub served_items: u64,
    pub failures: u64,
    pub benched: bool,
    pub paused: bool,
    /// Why a cloud route serves nothing: it is not the hub's route now, or its agent does not
    /// hold the current key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale: Option<String>,
    /// Why it serves nothing: its output was wrong in itself (NaN or infinity), or a cloud
    /// route's pin matches no endpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_of_service: Option<String>,
    /// Work-frame latency the agent measured (hub-side EWMA of `done.latency_ms`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ewma_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heartbeat: Option<ProviderStats>,
}

#[derive(Debug, Serialize)]
pub struct RoleView {
    pub policy: Policy,
    pub queue_depth: usize,
    /// Items waiting, per class (`interactive`, `batch`) and project.
    pub waiting: BTreeMap<WorkClass, BTreeMap<String, usize>>,
    /// How long its requests waited for their first lease over the last minute, in ms
    /// (absent: none was leased in that minute).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<Quantiles>,
    /// Requests refused at admission since start, by the code their client was told.
    pub refused: BTreeMap<&'static str, u64>,
    /// Accepted requests that ended without an answer since start, by code.
    pub failed: BTreeMap<&'static str, u64>,
    pub leases: usize,
    pub items_in_flight: usize,
    /// Why a new request of the role would not be served now (absent: it would be).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unservable: Option<UnservableView>,
}

/// What a client would be told.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct UnservableView {
    pub code: &'static str,
    pub message: String,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigView {
    pub key_pushed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_pushed_at_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_push_ms: Option<u64>,
    pub cloud_roles: Vec<Role>,
    /// The revision of the hub's config (bumped by every push; agents report theirs).
    pub revision: u64,
    /// The current key's generation id (random per push with a key; not derived from it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_generation: Option<String>,
    /// Connected agents that do not hold the current key: push the key again to serve cloud
    /// work from them.
    pub agents_needing_key: Vec<String>,
}

/// The hub's own settings as they apply now (a SIGHUP may have changed them).
#[derive(Debug, Serialize)]
pub struct SettingsView {
    pub heartbeat_ms: u64,
    /// Each role's lease, request timeout and call timeout.
    pub timings: BTreeMap<Role, TimingsView>,
    pub max_held_bytes: usize,
    pub max_inputs: usize,
    pub max_input_chars: usize,
}

#[derive(Debug, Serialize)]
pub struct TimingsView {
    pub lease_s: f64,
    pub request_timeout_s: f64,
    pub call_timeout_s: f64,
}

impl Hub {
    pub fn status(&self) -> StatusView {
        let state = self.state();
        let projects = self.projects_view();
        // Read before the core's lock: stepping aside takes that lock after its own.
        let mut ha = self.store().ha_view();
        ha.aside = self.aside();
        ha.peers = self.peers();
        ha.handover_saved_ms = self.handover_saved_ms();
        let mut core = self.core();
        let now = Instant::now();
        core.budget.tick(now);
        let budget = core.budget.view(now);
        let gate = core.gate.view(&serving_by_role(&core));
        let needing_key = core.agents_needing_key();
        let agents = core
            .agents()
            .iter()
            .map(|(id, a)| AgentView {
                id: id.clone(),
                session: a.session,
                hostname: a.hostname.clone(),
                version: a.version.clone(),
                connected_s: a.connected_at.elapsed().as_secs(),
                leases: core.leases_of(id),
                providers: a
                    .providers
                    .values()
                    .map(|p| ProviderView {
                        provider: p.reference.provider.clone(),
                        role: p.role(),
                        origin: p.reference.origin.clone(),
                        dims: p.info.dims,
                        max_batch_items: p.info.max_batch_items,
                        max_batch_tokens: p.info.max_batch_tokens,
                        attention: p.info.attention.clone(),
                        credits: p.credits,
                        in_flight: p.in_flight,
                        served_items: p.served_items,
                        failures: p.failures,
                        benched: !p.is_healthy(now),
                        paused: p.paused_until.is_some_and(|t| t > now),
                        stale: p.stale.as_ref().map(|s| s.reason.clone()),
                        out_of_service: p.defective.clone().or_else(|| p.refused.clone()),
                        latency_ewma_ms: p.latency_ewma_ms,
                        heartbeat: p.heartbeat.clone(),
                    })
                    .collect(),
                devices: a.devices.clone(),
                last_config_ack: a.last_config_ack.clone(),
                holds: a.held.clone(),
                needs_key_push: needing_key.contains(id),
                draining: a.draining,
            })
            .collect();
        let leases = core.leases_by_role();
        let roles = Role::ALL
            .into_iter()
            .map(|role| {
                let (n, items) = leases.get(&role).copied().unwrap_or_default();
                let view = RoleView {
                    policy: core.cloud.policy(role),
                    queue_depth: core.queue_depth(role),
                    waiting: core.waiting(role),
                    wait_ms: core
                        .counters
                        .recent_waits_ms
                        .get_mut(&role)
                        .and_then(|r| r.quantiles(now)),
                    refused: core
                        .counters
                        .refused
                        .get(&role)
                        .cloned()
                        .unwrap_or_default(),
                    failed: core.counters.failed.get(&role).cloned().unwrap_or_default(),
                    leases: n,
                    items_in_flight: items,
                    unservable: core.role_outlook(role).map(|u| UnservableView {
                        code: u.code.as_str(),
                        message: u.message,
                    }),
                };
                (role, view)
            })
            .collect();
        let events = super::events::merged([core.gate.events(), core.budget.events()]);
        let migrations = [Role::Embedding, Role::CodeEmbedding]
            .into_iter()
            .filter_map(|r| core.migration_view(r))
            .collect();
        StatusView {
            projects,
            ha,
            events,
            migrations,
            uptime_s: self.uptime().as_secs(),
            agents,
            sockets: core.sockets().clone(),
            roles,
            requests_waiting: core.requests_waiting(),
            held_bytes: core.held_bytes(),
            config: ConfigView {
                key_pushed: state.key.is_some(),
                key_pushed_at_ms: state.key.as_ref().map(|k| k.pushed_at_ms),
                last_push_ms: state.last_push_ms,
                cloud_roles: state.cloud.allowed_models.keys().copied().collect(),
                revision: state.config_revision,
                key_generation: state.key_generation.clone(),
                agents_needing_key: needing_key,
            },
            settings: SettingsView {
                heartbeat_ms: core.settings.heartbeat_interval.as_millis() as u64,
                timings: Role::ALL
                    .into_iter()
                    .map(|r| {
                        let t = core.settings.timings(r);
                        let view = TimingsView {
                            lease_s: t.lease.as_secs_f64(),
                            request_timeout_s: t.request_timeout.as_secs_f64(),
                            call_timeout_s: t.call_timeout.as_secs_f64(),
                        };
                        (r, view)
                    })
                    .collect(),
                max_held_bytes: core.settings.limits.max_held_bytes,
                max_inputs: core.settings.limits.max_inputs,
                max_input_chars: core.settings.limits.max_input_chars,
            },
            budget,
            gate,
            scorers: core.scorer_check.view(),
        }
    }
}

/// Connected embedding providers per role.
pub(super) fn serving_by_role(core: &super::core::Core) -> BTreeMap<Role, Vec<String>> {
    let mut out: BTreeMap<Role, Vec<String>> = BTreeMap::new();
    for a in core.agents().values() {
        for p in a.providers.values().filter(|p| p.role().is_embedding()) {
            out.entry(p.role())
                .or_default()
                .push(p.reference.provider.clone());
        }
    }
    out
}

/// What the hub serves for one role, as the clients' model listings show it (`/v1/models`,
/// TEI's `/info`, Ollama's model names): its model, and for an embedding role its space.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct RoleCatalog {
    pub role: Role,
    /// The space's model for an embedding role; else the first connected provider's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The role's current vector space (embedding roles).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub space: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dims: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooling: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_input_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_items: Option<usize>,
    /// Connected providers of the role.
    pub providers: usize,
    /// Whether the role's readiness gates the hub's (`/ready`).
    pub gates_ready: bool,
    /// Why a new request of the role would not be served now (absent: it would be).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unservable: Option<UnservableView>,
}

impl Hub {
    /// Every role readiness answers for ([`super::core::Core::readiness`]), with its model.
    pub fn catalog(&self) -> Vec<RoleCatalog> {
        let core = self.core();
        core.readiness()
            .into_iter()
            .map(|(role, readiness)| {
                let space = core
                    .gate
                    .current_id(role)
                    .and_then(|id| core.gate.space(id).map(|s| (id.to_string(), s)));
                let providers: Vec<_> = core
                    .agents()
                    .values()
                    .flat_map(|a| a.providers.values())
                    .filter(|p| p.role() == role)
                    .collect();
                let shown = providers
                    .iter()
                    .find(|p| space.as_ref().is_none_or(|(_, s)| p.info.model == s.model))
                    .or(providers.first());
                RoleCatalog {
                    role,
                    model: space
                        .as_ref()
                        .map(|(_, s)| s.model.clone())
                        .or_else(|| shown.map(|p| p.info.model.clone())),
                    revision: shown.and_then(|p| p.info.revision.clone()),
                    dims: space.as_ref().map(|(_, s)| s.dims),
                    space: space.map(|(id, _)| id),
                    dtype: shown.and_then(|p| p.info.dtype.clone()),
                    pooling: shown.and_then(|p| p.info.pooling.clone()),
                    max_input_tokens: shown.and_then(|p| p.info.max_input_tokens),
                    max_batch_tokens: shown.map(|p| p.info.max_batch_tokens),
                    max_batch_items: shown.map(|p| p.info.max_batch_items),
                    providers: providers.len(),
                    gates_ready: readiness.gates,
                    unservable: readiness.unservable.map(|u| UnservableView {
                        code: u.code.as_str(),
                        message: u.message,
                    }),
                }
            })
            .collect()
    }
}
