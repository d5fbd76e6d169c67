//! The status snapshot this agent reports to a master (§2.1.4, §3.1): its identity
//! ([`RelayContext`]), its local roles as the containers a Fantom master expects, and one
//! `masters[]` row per slot. The heartbeat sends the small form every 5 s; `GET /api/status`
//! adds each slot's virtual inference and virtual containers.

use std::collections::BTreeMap;
use std::time::Instant;

use super::containers::Containers;
use super::slots::Slots;
use super::status::{AgentInfo, Gpu, RoleActivity, StatusData};
use crate::roles::Role;

/// What every slot reports about this agent.
#[derive(Clone, Debug)]
pub struct RelayContext {
    /// `register.agentUrl`: the same to every master.
    pub agent_url: String,
    pub hostname: String,
    /// `version` and `agent.version` of the status snapshot.
    pub version: String,
    /// For `agent.uptime`.
    pub started: Instant,
}

/// The status snapshot as the slot `master` sees it (a sandbox model pushed by that master
/// adds the `rlm-sandbox` role key, which the chat host ranking reads, §3.3). `detailed` adds
/// the virtual containers of every slot (`GET /api/status`); heartbeats stay small.
pub fn status_data(
    ctx: &RelayContext,
    containers: &Containers,
    slots: &Slots,
    master: Option<&str>,
    detailed: bool,
    shown: Option<&[String]>,
) -> StatusData {
    let mut by_role = BTreeMap::new();
    let mut roles = BTreeMap::new();
    let mut gpus: Vec<Gpu> = Vec::new();
    for s in containers.servers() {
        by_role.insert(s.key().to_string(), s.container());
        roles.insert(s.key().to_string(), s.activity());
    }
    for c in containers.iter() {
        by_role.insert(c.role.as_str().to_string(), c.container());
        roles.insert(c.role.as_str().to_string(), c.activity());
        if let Some(index) = c.device.strip_prefix("cuda:").and_then(|i| i.parse().ok())
            && !gpus.iter().any(|g| g.index == index)
        {
            gpus.push(Gpu {
                index,
                name: Some(c.device.clone()),
                ..Default::default()
            });
        }
    }
    let sandbox = |url: &str| {
        slots
            .with_slot(url, |s| s.allowed(Role::RlmSandbox).is_some())
            .unwrap_or(false)
    };
    let with_sandbox = match (master, shown) {
        (Some(url), _) => sandbox(url),
        (None, Some(urls)) => urls.iter().any(|u| sandbox(u)),
        (None, None) => slots.server_urls().iter().any(|u| sandbox(u)),
    };
    if with_sandbox {
        roles.insert(
            Role::RlmSandbox.as_str().to_string(),
            RoleActivity::default(),
        );
    }
    StatusData {
        agent_url: Some(ctx.agent_url.clone()),
        hostname: Some(ctx.hostname.clone()),
        mode: Some("fantom-sidecar".into()),
        version: Some(ctx.version.clone()),
        agent: Some(AgentInfo {
            version: ctx.version.clone(),
            uptime: Some(ctx.started.elapsed().as_secs()),
        }),
        container_names: by_role.values().map(|c| c.name.clone()).collect(),
        containers: by_role,
        roles,
        gpus,
        masters: slots.master_entries(detailed, shown),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::agent::CloudOptions;
    use crate::agent::provider::{BoxFuture, Provider, ProviderFailure, WorkResult};
    use crate::config::agent::FantomMaster;
    use crate::fantom::frames::{Heartbeat, SidecarFrame, encode_sidecar};
    use crate::protocol::{Backend, FailureClass, ProviderInfo, WorkInput};

    /// A provider that only describes itself.
    struct Described(ProviderInfo);

    impl Provider for Described {
        fn info(&self) -> ProviderInfo {
            self.0.clone()
        }
        fn pipeline_depth(&self) -> u32 {
            1
        }
        fn run(&self, _: WorkInput) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
            Box::pin(async { Err(ProviderFailure::new(FailureClass::Fatal, "not here")) })
        }
    }

    fn described(role: Role, model: &str, device: &str) -> Arc<dyn Provider> {
        Arc::new(Described(ProviderInfo {
            id: role.to_string(),
            role,
            backend: Backend::Local,
            model: model.into(),
            revision: None,
            upstream: None,
            dims: None,
            dtype: None,
            device: Some(device.into()),
            max_input_tokens: None,
            pooling: None,
            max_batch_items: 16,
            max_batch_tokens: 1024,
            score_activation: None,
            server: None,
            attention: None,
        }))
    }

    fn fixture() -> (RelayContext, Containers, Slots) {
        let ctx = RelayContext {
            agent_url: "http://10.0.0.5:8098".into(),
            hostname: "gpu-01".into(),
            version: "0.1.0".into(),
            started: Instant::now(),
        };
        let providers = [
            described(Role::Embedding, "all-minilm-l6-v2", "cpu"),
            described(Role::Reranker, "ms-marco-minilm", "cuda:0"),
            described(Role::CodeAssistant, "never-local", "cpu"),
        ];
        let ports = [(Role::Reranker, 8099)].into_iter().collect();
        let containers = Containers::new(&providers, &[], &Default::default(), &ports, 8098, false);
        let masters = [FantomMaster {
            server_url: "http://10.0.0.2:3848".into(),
            ws_port: None,
            auth_token_file: None,
        }];
        (
            ctx,
            containers,
            Slots::new(&masters, CloudOptions::default()),
        )
    }

    #[test]
    fn the_heartbeat_reports_local_roles_at_their_ports_and_every_slot() {
        let (ctx, containers, slots) = fixture();
        let data = status_data(
            &ctx,
            &containers,
            &slots,
            Some("http://10.0.0.2:3848"),
            false,
            None,
        );
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
        assert_eq!(embedding["loadedModels"][0]["gpuPercent"], -1, "on the CPU");
        let reranker = &sd["containers"]["reranker"];
        assert_eq!(reranker["type"], "vllm");
        assert_eq!(reranker["config"]["port"], 8099, "its own role port");
        assert_eq!(reranker["loadedModels"][0]["gpuPercent"], 100);
        assert_eq!(sd["gpus"][0]["index"], 0);
        assert!(sd["containers"].get("code-assistant").is_none());
        assert!(sd["roles"].get("embedding").is_some());
        assert_eq!(sd["masters"][0]["serverUrl"], "http://10.0.0.2:3848");
        assert_eq!(sd["masters"][0]["wsPort"], 3002, "the effective port");
        assert!(sd["masters"][0].get("virtualContainers").is_none(), "small");
        assert_eq!(sd["agent"]["version"], "0.1.0");
        assert_eq!(sd["agentUrl"], "http://10.0.0.5:8098");
    }

    #[test]
    fn the_status_route_adds_each_slots_virtual_containers_without_the_key() {
        let (ctx, containers, slots) = fixture();
        let master = "http://10.0.0.2:3848";
        let push = serde_json::from_str(
            r#"{"apiKey":"sk-or-v1-snapshot-secret","allowedModels":{
                "code-embedding":{"model":"qwen/qwen3-embedding-8b","provider":"Nebius","dims":4096},
                "rlm-sandbox":{"model":"deepseek/deepseek-v4-flash"}},
              "modeByRole":{"code-embedding":"cloud-only","rlm":"local-first"}}"#,
        )
        .unwrap();
        slots.apply_config(master, push);
        slots.begin_call(master, "code-embedding");
        slots.end_call(master, "code-embedding", 840, None);
        let data = status_data(&ctx, &containers, &slots, None, true, None);
        let text = serde_json::to_string(&data).unwrap();
        assert!(!text.contains("snapshot-secret"), "{text}");
        let v: serde_json::Value =
            serde_json::from_value(serde_json::to_value(&data).unwrap()).unwrap();
        let row = &v["masters"][0];
        assert_eq!(row["virtualInference"]["openrouter"], "configured");
        assert_eq!(
            row["virtualInference"]["modeByRole"]["code-embedding"],
            "cloud-only"
        );
        let rows = row["virtualContainers"].as_array().unwrap();
        let code = rows.iter().find(|r| r["role"] == "code-embedding").unwrap();
        assert_eq!(code["provider"], "Nebius");
        assert_eq!(code["dims"], 4096);
        assert_eq!(code["mode"], "cloud-only");
        assert_eq!(code["served"], 1);
        assert_eq!(code["lastDurationMs"], 840);
        assert_eq!(code["state"], "idle");
        let rlm = rows
            .iter()
            .find(|r| r["role"] == "rlm")
            .expect("the sandbox row as rlm");
        assert_eq!(rlm["model"], "deepseek/deepseek-v4-flash");
        assert_eq!(
            rlm["mode"], "local-first",
            "rlm-sandbox falls back to the rlm mode"
        );
        assert!(v["roles"].get("rlm-sandbox").is_some());
    }
}
