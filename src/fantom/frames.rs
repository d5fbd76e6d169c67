//! The relay's frames (`ws://<master>:<wsPort>/sidecar`, §2.1) and the commands it carries
//! (§2.2), as the master reads and writes their JSON.
//!
//! Text frames of JSON with a `type` string (a binary frame is UTF-8 JSON too). The master
//! counts a frame as a heartbeat only when its text starts with exactly `{"type":"heartbeat"`
//! and logs the first 120 characters of every frame it receives: [`encode_sidecar`] writes
//! `type` first (serde writes an internal tag first), and no sidecar frame carries a secret.
//! Master frames can carry the OpenRouter key near their head (`config`): never log a master
//! frame's text. Liveness is WebSocket ping/pong: the relay has no JSON ping or pong.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::status::StatusData;
use crate::config::push::OpenRouterPush;
use crate::roles::Role;

/// The relay's path on the master's dedicated listener.
pub const RELAY_PATH: &str = "/sidecar";
/// Fantom's relay port (`sidecarMasterWsPort`, `FANTOM_SIDECAR_WS_PORT`).
pub const FANTOM_WS_PORT: u16 = 3003;
/// The port a slot without `wsPort` dials: Sound Suite's relay (§1.3).
pub const DEFAULT_WS_PORT: u16 = 3002;
/// The agent's HTTP port; the master hard-codes it for the chat routes (§1.1).
pub const AGENT_PORT: u16 = 8098;
pub const HEARTBEAT_INTERVAL_MS: u64 = 5_000;
/// The master logs this many characters of every frame it receives.
pub const LOGGED_HEAD_CHARS: usize = 120;
/// The HTTP fallback heartbeat, on the master's HTTP port (§3.4).
pub const HTTP_HEARTBEAT_PATH: &str = "/api/admin/gpu/sidecars/heartbeat";

/// Frames the sidecar sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum SidecarFrame {
    /// The first frame on every socket (§2.1.2).
    #[serde(rename = "register")]
    Register(Register),
    /// Every 5 s once `registered` came (§2.1.4); also the HTTP fallback's body.
    #[serde(rename = "heartbeat")]
    Heartbeat(Heartbeat),
    /// The answer to one `command` (§2.1.6).
    #[serde(rename = "result")]
    Result(CommandResult),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Register {
    /// The agent's own HTTP base (`http://10.0.0.5:8098`): its identity, the same to every
    /// master.
    pub agent_url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Container names (`ss-<role>`); the master's role detection strips the prefix.
    #[serde(default)]
    pub containers: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Heartbeat {
    /// The HTTP fallback only (`POST /api/admin/gpu/sidecars/heartbeat`): who is beating.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_url: Option<String>,
    /// A tiebreak when the master picks a sidecar (fewer is better).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_requests: Option<u64>,
    /// Without it the heartbeat refreshes liveness but no capabilities. (Boxed: it is most
    /// of a frame's size.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_data: Option<Box<StatusData>>,
}

/// `{type:"result", id, error?, ...flat keys}`: with `error` set the master rejects the call
/// with that text and discards the rest; otherwise it hands every other key to the caller.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommandResult {
    /// The command's `id` (an unknown id is ignored by the master).
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The result's own keys, flat beside `id` (never `type`, `id`, `error` or a key).
    #[serde(flatten)]
    pub body: Map<String, Value>,
}

impl CommandResult {
    /// A success; `body` should serialize to an object (anything else lands under `result`).
    pub fn ok(id: impl Into<String>, body: &impl Serialize) -> Self {
        // Through text, not `to_value`: that widens each f32 to its full f64 expansion
        // (0.0123 → 0.012299999594688416), doubling an embedding's size on the wire.
        let value =
            serde_json::to_string(body).and_then(|text| serde_json::from_str::<Value>(&text));
        let mut body = match value {
            Ok(Value::Object(map)) => map,
            Ok(Value::Null) => Map::new(),
            Ok(other) => [("result".to_string(), other)].into_iter().collect(),
            Err(e) => return Self::err(id, format!("result not serializable: {e}")),
        };
        // Reserved members would be written twice; a key must never cross the relay.
        for reserved in ["type", "id", "error", "apiKey", "api_key"] {
            body.remove(reserved);
        }
        CommandResult {
            id: id.into(),
            error: None,
            body,
        }
    }

    pub fn err(id: impl Into<String>, message: impl Into<String>) -> Self {
        CommandResult {
            id: id.into(),
            error: Some(message.into()),
            body: Map::new(),
        }
    }

    /// The upstream convention for actions a sidecar does not implement.
    pub fn unknown_action(id: impl Into<String>, action: &str) -> Self {
        Self::err(id, format!("Unknown action: {action}"))
    }
}

/// Where a virtual command was served. `local` is not an error, but Fantom reads it as "no
/// cloud capacity" and fails the provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Openrouter,
    Local,
}

/// The `virtual-embed` result: one vector per text, each `dims` wide.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EmbedResult {
    pub source: Source,
    pub embeddings: Vec<Vec<f32>>,
    pub model: String,
    pub dims: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
}

/// The `virtual-rerank` result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RerankResult {
    pub source: Source,
    pub results: Vec<RerankHit>,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RerankHit {
    pub index: usize,
    pub relevance_score: f32,
}

/// The `virtual-key-info` result (flat, or under `data`): numbers only, in OpenRouter's
/// snake_case. Never the key, nor `/key`'s `label` (it shows part of the key).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KeyInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
    /// From `/credits`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_credits: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_usage: Option<f64>,
    /// From `/key` (`null` there: the key has no cap of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_remaining: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_free_tier: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RateLimit {
    pub requests: i64,
    pub interval: Interval,
}

/// Seconds, or text such as `10s`, `1m`, `500ms`, `1h`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Interval {
    Seconds(f64),
    Text(String),
}

/// Frames the master sends.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum MasterFrame {
    /// The ack of a `register`: exactly `{"type":"registered","ok":true}` (§2.1.3).
    #[serde(rename = "registered")]
    Registered {
        #[serde(default)]
        ok: bool,
    },
    #[serde(rename = "command")]
    Command(Command),
    /// A refusal; the socket stays open (§2.1.7).
    #[serde(rename = "error")]
    Error {
        #[serde(default)]
        message: String,
    },
    #[serde(rename = "master-identity")]
    MasterIdentity(MasterIdentity),
    /// The OpenRouter push, fire and forget: no `result` (§2.1.10).
    #[serde(rename = "config")]
    Config(ConfigFrame),
    /// The same push under the name the upstream sidecar also accepts.
    #[serde(rename = "config-push")]
    ConfigPush(ConfigFrame),
}

/// `{type:"command", id, action, ...payload}`, the payload flat beside `id` (§2.1.5).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Command {
    /// `cmd-<base36 ms>-<6 base36>`; the `result` echoes it.
    pub id: String,
    pub action: String,
    /// Every other key of the frame.
    #[serde(flatten)]
    pub payload: Map<String, Value>,
}

/// A command's action with its payload read (§2.2).
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    VirtualEmbed(VirtualEmbed),
    VirtualRerank(VirtualRerank),
    /// No payload.
    VirtualKeyInfo,
    /// `start` (also the UI's `pull` and `pull-and-load`, 600 s on the master's side), `stop`,
    /// `acquire`, `release`.
    Container(ContainerVerb, ContainerAction),
    /// Answer with [`CommandResult::unknown_action`].
    Unknown(String),
}

impl Command {
    /// Reads the payload for this command's action; an error names what is wrong with it.
    pub fn parse(&self) -> Result<Action, serde_json::Error> {
        let args = || Value::Object(self.payload.clone());
        Ok(match self.action.as_str() {
            "virtual-embed" => Action::VirtualEmbed(serde_json::from_value(args())?),
            "virtual-rerank" => Action::VirtualRerank(serde_json::from_value(args())?),
            "virtual-key-info" => Action::VirtualKeyInfo,
            other => match ContainerVerb::from_name(other) {
                Some(verb) => Action::Container(verb, serde_json::from_value(args())?),
                None => Action::Unknown(other.to_string()),
            },
        })
    }
}

/// What both virtual commands carry beside their input.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualCommon {
    /// Fantom always sends `false`: do not fall back to local.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_available: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_error_reason: Option<String>,
    /// The model the master expects: refuse rather than substitute another (always sent with
    /// `virtual-embed`; with `virtual-rerank` in strict mode only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualEmbed {
    /// `embedding` or `code-embedding`.
    pub role: Role,
    pub texts: Vec<String>,
    #[serde(flatten)]
    pub common: VirtualCommon,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualRerank {
    /// `reranker`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    pub query: String,
    pub documents: Vec<String>,
    /// Fantom sends `documents.length`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_n: Option<usize>,
    #[serde(flatten)]
    pub common: VirtualCommon,
}

/// A container action (§2.2), from the relay or from `POST /start` etc.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerVerb {
    Start,
    Stop,
    Acquire,
    Release,
}

impl ContainerVerb {
    const ALL: [ContainerVerb; 4] = [
        ContainerVerb::Start,
        ContainerVerb::Stop,
        ContainerVerb::Acquire,
        ContainerVerb::Release,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ContainerVerb::Start => "start",
            ContainerVerb::Stop => "stop",
            ContainerVerb::Acquire => "acquire",
            ContainerVerb::Release => "release",
        }
    }

    /// The verb an action name spells, if any.
    pub fn from_name(name: &str) -> Option<ContainerVerb> {
        Self::ALL.into_iter().find(|v| v.as_str() == name)
    }
}

/// `start`, `stop`, `acquire`, `release`: a local container role (`embedding`,
/// `code-embedding`, `reranker`, `rlm`, `completion`, `ocr`, ...), not one of our five roles.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContainerAction {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Sent on a heartbeat whose `statusData.masters` has a slot at the master's HTTP port with the
/// wrong `wsPort`: fix that slot's `wsPort` in place, keep its `serverUrl`, add no slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MasterIdentity {
    /// The slot's `serverUrl`, exactly as the sidecar reported it.
    pub canonical_url: String,
    pub ws_port: u16,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConfigFrame {
    /// `cfg-<base36 ms>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default)]
    pub payload: ConfigPayload,
}

/// Fantom sends only `openrouter`. Sound Suite's other keys (`idleTimeouts`, `minOnline`,
/// `registry`, `serverUrl`) are ignored.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigPayload {
    /// Merged per slot by [`crate::config::push::merge`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub openrouter: Option<OpenRouterPush>,
    /// The multi-master spec's "forget this master's slot".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoke_server_url: Option<String>,
}

/// Why a master frame was not understood. Never quotes a config frame's values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RelayFrameError {
    #[error("malformed relay frame: {0}")]
    Malformed(String),
    #[error("a binary relay frame that is not UTF-8")]
    NotUtf8,
    #[error("a relay frame needs a string \"type\" field")]
    MissingType,
    #[error("unknown relay frame type '{0}'")]
    UnknownType(String),
    #[error("invalid '{kind}' relay frame: {message}")]
    Invalid { kind: String, message: String },
}

const MASTER_TYPES: [&str; 6] = [
    "registered",
    "command",
    "error",
    "master-identity",
    "config",
    "config-push",
];

/// Decodes a master's text frame; an unknown `type` is an error for this frame only.
pub fn decode_master(text: &str) -> Result<MasterFrame, RelayFrameError> {
    serde_json::from_str(text).map_err(|e| {
        let head: Value = match serde_json::from_str(text) {
            Ok(head) => head,
            Err(syntax) => return RelayFrameError::Malformed(syntax.to_string()),
        };
        let Some(kind) = head.get("type").and_then(Value::as_str) else {
            return RelayFrameError::MissingType;
        };
        if !MASTER_TYPES.contains(&kind) {
            return RelayFrameError::UnknownType(kind.to_string());
        }
        // serde quotes offending values; a config frame's could be (near) the key.
        let message = if kind.starts_with("config") {
            format!(
                "unexpected shape at line {} column {}",
                e.line(),
                e.column()
            )
        } else {
            e.to_string()
        };
        RelayFrameError::Invalid {
            kind: kind.to_string(),
            message,
        }
    })
}

/// Decodes a master's binary frame (UTF-8 JSON, like a text frame).
pub fn decode_master_bytes(bytes: &[u8]) -> Result<MasterFrame, RelayFrameError> {
    decode_master(std::str::from_utf8(bytes).map_err(|_| RelayFrameError::NotUtf8)?)
}

/// Encodes a sidecar frame: `type` first, no whitespace before it, no secret anywhere.
pub fn encode_sidecar(frame: &SidecarFrame) -> String {
    // Plain data with string keys: serialization cannot fail.
    serde_json::to_string(frame).unwrap_or_default()
}

/// Encodes a master frame (the test master's writer). Like Fantom's master it writes a pushed
/// key wherever it falls, possibly in the first 120 characters.
pub fn encode_master(frame: &MasterFrame) -> String {
    serde_json::to_string(frame).unwrap_or_default()
}
