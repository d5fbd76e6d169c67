//! The agent's TOML file: which hub, who it is, its tokens' sources, and the local models it
//! serves, one `[[models]]` table per model (each serving one or more roles).
//!
//! ```toml
//! hub_url = "ws://hub.internal:8090/v1/agent"
//! agent_id = "gpu-1"                       # default: the hostname
//! fleet_token_file = "/etc/fantom-sidecar/fleet.token"   # or fleet_token_env = "FANTOM_FLEET_TOKEN"
//!
//! [[models]]
//! roles = ["embedding", "code-embedding"]
//! model = "qwen3-embedding-4b"
//! model_dir = "/var/lib/fantom-sidecar/models/qwen3-embedding-4b"
//! pipeline_depth = 2
//! ```
//!
//! Cloud routes need no table: a config push with a key creates them. `openrouter_url`
//! (default `https://openrouter.ai/api/v1`) and `cloud_pipeline_depth` (default 8) tune them.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::model::ModelChoice;
use crate::roles::Role;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// `ws://` or `wss://` URL of the hub's agent endpoint.
    pub hub_url: String,
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
    /// Local models; none is fine (the agent then serves cloud routes only, after a push).
    #[serde(default)]
    pub models: Vec<ServedModel>,
}

/// One local model and the roles it serves.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServedModel {
    pub roles: Vec<Role>,
    /// Work frames in flight at once per role (the credits of each pull loop).
    #[serde(default = "default_depth")]
    pub pipeline_depth: u32,
    /// The most items one work frame may carry.
    #[serde(default = "default_items")]
    pub max_items_per_work: usize,
    #[serde(flatten)]
    pub model: ModelChoice,
}

fn default_drain_s() -> u64 {
    30
}
fn default_cloud_depth() -> u32 {
    8
}
fn default_depth() -> u32 {
    2
}
fn default_items() -> usize {
    64
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
    pub fn load(path: &Path) -> Result<Self, AgentConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| AgentConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|message| AgentConfigError::Parse {
            path: path.to_path_buf(),
            message,
        })
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let cfg: AgentConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        if !(cfg.hub_url.starts_with("ws://") || cfg.hub_url.starts_with("wss://")) {
            return Err(format!(
                "hub_url '{}' must start with ws:// or wss://",
                cfg.hub_url
            ));
        }
        for m in &cfg.models {
            if m.roles.is_empty() {
                return Err("a [[models]] table needs at least one role".into());
            }
            if m.pipeline_depth == 0 || m.max_items_per_work == 0 {
                return Err("pipeline_depth and max_items_per_work must be at least 1".into());
            }
        }
        Ok(cfg)
    }
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
        assert_eq!(cfg.models[0].pipeline_depth, 2);
        let bad_role = AgentConfig::parse(
            "hub_url = \"ws://h/v1/agent\"\n[[models]]\nroles = [\"embeddings\"]\nmodel = \"x\"",
        );
        assert!(bad_role.unwrap_err().contains("embeddings"));
        assert!(AgentConfig::parse("hub_url = \"ws://h\"\nfleet_token = \"inline\"").is_err());
        assert!(AgentConfig::parse("hub_url = \"http://h\"").is_err());
    }
}
