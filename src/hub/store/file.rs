//! The file backend of the state store: `hub-state.json` in the hub's state dir, written
//! atomically (temp file, fsync, rename, fsync of the directory) so a crash leaves the old
//! state or the new, never a torn file; and `hub.lock` beside it, held with an exclusive
//! `flock` for the hub's life, so a second hub on the same dir refuses to start instead of
//! writing the file beside the first. The kernel drops the lock when the process ends, however
//! it ends (a `kill -9` leaves no stale lock to clear). The lock file names its holder; an
//! agent sharing the dir takes no part in it.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use super::parts::{self, Recovery};
use crate::hub::state::{HubState, StateError};

pub const STATE_FILE: &str = "hub-state.json";
pub const LOCK_FILE: &str = "hub.lock";

/// A state dir this process holds (clones share the lock).
#[derive(Clone, Debug)]
pub struct FileStore {
    dir: PathBuf,
    /// Open for the hub's life: the lock lives as long as this descriptor.
    _lock: std::sync::Arc<File>,
    /// How a load treats a field it cannot read.
    recovery: std::sync::Arc<Recovery>,
}

impl FileStore {
    /// Creates the dir if needed and takes its lock; refused, naming the holder, when another
    /// hub holds it.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        let lock_path = dir.join(LOCK_FILE);
        let lock_error = |source| StateError::Lock {
            path: lock_path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(lock_error)?;
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(lock_error)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = lock.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(StateError::Locked {
                    dir: dir.to_path_buf(),
                    holder: if holder.is_empty() {
                        "a hub that has not written its name yet".into()
                    } else {
                        holder.chars().take(200).collect()
                    },
                });
            }
            Err(TryLockError::Error(source)) => return Err(lock_error(source)),
        }
        let me = format!(
            "pid {} on {}, since {}\n",
            std::process::id(),
            crate::service::host::hostname(),
            httpdate::fmt_http_date(std::time::SystemTime::now())
        );
        let named = lock
            .set_len(0)
            .and_then(|()| lock.rewind())
            .and_then(|()| lock.write_all(me.as_bytes()))
            .and_then(|()| lock.sync_all());
        named.map_err(lock_error)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            _lock: std::sync::Arc::new(lock),
            recovery: std::sync::Arc::new(Recovery::refuse()),
        })
    }

    /// Unreadable fields are copied aside into the state dir and start from their defaults.
    pub fn setting_aside_unreadable(mut self) -> Self {
        self.recovery = std::sync::Arc::new(Recovery::set_aside_into(&self.dir));
        self
    }

    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads the state file; a missing file is a fresh hub.
    pub fn load(&self) -> Result<HubState, StateError> {
        read_with(&self.dir, &self.recovery)
    }

    /// Writes the state file atomically (blocking: callers run it off the async threads).
    pub fn save(&self, state: &HubState) -> Result<(), StateError> {
        write(&self.dir, state)
    }
}

/// Reads the state file of `dir` (no lock: for tools that only look).
pub fn read(dir: &Path) -> Result<HubState, StateError> {
    read_with(dir, &Recovery::refuse())
}

fn read_with(dir: &Path, recovery: &Recovery) -> Result<HubState, StateError> {
    let path = dir.join(STATE_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HubState::fresh()),
        Err(source) => return Err(StateError::Read { path, source }),
    };
    parts::decode_state(&path.display().to_string(), &bytes, recovery)
}

fn write(dir: &Path, state: &HubState) -> Result<(), StateError> {
    let path = dir.join(STATE_FILE);
    // Checked to read back before anything is written; then pretty, for the operator's eyes.
    parts::encode(&path.display().to_string(), state)?;
    let bytes = serde_json::to_vec_pretty(state).map_err(|e| StateError::Write {
        path: path.clone(),
        source: e.into(),
    })?;
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(".{STATE_FILE}.tmp"));
        let mut file = File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.write_all(b"\n")?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(|source| StateError::Write { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::push::{CloudSettings, OpenRouterPush, merge};
    use crate::hub::state::KeyRecord;

    #[test]
    fn state_round_trips_and_a_fresh_dir_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open(dir.path()).unwrap();
        assert_eq!(store.load().unwrap().cloud, CloudSettings::default());
        let push: OpenRouterPush = serde_json::from_str(
            r#"{"apiKey":"sk-or-v1-xyz","allowedModels":{"reranker":{"model":"qwen/qwen3-reranker-8b"}},"modeByRole":{"reranker":"cloud"}}"#,
        )
        .unwrap();
        let mut state = store.load().unwrap();
        merge(&mut state.cloud, false, &push).unwrap();
        state.key = Some(KeyRecord {
            pushed_at_ms: 1,
            pushes: 1,
        });
        store.save(&state).unwrap();
        let text = std::fs::read_to_string(dir.path().join(STATE_FILE)).unwrap();
        assert!(!text.contains("sk-or-v1-xyz"), "{text}");
        assert_eq!(store.load().unwrap(), state);
        std::fs::write(dir.path().join(STATE_FILE), "{").unwrap();
        assert!(matches!(store.load(), Err(StateError::Unreadable { .. })));
    }

    #[test]
    fn a_second_store_on_a_held_dir_is_refused_naming_the_holder_until_it_is_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = FileStore::open(dir.path()).unwrap();
        // flock locks belong to an open file: a second open in this process conflicts too.
        let refused = FileStore::open(dir.path()).unwrap_err();
        let message = refused.to_string();
        assert!(matches!(refused, StateError::Locked { .. }), "{message}");
        assert!(
            message.contains(&dir.path().display().to_string()),
            "{message}"
        );
        assert!(
            message.contains(&format!("pid {}", std::process::id())),
            "{message}"
        );
        drop(first);
        FileStore::open(dir.path()).expect("free once the holder let go");
    }
}
