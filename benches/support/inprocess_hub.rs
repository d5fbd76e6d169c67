//! A hub for benchmarks, in this process: a fresh state dir, generated tokens, the HTTP and
//! agent endpoints on a loopback port, and the maintenance tick.

use std::net::SocketAddr;

use fantom_sidecar::hub::core::HubSettings;
use fantom_sidecar::hub::store::StateStore;
use fantom_sidecar::hub::store::file::FileStore;
use fantom_sidecar::hub::{Hub, HubOptions};
use fantom_sidecar::secret::Secret;

pub struct BenchHub {
    pub hub: Hub,
    pub addr: SocketAddr,
    pub fleet_token: Secret,
    _state: tempfile::TempDir,
}

/// Starts a hub (call inside a Tokio runtime).
pub fn start() -> BenchHub {
    let state = tempfile::tempdir().expect("a temp dir");
    let fleet_token = Secret::generate();
    let hub = Hub::open(
        HubOptions {
            settings: HubSettings::default(),
            store: StateStore::File(FileStore::open(state.path()).expect("the state dir")),
            fleet_token: fleet_token.clone(),
            admin_token: Secret::generate(),
            client_token: None,
            require_project_key: false,
            gate: Default::default(),
        },
        fantom_sidecar::hub::state::HubState::fresh(),
    )
    .expect("a hub");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(fantom_sidecar::http::serve(
        listener,
        fantom_sidecar::http::hub_router(hub.clone()),
        None,
        std::future::pending(),
    ));
    hub.spawn_maintenance();
    BenchHub {
        hub,
        addr,
        fleet_token,
        _state: state,
    }
}
