//! Hubs on etcd when etcd itself is in trouble, when hubs race, and the way in from a single
//! hub: two of three members stopped (no quorum) fence the leader, so local embeddings go on
//! and cloud chat, config writes and new spaces stop with the reason, until the members
//! return (the int8 rule stored with the space serves every width while fenced, and the next
//! leader quantizes as the last did); two hubs started at once on an empty store found one space, and a verdict judged
//! before a failover is handed to the next leader, not probed again; `migrate-state` copies a
//! single hub's state dir into etcd once.

use std::time::Duration;

use serde_json::{Value, json};

use crate::cloud::{KEY, push_body, upstream};
use crate::etcd_cluster::Cluster;
use crate::ha::{embed_retrying, etcd_hub, leader_and_standby, leads};
use crate::support::*;

/// Cohere's embed of `text` as `types` through `hub` (at `width`, if given): status and body.
async fn quantized(
    hub: &HubProc,
    text: &str,
    types: &[&str],
    width: Option<usize>,
) -> (u16, Value) {
    let mut body = json!({"model": "embedding", "texts": [text], "embedding_types": types});
    if let Some(w) = width {
        body["output_dimension"] = json!(w);
    }
    hub.post("/v2/embed", &body).await
}

/// A chat through `hub`: its status and body (bounded: a forward may meet a stopped leader).
async fn chat(hub: &HubProc, text: &str) -> (u16, Value) {
    let r = hub
        .http
        .post(hub.url("/v1/chat/completions"))
        .json(&json!({"model": "code-assistant",
            "messages": [{"role": "user", "content": text}]}))
        .timeout(Duration::from_secs(30))
        .send()
        .await;
    match r {
        Ok(r) => {
            let code = r.status().as_u16();
            (code, r.json().await.unwrap_or(Value::Null))
        }
        Err(e) => (0, json!({"transport": e.to_string()})),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_etcds_quorum_the_leader_is_fenced_local_work_goes_on_and_all_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    let (a, b) = leader_and_standby(dir.path(), &cluster).await;
    let up = upstream(|c| c.max_concurrency = Some(4)).await;
    // One GPU host (MiniLM) and one cloud host, each listing both hubs.
    let both = format!("hub_urls = [\"{}\"]", b.ws_url());
    let gpu_body = format!("{both}\n{}", minilm_models_toml());
    let _gpu = start_agent_toml(
        dir.path(),
        &a.ws_url(),
        &a.fleet_file,
        "gpu",
        &gpu_body,
        &[],
    );
    let cloud_body = format!(
        "{both}\nopenrouter_url = \"{}\"\ncloud_pipeline_depth = 8",
        up.base_url
    );
    let _cloud = start_agent_toml(
        dir.path(),
        &a.ws_url(),
        &a.fleet_file,
        "cloud",
        &cloud_body,
        &[],
    );
    a.wait_for_agent("gpu").await;
    a.wait_for_agent("cloud").await;
    let (code, body) = a.push(push_body(json!({"code-assistant": "cloud"}))).await;
    assert_eq!(code, 200, "{body}");
    let space = embed_retrying(&a, "before").await;
    // The leader fixes the space's int8 scale at its full width and stores it with the space.
    let (code, before) = quantized(&a, "int8 codes", &["int8"], None).await;
    assert_eq!(code, 200, "{before}");
    let codes = before["embeddings"]["int8"][0].clone();
    assert_eq!(codes.as_array().map(Vec::len), Some(384), "{before}");
    eventually("a chat through the leader", || async {
        (chat(&a, "before").await.0 == 200).then_some(())
    })
    .await;

    // Two of three members stop: etcd has no quorum, the leader cannot renew its lease.
    cluster.signal(1, "STOP");
    cluster.signal(2, "STOP");
    let refused = eventually("cloud chat refused with the reason", || async {
        let (code, body) = chat(&a, "during").await;
        (code == 503).then_some(body)
    })
    .await;
    assert_eq!(refused["error"]["code"], "store_unreachable", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("cannot reach etcd")),
        "{refused}"
    );
    // Local embeddings go on, in the same space, while fenced.
    let r = a
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": ["during the outage"]}),
        )
        .await;
    assert_eq!(r.0, 200, "{}", r.1);
    assert_eq!(r.1["data"][0]["space"]["id"], space.as_str());
    // The space's stored rule serves int8 while fenced, at the width it was first asked and at
    // a width never asked before (derived, nothing to write); sign bits need no scale.
    let (code, body) = quantized(&a, "int8 codes", &["int8"], None).await;
    assert_eq!(
        (code, &body["embeddings"]["int8"][0]),
        (200, &codes),
        "{body}"
    );
    let (code, narrow) = quantized(&a, "int8 codes", &["int8", "binary"], Some(128)).await;
    assert_eq!(code, 200, "{narrow}");
    let narrow = narrow["embeddings"]["int8"][0].clone();
    assert_eq!(narrow.as_array().map(Vec::len), Some(128), "{narrow}");
    let (code, body) = quantized(&a, "int8 codes", &["ubinary"], Some(128)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        body["embeddings"]["ubinary"][0].as_array().map(Vec::len),
        Some(16)
    );
    // Readiness and status say why; a config write is refused with the reason, not lost.
    let (_, ready) = a.get("/ready").await;
    assert!(
        ready["store"]
            .as_str()
            .is_some_and(|m| m.contains("cannot reach etcd")),
        "{ready}"
    );
    assert_eq!(ready["roles"]["embedding"]["ready"], true, "{ready}");
    let ha = a.status().await["ha"].clone();
    assert!(ha["fenced"].is_string(), "{ha}");
    let (code, body) = a.post_admin("/admin/budget", &json!({"permits": 2})).await;
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["error"]["code"], "store_unreachable", "{body}");
    // Refused at once, never sent up.
    let (code, body) = chat(&a, "while fenced").await;
    assert_eq!(code, 503, "{body}");
    let in_flight_cap = up.state.max_in_flight();

    // The members return: chat is served again (by the same leader, whose lease etcd kept,
    // or by the other hub), through either address.
    cluster.signal(1, "CONT");
    cluster.signal(2, "CONT");
    eventually("a chat after etcd returned", || async {
        (chat(&b, "after").await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(embed_retrying(&b, "after").await, space);
    // Whichever hub leads now quantizes as the last did: the same codes. (That it serves the
    // stored number, not one it computes again, is `hub::space_scales`' unit test.)
    let (code, after) = quantized(&b, "int8 codes", &["int8"], None).await;
    assert_eq!(
        (code, &after["embeddings"]["int8"][0]),
        (200, &codes),
        "{after}"
    );
    let (code, after) = quantized(&b, "int8 codes", &["int8"], Some(128)).await;
    assert_eq!(
        (code, &after["embeddings"]["int8"][0]),
        (200, &narrow),
        "{after}"
    );
    assert!(
        in_flight_cap <= 4,
        "the stand-in's cap held: {in_flight_cap}"
    );
    assert!(
        !up.state.bodies_seen_contain("while fenced"),
        "no chat went up while fenced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hubs_at_once_found_one_space_and_a_verdict_is_handed_over_not_probed_again() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    // Both start together against an empty store.
    let a = etcd_hub(dir.path(), "a", &cluster);
    let b = etcd_hub(dir.path(), "b", &cluster);
    let body = format!("hub_urls = [\"{}\"]\n{}", b.ws_url(), minilm_models_toml());
    let _gpu = start_agent_toml(dir.path(), &a.ws_url(), &a.fleet_file, "gpu", &body, &[]);
    let space = embed_retrying(&a, "one").await;
    assert_eq!(
        embed_retrying(&b, "two").await,
        space,
        "one space, whichever hub"
    );
    let spaces = |s: Value| -> Vec<Value> {
        s["gate"]["spaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| json!([v["id"], v["generation"]]))
            .collect()
    };
    let (sa, sb) = (
        a.admin_get("/admin/status").await,
        b.admin_get("/admin/status").await,
    );
    assert_eq!(
        spaces(sa.clone()),
        spaces(sb),
        "both report the same spaces"
    );
    // MiniLM serves two embedding roles: one space each.
    let mut roles: Vec<Value> = sa["gate"]["spaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["role"].clone())
        .collect();
    let n = roles.len();
    roles.dedup();
    assert_eq!((n, roles.len()), (2, 2), "{}", sa["gate"]);
    let verdict = |s: &Value| -> Value {
        s["gate"]["verdicts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["provider"] == "gpu/embedding" && v["state"] == "pass")
            .cloned()
            .unwrap_or(Value::Null)
    };
    let before = verdict(&sa);
    assert!(before["checked_at_ms"].is_u64(), "{sa}");
    let epoch = sa["ha"]["epoch"].as_i64().unwrap();

    // The leader is killed once its verdict was checkpointed: the next leader holds it as
    // judged then (the same check time), and does not probe the provider again.
    let (mut leader, standby) = if a.get("/health").await.1["status"] == "standby" {
        (b, a)
    } else {
        (a, b)
    };
    cluster.part_stored("/fantom-sidecar", "verdicts").await;
    leader.proc.kill();
    leads(&standby).await;
    standby.wait_for_agent("gpu").await;
    assert_eq!(embed_retrying(&standby, "three").await, space);
    let after = standby.admin_get("/admin/status").await;
    assert!(
        after["ha"]["epoch"].as_i64().unwrap() > epoch,
        "{}",
        after["ha"]
    );
    assert_eq!(
        verdict(&after)["checked_at_ms"],
        before["checked_at_ms"],
        "the verdict came from etcd, not from a new probe: {}",
        after["gate"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_state_copies_a_single_hubs_state_dir_into_etcd_once() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    let single = dir.path().join("single");
    std::fs::create_dir_all(&single).unwrap();
    let mut hub = HubProc::start(&single, None, &[], &[], "hub.log");
    let (code, body) = hub
        .post_admin("/admin/budget", &json!({"permits": 7}))
        .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = hub.push(json!({"openrouter": {"apiKey": KEY}})).await;
    assert_eq!(code, 200, "{body}");
    let args = |log: &str| -> (Vec<String>, std::path::PathBuf) {
        (
            [
                "migrate-state",
                "--state-dir",
                &hub.state.display().to_string(),
                "--etcd-endpoints",
                &cluster.endpoints(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            dir.path().join(log),
        )
    };
    // Refused while the hub runs: its dir is locked.
    let (a, log) = args("m0.log");
    let (status, out) = run_to_exit(&a, &log);
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("held by another hub"), "{out}");
    hub.proc.terminate();

    let (a, log) = args("m1.log");
    let (status, out) = run_to_exit(&a, &log);
    assert!(status.success(), "{out}");
    // Once: a store that holds a state is never overwritten.
    let (a, log) = args("m2.log");
    let (status, out) = run_to_exit(&a, &log);
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("already holds a hub state"), "{out}");

    // A hub on etcd with the single hub's tokens starts from its state.
    let e = dir.path().join("e");
    std::fs::create_dir_all(e.join("state")).unwrap();
    for t in ["admin.token", "fleet.token"] {
        std::fs::copy(hub.state.join(t), e.join("state").join(t)).unwrap();
    }
    let admin = e.join("state/admin.token").display().to_string();
    let fleet = e.join("state/fleet.token").display().to_string();
    let endpoints = cluster.endpoints();
    let on_etcd = HubProc::start(
        &e,
        None,
        &[
            "--etcd-endpoints",
            &endpoints,
            "--admin-token-file",
            &admin,
            "--fleet-token-file",
            &fleet,
        ],
        &[],
        "hub.log",
    );
    leads(&on_etcd).await;
    let status = on_etcd.status().await;
    assert_eq!(
        status["budget"]["override_permits"], 7,
        "{}",
        status["budget"]
    );
    assert_eq!(status["config"]["keyPushed"], true, "{}", status["config"]);
}

/// A client sending `body` to `urls[0]` or `urls[1]` until `total` requests (shared through
/// `sent`) are served, switching address after a failure (bounded: 60 s per request): the
/// answers, and how many retries it took.
fn spawn_retrying(
    http: reqwest::Client,
    urls: [String; 2],
    sent: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    total: usize,
    c: usize,
    body: Value,
) -> tokio::task::JoinHandle<(Vec<Value>, usize)> {
    tokio::spawn(async move {
        let mut answers = Vec::new();
        let mut retries = 0;
        let mut at = c;
        while sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            loop {
                let r = http
                    .post(&urls[at % 2])
                    .json(&body)
                    .timeout(Duration::from_secs(20))
                    .send()
                    .await;
                if let Ok(r) = r
                    && r.status() == 200
                    && let Ok(answer) = r.json::<Value>().await
                {
                    answers.push(answer);
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "a request to {} never got through",
                    urls[at % 2]
                );
                retries += 1;
                at += 1;
                // A client's retry pause (not a synchronisation: any length works).
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        (answers, retries)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_under_chat_and_embedding_load_keeps_one_budget_and_one_space() {
    const CAP: usize = 4;
    const CLIENTS: usize = 8;
    const CHATS: usize = 80;
    const EMBED_CLIENTS: usize = 4;
    const EMBEDS: usize = 60;
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    let (mut a, b) = leader_and_standby(dir.path(), &cluster).await;
    let up = upstream(|c| {
        c.max_concurrency = Some(CAP);
        c.latency_ms = (100, 200);
    })
    .await;
    let body = format!(
        "hub_urls = [\"{}\"]\nopenrouter_url = \"{}\"\ncloud_pipeline_depth = 8",
        b.ws_url(),
        up.base_url
    );
    let _cloud = start_agent_toml(dir.path(), &a.ws_url(), &a.fleet_file, "cloud", &body, &[]);
    // Two GPU hosts (MiniLM), listing both hubs too.
    let gpu = format!("hub_urls = [\"{}\"]\n{}", b.ws_url(), minilm_models_toml());
    let _gpus: Vec<Proc> = ["gpu1", "gpu2"]
        .iter()
        .map(|id| start_agent_toml(dir.path(), &a.ws_url(), &a.fleet_file, id, &gpu, &[]))
        .collect();
    for id in ["cloud", "gpu1", "gpu2"] {
        a.wait_for_agent(id).await;
    }
    // Embeddings stay on the GPU hosts: the stand-in's calls are the chats' alone.
    let modes = json!({"code-assistant": "cloud", "embedding": "local", "code-embedding": "local"});
    let (code, body) = a.push(push_body(modes)).await;
    assert_eq!(code, 200, "{body}");
    let space = embed_retrying(&a, "warm").await;
    // One budget for the key: the operator's number, kept in etcd for whichever hub leads.
    let (code, body) = a
        .post_admin("/admin/budget", &json!({"permits": CAP}))
        .await;
    assert_eq!(code, 200, "{body}");
    eventually("a chat", || async {
        (chat(&a, "warm").await.0 == 200).then_some(())
    })
    .await;
    // A project and its key, made on the leader.
    let (code, made) = a
        .post_admin("/admin/projects", &json!({"name": "indexer"}))
        .await;
    assert_eq!(code, 201, "{made}");
    let key = made["key"].as_str().unwrap().to_string();

    // Clients that retry on the other address, as a client given both does: chats, and
    // embeddings served by the two GPU hosts.
    let urls = [a.url(""), b.url("")];
    let chats = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let embeds = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let body = json!({"model": "code-assistant",
                "messages": [{"role": "user", "content": format!("client {c}")}]});
            let urls = urls.clone().map(|u| format!("{u}/v1/chat/completions"));
            spawn_retrying(a.http.clone(), urls, chats.clone(), CHATS, c, body)
        })
        .collect();
    clients.extend((0..EMBED_CLIENTS).map(|c| {
        let body = json!({"model": "embedding", "input": [format!("fn client_{c}() {{}}")]});
        let urls = urls.clone().map(|u| format!("{u}/v1/embeddings"));
        spawn_retrying(a.http.clone(), urls, embeds.clone(), EMBEDS, c, body)
    }));
    // The kill lands while chats and embeddings are in flight.
    eventually("chats and embeddings under way", || async {
        (up.state.served() >= 10 && embeds.load(std::sync::atomic::Ordering::Relaxed) >= 10)
            .then_some(())
    })
    .await;
    a.proc.kill();
    leads(&b).await;
    let mut answers = Vec::new();
    let mut retries = 0;
    for c in clients {
        let (a, r) = c.await.unwrap();
        answers.extend(a);
        retries += r;
    }
    let (chat_answers, embed_answers): (Vec<Value>, Vec<Value>) =
        answers.into_iter().partition(|a| !a["data"].is_array());
    assert_eq!(
        (chat_answers.len(), embed_answers.len()),
        (CHATS, EMBEDS),
        "every chat and every embedding succeeded ({retries} client retries)"
    );
    assert!(
        embed_answers
            .iter()
            .all(|e| e["data"][0]["space"]["id"] == space.as_str()),
        "every vector in the space founded before the kill"
    );
    assert!(
        up.state.max_in_flight() <= CAP,
        "the stand-in saw {} calls at once across the failover (cap {CAP})",
        up.state.max_in_flight()
    );
    assert_eq!(up.state.throttled_429(), 0, "the budget kept under the cap");
    let budget = b.status().await["budget"].clone();
    assert_eq!(budget["override_permits"], CAP, "{budget}");
    // The project came through the failover: its key is taken, another is not.
    let with = |key: &str| {
        let (http, url, key) = (
            b.http.clone(),
            b.url("/v1/chat/completions"),
            key.to_string(),
        );
        async move {
            http.post(url)
                .bearer_auth(key)
                .json(&json!({"model": "code-assistant",
                    "messages": [{"role": "user", "content": "as the indexer"}]}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(with(&key).await, 200);
    // A project key this hub does not know (rotated, removed, mistyped) is refused; a
    // placeholder such as "EMPTY" would be no key at all (`default`).
    let stranger = format!("fsp-{}", "0".repeat(64));
    assert_eq!(with(&stranger).await, 401);
    let projects = b.admin_get("/admin/projects").await;
    assert!(projects.to_string().contains("indexer"), "{projects}");
}

/// Accepts one agent session on `listener` as a hub of an older build would (no epoch on the
/// upgrade): reads `hello`, sends `welcome` under `epoch`; the socket.
async fn welcome_under(
    listener: &tokio::net::TcpListener,
    epoch: i64,
) -> tokio_tungstenite::WebSocketStream<tokio::net::TcpStream> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    // The agent dials every hub at once and gives up on an upgrade after a second: a
    // connection it has given up on since ends before its hello here, and the next is taken.
    let (mut ws, hello) = loop {
        let (tcp, _) = tokio::time::timeout(Duration::from_secs(60), listener.accept())
            .await
            .expect("the agent dials within a minute")
            .unwrap();
        let Ok(mut ws) = tokio_tungstenite::accept_async(tcp).await else {
            continue;
        };
        let hello = loop {
            match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
                Ok(Some(Ok(Message::Text(t)))) => {
                    break Some(serde_json::from_str::<Value>(&t).unwrap());
                }
                Ok(Some(Ok(Message::Close(_))) | Some(Err(_)) | None) => break None,
                Ok(Some(Ok(_))) => continue,
                Err(_) => panic!("no hello within 10 s"),
            }
        };
        if let Some(hello) = hello {
            break (ws, hello);
        }
    };
    assert_eq!(hello["type"], "hello", "{hello}");
    let welcome = json!({"type": "welcome", "session": 1, "protocol_version": 1,
        "heartbeat_interval_ms": 5000, "lease_ms": 60000, "pings": false, "epoch": epoch});
    ws.send(Message::text(welcome.to_string())).await.unwrap();
    ws
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refuses_a_hub_that_welcomes_it_under_an_older_epoch() {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let dir = tempfile::tempdir().unwrap();
    let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let second = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fleet = dir.path().join("fleet.token");
    std::fs::write(&fleet, "epoch-test-fleet-token").unwrap();
    let body = format!(
        "hub_urls = [\"ws://{}/v1/agent\"]\nopenrouter_url = \"http://127.0.0.1:1\"",
        second.local_addr().unwrap()
    );
    let hub_url = format!("ws://{}/v1/agent", first.local_addr().unwrap());
    let _agent = start_agent_toml(dir.path(), &hub_url, &fleet, "edge", &body, &[]);

    // The first hub leads under epoch 9 and welcomes the agent, then its socket ends.
    drop(welcome_under(&first, 9).await);
    // The agent dials it again (the last hub that welcomed it), and it welcomes the agent under
    // epoch 7: a leader deposed since, that has not noticed. The agent sends nothing under
    // that session and closes it.
    let mut stale = welcome_under(&first, 7).await;
    let after = tokio::time::timeout(Duration::from_secs(10), stale.next()).await;
    assert!(
        matches!(after, Ok(None | Some(Ok(Message::Close(_))) | Some(Err(_)))),
        "the agent answered under the older epoch: {after:?}"
    );
    // Then it dials the other hub, which welcomes it under a newer epoch.
    let _current = welcome_under(&second, 10).await;
    let log = std::fs::read_to_string(dir.path().join("edge.log")).unwrap();
    assert!(log.contains("older than epoch 9 seen before"), "{log}");
}
