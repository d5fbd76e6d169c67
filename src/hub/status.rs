//! Views of the hub: for operators, the `/admin/status` document and the Prometheus text of
//! `/metrics` (counters, gauges and the queue, batch and token histograms); for clients, the
//! role catalog behind `/v1/models`, TEI's `/info`, model-id lookup and `/ready`. Each reads
//! one snapshot under the core's lock; none can see a secret (the core holds none).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Instant;

use serde::Serialize;

use super::Hub;
use super::budget::BudgetView;
use super::registry::{ModelOrigin, SocketCount};
use crate::histogram::{self, Histogram};
use crate::protocol::{ConfigAck, DeviceInfo, HeldConfig, ProviderStats};
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
    /// Each project: settings and accounting (never a key).
    pub projects: Vec<super::project_admin::ProjectView>,
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
                        credits: p.credits,
                        in_flight: p.in_flight,
                        served_items: p.served_items,
                        failures: p.failures,
                        benched: !p.is_healthy(now),
                        paused: p.paused_until.is_some_and(|t| t > now),
                        stale: p.stale.as_ref().map(|s| s.reason.clone()),
                        latency_ewma_ms: p.latency_ewma_ms,
                        heartbeat: p.heartbeat.clone(),
                    })
                    .collect(),
                devices: a.devices.clone(),
                last_config_ack: a.last_config_ack.clone(),
                holds: a.held.clone(),
                needs_key_push: needing_key.contains(id),
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
        StatusView {
            projects,
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
        }
    }

    /// Prometheus text exposition of the hub's counters and gauges.
    pub fn metrics_text(&self) -> String {
        let mut core = self.core();
        let now = Instant::now();
        core.budget.tick(now);
        let budget = core.budget.view(now);
        let c = &core.counters;
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, f64)>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in rows {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        let per_role = |m: &BTreeMap<Role, u64>| -> Vec<(String, f64)> {
            Role::ALL
                .iter()
                .map(|r| {
                    (
                        format!("{{role=\"{r}\"}}"),
                        m.get(r).copied().unwrap_or(0) as f64,
                    )
                })
                .collect()
        };
        family(
            "fantom_hub_requests_total",
            "counter",
            "Client requests accepted.",
            per_role(&c.requests),
        );
        family(
            "fantom_hub_items_accepted_total",
            "counter",
            "Items (texts, documents) accepted into a role queue.",
            per_role(&c.items_accepted),
        );
        family(
            "fantom_hub_items_served_total",
            "counter",
            "Items a provider returned a result for.",
            per_role(&c.items_served),
        );
        family(
            "fantom_hub_rejected_queue_full_total",
            "counter",
            "Requests answered 429 because the role queue was full.",
            per_role(&c.rejected_full),
        );
        let depth = Role::ALL
            .iter()
            .map(|r| (format!("{{role=\"{r}\"}}"), core.queue_depth(*r) as f64))
            .collect();
        family(
            "fantom_hub_queue_depth",
            "gauge",
            "Items waiting in a role queue.",
            depth,
        );
        family(
            "fantom_hub_held_bytes",
            "gauge",
            "Input bytes held by accepted requests (queued, leased or partly served).",
            vec![(String::new(), core.held_bytes() as f64)],
        );
        let leases = core.leases_by_role();
        let in_flight = Role::ALL
            .iter()
            .map(|r| {
                let n = leases.get(r).map_or(0, |l| l.0);
                (format!("{{role=\"{r}\"}}"), n as f64)
            })
            .collect();
        family(
            "fantom_hub_leases_in_flight",
            "gauge",
            "Leases out to providers.",
            in_flight,
        );
        family(
            "fantom_hub_leases_total",
            "counter",
            "Leases by outcome other than done.",
            vec![
                ("{outcome=\"granted\"}".into(), c.leases_granted as f64),
                ("{outcome=\"expired\"}".into(), c.leases_expired as f64),
                ("{outcome=\"lost\"}".into(), c.leases_lost as f64),
                ("{outcome=\"cancelled\"}".into(), c.leases_cancelled as f64),
            ],
        );
        family(
            "fantom_hub_lease_renewals_total",
            "counter",
            "Leases renewed by a heartbeat (work still running on a live agent).",
            vec![(String::new(), c.leases_renewed as f64)],
        );
        family(
            "fantom_hub_rejected_unservable_total",
            "counter",
            "Requests refused at admission because nothing could serve them, by reason.",
            c.rejected_unservable
                .iter()
                .map(|(k, v)| (format!("{{reason=\"{k}\"}}"), *v as f64))
                .collect(),
        );
        family(
            "fantom_hub_requests_failed_total",
            "counter",
            "Accepted requests that failed (fatal input, attempts, nothing left to serve them).",
            vec![(String::new(), c.requests_failed as f64)],
        );
        family(
            "fantom_hub_rescored_total",
            "counter",
            "Rerank requests scored again whole because every provider of their scorer left.",
            vec![(String::new(), c.rescored as f64)],
        );
        family(
            "fantom_hub_failures_total",
            "counter",
            "Failed leases by class.",
            c.failures
                .iter()
                .map(|(k, v)| (format!("{{class=\"{k}\"}}"), *v as f64))
                .collect(),
        );
        family(
            "fantom_hub_late_results_total",
            "counter",
            "Results dropped because the item already had one or its lease was gone.",
            vec![(String::new(), c.late_results as f64)],
        );
        family(
            "fantom_hub_agents_connected",
            "gauge",
            "Agents with an open session.",
            vec![(String::new(), core.agents().len() as f64)],
        );
        let mut latency = Vec::new();
        let mut served = Vec::new();
        for a in core.agents().values() {
            for p in a.providers.values() {
                let labels = format!(
                    "{{provider=\"{}\",role=\"{}\"}}",
                    label(&p.reference.provider),
                    p.role()
                );
                if let Some(ms) = p.latency_ewma_ms {
                    latency.push((labels.clone(), ms));
                }
                served.push((labels, p.served_items as f64));
            }
        }
        family(
            "fantom_hub_provider_latency_ewma_ms",
            "gauge",
            "Work-frame latency measured by the agent around the model call (EWMA).",
            latency,
        );
        family(
            "fantom_hub_provider_items_served",
            "gauge",
            "Items a connected provider served in its current session.",
            served,
        );
        let one = |v: f64| vec![(String::new(), v)];
        family(
            "fantom_hub_budget_ceiling",
            "gauge",
            "Cloud budget ceiling (permits).",
            one(budget.ceiling as f64),
        );
        family(
            "fantom_hub_budget_limit",
            "gauge",
            "Cloud budget effective limit now (permits).",
            one(budget.limit as f64),
        );
        family(
            "fantom_hub_budget_in_flight",
            "gauge",
            "Cloud leases holding a permit.",
            one(budget.in_flight as f64),
        );
        family(
            "fantom_hub_budget_granted_total",
            "counter",
            "Cloud permits granted.",
            one(budget.granted as f64),
        );
        family(
            "fantom_hub_budget_throttles_total",
            "counter",
            "Global throttle signals (platform 429, in-flight 402).",
            one(budget.throttles as f64),
        );
        family(
            "fantom_hub_budget_cooldown_remaining_ms",
            "gauge",
            "Global cooldown left.",
            one(budget.cooldown_remaining_ms as f64),
        );
        family(
            "fantom_hub_budget_latency_ewma_ms",
            "gauge",
            "Upstream latency EWMA of successful cloud calls.",
            one(budget.latency_ewma_ms),
        );
        family(
            "fantom_hub_budget_stopped",
            "gauge",
            "1 when a hard 402 stopped cloud work.",
            one(if budget.stopped.is_some() { 1.0 } else { 0.0 }),
        );
        let route_rows = |f: &dyn Fn(&super::budget::RouteView) -> f64| -> Vec<(String, f64)> {
            budget
                .routes
                .iter()
                .map(|r| (format!("{{route=\"{}\"}}", label(&r.route)), f(r)))
                .collect()
        };
        let gate = core.gate.view(&serving_by_role(&core));
        let verdict_rows = gate
            .verdicts
            .iter()
            .map(|v| {
                let state = serde_json::to_value(&v.verdict)
                    .ok()
                    .and_then(|j| j.get("state").and_then(|s| s.as_str().map(str::to_string)))
                    .unwrap_or_default();
                (
                    format!(
                        "{{provider=\"{}\",space=\"{}\",state=\"{state}\"}}",
                        label(&v.provider),
                        label(&v.space)
                    ),
                    1.0,
                )
            })
            .collect();
        family(
            "fantom_hub_gate_verdict",
            "gauge",
            "Gate verdicts by provider, space and state (1 per verdict).",
            verdict_rows,
        );
        let cos_rows = gate
            .verdicts
            .iter()
            .filter_map(|v| {
                let e = v.evidence.as_ref()?;
                Some((
                    format!(
                        "{{provider=\"{}\",space=\"{}\"}}",
                        label(&v.provider),
                        label(&v.space)
                    ),
                    e.min_cosine,
                ))
            })
            .collect();
        family(
            "fantom_hub_gate_min_cosine",
            "gauge",
            "Minimum probe cosine of the last check against the space's fingerprint.",
            cos_rows,
        );
        let rows = gate
            .spaces
            .iter()
            .flat_map(|s| {
                s.rows.iter().map(move |(p, n)| {
                    (
                        format!("{{space=\"{}\",provider=\"{}\"}}", label(&s.id), label(p)),
                        *n as f64,
                    )
                })
            })
            .collect();
        family(
            "fantom_hub_space_rows_total",
            "counter",
            "Vectors returned per space and provider.",
            rows,
        );
        family(
            "fantom_hub_budget_route_limit",
            "gauge",
            "Cloud route sub-limit (permits).",
            route_rows(&|r| r.limit as f64),
        );
        family(
            "fantom_hub_budget_route_in_flight",
            "gauge",
            "Cloud route leases holding a permit.",
            route_rows(&|r| r.in_flight as f64),
        );
        family(
            "fantom_hub_budget_route_throttles_total",
            "counter",
            "Upstream 429s per route.",
            route_rows(&|r| r.throttles as f64),
        );
        let c = &core.counters;
        let per_provider = |m: &BTreeMap<String, u64>| -> Vec<(String, f64)> {
            m.iter()
                .map(|(p, n)| (format!("{{provider=\"{}\"}}", label(p)), *n as f64))
                .collect()
        };
        let (texts, tokens, failures) = (
            per_provider(&c.canary_texts),
            per_provider(&c.canary_tokens),
            per_provider(&c.canary_failures),
        );
        let mut family = |name: &str, help: &str, rows: Vec<(String, f64)>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (labels, value) in rows {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        family(
            "fantom_hub_canary_texts_total",
            "Canaries (probe texts) sent in embedding work frames, per provider.",
            texts,
        );
        family(
            "fantom_hub_canary_tokens_total",
            "Tokens of the canaries (the hub's share of each frame's count; never in a client's usage).",
            tokens,
        );
        family(
            "fantom_hub_canary_failures_total",
            "Canaries that came back drifted (the provider was suspended at once).",
            failures,
        );
        fn by_role(m: &BTreeMap<Role, Histogram>) -> Vec<(String, &Histogram)> {
            m.iter()
                .map(|(r, h)| (format!("role=\"{r}\""), h))
                .collect()
        }
        histogram::render_family(
            &mut out,
            "fantom_hub_queue_seconds",
            "Seconds from a request's acceptance to its first lease.",
            by_role(&c.queue_seconds),
        );
        histogram::render_family(
            &mut out,
            "fantom_hub_batch_items",
            "Items per work frame granted to a provider.",
            by_role(&c.batch_items),
        );
        histogram::render_family(
            &mut out,
            "fantom_hub_request_tokens",
            "Tokens per completed request.",
            by_role(&c.request_tokens),
        );
        drop(core);
        self.render_project_metrics(&mut out);
        out
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
pub fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Connected embedding providers per role.
fn serving_by_role(core: &super::core::Core) -> BTreeMap<Role, Vec<String>> {
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
