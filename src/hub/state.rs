//! What the hub persists: only the safe config (models, pins, dims, policies, and that a key
//! push happened, with its time, the config's revision and the key's generation id), the
//! vector spaces, and the projects (settings, key digests, the day's cloud use). Written atomically (temp file, fsync, rename, fsync of the
//! directory) so a crash leaves the old state or the new, never a torn file.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::push::CloudSettings;

pub const STATE_FILE: &str = "hub-state.json";

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
    /// Projects: settings and key digests (never a key).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub projects: std::collections::BTreeMap<String, crate::hub::projects::ProjectRecord>,
    /// Each project's cloud use today (UTC), checkpointed: allowances survive a restart.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub project_usage: std::collections::BTreeMap<String, crate::hub::projects::usage::DayUsage>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read the hub state {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the hub state {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("cannot write the hub state {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl HubState {
    /// Reads the state file of `dir`; a missing file is a fresh hub.
    pub fn load(dir: &Path) -> Result<Self, StateError> {
        let path = dir.join(STATE_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self {
                    version: 1,
                    ..Self::default()
                });
            }
            Err(source) => return Err(StateError::Read { path, source }),
        };
        serde_json::from_str(&text).map_err(|e| StateError::Parse {
            path,
            message: e.to_string(),
        })
    }

    /// Writes the state file of `dir` atomically.
    pub fn save(&self, dir: &Path) -> Result<(), StateError> {
        let path = dir.join(STATE_FILE);
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(dir)?;
            let tmp = dir.join(format!(".{STATE_FILE}.tmp"));
            let mut file = std::fs::File::create(&tmp)?;
            serde_json::to_writer_pretty(&mut file, self)?;
            file.write_all(b"\n")?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(dir)?.sync_all()
        };
        write().map_err(|source| StateError::Write { path, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::push::{OpenRouterPush, merge};

    #[test]
    fn state_round_trips_and_a_fresh_dir_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            HubState::load(dir.path()).unwrap().cloud,
            CloudSettings::default()
        );
        let push: OpenRouterPush = serde_json::from_str(
            r#"{"apiKey":"sk-or-v1-xyz","allowedModels":{"reranker":{"model":"qwen/qwen3-reranker-8b"}},"modeByRole":{"reranker":"cloud"}}"#,
        )
        .unwrap();
        let mut state = HubState::load(dir.path()).unwrap();
        merge(&mut state.cloud, false, &push).unwrap();
        state.key = Some(KeyRecord {
            pushed_at_ms: 1,
            pushes: 1,
        });
        state.save(dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(STATE_FILE)).unwrap();
        assert!(!text.contains("sk-or-v1-xyz"), "{text}");
        assert_eq!(HubState::load(dir.path()).unwrap(), state);
        std::fs::write(dir.path().join(STATE_FILE), "{").unwrap();
        assert!(matches!(
            HubState::load(dir.path()),
            Err(StateError::Parse { .. })
        ));
    }
}
