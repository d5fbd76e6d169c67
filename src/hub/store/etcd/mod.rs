//! The etcd backend of the state store, for hubs that share one store (`--etcd-endpoints`):
//! the hub's state in etcd under a prefix, written only by the leader ([`election`]) and
//! only while it leads (every write is a transaction that checks the leader key's epoch).
//!
//! etcd caps a request at 1.5 MiB and a fingerprint can be close to that, so the state is kept
//! in parts (`config`, each space, `projects`, `usage`, and what a leader hands to the next:
//! the gate's `verdicts` and the `budget`'s learned window), each stored by digest:
//! `<prefix>/blob/<part>/<sha256>/<n>` holds its chunks (512 KiB at most, a transaction
//! each), and `<prefix>/state/<part>` names the digest, the chunk count and the length. A part
//! is written only when its digest changed; its chunks go first and its name last, so a reader
//! sees the old part or the new, whole and checked against its digest, never a mix.
//!
//! A name is written by compare-and-set on the revision this hub last read or wrote it at (0:
//! absent), beside the epoch guard: a space is founded only where no space of that id is
//! stored, so two hubs that both believed they lead could never found two spaces for one
//! role, and a part another writer changed is never overwritten blind.

pub mod client;
pub mod election;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use self::client::{Compare, EtcdClient, Op};
use self::election::{Leadership, Standing};
use crate::hub::state::{HubState, StateError};

/// Chunks of a part: well under etcd's request cap, with room for the transaction around it.
const CHUNK_BYTES: usize = 512 * 1024;

/// A part's name record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct PartRecord {
    sha256: String,
    chunks: usize,
    bytes: usize,
}

/// The parts as this hub knows them stored.
#[derive(Debug, Default)]
struct Stored {
    /// Each part's digest (what a save compares with), and the revision its name was last
    /// written at (what the next write of it checks).
    parts: BTreeMap<String, (String, i64)>,
    /// Parts whose last name write failed without an answer (a timeout): it may have applied.
    /// Their name is read again before the next write: as the only writer under this epoch,
    /// what is there now is either the old name or the one this hub sent.
    in_doubt: std::collections::BTreeSet<String>,
}

/// The store of the leading hub.
#[derive(Debug)]
pub struct EtcdStore {
    client: std::sync::Arc<EtcdClient>,
    prefix: String,
    leadership: Leadership,
    /// Set `Deposed` when etcd refuses a write under this epoch: the leader stops at once.
    standing: std::sync::Arc<tokio::sync::watch::Sender<Standing>>,
    /// What this hub knows is stored.
    stored: tokio::sync::Mutex<Stored>,
}

impl EtcdStore {
    pub fn new(
        client: std::sync::Arc<EtcdClient>,
        prefix: &str,
        leadership: Leadership,
        standing: std::sync::Arc<tokio::sync::watch::Sender<Standing>>,
    ) -> Self {
        Self {
            client,
            prefix: prefix.trim_end_matches('/').to_string(),
            leadership,
            standing,
            stored: tokio::sync::Mutex::new(Stored::default()),
        }
    }

    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn client(&self) -> &std::sync::Arc<EtcdClient> {
        &self.client
    }

    fn state_key(&self, part: &str) -> String {
        format!("{}/state/{part}", self.prefix)
    }

    fn blob_prefix(&self, part: &str, sha256: &str) -> String {
        format!("{}/blob/{part}/{sha256}/", self.prefix)
    }

    /// The state as stored (a store that holds none yet: a fresh hub).
    pub async fn load(&self) -> Result<HubState, StateError> {
        let names = self.client.get_prefix(&self.state_key("")).await?;
        let mut parts = BTreeMap::new();
        let mut stored = BTreeMap::new();
        for kv in names {
            let part = kv.key[self.state_key("").len()..].to_string();
            let record: PartRecord =
                serde_json::from_slice(&kv.value).map_err(|e| StateError::Corrupt {
                    at: kv.key.clone(),
                    message: e.to_string(),
                })?;
            let chunks = self
                .client
                .get_prefix(&self.blob_prefix(&part, &record.sha256))
                .await?;
            let bytes: Vec<u8> = chunks.into_iter().flat_map(|kv| kv.value).collect();
            if bytes.len() != record.bytes || sha256_hex(&bytes) != record.sha256 {
                return Err(StateError::Corrupt {
                    at: kv.key.clone(),
                    message: format!(
                        "its chunks ({} bytes) do not match the digest it names",
                        bytes.len()
                    ),
                });
            }
            stored.insert(part.clone(), (record.sha256, kv.mod_revision));
            parts.insert(part, bytes);
        }
        let state = join(&parts).map_err(|message| StateError::Corrupt {
            at: self.state_key(""),
            message,
        })?;
        *self.stored.lock().await = Stored {
            parts: stored,
            in_doubt: Default::default(),
        };
        Ok(state)
    }

    /// Writes the parts that changed, each guarded by this leader's epoch.
    pub async fn save(&self, state: &HubState) -> Result<(), StateError> {
        let parts = split(state);
        let mut stored = self.stored.lock().await;
        let doubts: Vec<String> = stored.in_doubt.iter().cloned().collect();
        for part in doubts {
            self.settle(&mut stored, &part).await?;
        }
        for (part, bytes) in &parts {
            let sha256 = sha256_hex(bytes);
            let (old, at) = match stored.parts.get(part) {
                Some((sha, at)) => (Some(sha.clone()), *at),
                None => (None, 0),
            };
            if old.as_deref() == Some(sha256.as_str()) {
                continue;
            }
            let blob = self.blob_prefix(part, &sha256);
            let chunks: Vec<&[u8]> = if bytes.is_empty() {
                Vec::new()
            } else {
                bytes.chunks(CHUNK_BYTES).collect()
            };
            for (n, chunk) in chunks.iter().enumerate() {
                self.guarded(
                    None,
                    &[Op::Put {
                        key: format!("{blob}{n:05}"),
                        value: chunk.to_vec(),
                        lease: None,
                    }],
                )
                .await?;
            }
            let record = PartRecord {
                sha256: sha256.clone(),
                chunks: chunks.len(),
                bytes: bytes.len(),
            };
            let name = serde_json::to_vec(&record).unwrap_or_default();
            let mut ops = vec![Op::Put {
                key: self.state_key(part),
                value: name.clone(),
                lease: None,
            }];
            if let Some(old) = &old {
                ops.push(Op::DeletePrefix {
                    prefix: self.blob_prefix(part, old),
                });
            }
            let cas = NameWrite {
                key: self.state_key(part),
                at,
                value: Some(&name),
            };
            let revision = match self.guarded(Some(&cas), &ops).await {
                Ok(revision) => revision,
                Err(e) => {
                    if matches!(e, StateError::Etcd(_)) {
                        stored.in_doubt.insert(part.clone());
                    }
                    return Err(e);
                }
            };
            stored.parts.insert(part.clone(), (sha256, revision));
        }
        let gone: Vec<(String, String, i64)> = stored
            .parts
            .iter()
            .filter(|(part, _)| !parts.contains_key(*part))
            .map(|(p, (s, at))| (p.clone(), s.clone(), *at))
            .collect();
        for (part, sha256, at) in gone {
            let cas = NameWrite {
                key: self.state_key(&part),
                at,
                value: None,
            };
            let deleted = self
                .guarded(
                    Some(&cas),
                    &[
                        Op::Delete {
                            key: self.state_key(&part),
                        },
                        Op::DeletePrefix {
                            prefix: self.blob_prefix(&part, &sha256),
                        },
                    ],
                )
                .await;
            if let Err(e) = deleted {
                if matches!(e, StateError::Etcd(_)) {
                    stored.in_doubt.insert(part.clone());
                }
                return Err(e);
            }
            stored.parts.remove(&part);
        }
        Ok(())
    }

    /// Reads a part's name again after a write of it that may or may not have applied.
    async fn settle(&self, stored: &mut Stored, part: &str) -> Result<(), StateError> {
        match self.client.get(&self.state_key(part)).await? {
            Some(kv) => {
                let record: PartRecord =
                    serde_json::from_slice(&kv.value).map_err(|e| StateError::Corrupt {
                        at: kv.key.clone(),
                        message: e.to_string(),
                    })?;
                stored
                    .parts
                    .insert(part.to_string(), (record.sha256, kv.mod_revision));
            }
            None => {
                stored.parts.remove(part);
            }
        }
        stored.in_doubt.remove(part);
        Ok(())
    }

    /// One transaction that applies only while this hub still leads (and is not fenced: a
    /// write it cannot be sure of leading for waits until etcd renews the lease) and, for a
    /// part's name, while the name is still at the revision this hub knows; the store's
    /// revision after it.
    async fn guarded(&self, name: Option<&NameWrite<'_>>, ops: &[Op]) -> Result<i64, StateError> {
        self.leadership
            .fence
            .check(std::time::Instant::now())
            .map_err(|f| StateError::Fenced(f.0))?;
        let mut compare = vec![self.leadership.guard()];
        let mut failure = vec![Op::Get {
            key: self.leadership.key.clone(),
        }];
        if let Some(n) = name {
            compare.push(Compare::ModRevision {
                key: n.key.clone(),
                revision: n.at,
            });
            failure.push(Op::Get { key: n.key.clone() });
        }
        let outcome = self.client.txn(&compare, ops, &failure).await?;
        if outcome.succeeded {
            return Ok(outcome.revision);
        }
        let leader = outcome.read.iter().find(|kv| kv.key == self.leadership.key);
        if leader.is_none_or(|kv| kv.create_revision != self.leadership.epoch) {
            self.leadership
                .fence
                .depose("etcd refused a write under this hub's epoch");
            self.standing.send_replace(Standing::Deposed {
                why: format!(
                    "etcd refused a write under epoch {}: the leader key is no longer this hub's",
                    self.leadership.epoch
                ),
            });
            return Err(StateError::Deposed {
                epoch: self.leadership.epoch,
            });
        }
        let Some(n) = name else {
            return Ok(outcome.revision);
        };
        // The epoch holds, the compare-and-set did not. A write of ours that timed out and was
        // applied all the same left the name as this one would: that is done, not a conflict.
        let now = outcome.read.iter().find(|kv| kv.key == n.key);
        match (now, n.value) {
            (Some(kv), Some(value)) if kv.value == value => Ok(kv.mod_revision),
            (None, None) => Ok(outcome.revision),
            _ => Err(StateError::Corrupt {
                at: n.key.clone(),
                message: "it changed in etcd since this hub read it (another writer under the \
                          prefix?); not overwritten: restart this hub to read it again"
                    .into(),
            }),
        }
    }
}

/// A part's name as a write leaves it: checked against the revision this hub knows.
struct NameWrite<'a> {
    key: String,
    /// The name's revision as this hub last read or wrote it (0: absent).
    at: i64,
    /// The name after the write (`None`: deleted).
    value: Option<&'a [u8]>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The state in parts: `config` (all but the spaces and projects), `space/<id>` each,
/// `projects`, `usage` (the last two only when not empty).
fn split(state: &HubState) -> BTreeMap<String, Vec<u8>> {
    let mut parts = BTreeMap::new();
    let config = HubState {
        spaces: BTreeMap::new(),
        projects: BTreeMap::new(),
        project_usage: BTreeMap::new(),
        verdicts: BTreeMap::new(),
        budget: None,
        ..state.clone()
    };
    parts.insert(
        "config".to_string(),
        serde_json::to_vec(&config).unwrap_or_default(),
    );
    for (id, space) in &state.spaces {
        parts.insert(
            format!("space/{id}"),
            serde_json::to_vec(space).unwrap_or_default(),
        );
    }
    if !state.projects.is_empty() {
        parts.insert(
            "projects".to_string(),
            serde_json::to_vec(&state.projects).unwrap_or_default(),
        );
    }
    if !state.project_usage.is_empty() {
        parts.insert(
            "usage".to_string(),
            serde_json::to_vec(&state.project_usage).unwrap_or_default(),
        );
    }
    if !state.verdicts.is_empty() {
        parts.insert(
            "verdicts".to_string(),
            serde_json::to_vec(&state.verdicts).unwrap_or_default(),
        );
    }
    if let Some(budget) = &state.budget {
        parts.insert(
            "budget".to_string(),
            serde_json::to_vec(budget).unwrap_or_default(),
        );
    }
    parts
}

/// The parts put back together (none: a fresh hub).
fn join(parts: &BTreeMap<String, Vec<u8>>) -> Result<HubState, String> {
    let mut state = match parts.get("config") {
        Some(bytes) => serde_json::from_slice(bytes).map_err(|e| format!("config: {e}"))?,
        None => HubState::fresh(),
    };
    for (part, bytes) in parts {
        if let Some(id) = part.strip_prefix("space/") {
            let space = serde_json::from_slice(bytes).map_err(|e| format!("{part}: {e}"))?;
            state.spaces.insert(id.to_string(), space);
        } else if part == "projects" {
            state.projects = serde_json::from_slice(bytes).map_err(|e| format!("{part}: {e}"))?;
        } else if part == "usage" {
            state.project_usage =
                serde_json::from_slice(bytes).map_err(|e| format!("{part}: {e}"))?;
        } else if part == "verdicts" {
            state.verdicts = serde_json::from_slice(bytes).map_err(|e| format!("{part}: {e}"))?;
        } else if part == "budget" {
            state.budget = serde_json::from_slice(bytes).map_err(|e| format!("{part}: {e}"))?;
        }
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_put_back_together_are_the_state() {
        let mut state = HubState::fresh();
        state.config_revision = 7;
        state.budget_override = Some(3);
        let parts = split(&state);
        assert_eq!(parts.keys().collect::<Vec<_>>(), ["config"]);
        assert_eq!(join(&parts).unwrap(), state);
        assert_eq!(join(&BTreeMap::new()).unwrap(), HubState::fresh());
    }
}
