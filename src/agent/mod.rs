//! The agent: runs on a GPU host, hosts providers, dials out to the hub and pulls work.
//!
//! [`Agent::run`] keeps exactly one socket to the hub at any time ([`connection`]): connect,
//! `hello`, one pull loop per provider with credits equal to its pipeline depth, heartbeats,
//! `done` with the latency measured around the model call; on a lost socket, reconnect with
//! exponential backoff and full jitter (1 s doubling to 30 s). On shutdown it stops pulling,
//! finishes (or hands back) its leases, and closes cleanly. Config pushes merge into what it
//! holds; the key stays in memory only.

pub mod connection;
pub mod http;
pub mod provider;
pub mod stats;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use self::provider::Provider;
use self::stats::ProviderCounters;
use crate::config::push::{self, CloudSettings, OpenRouterPush};
use crate::protocol::{ConfigAck, DeviceInfo, ProviderStats};
use crate::secret::Secret;

/// How an agent runs.
pub struct AgentOptions {
    /// `ws://` or `wss://` URL of the hub's `/v1/agent`.
    pub hub_url: String,
    pub agent_id: String,
    pub fleet_token: Secret,
    /// A PEM CA bundle to trust for `wss://` instead of the system roots.
    pub ca_file: Option<PathBuf>,
    /// How long shutdown waits for leases in progress.
    pub drain_timeout: Duration,
    pub max_frame_bytes: usize,
    pub providers: Vec<Arc<dyn Provider>>,
}

/// The agent's shared state (sessions come and go; this stays).
pub struct Agent {
    opts: AgentOptions,
    counters: Vec<Mutex<ProviderCounters>>,
    cloud: Mutex<HeldConfig>,
    connected: AtomicBool,
    sessions: AtomicU64,
}

/// What config pushes left here: the safe part, and the key (memory only).
#[derive(Default)]
struct HeldConfig {
    settings: CloudSettings,
    key: Option<Secret>,
}

impl Agent {
    pub fn new(opts: AgentOptions) -> Arc<Self> {
        let counters = opts.providers.iter().map(|_| Mutex::default()).collect();
        Arc::new(Self {
            opts,
            counters,
            cloud: Mutex::new(HeldConfig::default()),
            connected: AtomicBool::new(false),
            sessions: AtomicU64::new(0),
        })
    }

    pub fn id(&self) -> &str {
        &self.opts.agent_id
    }

    pub fn providers(&self) -> &[Arc<dyn Provider>] {
        &self.opts.providers
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Sessions that reached `welcome` since start.
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Ordering::Relaxed)
    }

    fn counters(&self, index: usize) -> std::sync::MutexGuard<'_, ProviderCounters> {
        self.counters[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn provider_stats(&self) -> Vec<ProviderStats> {
        self.opts
            .providers
            .iter()
            .enumerate()
            .map(|(i, p)| self.counters(i).snapshot(&p.info().id))
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

    fn held(&self) -> std::sync::MutexGuard<'_, HeldConfig> {
        self.cloud
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Merges a config push (DESIGN §4) and says what became of it.
    pub fn apply_config(&self, id: String, mut push: OpenRouterPush) -> ConfigAck {
        let mut held = self.held();
        let holds_key = held.key.is_some();
        match push::merge(&mut held.settings, holds_key, &push) {
            Ok(report) => {
                if let Some(key) = push.api_key.take() {
                    held.key = Some(key);
                }
                tracing::info!(config_id = %id, key_included = report.key_included, "config push applied");
                ConfigAck {
                    id,
                    applied: true,
                    reason: None,
                    roles: report.roles,
                }
            }
            Err(refused) => {
                tracing::warn!(config_id = %id, reason = %refused, "config push refused");
                ConfigAck {
                    id,
                    applied: false,
                    reason: Some(refused.to_string()),
                    roles: Default::default(),
                }
            }
        }
    }

    /// Runs until `shutdown` turns true: one session at a time, reconnecting with backoff.
    pub async fn run(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        connection::run(self, shutdown).await
    }
}

/// The host's name (for `hello`), from the kernel.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".into())
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
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return (None, None);
    };
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb / 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
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
                "role {} is a chat role: chat is served by cloud routes, not local models",
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
                served.pipeline_depth,
                served.max_items_per_work,
            )));
        }
    }
    Ok(providers)
}
