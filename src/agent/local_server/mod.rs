//! Model servers the operator already runs on this host (vLLM, Ollama, llama.cpp, TEI, any
//! OpenAI-compatible server), fronted instead of reimplemented: one [`LocalServer`] per
//! `[[local_server]]` table.
//!
//! Each is health-checked in its own API ([`api`]) every `health_interval_s`, never assumed:
//! it is *up* only while it answers and lists the declared model. A refused connection takes
//! it down at once; a slow or failing answer only at the second in a row. While up, a server
//! with a hub role is a local provider ([`provider::ServerProvider`]) of the agent's hub
//! session; the session re-announces its providers when one comes or goes ([`LocalServers`]'s
//! change counter). Fantom masters see each as a container ([`crate::fantom::containers`]),
//! `running` only while up; `start` and `stop` run `systemctl` on its `unit` when one is named.

pub mod api;
pub mod provider;
pub mod rerank;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use self::api::{Checked, ServerApi};
use self::provider::ServerProvider;
use super::provider::Provider;
use crate::config::local_server::LocalServerConfig;

/// How long `systemctl --no-block start|stop` may take (it only queues the job).
const UNIT_TIMEOUT: Duration = Duration::from_secs(20);

/// Where a server stands, as the last health checks saw it.
#[derive(Clone, Debug, PartialEq)]
pub enum Health {
    /// Not checked yet.
    Unchecked,
    Up(Checked),
    Down(String),
}

/// Why a unit action did not happen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum UnitError {
    #[error(
        "the {0} server is managed elsewhere (its [[local_server]] table names no unit): start or stop it where it is managed"
    )]
    Unmanaged(&'static str),
    #[error("systemctl {verb} {unit} failed: {message}")]
    Failed {
        verb: &'static str,
        unit: String,
        message: String,
    },
}

/// One declared server.
pub struct LocalServer {
    pub config: LocalServerConfig,
    api: Arc<ServerApi>,
    health: watch::Sender<Health>,
    /// Failed checks in a row.
    strikes: AtomicU32,
    /// One check at a time: a check that started before a unit action never overwrites the
    /// one after it.
    checking: tokio::sync::Mutex<()>,
    check_now: Arc<Notify>,
    /// The hub provider of the current revision (rebuilt when the revision changes).
    provider: Mutex<Option<Arc<ServerProvider>>>,
    systemctl: PathBuf,
    changes: Arc<watch::Sender<u64>>,
}

impl LocalServer {
    /// The container name a master sees (`rlm`, `embedding`, ...).
    pub fn key(&self) -> &'static str {
        self.config.role.container_key()
    }

    pub fn health(&self) -> Health {
        self.health.borrow().clone()
    }

    pub fn is_up(&self) -> bool {
        matches!(*self.health.borrow(), Health::Up(_))
    }

    /// The provider the hub sees, while the server is up and serves a hub role.
    pub fn provider(&self) -> Option<Arc<dyn Provider>> {
        if !self.is_up() {
            return None;
        }
        let p = self
            .provider
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()?;
        Some(p)
    }

    /// Asks the health loop to check now (a work call found nothing listening).
    pub fn poke(&self) {
        self.check_now.notify_one();
    }

    /// One health check, and what it changes.
    pub async fn check(&self) -> Health {
        let _one = self.checking.lock().await;
        let checked = self.api.check().await;
        let before = self.health();
        let next = match checked {
            Ok(c) => {
                self.strikes.store(0, Ordering::Relaxed);
                Health::Up(c)
            }
            Err(e) => {
                let strikes = self.strikes.fetch_add(1, Ordering::Relaxed) + 1;
                let up = matches!(before, Health::Up(_));
                if up && strikes < 2 && !e.is_refused() {
                    tracing::warn!(server = self.key(), error = %e, "a health check failed; one more and the server is down");
                    return before;
                }
                Health::Down(e.to_string())
            }
        };
        if next != before {
            self.changed(&before, &next);
        }
        next
    }

    fn changed(&self, before: &Health, next: &Health) {
        let (key, url) = (self.key(), self.config.base_url());
        match next {
            Health::Up(c) => {
                tracing::info!(server = key, url, kind = self.config.kind.as_str(), model = %self.config.model, revision = ?c.revision, "local server up");
                let mut slot = self.provider.lock().unwrap_or_else(PoisonError::into_inner);
                let revision = provider::served_revision(&self.config, c.revision.clone());
                let same = slot
                    .as_ref()
                    .is_some_and(|p| p.info_ref().revision == revision);
                if !same {
                    *slot = self.config.role.hub_role().map(|role| {
                        Arc::new(ServerProvider::new(
                            role,
                            &self.config,
                            c.revision.clone(),
                            self.api.clone(),
                            self.check_now.clone(),
                        ))
                    });
                }
            }
            Health::Down(reason) if matches!(before, Health::Up(_)) => {
                tracing::warn!(server = key, url, reason = %reason, "local server down")
            }
            Health::Down(reason) => {
                tracing::warn!(server = key, url, reason = %reason, "local server not answering")
            }
            Health::Unchecked => {}
        }
        self.health.send_replace(next.clone());
        self.changes.send_modify(|n| *n += 1);
    }

    /// Checks every `health_interval_s` (sooner when poked) until `stop` turns true.
    pub async fn watch_health(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let every = self.config.health_interval();
        loop {
            self.check().await;
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = self.check_now.notified() => {}
                r = stop.wait_for(|s| *s) => {
                    let _ = r;
                    return;
                }
            }
        }
    }

    /// `systemctl --no-block start|stop <unit>` (the job is queued; a model server may take
    /// minutes to load), then one health check: the answer's status is where it stands now,
    /// and the health checks follow it from there. Without a unit: [`UnitError::Unmanaged`].
    pub async fn control(&self, verb: &'static str) -> Result<Health, UnitError> {
        let Some(unit) = self.config.unit.clone() else {
            return Err(UnitError::Unmanaged(self.key()));
        };
        let fail = |message: String| UnitError::Failed {
            verb,
            unit: unit.clone(),
            message,
        };
        tracing::info!(server = self.key(), unit = %unit, verb, "systemctl");
        let child = tokio::process::Command::new(&self.systemctl)
            .arg("--no-block")
            .arg(verb)
            .arg(&unit)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(UNIT_TIMEOUT, child)
            .await
            .map_err(|_| fail(format!("no answer in {} s", UNIT_TIMEOUT.as_secs())))?
            .map_err(|e| fail(format!("{}: {e}", self.systemctl.display())))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let message: String = stderr.trim().chars().take(300).collect();
            return Err(fail(format!("{} ({message})", out.status)));
        }
        Ok(self.check().await)
    }
}

/// Every declared server of an agent, and one counter that moves whenever one of them comes
/// up, goes down or changes revision (the hub session re-announces its providers then).
pub struct LocalServers {
    all: Vec<Arc<LocalServer>>,
    changes: Arc<watch::Sender<u64>>,
}

impl Default for LocalServers {
    fn default() -> Self {
        Self {
            all: Vec::new(),
            changes: Arc::new(watch::channel(0).0),
        }
    }
}

impl LocalServers {
    /// One server per table; `work_timeout` bounds each work call. Nothing is checked yet.
    pub fn new(
        configs: &[LocalServerConfig],
        systemctl: &std::path::Path,
        work_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let mut set = Self::default();
        for config in configs {
            let key = config.api_key()?;
            let api = ServerApi::new(config, key, work_timeout).map_err(|e| {
                anyhow::anyhow!("local_server {}: {e}", config.role.container_key())
            })?;
            set.all.push(Arc::new(LocalServer {
                config: config.clone(),
                api: Arc::new(api),
                health: watch::channel(Health::Unchecked).0,
                strikes: AtomicU32::new(0),
                checking: tokio::sync::Mutex::new(()),
                check_now: Arc::new(Notify::new()),
                provider: Mutex::new(None),
                systemctl: systemctl.to_path_buf(),
                changes: set.changes.clone(),
            }));
        }
        Ok(set)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<LocalServer>> {
        self.all.iter()
    }

    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// Checks each once now (so the first hello and heartbeat say where they stand), then
    /// keeps checking until `stop`.
    pub async fn start(&self, stop: &watch::Receiver<bool>) {
        futures_util::future::join_all(self.all.iter().map(|s| s.check())).await;
        for s in &self.all {
            tokio::spawn(s.clone().watch_health(stop.clone()));
        }
    }

    /// The hub providers of the servers up now.
    pub fn providers(&self) -> Vec<Arc<dyn Provider>> {
        self.all.iter().filter_map(|s| s.provider()).collect()
    }

    /// Moves when the provider set may have changed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}
