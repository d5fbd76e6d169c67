//! `models.lock`: digests recorded on first load for manifest files that carry none.
//!
//! Like `Cargo.lock`, the lock file turns "whatever the hub served the first time" into a pin:
//! once a file's digest is recorded for (model id, revision), a later load of different bytes is
//! refused, so a model can never silently change under an index. The file is TOML, rewritten
//! atomically (temp file, fsync, rename) so a crash never leaves half a lock.
//!
//! Where it lives: `--lock-file`, else `$FANTOM_MODELS_LOCK`, else systemd's `$STATE_DIRECTORY`,
//! else `$XDG_STATE_HOME/fantom-sidecar/`, else `~/.local/state/fantom-sidecar/`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Revision, Sha256};

/// Why the lock file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("cannot read lock file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("lock file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("cannot write lock file {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Serialize, Deserialize, Default)]
struct LockFile {
    version: u32,
    #[serde(default, rename = "model")]
    models: Vec<LockedModel>,
}

#[derive(Serialize, Deserialize, Clone)]
struct LockedModel {
    id: String,
    repo: String,
    revision: String,
    files: BTreeMap<String, Sha256>,
}

/// The lock file's content, keyed by (model id, revision).
pub struct ModelsLock {
    path: PathBuf,
    models: BTreeMap<(String, String), LockedModel>,
}

impl ModelsLock {
    /// The lock path when no `--lock-file` is given.
    pub fn default_path() -> PathBuf {
        let env = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        if let Some(p) = env("FANTOM_MODELS_LOCK") {
            return p;
        }
        if let Some(dir) = env("STATE_DIRECTORY") {
            // systemd may pass several colon-separated directories; the first is ours.
            let first = dir
                .to_string_lossy()
                .split(':')
                .next()
                .unwrap_or("")
                .to_string();
            return PathBuf::from(first).join("models.lock");
        }
        let state = env("XDG_STATE_HOME")
            .or_else(|| env("HOME").map(|h| h.join(".local/state")))
            .unwrap_or_else(|| PathBuf::from("."));
        state.join("fantom-sidecar").join("models.lock")
    }

    /// Reads the lock; a missing file is an empty lock.
    pub fn load(path: &Path) -> Result<Self, LockError> {
        let models = match std::fs::read_to_string(path) {
            Ok(text) => {
                let file: LockFile = toml::from_str(&text).map_err(|e| LockError::Parse {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
                file.models
                    .into_iter()
                    .map(|m| ((m.id.clone(), m.revision.clone()), m))
                    .collect()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(source) => {
                return Err(LockError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            models,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded digest of `file` for this model and revision.
    pub fn recorded(&self, id: &str, revision: &Revision, file: &str) -> Option<Sha256> {
        self.models
            .get(&(id.to_string(), revision.to_string()))
            .and_then(|m| m.files.get(file).copied())
    }

    /// Records digests and writes the file atomically. Re-reads the file first so that a
    /// concurrent writer's entries are kept; an entry recorded meanwhile is never overwritten.
    pub fn record(
        &mut self,
        id: &str,
        repo: &str,
        revision: &Revision,
        digests: &BTreeMap<String, Sha256>,
    ) -> Result<(), LockError> {
        let fresh = Self::load(&self.path)?;
        self.models = fresh.models;
        let entry = self
            .models
            .entry((id.to_string(), revision.to_string()))
            .or_insert_with(|| LockedModel {
                id: id.to_string(),
                repo: repo.to_string(),
                revision: revision.to_string(),
                files: BTreeMap::new(),
            });
        for (file, digest) in digests {
            entry.files.entry(file.clone()).or_insert(*digest);
        }
        self.write()
    }

    fn write(&self) -> Result<(), LockError> {
        let err = |source| LockError::Write {
            path: self.path.clone(),
            source,
        };
        let file = LockFile {
            version: 1,
            models: self.models.values().cloned().collect(),
        };
        let body = toml::to_string_pretty(&file).map_err(|e| {
            err(std::io::Error::other(format!(
                "cannot serialise the lock: {e}"
            )))
        })?;
        let text = format!(
            "# models.lock: written by fantom-sidecar. Digests recorded on first load of model files\n\
             # whose manifest has none; a later load of different bytes is refused. Do not edit by\n\
             # hand; delete an entry to re-pin that model on its next load.\n{body}"
        );
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty());
        if let Some(dir) = dir {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let tmp = self.path.with_extension("lock.tmp");
        {
            let mut f = std::fs::File::create(&tmp).map_err(err)?;
            f.write_all(text.as_bytes()).map_err(err)?;
            f.sync_all().map_err(err)?;
        }
        std::fs::rename(&tmp, &self.path).map_err(err)?;
        if let Some(dir) = dir {
            // Make the rename itself durable.
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rev() -> Revision {
        "0123456789abcdef0123456789abcdef01234567".parse().unwrap()
    }

    #[test]
    fn records_survive_reload_and_never_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/models.lock");
        let mut lock = ModelsLock::load(&path).unwrap();
        assert!(lock.recorded("m", &rev(), "a").is_none());
        let d1 = Sha256::of_bytes(b"one");
        let d2 = Sha256::of_bytes(b"two");
        lock.record(
            "m",
            "org/m",
            &rev(),
            &BTreeMap::from([("a".to_string(), d1)]),
        )
        .unwrap();
        let again = ModelsLock::load(&path).unwrap();
        assert_eq!(again.recorded("m", &rev(), "a"), Some(d1));
        // A second record of the same file keeps the first digest: the lock is a pin.
        let mut again = again;
        again
            .record(
                "m",
                "org/m",
                &rev(),
                &BTreeMap::from([("a".to_string(), d2)]),
            )
            .unwrap();
        assert_eq!(
            ModelsLock::load(&path).unwrap().recorded("m", &rev(), "a"),
            Some(d1)
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# models.lock"), "{text}");
        assert!(!dir.path().join("sub/models.lock.tmp").exists());
    }

    #[test]
    fn garbage_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("models.lock");
        std::fs::write(&path, "version = [").unwrap();
        let err = ModelsLock::load(&path).err().unwrap();
        assert!(err.to_string().contains("is not valid"), "{err}");
    }
}
