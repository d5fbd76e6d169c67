//! The etcd backend of the state store, for hubs that share one store (`--etcd-endpoints`):
//! the hub's state in etcd under a prefix, written only by the leader ([`election`]) and
//! only while it leads (every write is a transaction that checks the leader key's epoch).
//!
//! etcd caps a request at 1.5 MiB and a fingerprint can be close to that, so the state is kept
//! in parts (`config`, each space, `projects`, `usage`, and what a leader hands to the next:
//! the gate's `verdicts` and the `budget`'s learned window), each stored by digest:
//! `<prefix>/blob/<part>/<sha256>/<n>` holds its chunks (512 KiB at most, a transaction each).
//!
//! **A save is whole** (layout 2). Chunks are content-addressed and written first; then one
//! root key, `<prefix>/state/root`, naming every part's digest, chunk count and length, is
//! switched in a single transaction guarded by the epoch and by compare-and-set on the
//! revision this hub last read or wrote it at (0: absent). A reader sees the old state or the
//! new, never a mix of parts; a save that fails (fenced, deposed, refused) leaves the old root,
//! and the chunks it wrote are deleted at once (or, when even that cannot be done, collected as
//! orphans by the next leader's load: chunks no root names). A root write that got no answer
//! is read back before the save answers, so an error means the store holds what memory holds.
//! Two hubs that both believed they lead could never found two spaces for one role: the
//! second root write fails its compare-and-set.
//!
//! The root carries the layout version: a hub of an older layout (which read each part's name
//! under `<prefix>/state/`) finds a key it cannot parse there and refuses to load, and a hub
//! refuses a layout newer than its own. A store of layout 1 (names per part, the same chunks)
//! is moved to layout 2 by the first leader that loads it, in the one transaction that writes
//! the root and deletes the old names.

pub mod client;
pub mod election;
pub mod members;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use self::client::{Compare, EtcdClient, Op};
use self::election::{Leadership, Standing};
use super::parts::{self, Recovery};
use crate::hub::state::{HubState, StateError};

/// Chunks of a part: well under etcd's request cap, with room for the transaction around it.
const CHUNK_BYTES: usize = 512 * 1024;

/// The layout this hub reads and writes.
pub const LAYOUT: u32 = 2;

/// The root's name under `<prefix>/state/`.
const ROOT: &str = "root";

/// A part as the root names it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct PartRecord {
    sha256: String,
    chunks: usize,
    bytes: usize,
}

/// The root: the layout and every part of one whole state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct RootRecord {
    layout: u32,
    parts: BTreeMap<String, PartRecord>,
}

impl RootRecord {
    fn empty() -> Self {
        Self {
            layout: LAYOUT,
            parts: BTreeMap::new(),
        }
    }

    fn names(&self, part: &str, sha256: &str) -> bool {
        self.parts.get(part).is_some_and(|r| r.sha256 == sha256)
    }
}

/// The root as this hub knows it stored.
#[derive(Debug)]
struct Stored {
    root: RootRecord,
    /// The root's revision as this hub last read or wrote it (0: absent).
    at: i64,
    /// The last root write got no answer and could not be read back: read it again first.
    in_doubt: bool,
    /// Layout-1 names still in etcd: deleted by the next root write.
    legacy: Vec<String>,
}

impl Default for Stored {
    fn default() -> Self {
        Self {
            root: RootRecord::empty(),
            at: 0,
            in_doubt: false,
            legacy: Vec::new(),
        }
    }
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
    /// How a load treats a part it cannot read.
    recovery: std::sync::Arc<Recovery>,
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
            recovery: std::sync::Arc::new(Recovery::refuse()),
        }
    }

    /// Unreadable parts are copied aside (into `state_dir`) and start from their defaults.
    pub fn with_recovery(mut self, recovery: Recovery) -> Self {
        self.recovery = std::sync::Arc::new(recovery);
        self
    }

    pub fn recovery(&self) -> &Recovery {
        &self.recovery
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

    fn state_key(&self, name: &str) -> String {
        format!("{}/state/{name}", self.prefix)
    }

    fn blob_prefix(&self, part: &str, sha256: &str) -> String {
        format!("{}/blob/{part}/{sha256}/", self.prefix)
    }

    /// Whether the store holds no state at all (no root and no layout-1 part).
    pub async fn is_empty(&self) -> Result<bool, StateError> {
        Ok(self
            .client
            .keys_with_prefix(&self.state_key(""))
            .await?
            .is_empty())
    }

    /// The state as stored (a store that holds none yet: a fresh hub). A leader moves a
    /// layout-1 store to layout 2 and collects the chunks no root names.
    pub async fn load(&self) -> Result<HubState, StateError> {
        let names = self.client.get_prefix(&self.state_key("")).await?;
        let root_key = self.state_key(ROOT);
        let (root, at, legacy) = match names.iter().find(|kv| kv.key == root_key) {
            Some(kv) => {
                let root = read_root(&kv.key, &kv.value)?;
                let others = names
                    .iter()
                    .filter(|n| n.key != root_key)
                    .map(|n| n.key.clone())
                    .collect();
                (root, kv.mod_revision, others)
            }
            None => {
                // Layout 1: a name per part, each a part record.
                let mut root = RootRecord::empty();
                for kv in &names {
                    let record: PartRecord =
                        serde_json::from_slice(&kv.value).map_err(|e| StateError::Corrupt {
                            at: kv.key.clone(),
                            message: e.to_string(),
                        })?;
                    root.parts
                        .insert(kv.key[self.state_key("").len()..].to_string(), record);
                }
                (root, 0, names.iter().map(|kv| kv.key.clone()).collect())
            }
        };
        let mut state = HubState::fresh();
        let mut kept = RootRecord::empty();
        // `config` first: the other parts go into the state it makes.
        let order = root
            .parts
            .iter()
            .filter(|(p, _)| *p == "config")
            .chain(root.parts.iter().filter(|(p, _)| *p != "config"));
        for (part, record) in order {
            let bytes = self.read_part(part, record).await?;
            if self.decode_into(&mut state, part, &bytes)? {
                kept.parts.insert(part.clone(), record.clone());
            }
        }
        let mut stored = self.stored.lock().await;
        *stored = Stored {
            root,
            at,
            in_doubt: false,
            legacy,
        };
        // A layout-1 store moves to layout 2; what was set aside (its copy is in the state
        // dir) is written as it loaded, so the next hub does not trip over it again.
        let rewrite = !stored.legacy.is_empty() || kept != stored.root;
        drop(stored);
        if rewrite {
            tracing::info!("the stored state is written again as it loaded (layout {LAYOUT})");
            self.save(&state).await?;
        }
        self.collect_orphans(&*self.stored.lock().await).await;
        Ok(state)
    }

    /// A part's chunks, checked against the digest the root names.
    async fn read_part(&self, part: &str, record: &PartRecord) -> Result<Vec<u8>, StateError> {
        let chunks = self
            .client
            .get_prefix(&self.blob_prefix(part, &record.sha256))
            .await?;
        let bytes: Vec<u8> = chunks.into_iter().flat_map(|kv| kv.value).collect();
        if bytes.len() != record.bytes || sha256_hex(&bytes) != record.sha256 {
            return Err(StateError::Corrupt {
                at: format!("{} ({part})", self.state_key(ROOT)),
                message: format!(
                    "the chunks of {part} ({} bytes) do not match the digest the root names",
                    bytes.len()
                ),
            });
        }
        Ok(bytes)
    }

    /// Puts one part into `state`; false when it was set aside (it starts from its defaults).
    fn decode_into(
        &self,
        state: &mut HubState,
        part: &str,
        bytes: &[u8],
    ) -> Result<bool, StateError> {
        let r = &self.recovery;
        let kept = if part == "config" {
            let before = r.taken().len();
            let config = parts::decode_state(part, bytes, r)?;
            *state = HubState {
                spaces: std::mem::take(&mut state.spaces),
                projects: std::mem::take(&mut state.projects),
                project_usage: std::mem::take(&mut state.project_usage),
                verdicts: std::mem::take(&mut state.verdicts),
                budget: state.budget.take(),
                ..config
            };
            r.taken().len() == before
        } else if let Some(id) = part.strip_prefix("space/") {
            parts::decode(part, bytes, r)?
                .map(|space| state.spaces.insert(id.to_string(), space))
                .is_some()
        } else if part == "projects" {
            parts::decode(part, bytes, r)?
                .map(|v| state.projects = v)
                .is_some()
        } else if part == "usage" {
            parts::decode(part, bytes, r)?
                .map(|v| state.project_usage = v)
                .is_some()
        } else if part == "verdicts" {
            parts::decode(part, bytes, r)?
                .map(|v| state.verdicts = v)
                .is_some()
        } else if part == "budget" {
            parts::decode(part, bytes, r)?
                .map(|v| state.budget = Some(v))
                .is_some()
        } else {
            tracing::warn!(
                part,
                "a stored part this hub does not know is left as it is"
            );
            true
        };
        Ok(kept)
    }

    /// Writes the parts that changed, then switches the root to the whole new state in one
    /// transaction guarded by this leader's epoch: all of it lands, or none.
    pub async fn save(&self, state: &HubState) -> Result<(), StateError> {
        let parts = split(state)?;
        let mut stored = self.stored.lock().await;
        if stored.in_doubt {
            self.settle(&mut stored).await?;
        }
        let mut next = RootRecord::empty();
        let mut written = Vec::new();
        for (part, bytes) in &parts {
            let sha256 = sha256_hex(bytes);
            let record = PartRecord {
                sha256: sha256.clone(),
                chunks: bytes.len().div_ceil(CHUNK_BYTES),
                bytes: bytes.len(),
            };
            if !stored.root.names(part, &sha256) {
                let blob = self.blob_prefix(part, &sha256);
                for (n, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
                    let put = Op::Put {
                        key: format!("{blob}{n:05}"),
                        value: chunk.to_vec(),
                        lease: None,
                    };
                    if let Err(e) = self.guarded(None, &[put]).await {
                        written.push(blob);
                        self.discard(&stored, &written).await;
                        return Err(e);
                    }
                }
                written.push(blob);
            }
            next.parts.insert(part.clone(), record);
        }
        if next == stored.root && stored.legacy.is_empty() {
            return Ok(());
        }
        self.switch_root(&mut stored, next, written).await
    }

    /// The one write that makes `next` the stored state (deleting layout-1 names, if any);
    /// then the chunks only the old root named go. On a refusal the chunks `written` by this
    /// save go instead, and the old root stands; on no answer nothing is deleted (the write
    /// may land yet) and the root is read again before the next save.
    async fn switch_root(
        &self,
        stored: &mut Stored,
        next: RootRecord,
        written: Vec<String>,
    ) -> Result<(), StateError> {
        let key = self.state_key(ROOT);
        let value = serde_json::to_vec(&next).unwrap_or_default();
        let mut ops = vec![Op::Put {
            key: key.clone(),
            value: value.clone(),
            lease: None,
        }];
        ops.extend(
            stored
                .legacy
                .iter()
                .filter(|k| **k != key)
                .map(|k| Op::Delete { key: k.clone() }),
        );
        let cas = NameWrite {
            key: key.clone(),
            at: stored.at,
            value: Some(&value),
        };
        let outcome = match self.guarded(Some(&cas), &ops).await {
            Err(StateError::Etcd(e)) => {
                // No answer: whether it applied is read back now, so the caller's answer is
                // the truth about the store. Not applied yet is not never: a write etcd took
                // may land after this read, so the chunks it names are never deleted here
                // (the next leader's load collects them if no root ever names them).
                match self.client.get(&key).await {
                    Ok(Some(kv)) if kv.value == value => Ok(kv.mod_revision),
                    read => {
                        stored.in_doubt = true;
                        match read {
                            Err(read) => {
                                tracing::warn!(error = %read, "a root write got no answer and cannot be read back; it is read again before the next save")
                            }
                            Ok(_) => {
                                tracing::warn!(error = %e, "a root write got no answer and has not landed; its chunks are kept (it may land yet) and the root is read again before the next save")
                            }
                        }
                        return Err(StateError::Etcd(e));
                    }
                }
            }
            other => other,
        };
        match outcome {
            Ok(revision) => {
                let old = std::mem::replace(&mut stored.root, next);
                stored.at = revision;
                stored.legacy.clear();
                let replaced: Vec<String> = old
                    .parts
                    .iter()
                    .filter(|(p, r)| !stored.root.names(p, &r.sha256))
                    .map(|(p, r)| self.blob_prefix(p, &r.sha256))
                    .collect();
                self.discard(stored, &replaced).await;
                Ok(())
            }
            Err(e) => {
                self.discard(stored, &written).await;
                Err(e)
            }
        }
    }

    /// Deletes chunk prefixes the stored root does not name (best effort: what is left is
    /// collected by the next leader's load).
    async fn discard(&self, stored: &Stored, prefixes: &[String]) {
        let ops: Vec<Op> = prefixes
            .iter()
            .filter(|p| {
                !stored
                    .root
                    .parts
                    .iter()
                    .any(|(part, r)| **p == self.blob_prefix(part, &r.sha256))
            })
            .map(|p| Op::DeletePrefix { prefix: p.clone() })
            .collect();
        for batch in ops.chunks(64) {
            if let Err(e) = self.guarded(None, batch).await {
                tracing::warn!(error = %e, chunks = batch.len(), "chunks no root names were not deleted; the next leader collects them");
                return;
            }
        }
    }

    /// Deletes every chunk no root names: left by a save that died between its chunks and its
    /// root (a kill, a fence that closed midway).
    async fn collect_orphans(&self, stored: &Stored) {
        let blob_root = format!("{}/blob/", self.prefix);
        let keys = match self.client.keys_with_prefix(&blob_root).await {
            Ok(keys) => keys,
            Err(e) => {
                tracing::warn!(error = %e, "the store's chunks could not be listed; orphans stay until the next load");
                return;
            }
        };
        let mut orphans = std::collections::BTreeSet::new();
        for key in keys {
            // `<part>/<sha256>/<n>`: a part's name may hold slashes (`space/<id>`).
            let rest = &key[blob_root.len()..];
            let mut it = rest.rsplitn(3, '/');
            let (_, sha, part) = (it.next(), it.next(), it.next());
            if let (Some(sha), Some(part)) = (sha, part)
                && !stored.root.names(part, sha)
            {
                orphans.insert(self.blob_prefix(part, sha));
            }
        }
        if !orphans.is_empty() {
            tracing::info!(
                orphans = orphans.len(),
                "collecting chunks no root names (a save that did not finish)"
            );
            let orphans: Vec<String> = orphans.into_iter().collect();
            self.discard(stored, &orphans).await;
        }
    }

    /// Reads the root again after a write of it that may or may not have applied.
    async fn settle(&self, stored: &mut Stored) -> Result<(), StateError> {
        match self.client.get(&self.state_key(ROOT)).await? {
            Some(kv) => {
                stored.root = read_root(&kv.key, &kv.value)?;
                stored.at = kv.mod_revision;
            }
            None => {
                stored.root = RootRecord::empty();
                stored.at = 0;
            }
        }
        stored.in_doubt = false;
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
/// `projects`, `usage`, `verdicts`, `budget` (the last four only when not empty); each checked
/// to read back before anything is written.
fn split(state: &HubState) -> Result<BTreeMap<String, Vec<u8>>, StateError> {
    let mut parts = BTreeMap::new();
    let config = HubState {
        spaces: BTreeMap::new(),
        projects: BTreeMap::new(),
        project_usage: BTreeMap::new(),
        verdicts: BTreeMap::new(),
        budget: None,
        ..state.clone()
    };
    parts.insert("config".to_string(), parts::encode("config", &config)?);
    for (id, space) in &state.spaces {
        let part = format!("space/{id}");
        let bytes = parts::encode(&part, space)?;
        parts.insert(part, bytes);
    }
    if !state.projects.is_empty() {
        parts.insert(
            "projects".to_string(),
            parts::encode("projects", &state.projects)?,
        );
    }
    if !state.project_usage.is_empty() {
        parts.insert(
            "usage".to_string(),
            parts::encode("usage", &state.project_usage)?,
        );
    }
    if !state.verdicts.is_empty() {
        parts.insert(
            "verdicts".to_string(),
            parts::encode("verdicts", &state.verdicts)?,
        );
    }
    if let Some(budget) = &state.budget {
        parts.insert("budget".to_string(), parts::encode("budget", budget)?);
    }
    Ok(parts)
}

/// The root as stored: a layout newer than this hub's is refused, naming both.
fn read_root(key: &str, bytes: &[u8]) -> Result<RootRecord, StateError> {
    let layout = serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|v| v.get("layout")?.as_u64());
    if let Some(found) = layout
        && found > u64::from(LAYOUT)
    {
        return Err(StateError::Corrupt {
            at: key.to_string(),
            message: format!(
                "it was written by a newer hub (layout {found}; this hub reads layout {LAYOUT}): \
                 upgrade this hub"
            ),
        });
    }
    serde_json::from_slice(bytes).map_err(|e| StateError::Corrupt {
        at: key.to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_splits_into_parts_that_each_read_back_and_a_newer_layout_is_refused() {
        let mut state = HubState::fresh();
        state.config_revision = 7;
        state.budget_override = Some(3);
        let parts = split(&state).unwrap();
        assert_eq!(parts.keys().collect::<Vec<_>>(), ["config"]);
        let back = parts::decode_state("config", &parts["config"], &Recovery::refuse()).unwrap();
        assert_eq!(back, state);
        let day = crate::hub::projects::usage::DayUsage {
            cloud_usd: f64::NAN,
            ..Default::default()
        };
        state.project_usage.insert("alpha".into(), day);
        assert!(matches!(split(&state), Err(StateError::Unstorable { .. })));

        let newer =
            serde_json::to_vec(&serde_json::json!({"layout": LAYOUT + 1, "parts": {}})).unwrap();
        let refused = read_root("/p/state/root", &newer).unwrap_err().to_string();
        assert!(refused.contains("newer hub"), "{refused}");
        let ours = serde_json::to_vec(&RootRecord::empty()).unwrap();
        assert_eq!(
            read_root("/p/state/root", &ours).unwrap(),
            RootRecord::empty()
        );
        // A hub of layout 1 parses every name under state/ as a part record: the root is not
        // one, so it refuses to load a layout-2 store.
        assert!(serde_json::from_slice::<PartRecord>(&ours).is_err());
    }
}
