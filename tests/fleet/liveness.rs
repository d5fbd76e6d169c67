//! Liveness: work slower than its lease is renewed by heartbeats and served once; a role's
//! call timeout ends a stuck call once; a black-holed socket is noticed on both sides within
//! seconds and the agent serves again; a second process claiming a live agent's id is refused
//! and exits, without the two taking turns; a streamed chat arrives chunk by chunk and a lost
//! agent ends it with an error event.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::black_hole::cloud_agent_behind_proxy;
use crate::cloud::{CHAT_MODEL, KEY, cloud_agent, upstream, wait_for_cloud};
use crate::integrity::{chat, spawn_post};
use crate::support::*;
use crate::upstream::Upstream;

/// The chat route, cloud-only.
pub async fn push_chat(hub: &HubProc) {
    let (code, body) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"code-assistant": {"model": CHAT_MODEL}},
            "modeByRole": {"code-assistant": "cloud"}}}))
        .await;
    assert_eq!(code, 200, "{body}");
}

/// The OpenRouter stand-in, a hub, and one cloud agent `id` serving the chat route.
pub async fn chat_fleet(dir: &std::path::Path, id: &str) -> (Upstream, HubProc, Proc) {
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(dir, None, &[], &[], "hub.log");
    let agent = cloud_agent(dir, &hub, id, &up);
    hub.wait_for_agent(id).await;
    push_chat(&hub).await;
    wait_for_cloud(&hub, id, 1).await;
    (up, hub, agent)
}

/// A chat held at the upstream until `n` upstream requests were seen.
async fn chat_reaches_upstream(up: &Upstream, n: u64) {
    tokio::time::timeout(PATIENCE, up.state.wait_for_requests(n))
        .await
        .expect("the chat reached the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_slower_than_its_lease_is_renewed_and_served_once_and_a_call_timeout_ends_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hub.toml");
    std::fs::write(&config, "heartbeat_ms = 300\nlease_s = 2\n").unwrap();
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--config", config.to_str().unwrap()],
        &[],
        "hub.log",
    );
    let _cloud = cloud_agent(dir.path(), &hub, "cloud", &up);
    hub.wait_for_agent("cloud").await;
    push_chat(&hub).await;
    wait_for_cloud(&hub, "cloud", 1).await;
    let lease_s = hub.status().await["settings"]["timings"]["code-assistant"]["lease_s"].clone();
    assert_eq!(lease_s, json!(2.0));

    // The chat takes many lease lengths: the agent's heartbeats keep its lease alive.
    up.state.set_hold(true);
    let client = spawn_post(&hub, "/v1/chat/completions", chat("a long answer", false));
    chat_reaches_upstream(&up, 1).await;
    let renewed_at_start = hub.metric("fantom_hub_lease_renewals_total").await;
    eventually("the lease was renewed for three lease lengths", || async {
        let renewed = hub.metric("fantom_hub_lease_renewals_total").await;
        (renewed - renewed_at_start >= 20.0).then_some(())
    })
    .await;
    up.state.set_hold(false);
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(up.state.requests(), 1, "one upstream call, never redone");
    assert_eq!(
        hub.metric("fantom_hub_leases_total{outcome=\"expired\"}")
            .await,
        0.0
    );

    // A role's call timeout (applied by SIGHUP) ends a stuck call once, naming the setting.
    std::fs::write(
        &config,
        "heartbeat_ms = 300\nlease_s = 2\n[roles.code-assistant]\ncall_timeout_s = 1\n",
    )
    .unwrap();
    hub.proc.signal("HUP");
    eventually("the call timeout applies", || async {
        let s = hub.status().await;
        (s["settings"]["timings"]["code-assistant"]["call_timeout_s"] == json!(1.0)).then_some(())
    })
    .await;
    up.state.set_hold(true);
    let started = Instant::now();
    let (code, body) = hub
        .post("/v1/chat/completions", &chat("a stuck one", false))
        .await;
    up.state.set_hold(false);
    assert_eq!(code, 422, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("call_timeout_s"), "{message}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(up.state.requests(), 2, "the stuck call was made once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_socket_is_noticed_and_the_agent_serves_again_within_20_s() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(dir.path(), None, &["--heartbeat-ms", "500"], &[], "hub.log");
    let (proxy, _agent) = cloud_agent_behind_proxy(dir.path(), &hub, "far", &up).await;
    hub.wait_for_agent("far").await;
    push_chat(&hub).await;
    wait_for_cloud(&hub, "far", 1).await;

    up.state.set_hold(true);
    let client = spawn_post(&hub, "/v1/chat/completions", chat("across a NAT", false));
    chat_reaches_upstream(&up, 1).await;
    assert_eq!(hub.status().await["roles"]["code-assistant"]["leases"], 1);

    // The route eats every packet of the open socket; neither end is told.
    proxy.black_hole();
    let holed = Instant::now();
    let sockets = eventually("the agent is back on a second socket", || async {
        let s = hub.status().await;
        let count = s["sockets"]["far"].clone();
        let connected = s["agents"].as_array()?.iter().any(|a| a["id"] == "far");
        (count["total"] == 2 && count["open"] == 1 && connected).then_some(count)
    })
    .await;
    // Its lease came back once and went out again on the new socket.
    chat_reaches_upstream(&up, 2).await;
    up.state.set_hold(false);
    let (code, body) = client.await.unwrap();
    let took = holed.elapsed();
    assert_eq!(code, 200, "{body}");
    assert!(
        took < Duration::from_secs(20),
        "served again after {took:?}"
    );
    assert_eq!(sockets["open"], 1);
    assert_eq!(
        hub.metric("fantom_hub_leases_total{outcome=\"lost\"}")
            .await,
        1.0,
        "the lease in flight was requeued once"
    );
    assert_eq!(up.state.served(), 1, "answered once");
    let log = std::fs::read_to_string(dir.path().join("far.log")).unwrap();
    assert!(
        log.contains("three heartbeats"),
        "the agent says why it redialled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_claiming_a_live_agents_id_is_refused_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &["--heartbeat-ms", "500"], &[], "hub.log");
    let _first = start_agent_toml(dir.path(), &hub.ws_url(), &hub.fleet_file, "twin", "", &[]);
    let live = hub.wait_for_agent("twin").await;
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let mut second = start_agent_toml(&other, &hub.ws_url(), &hub.fleet_file, "twin", "", &[]);
    let exit = second.wait_exit();
    assert!(!exit.success(), "{exit:?}");
    let log = std::fs::read_to_string(other.join("twin.log")).unwrap();
    assert!(
        log.contains("in use by another live agent process"),
        "the refused process says why: {log}"
    );
    // The live one was never superseded: same session, one socket ever.
    let s = hub.status().await;
    let twin = s["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "twin")
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(twin["session"], live["session"], "{s}");
    assert_eq!(s["sockets"]["twin"]["total"], 1, "{s}");
}

/// Reads server-sent events from `r` until `stop` accepts one (bounded); returns every
/// event's data so far.
async fn read_events(
    r: &mut reqwest::Response,
    seen: &mut Vec<String>,
    stop: impl Fn(&str) -> bool,
) -> bool {
    let mut pending = String::new();
    loop {
        let chunk = tokio::time::timeout(PATIENCE, r.chunk())
            .await
            .expect("an event in time")
            .expect("the stream reads");
        let Some(bytes) = chunk else {
            return false;
        };
        pending.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(at) = pending.find("\n\n") {
            let event: String = pending.drain(..at + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                seen.push(data.to_string());
                if stop(data) {
                    return true;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_arrives_chunk_by_chunk_and_a_lost_agent_ends_it_with_an_error_event() {
    let dir = tempfile::tempdir().unwrap();
    let (up, hub, mut agent) = chat_fleet(dir.path(), "streamer").await;
    let streamed = |text: &str| {
        hub.http
            .post(hub.url("/v1/chat/completions"))
            .json(&chat(text, true))
    };

    // The upstream sends its first chunk and stops: the client has that chunk while the
    // upstream is still holding the rest.
    up.state.set_stream_hold(true);
    let mut r = streamed("one two three").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut events = Vec::new();
    assert!(read_events(&mut r, &mut events, |d| d.contains("echo:")).await);
    assert_eq!(
        streamed_content(&events),
        "echo:",
        "only the first chunk so far"
    );
    up.state.set_stream_hold(false);
    assert!(read_events(&mut r, &mut events, |d| d == "[DONE]").await);
    assert_eq!(streamed_content(&events), "echo: one two three");
    assert!(
        events.iter().all(|e| !e.contains("\"error\"")),
        "{events:?}"
    );

    // The agent dies mid-stream: the client's stream ends with an error event, not [DONE].
    up.state.set_stream_hold(true);
    let mut r = streamed("cut short").send().await.unwrap();
    let mut events = Vec::new();
    assert!(read_events(&mut r, &mut events, |d| d.contains("echo:")).await);
    agent.kill();
    let ended_with_error = read_events(&mut r, &mut events, |d| d.contains("\"error\"")).await;
    up.state.set_stream_hold(false);
    assert!(ended_with_error, "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "stream_cut", "{last}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    // It is not served again behind the client's back.
    assert_eq!(up.state.requests(), 2);
}
