//! The status snapshot this agent reports to a master (§2.1.4): its identity
//! ([`RelayContext`]), its local roles as the containers a Fantom master expects, and one
//! `masters[]` row per slot. The heartbeat sends it every 5 s; `GET /api/status` will add the
//! per-slot virtual containers.

use std::collections::BTreeMap;
use std::time::Instant;

use super::slots::Slots;
use super::status::{
    AgentInfo, Container, ContainerConfig, ContainerKind, LoadedModel, MasterEntry, RoleActivity,
    StatusData,
};
use crate::roles::Role;

/// What every slot reports about this agent.
#[derive(Clone, Debug)]
pub struct RelayContext {
    /// `register.agentUrl`: the same to every master.
    pub agent_url: String,
    pub hostname: String,
    /// The agent's HTTP port: `config.port` of every local container for now.
    pub http_port: u16,
    /// `version` and `agent.version` of the status snapshot.
    pub version: String,
    /// The local roles and the model serving each.
    pub roles: Vec<(Role, String)>,
    /// For `agent.uptime`.
    pub started: Instant,
}

impl RelayContext {
    /// The local roles a master knows as containers (`embedding`, `code-embedding`,
    /// `reranker`); chat roles are never local.
    pub fn containers(&self) -> impl Iterator<Item = (Role, &str)> {
        self.roles
            .iter()
            .filter(|(role, _)| {
                matches!(role, Role::Embedding | Role::CodeEmbedding | Role::Reranker)
            })
            .map(|(role, model)| (*role, model.as_str()))
    }
}

/// The heartbeat's `statusData` (§2.1.4) as the slot `master` sends it (the `masters[]` rows
/// carry no virtual containers: the heartbeat stays small).
pub fn status_data(ctx: &RelayContext, slots: &Slots, master: &str) -> StatusData {
    let mut containers = BTreeMap::new();
    let mut roles = BTreeMap::new();
    for (role, model) in ctx.containers() {
        // Ollama's `/api/embed` for embedders, vLLM's `/v1/rerank` for the reranker.
        let kind = if role == Role::Reranker {
            ContainerKind::Vllm
        } else {
            ContainerKind::Ollama
        };
        let container = Container {
            name: format!("ss-{role}"),
            status: Container::RUNNING.to_string(),
            image: None,
            model: Some(model.to_string()),
            kind: Some(kind),
            config: ContainerConfig {
                image: None,
                model: Some(model.to_string()),
                port: ctx.http_port,
                vram: None,
                kind: Some(kind),
                gpu_only: None,
            },
            loaded_models: vec![LoadedModel {
                name: model.to_string(),
                size: None,
                gpu_percent: None,
                processor: None,
                until: None,
            }],
            exists: None,
        };
        containers.insert(role.as_str().to_string(), container);
        let activity = RoleActivity {
            active_requests: Some(0),
            ..Default::default()
        };
        roles.insert(role.as_str().to_string(), activity);
    }
    let views = slots.snapshot();
    // The chat host ranking reads `roles` keys: say so when this master pushed a sandbox model.
    if views
        .iter()
        .any(|v| v.server_url == master && v.models.contains_key(Role::RlmSandbox.as_str()))
    {
        roles.insert(
            Role::RlmSandbox.as_str().to_string(),
            RoleActivity::default(),
        );
    }
    let masters = views
        .into_iter()
        .map(|v| MasterEntry {
            server_url: v.server_url,
            ws_port: Some(v.ws_port),
            connection_mode: v.connected.then(|| "websocket".to_string()),
            virtual_inference: None,
            virtual_containers: None,
        })
        .collect();
    StatusData {
        agent_url: Some(ctx.agent_url.clone()),
        hostname: Some(ctx.hostname.clone()),
        version: Some(ctx.version.clone()),
        agent: Some(AgentInfo {
            version: ctx.version.clone(),
            uptime: Some(ctx.started.elapsed().as_secs()),
        }),
        container_names: containers
            .values()
            .map(|c: &Container| c.name.clone())
            .collect(),
        containers,
        roles,
        masters,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::agent::FantomMaster;
    use crate::fantom::frames::{Heartbeat, SidecarFrame, encode_sidecar};

    #[test]
    fn the_heartbeat_reports_local_roles_at_the_agent_port_and_every_slot() {
        let ctx = RelayContext {
            agent_url: "http://10.0.0.5:8098".into(),
            hostname: "gpu-01".into(),
            http_port: 8098,
            version: "0.1.0".into(),
            roles: vec![
                (Role::Embedding, "all-minilm-l6-v2".into()),
                (Role::Reranker, "ms-marco-minilm".into()),
                (Role::CodeAssistant, "never-local".into()),
            ],
            started: Instant::now(),
        };
        let masters = [FantomMaster {
            server_url: "http://10.0.0.2:3848".into(),
            ws_port: None,
            auth_token_file: None,
        }];
        let slots = Slots::new(&masters);
        let data = status_data(&ctx, &slots, "http://10.0.0.2:3848");
        let beat = SidecarFrame::Heartbeat(Heartbeat {
            status_data: Some(Box::new(data)),
            ..Default::default()
        });
        let text = encode_sidecar(&beat);
        assert!(text.starts_with(r#"{"type":"heartbeat""#), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let sd = &v["statusData"];
        let embedding = &sd["containers"]["embedding"];
        assert_eq!(embedding["name"], "ss-embedding");
        assert_eq!(embedding["status"], "running");
        assert_eq!(embedding["config"]["port"], 8098);
        assert_eq!(embedding["loadedModels"][0]["name"], "all-minilm-l6-v2");
        assert_eq!(sd["containers"]["reranker"]["type"], "vllm");
        assert!(sd["containers"].get("code-assistant").is_none());
        assert!(sd["roles"].get("embedding").is_some());
        assert_eq!(sd["masters"][0]["serverUrl"], "http://10.0.0.2:3848");
        assert_eq!(sd["masters"][0]["wsPort"], 3002, "the effective port");
        assert_eq!(sd["agent"]["version"], "0.1.0");
        assert_eq!(sd["agentUrl"], "http://10.0.0.5:8098");
    }
}
