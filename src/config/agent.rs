//! The agent's TOML file: which hub and which Fantom masters, who it is, its tokens' sources,
//! and the local models it serves, one `[[models]]` table per model (each serving one or more
//! roles). At least one of `hub_url` (or `hub_urls`) and a `[[fantom_master]]` table must be
//! set.
//!
//! ```toml
//! hub_url = "ws://hub.internal:8090/v1/agent"   # optional with a [[fantom_master]]
//! # hub_urls = ["ws://hub-1:8090/v1/agent", "ws://hub-2:8090/v1/agent"]   # hubs on one etcd
//! agent_id = "gpu-1"                       # default: the hostname
//! fleet_token_file = "/etc/fantom-sidecar/fleet.token"   # or fleet_token_env = "FANTOM_FLEET_TOKEN"
//!
//! [[models]]
//! roles = ["embedding", "code-embedding"]
//! model = "qwen3-embedding-4b"
//! model_dir = "/var/lib/fantom-sidecar/models/qwen3-embedding-4b"
//! # pipeline_depth = 4          # default: 2 on the CPU, 4 on a GPU
//! # max_items_per_work = 256    # default: 64 on the CPU, 256 on a GPU
//! ```
//!
//! Model servers the operator already runs (vLLM, Ollama, llama.cpp, TEI, any OpenAI-compatible
//! server) are fronted, not reimplemented: one `[[local_server]]` table each
//! ([`super::local_server`]). Masters see each as a container, the hub as a local provider.
//!
//! Cloud routes need no table: a config push with a key creates them. `openrouter_url`
//! (default `https://openrouter.ai/api/v1`) and `cloud_pipeline_depth` (default 8) tune them.
//!
//! Fantom masters (the relay drop-in, [`crate::fantom`]), one table per master:
//!
//! ```toml
//! agent_url = "http://10.0.0.5:8098"   # register.agentUrl, the same to every master
//! hostname = "gpu-01"                  # default: the host's name
//!
//! [[fantom_master]]
//! server_url = "http://10.0.0.2:3848"  # the slot's key, byte for byte
//! ws_port = 3003                       # the relay port; unset dials 3002
//! ```
//!
//! The agent's HTTP port (and role ports) take a bearer token when one is configured:
//! `http_token_file` / `http_token_env`, and each master's `auth_token_file` (the registry
//! entry's `authToken` the master sends). `[role_ports]` serves a role on its own port (the
//! master reads `containers[role].config.port`), e.g. `embedding = 11434`. Masters may also come
//! from the environment: `SIDECAR_MASTERS="url1,url2|3003"` and `MASTER_URL="url"`.

use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use serde::Deserialize;

use super::local_server::LocalServerConfig;
use super::model::ModelChoice;
use super::tokens::TokenError;
use crate::roles::{Op, Role};
use crate::secret::Secret;

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// `ws://` or `wss://` URL of the hub's agent endpoint; no hub session without it (or
    /// `hub_urls`).
    #[serde(default)]
    pub hub_url: Option<String>,
    /// Every hub of a store on etcd (`hub_url` may name one of them too): the agent dials the
    /// one that leads, and follows a standby's pointer only to an address in this list.
    #[serde(default)]
    pub hub_urls: Vec<String>,
    /// The agent's HTTP base as masters reach it (`register.agentUrl`); default
    /// `http://<hostname>:<--http port>`.
    #[serde(default)]
    pub agent_url: Option<String>,
    /// The name sent to masters (`register.hostname`); default the host's name.
    #[serde(default)]
    pub hostname: Option<String>,
    /// Fantom masters to dial on their relay, one slot each (`[[fantom_master]]` tables).
    #[serde(default, rename = "fantom_master")]
    pub fantom_masters: Vec<FantomMaster>,
    /// Unique in the fleet; the hostname when absent.
    #[serde(default)]
    pub agent_id: Option<String>,
    #[serde(default)]
    pub fleet_token_file: Option<PathBuf>,
    #[serde(default)]
    pub fleet_token_env: Option<String>,
    /// A PEM CA bundle to trust for `wss://` (instead of the system roots).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// How long SIGTERM waits for leases in progress before handing them back.
    #[serde(default = "default_drain_s")]
    pub drain_timeout_s: u64,
    /// OpenRouter's API base for cloud routes (default `https://openrouter.ai/api/v1`).
    #[serde(default)]
    pub openrouter_url: Option<String>,
    /// Work frames one cloud provider takes at once (the hub's budget decides how many run).
    #[serde(default = "default_cloud_depth")]
    pub cloud_pipeline_depth: u32,
    /// The bearer token of the agent's HTTP port and role ports (a file; or `http_token_env`).
    #[serde(default)]
    pub http_token_file: Option<PathBuf>,
    #[serde(default)]
    pub http_token_env: Option<String>,
    /// A role served on its own port (`embedding = 11434`); unset: on the agent's port.
    #[serde(default)]
    pub role_ports: BTreeMap<Role, u16>,
    /// Local models; none is fine (the agent then serves cloud routes only, after a push).
    #[serde(default)]
    pub models: Vec<ServedModel>,
    /// Model servers on this host the agent fronts (`[[local_server]]` tables).
    #[serde(default, rename = "local_server")]
    pub local_servers: Vec<LocalServerConfig>,
    /// The `systemctl` a declared server's `unit` is started and stopped with.
    #[serde(default = "default_systemctl")]
    pub systemctl: PathBuf,
}

/// One Fantom master: where its relay is (`ws://<host of server_url>:<ws_port>/sidecar`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FantomMaster {
    /// The master's HTTP base (`http://10.0.0.2:3848`): the slot's key, byte for byte as the
    /// master knows it (`master-identity` and the chat header match it exactly).
    pub server_url: String,
    /// The relay port; unset dials 3002 (Sound Suite's relay), which a Fantom master corrects
    /// with `master-identity`. Fantom's is 3003.
    #[serde(default)]
    pub ws_port: Option<u16>,
    /// The token this master presents on the agent's HTTP port (accepted as a bearer token;
    /// never logged).
    #[serde(default)]
    pub auth_token_file: Option<PathBuf>,
}

impl FantomMaster {
    /// The token of `auth_token_file`, read now; `None` without one.
    pub fn auth_token(&self) -> Result<Option<Secret>, TokenError> {
        self.auth_token_file
            .as_deref()
            .map(super::tokens::read_token_file)
            .transpose()
    }
}

/// One local model and the roles it serves.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServedModel {
    pub roles: Vec<Role>,
    /// Work frames in flight at once per role (the credits of each pull loop); unset: the
    /// device's default ([`Pipeline::for_device`]).
    #[serde(default)]
    pub pipeline_depth: Option<u32>,
    /// The most items one work frame may carry; unset: the device's default.
    #[serde(default)]
    pub max_items_per_work: Option<usize>,
    #[serde(flatten)]
    pub model: ModelChoice,
}

/// How much work a local model takes from the hub at once: frames in flight and items a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    pub depth: u32,
    pub max_items: usize,
}

impl Pipeline {
    /// The CPU's: two frames of 64 (the hub's fairness bounds were measured with these).
    pub const CPU: Pipeline = Pipeline {
        depth: 2,
        max_items: 64,
    };
    /// A GPU's: four frames of 256, so the engine always holds the next frames while one runs
    /// (a batch there is up to 256 rows; the last credit stays for interactive work) and the
    /// model thread never waits for the hub's round trip. Chosen from the engine's batch
    /// shapes, not yet measured on a GPU: the GPU check (benches/gpu/run.sh) runs `serve` with
    /// these and with 2 × 64 and 8 × 256 (docs/gpu.md).
    pub const GPU: Pipeline = Pipeline {
        depth: 4,
        max_items: 256,
    };

    /// The default for a model running on `device` (`cpu`, `cuda:0`, …).
    pub fn for_device(device: &str) -> Pipeline {
        if device == "cpu" {
            Self::CPU
        } else {
            Self::GPU
        }
    }
}

impl ServedModel {
    /// The pipeline for this model on `device`: what the table sets, else the device's default.
    pub fn pipeline(&self, device: &str) -> Pipeline {
        let default = Pipeline::for_device(device);
        Pipeline {
            depth: self.pipeline_depth.unwrap_or(default.depth),
            max_items: self.max_items_per_work.unwrap_or(default.max_items),
        }
    }
}

fn default_systemctl() -> PathBuf {
    PathBuf::from("systemctl")
}
fn default_drain_s() -> u64 {
    30
}
fn default_cloud_depth() -> u32 {
    8
}

#[derive(Debug, thiserror::Error)]
pub enum AgentConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
}

impl AgentConfig {
    /// The hubs to dial: `hub_url`, then `hub_urls`, each once.
    pub fn hubs(&self) -> Vec<String> {
        let mut hubs: Vec<String> = Vec::new();
        for url in self.hub_url.iter().chain(&self.hub_urls) {
            if !hubs.contains(url) {
                hubs.push(url.clone());
            }
        }
        hubs
    }

    pub fn load(path: &Path) -> Result<Self, AgentConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| AgentConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        Self::parse_with_env(&text, env).map_err(|message| AgentConfigError::Parse {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses a config file's text (no environment).
    pub fn parse(text: &str) -> Result<Self, String> {
        Self::parse_with_env(text, |_| None)
    }

    /// Parses the text, adds the masters of `SIDECAR_MASTERS` and `MASTER_URL` (as `env`
    /// reads them) that the file does not list, and checks the whole.
    pub fn parse_with_env(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let mut cfg: AgentConfig = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
        for master in env_masters(
            env("SIDECAR_MASTERS").as_deref(),
            env("MASTER_URL").as_deref(),
        )? {
            if !cfg
                .fantom_masters
                .iter()
                .any(|m| m.server_url == master.server_url)
            {
                cfg.fantom_masters.push(master);
            }
        }
        for hub_url in cfg.hubs() {
            if !(hub_url.starts_with("ws://") || hub_url.starts_with("wss://")) {
                return Err(format!(
                    "hub_url '{hub_url}' must start with ws:// or wss://"
                ));
            }
        }
        for (role, port) in &cfg.role_ports {
            if *port == 0 {
                return Err(format!("role_ports: {role} = 0"));
            }
            let by_server = cfg
                .local_servers
                .iter()
                .any(|s| s.role.hub_role() == Some(*role) && role.op() != Op::Chat);
            if !cfg.models.iter().any(|m| m.roles.contains(role)) && !by_server {
                return Err(format!(
                    "role_ports: {role} has a port but no [[models]] table or embedding or reranker [[local_server]] serves it"
                ));
            }
        }
        if cfg.hubs().is_empty() && cfg.fantom_masters.is_empty() {
            return Err(
                "set hub_url (or hub_urls), or at least one [[fantom_master]] table".into(),
            );
        }
        if let Some(url) = &cfg.agent_url
            && !is_http(url)
        {
            return Err(format!(
                "agent_url '{url}' must start with http:// or https://"
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for m in &cfg.fantom_masters {
            if !is_http(&m.server_url) {
                return Err(format!(
                    "fantom_master server_url '{}' must start with http:// or https://",
                    m.server_url
                ));
            }
            if m.ws_port == Some(0) {
                return Err(format!("fantom_master '{}': ws_port 0", m.server_url));
            }
            if crate::fantom::slots::relay_url(&m.server_url, m.ws_port).is_none() {
                return Err(format!(
                    "fantom_master server_url '{}' has no host",
                    m.server_url
                ));
            }
            if !seen.insert(m.server_url.as_str()) {
                return Err(format!(
                    "fantom_master server_url '{}' is listed twice",
                    m.server_url
                ));
            }
        }
        let mut served = std::collections::BTreeSet::new();
        for server in &cfg.local_servers {
            server.check()?;
            let key = server.role.container_key();
            if !served.insert(key) {
                return Err(format!(
                    "two [[local_server]] tables serve {key}; keep one per role"
                ));
            }
            if let Some(role) = server.role.hub_role()
                && cfg.models.iter().any(|m| m.roles.contains(&role))
            {
                return Err(format!(
                    "role {role} is served by a [[models]] table and a [[local_server]]; keep one per agent (run the other on an agent of its own)"
                ));
            }
        }
        for m in &cfg.models {
            if m.roles.is_empty() {
                return Err("a [[models]] table needs at least one role".into());
            }
            if m.pipeline_depth == Some(0) || m.max_items_per_work == Some(0) {
                return Err("pipeline_depth and max_items_per_work must be at least 1".into());
            }
        }
        Ok(cfg)
    }
}

/// A parse error as its line number and message, never the offending line itself: a key typed
/// into a wrong field (`api_key` for `api_key_file`, in any TOML quoting) must not be echoed;
/// values the message quotes are withheld too.
fn parse_error(text: &str, e: &toml::de::Error) -> String {
    let line = e
        .span()
        .and_then(|span| text.get(..span.start))
        .map(|before| before.matches('\n').count() + 1);
    let message = crate::secret::redact(e.message());
    match line {
        Some(line) => format!("line {line}: {message}"),
        None => message,
    }
}

/// `SIDECAR_MASTERS="url1,url2|3003"` (a `|wsPort` per entry, optional) and `MASTER_URL`.
fn env_masters(list: Option<&str>, single: Option<&str>) -> Result<Vec<FantomMaster>, String> {
    let mut out = Vec::new();
    let entries = list.into_iter().flat_map(|l| l.split(',')).chain(single);
    for entry in entries.map(str::trim).filter(|e| !e.is_empty()) {
        let (url, ws_port) = match entry.rsplit_once('|') {
            Some((url, port)) => {
                let port = port
                    .trim()
                    .parse::<u16>()
                    .map_err(|_| format!("SIDECAR_MASTERS entry '{entry}': bad wsPort"))?;
                (url.trim(), Some(port))
            }
            None => (entry, None),
        };
        out.push(FantomMaster {
            server_url: url.to_string(),
            ws_port,
            auth_token_file: None,
        });
    }
    Ok(out)
}

fn is_http(url: &str) -> bool {
    url.starts_with("http://") || url.starts_with("https://")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_models_and_refuses_unknown_roles_and_fields() {
        let cfg = AgentConfig::parse(
            r#"hub_url = "ws://127.0.0.1:8090/v1/agent"
               fleet_token_env = "T"
               [[models]]
               roles = ["embedding", "code-embedding"]
               model = "all-minilm-l6-v2"
               device = "cpu"
               max_batch_rows = 32"#,
        )
        .unwrap();
        assert_eq!(cfg.models[0].roles.len(), 2);
        assert_eq!(cfg.models[0].model.max_batch_rows, 32);
        assert_eq!(cfg.models[0].pipeline_depth, None);
        assert_eq!(cfg.models[0].pipeline("cpu"), Pipeline::CPU);
        assert_eq!(cfg.models[0].pipeline("cuda:0"), Pipeline::GPU);
        let bad_role = AgentConfig::parse(
            "hub_url = \"ws://h/v1/agent\"\n[[models]]\nroles = [\"embeddings\"]\nmodel = \"x\"",
        );
        assert!(bad_role.unwrap_err().contains("embeddings"));
        assert!(AgentConfig::parse("hub_url = \"ws://h\"\nfleet_token = \"inline\"").is_err());
        assert!(AgentConfig::parse("hub_url = \"http://h\"").is_err());
    }

    #[test]
    fn fantom_masters_may_stand_without_a_hub() {
        let cfg = AgentConfig::parse(
            r#"agent_url = "http://10.0.0.5:8098"
               [[fantom_master]]
               server_url = "http://10.0.0.2:3848"
               ws_port = 3003
               [[fantom_master]]
               server_url = "https://fantom.example"
            "#,
        )
        .unwrap();
        assert!(cfg.hub_url.is_none());
        assert_eq!(cfg.fantom_masters.len(), 2);
        assert_eq!(cfg.fantom_masters[0].ws_port, Some(3003));
        assert_eq!(cfg.fantom_masters[1].ws_port, None);
        assert!(
            AgentConfig::parse("agent_id = \"a\"").is_err(),
            "neither hub nor master"
        );
        let bad = |body: &str| AgentConfig::parse(body).is_err();
        assert!(bad(
            "[[fantom_master]]\nserver_url = \"ws://10.0.0.2:3848\""
        ));
        assert!(bad(
            "[[fantom_master]]\nserver_url = \"http://h\"\nport = 1"
        ));
        assert!(bad(
            "[[fantom_master]]\nserver_url = \"http://h\"\nws_port = 0"
        ));
        assert!(bad(
            "[[fantom_master]]\nserver_url = \"http://h\"\n[[fantom_master]]\nserver_url = \"http://h\""
        ));
        assert!(bad(
            "agent_url = \"10.0.0.5:8098\"\n[[fantom_master]]\nserver_url = \"http://h\""
        ));
    }

    #[test]
    fn local_servers_are_one_per_role_and_never_beside_a_model_of_their_role() {
        let server = |role: &str| {
            format!(
                "\n[[local_server]]\nrole = \"{role}\"\nurl = \"http://127.0.0.1:8100\"\nmodel = \"m\"\nkind = \"vllm\"\n"
            )
        };
        let top = "hub_url = \"ws://h/v1/agent\"\n";
        let cfg =
            AgentConfig::parse(&format!("{top}{}{}", server("rlm"), server("completion"))).unwrap();
        assert_eq!(cfg.local_servers.len(), 2);
        assert_eq!(cfg.systemctl, PathBuf::from("systemctl"));
        let twice = AgentConfig::parse(&format!("{top}{}{}", server("rlm"), server("rlm-sandbox")));
        assert!(twice.unwrap_err().contains("two [[local_server]]"));
        let beside = AgentConfig::parse(&format!(
            "{top}[[models]]\nroles = [\"embedding\"]\nmodel = \"x\"\n{}",
            server("embedding")
        ));
        assert!(beside.unwrap_err().contains("keep one per agent"));
        // A role port may serve a fronted embedding server.
        let ported = AgentConfig::parse(&format!(
            "{top}[role_ports]\nembedding = 11434\n{}",
            server("embedding")
        ));
        assert!(ported.is_ok(), "{ported:?}");
        let chat_port = AgentConfig::parse(&format!(
            "{top}[role_ports]\ncode-assistant = 11434\n{}",
            server("completion")
        ));
        assert!(
            chat_port.is_err(),
            "the master calls a chat server's own port"
        );

        // A key typed where it does not belong is refused and never echoed.
        let key = "sk-or-v1-0123456789abcdef0123456789abcdef";
        for quoted in [format!("\"{key}\""), "'vllm-token-abc123'".to_string()] {
            let wrong_field =
                AgentConfig::parse(&format!("{top}{}api_key = {quoted}\n", server("rlm")))
                    .unwrap_err();
            assert!(
                wrong_field.contains("api_key_file")
                    && !wrong_field.contains(key)
                    && !wrong_field.contains("abc123"),
                "{wrong_field}"
            );
        }
        let as_model = server("rlm").replace("\"m\"", &format!("\"{key}\""));
        let as_model = AgentConfig::parse(&format!("{top}{as_model}")).unwrap_err();
        assert!(
            as_model.contains("looks like a key") && !as_model.contains(key),
            "{as_model}"
        );
    }

    #[test]
    fn the_example_file_parses() {
        let cfg = AgentConfig::parse(include_str!("../../systemd/agent.example.toml")).unwrap();
        assert!(cfg.hub_url.is_some());
        assert!(!cfg.models.is_empty());
        assert!(!cfg.fantom_masters.is_empty());
    }

    #[test]
    fn masters_come_from_the_environment_too_and_role_ports_need_a_model() {
        let env = |name: &str| match name {
            "SIDECAR_MASTERS" => Some("http://a:3848|3003, http://b:3848".to_string()),
            "MASTER_URL" => Some("http://a:3848".to_string()),
            _ => None,
        };
        let cfg = AgentConfig::parse_with_env("agent_id = \"x\"", env).unwrap();
        let got: Vec<_> = cfg
            .fantom_masters
            .iter()
            .map(|m| (m.server_url.as_str(), m.ws_port))
            .collect();
        assert_eq!(
            got,
            vec![("http://a:3848", Some(3003)), ("http://b:3848", None)]
        );
        let bad_port = |_: &str| Some("http://a|x".to_string());
        assert!(AgentConfig::parse_with_env("", bad_port).is_err());

        let with_port = |port: &str| {
            AgentConfig::parse(&format!(
                "hub_url = \"ws://h/v1/agent\"\nhttp_token_env = \"T\"\n[role_ports]\n{port}\n[[models]]\nroles = [\"embedding\"]\nmodel = \"m\""
            ))
        };
        let cfg = with_port("embedding = 11434").unwrap();
        assert_eq!(cfg.role_ports[&Role::Embedding], 11434);
        assert!(
            with_port("reranker = 8099")
                .unwrap_err()
                .contains("no [[models]]")
        );
        assert!(with_port("embedding = 0").is_err());
        assert!(with_port("rerank = 8099").is_err());
    }
}
