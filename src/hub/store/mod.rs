//! The state store: where the hub keeps what it persists ([`HubState`]: the safe config, the
//! vector spaces, the projects), behind one small interface that is the hub's only way to
//! load and save it. One backend today: a file in the state dir, locked for one hub
//! ([`file`]). Saving blocks on a disk, so it runs on a blocking thread; the hot dispatch path
//! never calls the store.

pub mod file;

use crate::hub::state::{HubState, StateError};

/// The hub's state store.
#[derive(Debug)]
pub enum StateStore {
    /// `hub-state.json` in a locked state dir (one hub).
    File(file::FileStore),
}

impl StateStore {
    /// The state as stored; a store that holds nothing yet is a fresh hub.
    pub fn load(&self) -> Result<HubState, StateError> {
        match self {
            StateStore::File(f) => f.load(),
        }
    }

    /// Writes the whole state (blocking).
    pub fn save(&self, state: &HubState) -> Result<(), StateError> {
        match self {
            StateStore::File(f) => f.save(state),
        }
    }

    /// What the store is, for logs and status (a path; never a credential).
    pub fn describe(&self) -> String {
        match self {
            StateStore::File(f) => format!("file {}", f.dir().join(file::STATE_FILE).display()),
        }
    }
}
