//! The state store: where the hub keeps what it persists ([`HubState`]: the safe config, the
//! vector spaces, the projects), behind one small interface that is the hub's only way to
//! load and save it. Two backends: a file in the state dir, locked for one hub ([`file`]), and
//! etcd, shared by hubs of which one leads and only the leader writes ([`etcd`]). The hot
//! dispatch path never calls the store: saves run beside it, under the hub's writers' lock.

pub mod etcd;
pub mod fence;
pub mod file;
pub mod parts;

use serde::Serialize;

use crate::hub::state::{HubState, StateError};

/// `/admin/status` → `ha`.
#[derive(Clone, Debug, Serialize)]
pub struct HaView {
    /// `single` (a state file, one hub) or `leader` (etcd; a standby's own status says
    /// `standby`: `http::standby`).
    pub role: &'static str,
    /// The store: a path, or etcd's endpoints and prefix (never a credential).
    pub store: String,
    /// On a standby: the leader it forwards to (its advertised URL), when one leads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
    /// With etcd: the leader key's creation revision this hub leads under.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
    /// With etcd: the lease's TTL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_ttl_s: Option<u64>,
    /// With etcd: lease renewals etcd answered since this hub won.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_renewals: Option<u64>,
    /// Parts this hub could not read at start and set aside (`--set-aside-unreadable-state`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub set_aside: Vec<parts::SetAside>,
    /// With etcd: the other hubs' advertised URLs as this leader last read them (whom it
    /// asks who leads when it is cut off from etcd).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<Vec<String>>,
    /// What a fenced leader heard from the other hubs: another hub leads under a newer epoch
    /// (`leader`: this one forwards to it), one is named under a newer epoch that it cannot
    /// confirm (`unconfirmed`: keyed and cloud work refused), or no hub says who leads
    /// (`isolated`: the same) (`crate::hub::aside`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aside: Option<crate::hub::aside::Aside>,
    /// With etcd, while the leader cannot renew its lead: why it grants and writes nothing
    /// (local work that passes goes on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fenced: Option<String>,
    /// With etcd: when this leader last wrote its handover (the gate's verdicts, the budget's
    /// window) for the next, in ms since the Unix epoch; absent until it has.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handover_saved_ms: Option<u64>,
}

/// The hub's state store.
#[derive(Debug)]
pub enum StateStore {
    /// `hub-state.json` in a locked state dir (one hub).
    File(file::FileStore),
    /// etcd, written by the leading hub.
    Etcd(etcd::EtcdStore),
}

impl StateStore {
    /// The state as stored; a store that holds nothing yet is a fresh hub.
    pub async fn load(&self) -> Result<HubState, StateError> {
        match self {
            StateStore::File(f) => f.load(),
            StateStore::Etcd(e) => e.load().await,
        }
    }

    /// Writes the state (the file on a blocking thread; etcd only the parts that changed).
    pub async fn save(&self, state: &HubState) -> Result<(), StateError> {
        match self {
            StateStore::File(f) => {
                let (f, state) = (f.clone(), state.clone());
                tokio::task::spawn_blocking(move || f.save(&state))
                    .await
                    .map_err(|e| StateError::Interrupted(e.to_string()))?
            }
            StateStore::Etcd(e) => e.save(state).await,
        }
    }

    /// Whether other hubs share the store (etcd): a leader then hands its verdicts and the
    /// budget's window to the next.
    pub fn is_shared(&self) -> bool {
        matches!(self, StateStore::Etcd(_))
    }

    /// What everything only a leader may do checks (never closed for a state file).
    pub fn fence(&self) -> fence::Fence {
        match self {
            StateStore::File(_) => fence::Fence::open(),
            StateStore::Etcd(e) => e.leadership().fence.clone(),
        }
    }

    pub fn ha_view(&self) -> HaView {
        match self {
            StateStore::File(f) => HaView {
                role: "single",
                store: self.describe(),
                leader: None,
                epoch: None,
                lease_ttl_s: None,
                lease_renewals: None,
                set_aside: f.recovery().taken(),
                peers: None,
                aside: None,
                fenced: None,
                handover_saved_ms: None,
            },
            StateStore::Etcd(e) => HaView {
                role: "leader",
                store: self.describe(),
                leader: None,
                epoch: Some(e.leadership().epoch),
                lease_ttl_s: Some(e.leadership().ttl.as_secs()),
                lease_renewals: e.leadership().fence.renewals(),
                set_aside: e.recovery().taken(),
                peers: None,
                aside: None,
                fenced: self
                    .fence()
                    .check(std::time::Instant::now())
                    .err()
                    .map(|f| f.0),
                handover_saved_ms: None,
            },
        }
    }

    /// What the store is, for logs and status (a path or endpoints; never a credential).
    pub fn describe(&self) -> String {
        match self {
            StateStore::File(f) => format!("file {}", f.dir().join(file::STATE_FILE).display()),
            StateStore::Etcd(e) => format!(
                "etcd {} under {} (epoch {})",
                e.client().endpoints().join(","),
                e.prefix(),
                e.leadership().epoch
            ),
        }
    }
}
