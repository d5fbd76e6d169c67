//! Hubs that share a three-member etcd (real `etcd` processes on loopback): one leads, the
//! other stands by (forwarding clients to the leader, pointing agents at it) and takes over
//! with the state when the leader dies; etcd's own Raft leader
//! dying moves no hub; a stopped leader that wakes up after its deadline is deposed and exits,
//! and so does a leader whose key is deleted under its live lease.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::etcd_cluster::Cluster;
use crate::support::{HubProc, eventually};

/// The default lease: etcd's own Raft election (about a second) fits in its deadline.
pub(crate) const TTL_S: u64 = 5;

/// A hub on `cluster`, in `dir/<name>`, with the tokens every hub of the store shares.
pub(crate) fn etcd_hub(dir: &Path, name: &str, cluster: &Cluster) -> HubProc {
    etcd_hub_with(dir, name, cluster, &[])
}

/// [`etcd_hub`] with more arguments.
pub(crate) fn etcd_hub_with(dir: &Path, name: &str, cluster: &Cluster, more: &[&str]) -> HubProc {
    etcd_hub_at(dir, name, &cluster.endpoints(), more)
}

/// A hub on the etcd `endpoints` (comma-separated), with more arguments.
pub(crate) fn etcd_hub_at(dir: &Path, name: &str, endpoints: &str, more: &[&str]) -> HubProc {
    etcd_hub_listening(dir, name, endpoints, None, more)
}

/// [`etcd_hub_at`] listening on `addr` (a hub started again at the address another had).
pub(crate) fn etcd_hub_listening(
    dir: &Path,
    name: &str,
    endpoints: &str,
    addr: Option<std::net::SocketAddr>,
    more: &[&str],
) -> HubProc {
    let home = dir.join(name);
    let state = home.join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("admin.token"), "ha-admin-token-for-tests").unwrap();
    std::fs::write(state.join("fleet.token"), "ha-fleet-token-for-tests").unwrap();
    let (admin, fleet) = (
        state.join("admin.token").display().to_string(),
        state.join("fleet.token").display().to_string(),
    );
    let ttl = TTL_S.to_string();
    let mut args = vec![
        "--etcd-endpoints",
        endpoints,
        "--leader-ttl-s",
        ttl.as_str(),
        "--admin-token-file",
        admin.as_str(),
        "--fleet-token-file",
        fleet.as_str(),
    ];
    args.extend_from_slice(more);
    HubProc::start(&home, addr, &args, &[], "hub.log")
}

/// `hub`'s status when it leads (a standby answers status for itself: `ha.role` says which).
pub(crate) async fn leader_status(hub: &HubProc) -> Option<Value> {
    // Bounded: a hub may be stopped.
    let r = hub
        .http
        .get(hub.url("/admin/status"))
        .bearer_auth(&hub.admin)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    let body: Value = r.json().await.ok()?;
    (body["ha"]["role"] == "leader").then_some(body)
}

/// Waits until `hub` leads.
pub(crate) async fn leads(hub: &HubProc) {
    eventually("the hub leads", || async {
        leader_status(hub).await.map(|_| ())
    })
    .await
}

/// The leader a standby names on `/health`.
pub(crate) async fn standby_of(hub: &HubProc) -> String {
    eventually("the standby names its leader", || async {
        let r = hub
            .http
            .get(hub.url("/health"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        let body: Value = r.json().await.ok()?;
        (body["status"] == "standby")
            .then(|| body["leader"].as_str().map(String::from))
            .flatten()
    })
    .await
}

/// A MiniLM agent `id` that dials `first`, with `other` in its `hub_urls` too.
pub(crate) fn minilm_agent_on_both(
    dir: &Path,
    first: &HubProc,
    other: &HubProc,
    id: &str,
) -> crate::support::Proc {
    let body = format!(
        "hub_urls = [\"{}\"]\n{}",
        other.ws_url(),
        crate::support::minilm_models_toml()
    );
    crate::support::start_agent_toml(dir, &first.ws_url(), &first.fleet_file, id, &body, &[])
}

/// Hub `a`, leading, and hub `b`, standing by behind it.
pub(crate) async fn leader_and_standby(dir: &Path, cluster: &Cluster) -> (HubProc, HubProc) {
    let a = etcd_hub(dir, "a", cluster);
    leads(&a).await;
    let b = etcd_hub(dir, "b", cluster);
    assert_eq!(standby_of(&b).await, format!("http://{}", a.proc.addr));
    (a, b)
}

async fn set_budget(hub: &HubProc, permits: u32) -> (u16, Value) {
    hub.post_admin("/admin/budget", &json!({"permits": permits}))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_with_the_state_when_the_leader_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    let (mut a, b) = leader_and_standby(dir.path(), &cluster).await;
    let a_url = format!("http://{}", a.proc.addr);
    // A standby forwards a client's request to the leader and streams its answer back.
    let via = |hub: &HubProc| {
        let (http, url) = (hub.http.clone(), hub.url("/v1/models"));
        async move {
            let r = http.get(url).send().await.unwrap();
            let forwarded = r.headers().get("x-fantom-forwarded-by").cloned();
            (
                r.status().as_u16(),
                forwarded,
                r.json::<Value>().await.unwrap(),
            )
        }
    };
    let (direct, through) = (via(&a).await, via(&b).await);
    assert_eq!(direct.0, 200, "{direct:?}");
    assert_eq!((through.0, &through.2), (200, &direct.2), "{through:?}");
    assert_eq!(through.1.unwrap(), "standby");
    assert!(direct.1.is_none());
    // A request that was forwarded already is never forwarded again (no loop through a
    // leader advertised at a standby's own address).
    let r = b
        .http
        .get(b.url("/v1/models"))
        .header("x-fantom-forwarded-by", "standby")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    // But it is not ready, and it never takes an agent's socket.
    let (code, _) = b.get("/ready").await;
    assert_eq!(code, 503);
    let (code, body) = b.get("/v1/agent").await;
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["error"]["code"], "standby", "{body}");
    assert_eq!(body["error"]["leader"], a_url.as_str(), "{body}");

    let (code, body) = set_budget(&a, 3).await;
    assert_eq!(code, 200, "{body}");

    a.proc.kill();
    let killed = Instant::now();
    leads(&b).await;
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(TTL_S + 5),
        "the standby led {took:?} after the kill (TTL {TTL_S} s)"
    );
    let budget = b.status().await["budget"].clone();
    assert_eq!(
        budget["override_permits"], 3,
        "the state came from etcd: {budget}"
    );

    // The old leader, started again, stands by behind the new one.
    let a2 = etcd_hub(dir.path(), "a2", &cluster);
    assert_eq!(standby_of(&a2).await, format!("http://{}", b.proc.addr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_raft_leader_dying_moves_no_hub_and_a_stopped_leader_wakes_deposed_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start(dir.path()).await;
    let (mut a, mut b) = leader_and_standby(dir.path(), &cluster).await;

    // etcd's own Raft leader dies: its members elect another within the hub's deadline, the
    // client moves to a live endpoint, and no hub fails over.
    let raft_leader = cluster.raft_leader().await;
    cluster.kill(raft_leader);
    let (code, body) = set_budget(&a, 5).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(standby_of(&b).await, format!("http://{}", a.proc.addr));

    // Stopped well past its deadline, the leader loses the lease; the standby takes over.
    a.proc.signal("STOP");
    leads(&b).await;
    a.proc.signal("CONT");
    let status = a.proc.wait_exit();
    assert_eq!(status.code(), Some(75), "a deposed leader exits with 75");
    let log = std::fs::read_to_string(&a.proc.log).unwrap();
    assert!(log.contains("this hub no longer leads"), "{log}");
    let budget = b.status().await["budget"].clone();
    assert_eq!(budget["override_permits"], 5, "{budget}");

    // The leader key deleted under a live lease (by hand, say): another hub could win at
    // once, so the leader is deposed at its next renewal, not at its next write.
    assert!(cluster.delete_key("/fantom-sidecar/leader").await);
    let status = b.proc.wait_exit();
    assert_eq!(status.code(), Some(75), "a deposed leader exits with 75");
    let log = std::fs::read_to_string(&b.proc.log).unwrap();
    assert!(log.contains("the leader key is gone"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_store_keeps_a_large_state_in_checked_chunks_and_refuses_a_deposed_writer() {
    use std::sync::Arc;

    use fantom_sidecar::hub::gate::Space;
    use fantom_sidecar::hub::state::{HubState, StateError};
    use fantom_sidecar::hub::store::etcd::EtcdStore;
    use fantom_sidecar::hub::store::etcd::client::{EtcdClient, EtcdOptions};
    use fantom_sidecar::hub::store::etcd::election::{
        LeaderRecord, Leadership, Standing, campaign,
    };
    use fantom_sidecar::roles::Role;

    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    let client = Arc::new(
        EtcdClient::new(&EtcdOptions {
            endpoints: cluster.endpoints().split(',').map(String::from).collect(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            user: None,
            password: None,
            timeout: Duration::from_secs(2),
            retry_for: Duration::from_secs(5),
        })
        .unwrap(),
    );
    let me = LeaderRecord {
        url: "http://hub-1".into(),
        process: "test".into(),
        since_ms: 0,
    };
    // Nothing renews these leases here: long enough for a busy machine.
    let ttl = Duration::from_secs(60);
    let standing = || Arc::new(tokio::sync::watch::channel(Standing::Leading).0);
    let first = campaign(&client, "/t", &me, ttl, |_, _| {}).await.unwrap();
    let (epoch, lease) = (first.epoch, first.lease);
    let deposed = standing();
    let mut deposed_rx = deposed.subscribe();
    let store = EtcdStore::new(Arc::clone(&client), "/t", first, Arc::clone(&deposed));
    assert_eq!(
        store.load().await.unwrap(),
        HubState::fresh(),
        "an empty store"
    );

    // A fingerprint past etcd's 1.5 MiB request cap.
    let mut state = HubState::fresh();
    state.config_revision = 9;
    let fingerprint: Vec<Vec<f32>> = (0..48)
        .map(|i| (0..4096).map(|j| ((i * 4096 + j) as f32).sin()).collect())
        .collect();
    let space = Space {
        role: Role::Embedding,
        model: "m".into(),
        dims: 4096,
        encoder: "a/embedding m@1".into(),
        cloud_reference: false,
        fingerprint,
        created_ms: 1,
        probe_set: "p".into(),
        generation: 1,
        int8_scales: [(4096, fantom_sidecar::quantize::Int8Scale { range: 0.25 })].into(),
        int8_rule: Some(fantom_sidecar::quantize::Int8Rule::CURRENT),
    };
    state.spaces.insert(space.id(), space);
    assert!(serde_json::to_vec(&state).unwrap().len() > 1_600_000);
    store.save(&state).await.unwrap();
    let chunks = client.get_prefix("/t/blob/").await.unwrap();
    assert!(chunks.len() > 3, "{} chunks", chunks.len());
    let reader = EtcdStore::new(
        Arc::clone(&client),
        "/t",
        Leadership {
            epoch,
            lease,
            ttl,
            key: "/t/leader".into(),
            granted_at: tokio::time::Instant::now(),
            fence: fantom_sidecar::hub::store::fence::Fence::leased(Instant::now() + ttl),
        },
        standing(),
    );
    assert_eq!(reader.load().await.unwrap(), state, "read back whole");

    // Another hub leads now: the first one's late write is refused by etcd itself.
    client.revoke(lease).await.unwrap();
    let second = campaign(&client, "/t", &me, ttl, |_, _| {}).await.unwrap();
    assert!(second.epoch > epoch);
    let mut late = state.clone();
    late.config_revision = 10;
    let refused = store.save(&late).await.unwrap_err();
    assert!(matches!(refused, StateError::Deposed { .. }), "{refused}");
    assert!(
        matches!(*deposed_rx.borrow_and_update(), Standing::Deposed { .. }),
        "a refused write deposes the leader at once"
    );
    let now = EtcdStore::new(Arc::clone(&client), "/t", second, standing());
    assert_eq!(now.load().await.unwrap().config_revision, 9);
}

/// Embeds `text` through `hub`, retrying (bounded) while it cannot serve yet, as a client
/// that retries does: the space id of the vector.
pub(crate) async fn embed_retrying(hub: &HubProc, text: &str) -> String {
    eventually("an embedding", || async {
        let r = hub
            .http
            .post(hub.url("/v1/embeddings"))
            .json(&json!({"model": "embedding", "input": [text]}))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .ok()?;
        if r.status() != 200 {
            return None;
        }
        let body: Value = r.json().await.ok()?;
        body["data"][0]["space"]["id"].as_str().map(String::from)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_follows_the_leader_it_is_pointed_to_and_the_next_after_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    let (mut a, b) = leader_and_standby(dir.path(), &cluster).await;
    // The standby is listed first: it refuses the upgrade naming the leader, which is listed
    // (the agent asks both at once and says hello to the leader only).
    let _gpu = minilm_agent_on_both(dir.path(), &b, &a, "gpu");
    a.wait_for_agent("gpu").await;
    let space = embed_retrying(&a, "before the kill").await;
    assert_eq!(space, "embedding:all-minilm-l6-v2:384");
    assert_eq!(
        embed_retrying(&b, "through the standby").await,
        space,
        "forwarded to the leader"
    );

    a.proc.kill();
    leads(&b).await;
    b.wait_for_agent("gpu").await;
    assert_eq!(
        embed_retrying(&b, "after the kill").await,
        space,
        "the space founded before the kill"
    );
}
