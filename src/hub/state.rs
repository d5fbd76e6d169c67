//! What the hub persists: only the safe config (models, pins, dims, policies, and that a key
//! push happened, with its time, the config's revision and the key's generation id), the
//! vector spaces, and the projects (settings, key digests, the day's cloud use). Where it is
//! kept, and how it is written, is the state store's ([`crate::hub::store`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::push::CloudSettings;

/// That a key was pushed, never the key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyRecord {
    /// When the last push with a key arrived (ms since the Unix epoch).
    pub pushed_at_ms: u64,
    pub pushes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HubState {
    pub version: u32,
    #[serde(default)]
    pub cloud: CloudSettings,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeyRecord>,
    /// When the last push (with or without a key) applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_push_ms: Option<u64>,
    /// Bumped by every push that applied: the config frame carries it, agents report the one
    /// they hold, and one that is behind is sent the whole config again.
    #[serde(default)]
    pub config_revision: u64,
    /// A random id per push that carried a key (never derived from the key): only agents
    /// holding this generation spend, and a refusal of an older one stops nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_generation: Option<String>,
    /// The operator's cloud budget override (permits, 1..=256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_override: Option<u32>,
    /// Vector spaces with their fingerprints (the gate's reference probe vectors).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub spaces: std::collections::BTreeMap<String, crate::hub::gate::Space>,
    /// Each embedding role's live spaces: its current one (changed only by an operator's
    /// cutover), and around a migration its next and previous ones.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub role_spaces: std::collections::BTreeMap<crate::roles::Role, crate::hub::gate::RoleSpaces>,
    /// Projects: settings and key digests (never a key).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub projects: std::collections::BTreeMap<String, crate::hub::projects::ProjectRecord>,
    /// Each project's cloud use today (UTC), checkpointed: allowances survive a restart.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub project_usage: std::collections::BTreeMap<String, crate::hub::projects::usage::DayUsage>,
    /// Hubs on etcd only: the gate's settled verdicts, handed to the next leader (a hub on a
    /// state file probes again after a restart, as it always did).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub verdicts: std::collections::BTreeMap<String, crate::hub::gate::StoredVerdict>,
    /// Hubs on etcd only: what the cloud budget learned, handed to the next leader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::hub::budget::BudgetCheckpoint>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read the hub state {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write the hub state {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the state dir {dir} is held by another hub ({holder}); stop that hub, or give this one \
         another --state-dir"
    )]
    Locked { dir: PathBuf, holder: String },
    #[error("cannot lock the state dir ({path}): {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the state write was interrupted: {0}")]
    Interrupted(String),
    #[error("the state store: {0}")]
    Etcd(#[from] crate::hub::store::etcd::client::EtcdError),
    #[error(
        "this hub no longer leads (its epoch {epoch} is not the leader key's): the write was \
         refused by etcd"
    )]
    Deposed { epoch: i64 },
    #[error("the state store cannot be written now: {0}")]
    Fenced(String),
    #[error("the stored state at {at} is not valid: {message}")]
    Corrupt { at: String, message: String },
    #[error(
        "the stored part {part} cannot be read at {field}: {message}; start the hub once with \
         --set-aside-unreadable-state to keep a copy of it and start it from its defaults"
    )]
    Unreadable {
        part: String,
        field: String,
        message: String,
    },
    #[error(
        "not saved: the part {part} would not read back at {field} ({message}); the store keeps \
         the last state that loads"
    )]
    Unstorable {
        part: String,
        field: String,
        message: String,
    },
}

impl HubState {
    /// The state of a hub that never saved one.
    pub fn fresh() -> Self {
        Self {
            version: 1,
            ..Self::default()
        }
    }
}
