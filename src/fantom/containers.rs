//! The agent's local roles as the "containers" a Fantom master knows (`ss-embedding`,
//! `ss-code-embedding`, `ss-reranker`): what each serves, on which port, whether it is loaded,
//! and the `start`/`stop`/`acquire`/`release` actions on it (§2.2, §3.1).
//!
//! Each container holds the [`Provider`] of its role (a candle engine) and the `[[models]]`
//! table it came from, so `stop` can unload the model and `start` load it again. When a hub
//! session shares the provider, the engine stays loaded until both let go of it; the answer
//! says so. The role endpoints ([`super::role_api`]) and nothing else call the providers here.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;

pub use super::frames::ContainerVerb;
use super::status::{Container, ContainerConfig, ContainerKind, LoadedModel, RoleActivity};
use crate::agent::provider::{LocalProvider, Provider};
use crate::config::agent::ServedModel;
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
        role: Role,
        serves: String,
        requested: String,
    },
    #[error("the {0} container is stopped; start it first")]
    Stopped(Role),
    #[error("the {role} model cannot be loaded again: {message}")]
    Load { role: Role, message: String },
}

/// The answer to a container action: `{ok, role, model, status}`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ActionReport {
    pub ok: bool,
    pub role: Role,
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
    /// The engine's device (`cpu`, `cuda:0`).
    pub device: String,
    /// The table it was loaded from (to load it again after a `stop`).
    served: Option<ServedModel>,
    /// A hub session holds the same provider.
    shared_with_hub: bool,
    state: Mutex<ContainerState>,
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
        self.lock().provider.is_some()
    }

    /// Whether `requested` names this container's model (Ollama's `:latest` tag is ignored).
    pub fn serves(&self, requested: &str) -> bool {
        let requested = requested.trim();
        requested == self.model || requested.strip_suffix(":latest") == Some(self.model.as_str())
    }

    /// The provider for one call, counted as active until the guard drops.
    pub fn begin(&self) -> Result<(Arc<dyn Provider>, ActiveCall<'_>), ContainerError> {
        let mut state = self.lock();
        let provider = state
            .provider
            .clone()
            .ok_or(ContainerError::Stopped(self.role))?;
        state.active_requests += 1;
        drop(state);
        Ok((provider, ActiveCall { container: self }))
    }

    fn report(&self, still_loaded_for_hub: bool) -> ActionReport {
        ActionReport {
            ok: true,
            role: self.role,
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
        // Ollama's `/api/embed` for embedders, vLLM's `/v1/rerank` for the reranker.
        let kind = if self.role == Role::Reranker {
            ContainerKind::Vllm
        } else {
            ContainerKind::Ollama
        };
        let on_gpu = self.device != "cpu";
        let loaded_models = if running {
            vec![LoadedModel {
                name: self.model.clone(),
                size: None,
                gpu_percent: Some(if on_gpu { 100 } else { -1 }),
                processor: Some(if on_gpu { "GPU" } else { "CPU" }.to_string()),
                until: None,
            }]
        } else {
            Vec::new()
        };
        Container {
            name: format!("ss-{}", self.role),
            status: if running {
                Container::RUNNING
            } else {
                Container::EXITED
            }
            .to_string(),
            image: None,
            model: Some(self.model.clone()),
            kind: Some(kind),
            config: ContainerConfig {
                image: None,
                model: Some(self.model.clone()),
                port: self.port,
                vram: None,
                kind: Some(kind),
                gpu_only: None,
            },
            loaded_models,
            exists: Some(true),
        }
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

/// Every local role of this agent.
#[derive(Default)]
pub struct Containers {
    all: Vec<LocalContainer>,
}

impl Containers {
    /// One container per local embedding or reranker provider. `tables` are the `[[models]]`
    /// the providers came from; `ports` the role ports (else `agent_port`).
    pub fn new(
        providers: &[Arc<dyn Provider>],
        tables: &[ServedModel],
        ports: &BTreeMap<Role, u16>,
        agent_port: u16,
        shared_with_hub: bool,
    ) -> Self {
        let all = providers
            .iter()
            .filter(|p| matches!(p.info().role.op(), Op::Embed | Op::Rerank))
            .map(|p| {
                let info = p.info();
                LocalContainer {
                    role: info.role,
                    model: info.model.clone(),
                    port: ports.get(&info.role).copied().unwrap_or(agent_port),
                    device: info.device.clone().unwrap_or_else(|| "cpu".into()),
                    served: tables
                        .iter()
                        .find(|t| t.roles.contains(&info.role))
                        .cloned(),
                    shared_with_hub,
                    state: Mutex::new(ContainerState {
                        provider: Some(p.clone()),
                        ..Default::default()
                    }),
                }
            })
            .collect();
        Containers { all }
    }

    pub fn iter(&self) -> impl Iterator<Item = &LocalContainer> {
        self.all.iter()
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
        let container = self.by_role(role)?;
        if let Some(requested) = model.filter(|m| !m.trim().is_empty())
            && !container.serves(requested)
        {
            return Err(ContainerError::ModelMismatch {
                role: container.role,
                serves: container.model.clone(),
                requested: requested.to_string(),
            });
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
    let Some(served) = &container.served else {
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
    Ok(Arc::new(LocalProvider::new(
        container.role,
        engine,
        served.pipeline_depth,
        served.max_items_per_work,
    )))
}
