//! The status snapshot: `heartbeat.statusData` (§2.1.4) and the body of `GET /api/status`
//! (§3.1), one shape for both (the status route adds `virtualInference` and
//! `virtualContainers` to each `masters[]` row; the heartbeat keeps them out to stay small).
//!
//! Field names are the master's (camelCase). `containers[role].config.port` is the capability
//! port the master sends inference to, so it is not optional here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What the master reads of a status snapshot (everything optional on its side).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusData {
    /// The agent's HTTP base; the HTTP-fallback heartbeat reads it when the top level has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Shown in the fleet table only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// The sidecar's version (supersede diagnostics); `agent.version` carries it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentInfo>,
    /// Role → container: the master's only capability source. Mapped roles: `embedding`,
    /// `code-embedding`, `reranker`, `completion` (llm), `ocr`, `rlm`; others are dropped.
    #[serde(default)]
    pub containers: BTreeMap<String, Container>,
    /// Its keys are the roles this host runs (chat host ranking, §3.3).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub roles: BTreeMap<String, RoleActivity>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<Gpu>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vram: Option<Vram>,
    /// MB, display only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_vram: Option<u64>,
    /// MB, display only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_vram: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub container_names: Vec<String>,
    /// One row per slot; drives the master's `wsPort` correction (`master-identity`).
    #[serde(default)]
    pub masters: Vec<MasterEntry>,
    /// Epoch ms; declared by the master, not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_config_push_at: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub version: String,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uptime: Option<u64>,
}

/// One role container (`statusData.containers[role]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    /// `ss-<role>`.
    pub name: String,
    /// [`Container::RUNNING`] makes the capability available.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The configured model (the master prefers `config.model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ContainerKind>,
    pub config: ContainerConfig,
    /// `[0].name` is the loaded model, `[0].gpuPercent` its GPU share; all names are models.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loaded_models: Vec<LoadedModel>,
    /// `false`: no such container (role detection then ignores a missing status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exists: Option<bool>,
}

impl Container {
    /// The container `ss-<key>`: `running` or `exited`, its model and kind, and the port the
    /// master sends its inference to.
    pub fn of(
        key: &str,
        running: bool,
        model: &str,
        kind: ContainerKind,
        port: u16,
        loaded_models: Vec<LoadedModel>,
    ) -> Container {
        Container {
            name: format!("ss-{key}"),
            status: if running { Self::RUNNING } else { Self::EXITED }.to_string(),
            image: None,
            model: Some(model.to_string()),
            kind: Some(kind),
            config: ContainerConfig {
                image: None,
                model: Some(model.to_string()),
                port,
                vram: None,
                kind: Some(kind),
                gpu_only: None,
            },
            loaded_models,
            exists: Some(true),
        }
    }

    pub const RUNNING: &'static str = "running";
    pub const EXITED: &'static str = "exited";
    pub const NOT_FOUND: &'static str = "not_found";
}

/// The master offers Pull buttons for `ollama` only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerKind {
    Ollama,
    Vllm,
    Utility,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The capability port. Without it the master sends inference to the agent port (8098).
    pub port: u16,
    /// MB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vram: Option<u64>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ContainerKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_only: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadedModel {
    pub name: String,
    /// Human text, e.g. `3.1 GB`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// 100: fully on the GPU; -1: CPU only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_percent: Option<i32>,
    /// `GPU`, `CPU`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processor: Option<String>,
    /// When the model unloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
}

impl LoadedModel {
    /// A model by name only (a fronted server does not say where it runs).
    pub fn named(name: &str) -> Self {
        LoadedModel {
            name: name.to_string(),
            size: None,
            gpu_percent: None,
            processor: None,
            until: None,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoleActivity {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_requests: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timer_active: Option<bool>,
    /// Epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_acquire: Option<u64>,
    /// Epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_release: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temp_c: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Vram {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_role: BTreeMap<String, VramRole>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VramRole {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_only: Option<bool>,
}

/// One slot (one master) as the sidecar reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MasterEntry {
    /// The slot's key, byte for byte as configured or pushed (the chat header must match it).
    pub server_url: String,
    /// The relay port this slot dials (report the effective one: 3002 when unset, so the
    /// master's `master-identity` correction can fire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ws_port: Option<u16>,
    /// e.g. `websocket`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_mode: Option<String>,
    /// `GET /api/status` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_inference: Option<VirtualInference>,
    /// `GET /api/status` only: the slot's OpenRouter routes (§3.1, §4.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_containers: Option<Vec<VirtualContainer>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualInference {
    /// Whether the slot holds a key (never the key, nor any part of it).
    pub openrouter: KeyState,
    /// The slot's wire modes as pushed.
    #[serde(default)]
    pub mode_by_role: BTreeMap<String, WireMode>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyState {
    Configured,
    Unset,
}

/// The three modes the sidecar understands (§4.2). Anything unknown or missing is
/// `local-only`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WireMode {
    LocalOnly,
    LocalFirst,
    CloudOnly,
}

impl WireMode {
    /// Reads a pushed mode leniently: unknown or missing → `local-only`.
    pub fn from_wire(mode: Option<&str>) -> WireMode {
        match mode {
            Some("cloud-only") => WireMode::CloudOnly,
            Some("local-first") => WireMode::LocalFirst,
            _ => WireMode::LocalOnly,
        }
    }
}

/// One OpenRouter route of a slot (a `virtualContainers[]` row). The master drops rows
/// without `model` or with a role outside embedding, code-embedding, reranker,
/// code-assistant, rlm; it never uses `local-only` rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualContainer {
    pub role: String,
    pub model: String,
    /// The pinned upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dims: Option<usize>,
    pub mode: WireMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<u64>,
    /// Epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_served_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failures: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_duration_ms: Option<u64>,
    pub state: VirtualState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VirtualState {
    Idle,
    Serving,
    Failed,
}
