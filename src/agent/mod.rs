//! The agent: runs on a GPU host, hosts providers, dials out to the hub and pulls work.
//!
//! [`Agent::run`] keeps exactly one socket to the hub at any time ([`connection`]): connect,
//! `hello`, one pull loop per provider with credits equal to its pipeline depth, heartbeats,
//! `done` with the latency measured around the model call; on a lost socket, reconnect with
//! exponential backoff and full jitter (1 s doubling to 30 s). On shutdown it stops pulling,
//! finishes (or hands back) its leases, and closes cleanly. Config pushes merge into what it
//! holds; the key stays in memory only.

pub mod cloud_provider;
pub mod connection;
pub mod http;
pub mod hub_finder;
pub mod kept_answers;
pub mod local_server;
pub mod provider;
pub mod stats;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use self::cloud_provider::CloudProvider;
use self::local_server::LocalServers;
use self::provider::Provider;
use self::stats::ProviderCounters;
use crate::cloud::openrouter::OpenRouterClient;
use crate::cloud::route::CloudRoute;
use crate::config::push::{self, CloudSettings, Outcome};
use crate::protocol::{
    AccountLimits, ConfigAck, ConfigFrame, DeviceInfo, HeldConfig, ProviderStats,
};
use crate::secret::Secret;

/// How an agent runs.
pub struct AgentOptions {
    /// `ws://` or `wss://` URLs of the hubs' `/v1/agent` (one hub, or the hubs of one etcd
    /// store); empty: no hub session (an agent that serves Fantom masters only).
    pub hub_urls: Vec<String>,
    pub agent_id: String,
    pub fleet_token: Secret,
    /// A PEM CA bundle to trust for `wss://` instead of the system roots.
    pub ca_file: Option<PathBuf>,
    /// How long shutdown waits for leases in progress.
    pub drain_timeout: Duration,
    pub max_frame_bytes: usize,
    /// The local providers (loaded models); cloud providers come from config pushes.
    pub providers: Vec<Arc<dyn Provider>>,
    /// The model servers this agent fronts: each is a provider while it answers.
    pub servers: Arc<LocalServers>,
    pub cloud: CloudOptions,
}

/// How cloud routes are served once a push gives this agent a key.
#[derive(Clone, Debug)]
pub struct CloudOptions {
    /// OpenRouter's API base (`https://openrouter.ai/api/v1`; tests point it at loopback).
    pub openrouter_url: String,
    /// Work frames one cloud provider takes at once (the hub's budget decides how many run).
    pub pipeline_depth: u32,
    /// One upstream call may take at most this long: the ceiling of every call (the hub's
    /// per-role call timeout, sent with each work frame, is shorter where set).
    pub request_timeout: Duration,
}

impl Default for CloudOptions {
    fn default() -> Self {
        Self {
            openrouter_url: crate::cloud::openrouter::DEFAULT_BASE_URL.to_string(),
            pipeline_depth: 8,
            // A chat may need minutes: the hub's chat roles allow 600 s by default.
            request_timeout: Duration::from_secs(600),
        }
    }
}

/// The agent's shared state (sessions come and go; this stays).
pub struct Agent {
    opts: AgentOptions,
    counters: Mutex<BTreeMap<String, ProviderCounters>>,
    cloud: Mutex<PushedConfig>,
    connected: AtomicBool,
    /// Hub dials attempted (connected or not): `READY=1` waits for the first.
    dials: watch::Sender<u64>,
    /// The hub of `hub_urls` dialled first: the last that welcomed this agent, or the leader
    /// a standby named.
    hub_at: std::sync::atomic::AtomicUsize,
    /// The highest leader epoch a hub welcomed this agent under (0: none yet).
    hub_epoch: std::sync::atomic::AtomicI64,
    /// Dials in a row that no hub answered in time: each waits longer (`hub_finder`).
    dial_patience: std::sync::atomic::AtomicU32,
    /// Suspensions hubs told this agent of (the last per verdict), reported in `hello`.
    suspensions: Mutex<Vec<crate::protocol::Suspension>>,
    sessions: AtomicU64,
    /// Random per process: tells the hub a reconnect of this process from another process
    /// claiming the same id.
    instance: String,
    /// Keyed chats running and the answers kept for the next hub.
    kept: Arc<kept_answers::KeptAnswers>,
    /// Sessions begun (welcomed or not): a keyed call belongs to the one that leased it.
    sockets: AtomicU64,
}

/// What config pushes left here: the safe part, the key (memory only), the hub's revision of
/// it and the key's generation, and the cloud providers built from them.
#[derive(Default)]
struct PushedConfig {
    settings: CloudSettings,
    key: Option<Secret>,
    revision: Option<u64>,
    key_generation: Option<String>,
    client: Option<Arc<OpenRouterClient>>,
    providers: Vec<Arc<dyn Provider>>,
}

impl PushedConfig {
    /// The hub's revision of it and the key's generation, as the hub is told.
    fn revision(&self) -> HeldConfig {
        HeldConfig {
            config_revision: self.revision,
            key_generation: self.key_generation.clone(),
        }
    }
}

impl Agent {
    pub fn new(opts: AgentOptions) -> Arc<Self> {
        Arc::new(Self {
            opts,
            counters: Mutex::default(),
            cloud: Mutex::new(PushedConfig::default()),
            connected: AtomicBool::new(false),
            dials: watch::channel(0).0,
            hub_at: std::sync::atomic::AtomicUsize::new(0),
            hub_epoch: std::sync::atomic::AtomicI64::new(0),
            dial_patience: std::sync::atomic::AtomicU32::new(0),
            suspensions: Mutex::default(),
            sessions: AtomicU64::new(0),
            instance: format!("{:016x}", rand::random::<u64>()),
            kept: Arc::default(),
            sockets: AtomicU64::new(0),
        })
    }

    pub fn id(&self) -> &str {
        &self.opts.agent_id
    }

    /// Every provider now: the local models, the fronted servers that answer, then the cloud
    /// routes pushes created.
    pub fn providers(&self) -> Vec<Arc<dyn Provider>> {
        let mut all = self.opts.providers.clone();
        all.extend(self.opts.servers.providers());
        all.extend(self.held().providers.iter().cloned());
        all
    }

    /// The model servers this agent fronts.
    pub fn servers(&self) -> &LocalServers {
        &self.opts.servers
    }

    /// Moves when a fronted server came up, went down or changed revision.
    pub fn server_changes(&self) -> watch::Receiver<u64> {
        self.opts.servers.subscribe()
    }

    /// Whether this agent has a hub to dial at all.
    pub fn has_hub(&self) -> bool {
        !self.opts.hub_urls.is_empty()
    }

    /// A hub suspended one of this agent's providers: kept (the last per verdict, the newest
    /// [`crate::protocol::MAX_REPORTED_SUSPENSIONS`]) for the next `hello`.
    pub(crate) fn note_suspension(&self, s: crate::protocol::Suspension) {
        tracing::warn!(provider = %s.provider, space = %s.space, reason = %s.reason, "the hub suspended a provider of this agent (drift)");
        let mut all = self
            .suspensions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.retain(|k| k.key != s.key);
        all.push(s);
        let over = all
            .len()
            .saturating_sub(crate::protocol::MAX_REPORTED_SUSPENSIONS);
        all.drain(..over);
    }

    /// The suspensions to report in `hello`.
    pub(crate) fn suspensions(&self) -> Vec<crate::protocol::Suspension> {
        self.suspensions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// One more hub dial was attempted.
    pub(crate) fn note_dial(&self) {
        self.dials.send_modify(|n| *n += 1);
    }

    /// Waits (at most `timeout`) until the first hub dial was attempted; at once without a hub.
    pub async fn first_dial(&self, timeout: Duration) {
        if !self.has_hub() {
            return;
        }
        let mut dials = self.dials.subscribe();
        let _ = tokio::time::timeout(timeout, dials.wait_for(|n| *n > 0)).await;
    }

    /// Work frames in progress across every provider.
    pub fn in_flight(&self) -> u64 {
        self.provider_stats()
            .iter()
            .map(|s| s.in_flight as u64)
            .sum()
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Sessions that reached `welcome` since start.
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Ordering::Relaxed)
    }

    /// Runs `f` on the counters of provider `id`.
    fn with_counters<T>(&self, id: &str, f: impl FnOnce(&mut ProviderCounters) -> T) -> T {
        let mut all = self
            .counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(all.entry(id.to_string()).or_default())
    }

    pub fn provider_stats(&self) -> Vec<ProviderStats> {
        self.providers()
            .iter()
            .map(|p| {
                let id = p.info().id;
                self.with_counters(&id, |c| c.snapshot(&id))
            })
            .collect()
    }

    /// The cloud settings pushes left here (no key).
    pub fn cloud_settings(&self) -> CloudSettings {
        self.held().settings.clone()
    }

    /// Whether a key was pushed (never which).
    pub fn holds_key(&self) -> bool {
        self.held().key.is_some()
    }

    fn held(&self) -> std::sync::MutexGuard<'_, PushedConfig> {
        self.cloud
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Which of the hub's configs this agent holds (`hello`, heartbeats, acks say it).
    pub fn held_config(&self) -> HeldConfig {
        self.held().revision()
    }

    /// Applies a config frame, rebuilds the cloud providers from what is held, and says what
    /// became of it. A frame with a `revision` is the hub's whole config: it replaces what was
    /// held, and a key of another generation than the frame's is dropped (the hub replaced it
    /// while this agent was away). A frame without one is a partial push (DESIGN §4), merged.
    pub fn apply_config(&self, frame: ConfigFrame) -> ConfigAck {
        let ConfigFrame {
            id,
            revision,
            key_generation,
            payload,
        } = frame;
        let mut held = self.held();
        let Some(mut push) = payload.openrouter else {
            return ConfigAck {
                id,
                applied: false,
                reason: Some("the push has no openrouter object".into()),
                roles: Default::default(),
                config: held.revision(),
            };
        };
        let held_key = held.key.clone();
        let merged = match revision {
            Some(_) => push::replace_holding(held_key.as_ref(), &push).map(|(settings, report)| {
                held.settings = settings;
                report
            }),
            None => push::merge_holding(
                &mut held.settings,
                held_key.is_some(),
                held_key.as_ref(),
                &push,
            ),
        };
        let mut report = match merged {
            Ok(report) => report,
            Err(refused) => {
                tracing::warn!(config_id = %id, reason = %refused, "config push refused");
                return ConfigAck {
                    id,
                    applied: false,
                    reason: Some(refused.to_string()),
                    roles: Default::default(),
                    config: held.revision(),
                };
            }
        };
        let mut key_changed = push.api_key.is_some();
        if let Some(key) = push.api_key.take() {
            match OpenRouterClient::new(
                &self.opts.cloud.openrouter_url,
                key.clone(),
                self.opts.cloud.request_timeout,
            ) {
                Ok(client) => held.client = Some(Arc::new(client)),
                Err(e) => {
                    // Never keep calling with the old key's client.
                    held.client = None;
                    tracing::error!(error = %e, "no OpenRouter client: cloud routes stay off");
                }
            }
            held.key = Some(key);
            held.key_generation = key_generation;
        } else if revision.is_some() && held.key.is_some() && held.key_generation != key_generation
        {
            tracing::warn!(config_id = %id, "the hub's key was replaced while this agent was away: the key held here is dropped, and cloud routes stay off until a push with the key");
            held.key = None;
            held.client = None;
            held.key_generation = None;
            key_changed = true;
        }
        if revision.is_some() {
            held.revision = revision;
        }
        let refusals = self.rebuild_cloud(&mut held, key_changed);
        for (role, reason) in refusals {
            report.roles.entry(role).or_default().model = Some(Outcome::Refused { reason });
        }
        tracing::info!(config_id = %id, revision = ?held.revision, key_included = report.key_included, cloud_providers = held.providers.len(), "config push applied");
        ConfigAck {
            id,
            applied: true,
            reason: None,
            roles: report.roles,
            config: held.revision(),
        }
    }

    /// One cloud provider per role whose policy lets the cloud serve and whose model is
    /// mapped; an unchanged route keeps its provider. Returns routes that could not be built.
    fn rebuild_cloud(&self, held: &mut PushedConfig, key_changed: bool) -> Vec<(String, String)> {
        let mut refusals = Vec::new();
        let Some(client) = held.client.clone() else {
            held.providers.clear();
            return refusals;
        };
        let mut next: Vec<Arc<dyn Provider>> = Vec::new();
        // The role's own route where its policy lets the cloud serve; then the routes the
        // hub's other live spaces of a role need (a migration's next space, the previous
        // one), whatever the role's policy.
        let own = held
            .settings
            .allowed_models
            .iter()
            .filter(|(role, _)| held.settings.policy(**role) != crate::roles::Policy::Local);
        let spaces = held
            .settings
            .space_routes
            .iter()
            .flat_map(|(role, routes)| routes.iter().map(move |r| (role, r)));
        for (role, allowed) in own.chain(spaces) {
            let route = match CloudRoute::from_allowed(*role, allowed) {
                Ok(route) => route,
                Err(e) => {
                    refusals.push((role.to_string(), e.to_string()));
                    continue;
                }
            };
            let provider =
                CloudProvider::new(route, client.clone(), self.opts.cloud.pipeline_depth);
            if next.iter().any(|p| p.info().id == provider.info().id) {
                continue; // one route, one provider (a space's route may be the role's own)
            }
            // A new key means new clients; otherwise an unchanged route keeps its provider.
            let kept = held
                .providers
                .iter()
                .find(|p| !key_changed && p.info() == provider.info())
                .cloned();
            next.push(kept.unwrap_or_else(|| Arc::new(provider)));
        }
        held.providers = next;
        refusals
    }

    /// Asks OpenRouter what the pushed key's account allows (numbers only).
    pub async fn discover_limits(&self) -> AccountLimits {
        let client = self.held().client.clone();
        let Some(client) = client else {
            return AccountLimits {
                error: Some("no key has been pushed to this agent".into()),
                ..Default::default()
            };
        };
        match client.key_info().await {
            Ok(info) => AccountLimits {
                rpm: info.rpm,
                funded: info.funded(),
                credits_remaining_usd: info.credits_remaining_usd,
                limit_remaining_usd: info.limit_remaining_usd,
                error: None,
            },
            Err(e) => AccountLimits {
                error: Some(e.to_string()),
                ..Default::default()
            },
        }
    }

    /// Runs until `shutdown` turns true: one session at a time, reconnecting with backoff.
    /// Without a hub URL it only waits for shutdown. Ends early, with the hub's reason, when
    /// the hub refuses this process for good (its agent id is held by another live process).
    pub async fn run(
        self: Arc<Self>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), connection::Refused> {
        if self.opts.hub_urls.is_empty() {
            let _ = shutdown.wait_for(|stop| *stop).await;
            return Ok(());
        }
        connection::run(self, shutdown).await
    }

    /// This process's random instance id (`hello.instance`).
    pub fn instance(&self) -> &str {
        &self.instance
    }
}

/// The devices the providers run on, with memory where the backend can tell (host memory
/// from `/proc/meminfo` for the CPU; CUDA memory is not reported by candle).
pub fn devices(providers: &[Arc<dyn Provider>]) -> Vec<DeviceInfo> {
    let mut ids: Vec<String> = providers.iter().filter_map(|p| p.info().device).collect();
    ids.sort();
    ids.dedup();
    let (total, free) = host_memory_mb();
    ids.into_iter()
        .map(|id| {
            let cpu = id == "cpu";
            DeviceInfo {
                memory_total_mb: if cpu { total } else { None },
                memory_free_mb: if cpu { free } else { None },
                id,
            }
        })
        .collect()
}

fn host_memory_mb() -> (Option<u64>, Option<u64>) {
    let memory = crate::inference::device::memory(&candle_core::Device::Cpu);
    (
        memory.map(|m| m.total_bytes >> 20),
        memory.map(|m| m.free_bytes >> 20),
    )
}

/// Loads the local models of an agent config: one engine per `[[models]]` table, one provider
/// per role it serves.
pub async fn load_providers(
    models: &[crate::config::agent::ServedModel],
) -> anyhow::Result<Vec<Arc<dyn Provider>>> {
    use crate::model_spec::Task;
    use crate::roles::Op;
    let mut providers: Vec<Arc<dyn Provider>> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for served in models {
        let ops: std::collections::BTreeSet<_> = served
            .roles
            .iter()
            .map(|r| format!("{:?}", r.op()))
            .collect();
        let task = match served.roles[0].op() {
            Op::Embed => Task::Embed,
            Op::Rerank => Task::Rerank,
            Op::Chat => anyhow::bail!(
                "role {} is a chat role: chat is served by cloud routes or by a model server this agent fronts ([[local_server]] with kind vllm, ollama, llama-cpp or openai), not by a [[models]] table",
                served.roles[0]
            ),
        };
        if ops.len() > 1 {
            anyhow::bail!(
                "one model cannot serve roles of different kinds ({:?}); give each kind its own [[models]] table",
                served.roles
            );
        }
        let engine = served.model.load(task).await?;
        for &role in &served.roles {
            if !seen.insert(role) {
                anyhow::bail!("role {role} is served by two [[models]] tables; keep one");
            }
            providers.push(Arc::new(provider::LocalProvider::new(
                role,
                engine.clone(),
                served.pipeline(&engine.info().device),
            )));
        }
    }
    Ok(providers)
}
