//! One model server the agent fronts instead of running it (a `[[local_server]]` table): an
//! operator's vLLM, Ollama, llama.cpp server, TEI or any OpenAI-compatible server on this
//! host. What it serves (its role), where (`url`), which model, which API it speaks (`kind`),
//! and optionally the systemd unit the agent may start and stop.
//!
//! ```toml
//! [[local_server]]
//! role = "rlm"                      # rlm, completion, ocr, embedding, code-embedding, reranker
//! url = "http://127.0.0.1:8100"
//! model = "mit-oasys/rlm-qwen3-8b"
//! kind = "vllm"                     # vllm, ollama, llama-cpp, tei, openai
//! unit = "vllm-rlm.service"         # optional: `start`/`stop` act on it
//! ```
//!
//! A reranker server (vLLM, TEI, llama.cpp or any server with Cohere's `/v1/rerank`) is a scorer
//! like a candle reranker: its identity is its model with the `revision` and `quantization`
//! the operator declares (TEI's `/info` tells its own `model_sha`), and the hub checks providers
//! that claim one identity on fixed probe pairs before they share a ranking.
//!
//! A role is written as a Fantom master knows its containers (`rlm`, `completion`, `ocr`) or
//! as the hub's role (`rlm-sandbox`, `code-assistant`, `embedding`, `code-embedding`); both
//! name the same thing ([`ServerRole`]).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::tokens::TokenError;
use crate::roles::{Op, Role};
use crate::secret::Secret;

/// What a declared server serves: the container a master sees and the hub role it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServerRole {
    /// The RLM's local model (`ss-rlm`); the hub's `rlm-sandbox`.
    Rlm,
    /// Fantom's `llm` capability (`ss-completion`); the hub's `code-assistant`.
    Completion,
    /// Fantom's `ocr` capability (`ss-ocr`); no hub role.
    Ocr,
    Embedding,
    CodeEmbedding,
    /// A cross-encoder reranker; the hub's `reranker`.
    Reranker,
}

impl ServerRole {
    /// The key of `statusData.containers` (the container is `ss-<key>`).
    pub fn container_key(self) -> &'static str {
        match self {
            ServerRole::Rlm => "rlm",
            ServerRole::Completion => "completion",
            ServerRole::Ocr => "ocr",
            ServerRole::Embedding => "embedding",
            ServerRole::CodeEmbedding => "code-embedding",
            ServerRole::Reranker => "reranker",
        }
    }

    /// The hub role it serves (`ocr` has none: masters only).
    pub fn hub_role(self) -> Option<Role> {
        match self {
            ServerRole::Rlm => Some(Role::RlmSandbox),
            ServerRole::Completion => Some(Role::CodeAssistant),
            ServerRole::Ocr => None,
            ServerRole::Embedding => Some(Role::Embedding),
            ServerRole::CodeEmbedding => Some(Role::CodeEmbedding),
            ServerRole::Reranker => Some(Role::Reranker),
        }
    }

    pub fn op(self) -> Op {
        match self {
            ServerRole::Rlm | ServerRole::Completion | ServerRole::Ocr => Op::Chat,
            ServerRole::Embedding | ServerRole::CodeEmbedding => Op::Embed,
            ServerRole::Reranker => Op::Rerank,
        }
    }

    fn parse(name: &str) -> Result<Self, String> {
        Ok(match name {
            "rlm" | "rlm-sandbox" => ServerRole::Rlm,
            "completion" | "code-assistant" => ServerRole::Completion,
            "ocr" => ServerRole::Ocr,
            "embedding" => ServerRole::Embedding,
            "code-embedding" => ServerRole::CodeEmbedding,
            "reranker" => ServerRole::Reranker,
            other => {
                return Err(format!(
                    "unknown local_server role '{other}'; the roles are: rlm (rlm-sandbox), completion (code-assistant), ocr, embedding, code-embedding, reranker"
                ));
            }
        })
    }
}

impl<'de> Deserialize<'de> for ServerRole {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        ServerRole::parse(name.trim()).map_err(serde::de::Error::custom)
    }
}

/// Which API a server speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerKind {
    /// vLLM's OpenAI server: `/v1/models`, `/v1/chat/completions`, `/v1/embeddings`,
    /// `/v1/rerank` (or `/v1/score`).
    Vllm,
    /// Ollama: `/api/tags`, `/api/embed`, and its OpenAI `/v1/chat/completions`.
    Ollama,
    /// llama.cpp's `llama-server`: `/health`, `/v1/chat/completions`, `/v1/embeddings`,
    /// `/v1/rerank`.
    LlamaCpp,
    /// text-embeddings-inference: `/health`, `/info`, `/embed`, `/rerank`.
    Tei,
    /// Any OpenAI-compatible server: `/v1/models`, `/v1/chat/completions`, `/v1/embeddings`,
    /// and Cohere's `/v1/rerank` (or vLLM's `/v1/score`).
    Openai,
}

impl ServerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ServerKind::Vllm => "vllm",
            ServerKind::Ollama => "ollama",
            ServerKind::LlamaCpp => "llama-cpp",
            ServerKind::Tei => "tei",
            ServerKind::Openai => "openai",
        }
    }

    /// Whether it serves `op` at all (TEI has no chat, Ollama no reranking).
    pub fn serves(self, op: Op) -> bool {
        match op {
            Op::Chat => self != ServerKind::Tei,
            Op::Embed => true,
            Op::Rerank => self != ServerKind::Ollama,
        }
    }
}

/// One `[[local_server]]` table.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalServerConfig {
    pub role: ServerRole,
    /// Where the agent reaches it (`http://127.0.0.1:8100`); masters call the same port on
    /// this host's address, so the server must listen where they can reach it.
    pub url: String,
    /// The model it serves, as the server names it (checked by the health check where the
    /// server lists its models).
    pub model: String,
    pub kind: ServerKind,
    /// A systemd unit `start`/`stop` act on; unset: the server is managed elsewhere.
    #[serde(default)]
    pub unit: Option<String>,
    /// A file holding the server's API key (vLLM's `--api-key`), sent as a bearer token.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// An embedding server's width, when known (else the gate's probe measures it).
    #[serde(default)]
    pub dims: Option<usize>,
    /// The weights' revision, as the operator declares it (a commit of the model's repository):
    /// part of a reranker's scorer identity where the server tells none (TEI's `model_sha`
    /// wins where it answers one).
    #[serde(default)]
    pub revision: Option<String>,
    /// The weights' quantization or dtype as served (`awq`, `fp8`, `bf16`): part of a
    /// reranker's scorer identity.
    #[serde(default)]
    pub quantization: Option<String>,
    /// Seconds between health checks.
    #[serde(default = "default_health_s")]
    pub health_interval_s: u64,
    /// Work frames in flight at once (the credits of its pull loop).
    #[serde(default = "default_depth")]
    pub pipeline_depth: u32,
    /// The most texts one embedding call carries.
    #[serde(default = "default_items")]
    pub max_items_per_work: usize,
}

fn default_health_s() -> u64 {
    5
}
fn default_depth() -> u32 {
    4
}
fn default_items() -> usize {
    32
}

impl LocalServerConfig {
    /// The base URL without a trailing `/`.
    pub fn base_url(&self) -> &str {
        self.url.trim().trim_end_matches('/')
    }

    /// The port masters call: the URL's, or its scheme's default.
    pub fn port(&self) -> Option<u16> {
        let url = reqwest::Url::parse(self.base_url()).ok()?;
        url.port_or_known_default()
    }

    pub fn health_interval(&self) -> Duration {
        Duration::from_secs(self.health_interval_s.clamp(1, 300))
    }

    /// The API key of `api_key_file`, read now.
    pub fn api_key(&self) -> Result<Option<Secret>, TokenError> {
        self.api_key_file
            .as_deref()
            .map(super::tokens::read_token_file)
            .transpose()
    }

    /// Checks one table on its own.
    pub fn check(&self) -> Result<(), String> {
        let name = self.role.container_key();
        // Never kept, shown or echoed: a key belongs in api_key_file.
        let unit = self.unit.as_deref().unwrap_or_default();
        let key_file = self
            .api_key_file
            .as_deref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let fields = [
            ("url", self.url.as_str()),
            ("model", &self.model),
            ("unit", unit),
            ("api_key_file", &key_file),
        ];
        for (field, value) in fields {
            if crate::secret::holds_key(value, &[]) {
                return Err(format!(
                    "local_server {name}: {field} looks like a key or token; put a server's key in a file and name the file in api_key_file"
                ));
            }
        }
        let url = reqwest::Url::parse(self.base_url())
            .map_err(|e| format!("local_server {name}: url '{}': {e}", self.url))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(format!(
                "local_server {name}: url '{}' must be http:// or https:// with a host",
                self.url
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!(
                "local_server {name}: the url carries credentials; put the key in api_key_file"
            ));
        }
        if self.model.trim().is_empty() {
            return Err(format!("local_server {name}: model is empty"));
        }
        if !self.kind.serves(self.role.op()) {
            let (api, kinds) = match self.role.op() {
                Op::Rerank => (
                    "rerank",
                    "vllm, tei, llama-cpp or openai (any server with /v1/rerank)",
                ),
                _ => ("chat", "vllm, ollama, llama-cpp or openai"),
            };
            return Err(format!(
                "local_server {name}: a {} server has no {api} API; use kind {kinds}",
                self.kind.as_str()
            ));
        }
        for (field, value) in [
            ("revision", &self.revision),
            ("quantization", &self.quantization),
        ] {
            if let Some(v) = value
                && (v.trim().is_empty() || v.chars().any(|c| c.is_whitespace() || c == '@'))
            {
                return Err(format!(
                    "local_server {name}: {field} must be one word without spaces or '@' (it is part of the scorer's identity)"
                ));
            }
        }
        if self.pipeline_depth == 0 || self.max_items_per_work == 0 {
            return Err(format!(
                "local_server {name}: pipeline_depth and max_items_per_work must be at least 1"
            ));
        }
        if self.dims == Some(0) {
            return Err(format!("local_server {name}: dims 0"));
        }
        if let Some(unit) = &self.unit
            && !is_unit_name(unit)
        {
            return Err(format!(
                "local_server {name}: unit '{unit}' is not a systemd unit name (e.g. vllm-rlm.service)"
            ));
        }
        Ok(())
    }
}

/// A unit name systemctl takes as one argument: no options, no paths, no spaces.
fn is_unit_name(unit: &str) -> bool {
    !unit.is_empty()
        && !unit.starts_with('-')
        && unit.len() <= 256
        && unit
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || ":-_.@\\".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<LocalServerConfig, String> {
        let cfg: LocalServerConfig = toml::from_str(body).map_err(|e| e.to_string())?;
        cfg.check().map(|()| cfg)
    }

    #[test]
    fn roles_read_in_either_vocabulary_and_kinds_must_serve_them() {
        let rlm = parse(
            "role = \"rlm\"\nurl = \"http://127.0.0.1:8100/\"\nmodel = \"m\"\nkind = \"vllm\"",
        )
        .unwrap();
        assert_eq!(rlm.role, ServerRole::Rlm);
        assert_eq!(rlm.role.hub_role(), Some(Role::RlmSandbox));
        assert_eq!(rlm.base_url(), "http://127.0.0.1:8100");
        assert_eq!(rlm.port(), Some(8100));
        let alias = parse(
            "role = \"code-assistant\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"ollama\"",
        )
        .unwrap();
        assert_eq!(alias.role.container_key(), "completion");
        assert_eq!(alias.port(), Some(80));
        assert_eq!(ServerRole::Ocr.hub_role(), None);

        let err = |body: &str| parse(body).unwrap_err();
        let reranker = parse(
            "role = \"reranker\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"tei\"\nrevision = \"abc\"\nquantization = \"fp16\"",
        )
        .unwrap();
        assert_eq!(reranker.role.hub_role(), Some(Role::Reranker));
        assert_eq!(reranker.revision.as_deref(), Some("abc"));
        assert!(
            err("role = \"reranker\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"ollama\"")
                .contains("no rerank API")
        );
        assert!(
            err("role = \"reranker\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"vllm\"\nrevision = \"a b\"")
                .contains("revision")
        );
        assert!(
            err("role = \"llm\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"vllm\"")
                .contains("rlm")
        );
        assert!(
            err("role = \"rlm\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"tei\"")
                .contains("no chat")
        );
        assert!(
            err("role = \"rlm\"\nurl = \"ws://h\"\nmodel = \"m\"\nkind = \"vllm\"")
                .contains("http")
        );
        assert!(
            err("role = \"rlm\"\nurl = \"http://u:p@h\"\nmodel = \"m\"\nkind = \"vllm\"")
                .contains("api_key_file")
        );
        assert!(
            err("role = \"rlm\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"sglang\"")
                .contains("sglang")
        );
        assert!(
            err("role = \"rlm\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"vllm\"\nunit = \"x; rm -rf /\"")
                .contains("unit")
        );
        assert!(
            err("role = \"rlm\"\nurl = \"http://h\"\nmodel = \"m\"\nkind = \"vllm\"\nunit = \"--now\"")
                .contains("unit")
        );
        assert!(parse(
            "role = \"embedding\"\nurl = \"http://h:8080\"\nmodel = \"m\"\nkind = \"tei\"\nunit = \"tei@embed.service\"\ndims = 384"
        )
        .is_ok());
    }
}
