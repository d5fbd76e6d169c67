//! A fronted chat server as the container a master knows (`ss-rlm` on vLLM, `ss-completion`
//! and `ss-ocr` on Ollama): the master calls its own port directly (`config.port` is the
//! server URL's), so the agent only reports it, `running` while its health check answers, and
//! acts on its unit for `start`/`stop`. `acquire`/`release` are timed as for our own models.

use std::sync::{Arc, Mutex, PoisonError};

use super::containers::{
    ActionReport, ContainerError, ContainerVerb, act_on_server, container_kind,
};
use super::status::{Container, LoadedModel, RoleActivity};
use crate::agent::local_server::LocalServer;
use crate::agent::local_server::api::ollama_same;
use crate::hub::now_ms;

pub struct ServerContainer {
    server: Arc<LocalServer>,
    /// The agent's hub session serves from it too (a master may not stop it then).
    shared_with_hub: bool,
    /// Last acquire and release (epoch ms).
    times: Mutex<(Option<u64>, Option<u64>)>,
}

impl ServerContainer {
    pub fn new(server: Arc<LocalServer>, shared_with_hub: bool) -> Self {
        Self {
            server,
            shared_with_hub,
            times: Mutex::default(),
        }
    }

    /// The role key (`rlm`, `completion`, `ocr`).
    pub fn key(&self) -> &'static str {
        self.server.key()
    }

    fn status(&self) -> &'static str {
        if self.server.is_up() {
            Container::RUNNING
        } else {
            Container::EXITED
        }
    }

    /// The master's view: the server's own port, its model, its kind.
    pub fn container(&self) -> Container {
        let cfg = &self.server.config;
        let kind = container_kind(cfg.kind);
        let running = self.server.is_up();
        let loaded = if running {
            vec![LoadedModel::named(&cfg.model)]
        } else {
            Vec::new()
        };
        let port = cfg.port().unwrap_or(80);
        Container::of(self.key(), running, &cfg.model, kind, port, loaded)
    }

    pub fn activity(&self) -> RoleActivity {
        let (last_acquire, last_release) =
            *self.times.lock().unwrap_or_else(PoisonError::into_inner);
        RoleActivity {
            // The master calls the server itself: its requests are not seen here.
            active_requests: None,
            idle_timer_active: Some(false),
            last_acquire,
            last_release,
        }
    }

    /// `start`/`acquire` start the unit when the server is down, `stop` stops it; without a
    /// unit those are refused (the server is managed elsewhere), except an `acquire` or
    /// `start` of a server that answers already. A server the hub serves from too is not
    /// stopped by a master.
    pub async fn act(
        &self,
        verb: ContainerVerb,
        model: Option<&str>,
    ) -> Result<ActionReport, ContainerError> {
        let cfg = &self.server.config;
        if let Some(requested) = model.filter(|m| !m.trim().is_empty())
            && !ollama_same(requested, &cfg.model)
        {
            return Err(ContainerError::ModelMismatch {
                role: self.key().to_string(),
                serves: cfg.model.clone(),
                requested: requested.to_string(),
            });
        }
        act_on_server(&self.server, verb, self.shared_with_hub).await?;
        {
            let mut times = self.times.lock().unwrap_or_else(PoisonError::into_inner);
            match verb {
                ContainerVerb::Acquire => times.0 = Some(now_ms()),
                ContainerVerb::Release => times.1 = Some(now_ms()),
                _ => {}
            }
        }
        Ok(ActionReport {
            ok: true,
            role: self.key().to_string(),
            model: cfg.model.clone(),
            status: self.status(),
            still_loaded_for_hub: false,
        })
    }
}
