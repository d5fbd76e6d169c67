//! The agent's local roles as the "containers" a Fantom master knows (`ss-embedding`,
//! `ss-code-embedding`, `ss-reranker`, `ss-rlm`, `ss-completion`): what each serves, on which
//! port, whether it is up, and the `start`/`stop`/`acquire`/`release` actions on it (§2.2,
//! §3.1).
//!
//! A [`LocalContainer`] is an embedding or reranker role the role endpoints
//! ([`super::role_api`]) answer: a candle engine with the `[[models]]` table it came from (so
//! `stop` can unload the model and `start` load it again; when a hub session shares the
//! provider, the engine stays loaded until both let go of it, and the answer says so), or a
//! fronted embedding server (`running` while it answers; `start`/`stop` act on its unit). A
//! chat server (the RLM's vLLM, Ollama's completion) is a [`ServerContainer`]: the master
//! calls its own port directly.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;

pub use super::frames::ContainerVerb;
pub use super::server_container::ServerContainer;
use super::status::{Container, ContainerKind, LoadedModel, RoleActivity};
use crate::agent::local_server::{LocalServer, LocalServers, UnitError};
use crate::agent::provider::{LocalProvider, Provider};
use crate::config::agent::ServedModel;
use crate::config::local_server::ServerKind;
use crate::hub::now_ms;
use crate::model_spec::Task;
use crate::roles::{Op, Role};

/// Why a container action or call was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ContainerError {
    #[error("no local container for role {0}")]
    NoContainer(String),
    #[error("model mismatch: the {role} container serves {serves}, not {requested}")]
    ModelMismatch {
        role: String,
        serves: String,
        requested: String,
    },
    #[error("the {0} container is stopped; start it first")]
    Stopped(Role),
    #[error("the {role} model cannot be loaded again: {message}")]
    Load { role: Role, message: String },
    /// A fronted server's unit: none named, or `systemctl` failed.
    #[error(transparent)]
    Unit(#[from] UnitError),
    /// A master's `stop` of a fronted server the hub session serves from too.
    #[error(
        "the {0} server also serves this agent's hub session: a master's stop would take it from the hub too; stop it where it is managed"
    )]
    SharedWithHub(String),
}

/// The answer to a container action: `{ok, role, model, status}`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ActionReport {
    pub ok: bool,
    /// The container's role key (`embedding`, `rlm`, ...).
    pub role: String,
    pub model: String,
    /// `running` or `exited`.
    pub status: &'static str,
    /// `stop` only: the hub session still holds the model, so its memory is not freed yet.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub still_loaded_for_hub: bool,
}

/// One local role.
pub struct LocalContainer {
    pub role: Role,
    /// The model name reported and matched (`containers[role].config.model`).
    pub model: String,
    /// The port its role endpoints answer on (`config.port`).
    pub port: u16,
    /// The engine's device (`cpu`, `cuda:0`; `server` for a fronted one).
    pub device: String,
    source: Source,
    /// A hub session holds the same provider.
    shared_with_hub: bool,
    state: Mutex<ContainerState>,
}

/// What serves a local container.
enum Source {
    /// A candle engine, and the table it was loaded from (to load it again after a `stop`).
    Model(Option<ServedModel>),
    /// A fronted embedding server.
    Server(Arc<LocalServer>),
}

#[derive(Default)]
struct ContainerState {
    provider: Option<Arc<dyn Provider>>,
    active_requests: u64,
    last_acquire_ms: Option<u64>,
    last_release_ms: Option<u64>,
}

/// Decrements a container's active requests when a call ends (also on error or cancel).
pub struct ActiveCall<'a> {
    container: &'a LocalContainer,
}

impl Drop for ActiveCall<'_> {
    fn drop(&mut self) {
        let mut state = self.container.lock();
        state.active_requests = state.active_requests.saturating_sub(1);
    }
}

impl LocalContainer {
    fn lock(&self) -> MutexGuard<'_, ContainerState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn is_running(&self) -> bool {
        match &self.source {
            Source::Server(server) => server.is_up(),
            Source::Model(_) => self.lock().provider.is_some(),
        }
    }

    /// Whether `requested` names this container's model (Ollama's `:latest` tag is ignored).
    pub fn serves(&self, requested: &str) -> bool {
        crate::agent::local_server::api::ollama_same(requested, &self.model)
    }

    /// The provider for one call, counted as active until the guard drops.
    pub fn begin(&self) -> Result<(Arc<dyn Provider>, ActiveCall<'_>), ContainerError> {
        let mut state = self.lock();
        let provider = match &self.source {
            Source::Server(server) => server.provider(),
            Source::Model(_) => state.provider.clone(),
        }
        .ok_or(ContainerError::Stopped(self.role))?;
        state.active_requests += 1;
        drop(state);
        Ok((provider, ActiveCall { container: self }))
    }

    fn report(&self, still_loaded_for_hub: bool) -> ActionReport {
        ActionReport {
            ok: true,
            role: self.role.to_string(),
            model: self.model.clone(),
            status: if self.is_running() {
                Container::RUNNING
            } else {
                Container::EXITED
            },
            still_loaded_for_hub,
        }
    }

    /// The master's view of this container.
    pub fn container(&self) -> Container {
        let running = self.is_running();
        // Ollama's `/api/embed` for embedders, vLLM's `/v1/rerank` for the reranker (a fronted
        // server's API is ours to answer here: masters call the agent's port for it).
        let kind = match &self.source {
            _ if self.role == Role::Reranker => ContainerKind::Vllm,
            Source::Server(server) => container_kind(server.config.kind),
            Source::Model(_) => ContainerKind::Ollama,
        };
        let on_gpu = self.device.starts_with("cuda");
        let loaded_models = match &self.source {
            _ if !running => Vec::new(),
            Source::Server(_) => vec![LoadedModel::named(&self.model)],
            Source::Model(_) => vec![LoadedModel {
                name: self.model.clone(),
                size: None,
                gpu_percent: Some(if on_gpu { 100 } else { -1 }),
                processor: Some(if on_gpu { "GPU" } else { "CPU" }.to_string()),
                until: None,
            }],
        };
        Container::of(
            self.role.as_str(),
            running,
            &self.model,
            kind,
            self.port,
            loaded_models,
        )
    }

    pub fn activity(&self) -> RoleActivity {
        let state = self.lock();
        RoleActivity {
            active_requests: Some(state.active_requests),
            idle_timer_active: Some(false),
            last_acquire: state.last_acquire_ms,
            last_release: state.last_release_ms,
        }
    }
}

/// A master's `type` for a server kind: it offers Pull buttons for `ollama` only.
pub fn container_kind(kind: ServerKind) -> ContainerKind {
    match kind {
        ServerKind::Ollama => ContainerKind::Ollama,
        _ => ContainerKind::Vllm,
    }
}

/// What `start`/`acquire` (start it when down) and `stop` do to a fronted server's unit. A
/// server the hub session serves from too is not a master's to stop.
pub(super) async fn act_on_server(
    server: &LocalServer,
    verb: ContainerVerb,
    shared_with_hub: bool,
) -> Result<(), ContainerError> {
    match verb {
        ContainerVerb::Start | ContainerVerb::Acquire if !server.is_up() => {
            server.control("start").await?;
        }
        ContainerVerb::Stop if shared_with_hub && server.config.role.hub_role().is_some() => {
            return Err(ContainerError::SharedWithHub(server.key().to_string()));
        }
        ContainerVerb::Stop => {
            server.control("stop").await?;
        }
        _ => {}
    }
    Ok(())
}

/// Every local role of this agent.
#[derive(Default)]
pub struct Containers {
    all: Vec<LocalContainer>,
    servers: Vec<ServerContainer>,
}

impl Containers {
    /// One container per local embedding or reranker provider, and one per fronted server.
    /// `tables` are the `[[models]]` the providers came from; `ports` the role ports (else
    /// `agent_port`, where an embedding server is answered too).
    pub fn new(
        providers: &[Arc<dyn Provider>],
        tables: &[ServedModel],
        servers: &LocalServers,
        ports: &BTreeMap<Role, u16>,
        agent_port: u16,
        shared_with_hub: bool,
    ) -> Self {
        let mut all: Vec<LocalContainer> = providers
            .iter()
            .filter(|p| matches!(p.info().role.op(), Op::Embed | Op::Rerank))
            .map(|p| {
                let info = p.info();
                LocalContainer {
                    role: info.role,
                    model: info.model.clone(),
                    port: ports.get(&info.role).copied().unwrap_or(agent_port),
                    device: info.device.clone().unwrap_or_else(|| "cpu".into()),
                    source: Source::Model(
                        tables
                            .iter()
                            .find(|t| t.roles.contains(&info.role))
                            .cloned(),
                    ),
                    shared_with_hub,
                    state: Mutex::new(ContainerState {
                        provider: Some(p.clone()),
                        ..Default::default()
                    }),
                }
            })
            .collect();
        let mut chat = Vec::new();
        for server in servers.iter() {
            match server.config.role.hub_role() {
                // Embedding and reranker servers are answered on the agent's role endpoints,
                // as our own models are; chat servers are called directly.
                Some(role) if role.op() != Op::Chat => all.push(LocalContainer {
                    role,
                    model: server.config.model.clone(),
                    port: ports.get(&role).copied().unwrap_or(agent_port),
                    device: "server".into(),
                    source: Source::Server(server.clone()),
                    shared_with_hub,
                    state: Mutex::default(),
                }),
                _ => chat.push(ServerContainer::new(server.clone(), shared_with_hub)),
            }
        }
        Containers { all, servers: chat }
    }

    /// The embedding and reranker containers (the role endpoints answer them).
    pub fn iter(&self) -> impl Iterator<Item = &LocalContainer> {
        self.all.iter()
    }

    /// Every container's name (`ss-<role>`), as `register` lists them.
    pub fn names(&self) -> Vec<String> {
        let servers = self.servers.iter().map(|s| s.key().to_string());
        let roles = self.all.iter().map(|c| c.role.to_string());
        servers
            .chain(roles)
            .map(|key| format!("ss-{key}"))
            .collect()
    }

    /// The chat servers masters call directly.
    pub fn servers(&self) -> impl Iterator<Item = &ServerContainer> {
        self.servers.iter()
    }

    /// The container of a role name as the master writes it.
    pub fn by_role(&self, role: &str) -> Result<&LocalContainer, ContainerError> {
        self.all
            .iter()
            .find(|c| c.role.as_str() == role)
            .ok_or_else(|| ContainerError::NoContainer(role.to_string()))
    }

    /// The container serving `model`, among those `allowed` (a role port serves its roles).
    pub fn by_model(&self, model: &str, allowed: impl Fn(Role) -> bool) -> Option<&LocalContainer> {
        self.all.iter().find(|c| allowed(c.role) && c.serves(model))
    }

    /// The first container of the allowed roles (a role port called without `model`).
    pub fn first(&self, allowed: impl Fn(Role) -> bool) -> Option<&LocalContainer> {
        self.all.iter().find(|c| allowed(c.role))
    }

    /// Requests in progress across every container.
    pub fn active_requests(&self) -> u64 {
        self.all.iter().map(|c| c.lock().active_requests).sum()
    }

    /// `start`/`acquire` (load when stopped), `stop` (unload), `release` (note the time).
    pub async fn act(
        &self,
        verb: ContainerVerb,
        role: &str,
        model: Option<&str>,
    ) -> Result<ActionReport, ContainerError> {
        if let Some(server) = self.servers.iter().find(|s| s.key() == role) {
            return server.act(verb, model).await;
        }
        let container = self.by_role(role)?;
        if let Some(requested) = model.filter(|m| !m.trim().is_empty())
            && !container.serves(requested)
        {
            return Err(ContainerError::ModelMismatch {
                role: container.role.to_string(),
                serves: container.model.clone(),
                requested: requested.to_string(),
            });
        }
        if let Source::Server(server) = &container.source {
            act_on_server(server, verb, container.shared_with_hub).await?;
            let mut state = container.lock();
            match verb {
                ContainerVerb::Acquire => state.last_acquire_ms = Some(now_ms()),
                ContainerVerb::Release => state.last_release_ms = Some(now_ms()),
                _ => {}
            }
            drop(state);
            return Ok(container.report(false));
        }
        match verb {
            ContainerVerb::Start | ContainerVerb::Acquire => {
                if !container.is_running() {
                    let provider = load(container).await?;
                    let mut state = container.lock();
                    // Two starts at once: the first loaded wins, the other engine drops.
                    if state.provider.is_none() {
                        state.provider = Some(provider);
                    }
                }
                if verb == ContainerVerb::Acquire {
                    container.lock().last_acquire_ms = Some(now_ms());
                }
                Ok(container.report(false))
            }
            ContainerVerb::Stop => {
                container.lock().provider = None;
                Ok(container.report(container.shared_with_hub))
            }
            ContainerVerb::Release => {
                container.lock().last_release_ms = Some(now_ms());
                Ok(container.report(false))
            }
        }
    }
}

/// Loads a stopped container's model again from its `[[models]]` table.
async fn load(container: &LocalContainer) -> Result<Arc<dyn Provider>, ContainerError> {
    let fail = |message: String| ContainerError::Load {
        role: container.role,
        message,
    };
    let Source::Model(Some(served)) = &container.source else {
        return Err(fail("no [[models]] table to load it from".into()));
    };
    let task = match container.role.op() {
        Op::Rerank => Task::Rerank,
        _ => Task::Embed,
    };
    tracing::info!(role = %container.role, model = %container.model, "loading a stopped container's model");
    let engine = served
        .model
        .load(task)
        .await
        .map_err(|e| fail(format!("{e:#}")))?;
    let pipeline = served.pipeline(&engine.info().device);
    Ok(Arc::new(LocalProvider::new(
        container.role,
        engine,
        pipeline,
    )))
}
