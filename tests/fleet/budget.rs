//! The cloud budget's start against a concurrency-capped upstream, with real processes: a hub,
//! three cloud-only agents and the OpenRouter stand-in allowing 10 calls at once and
//! reporting no RPM (a funded key: a ceiling of 16 nothing has confirmed). 48 clients send
//! chats until 600 are served. What is checked is behaviour, not speed: no request fails, the
//! route opens under the ceiling and grows into the upstream's wall, the 429s that find it
//! (at most 1 % of the calls) neither halve the limit nor cool the route down, and the limit
//! holds at the upstream's capacity.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

use crate::cloud::{cloud_agent, push_body, upstream, wait_for_cloud};
use crate::support::*;

const CAP: u64 = 10;
const CLIENTS: usize = 48;
const CHATS: usize = 600;

/// The chat route's budget view.
async fn chat_route(hub: &HubProc) -> Option<Value> {
    hub.status().await["budget"]["routes"]
        .as_array()?
        .iter()
        .find(|r| {
            r["route"]
                .as_str()
                .is_some_and(|n| n.starts_with("code-assistant:"))
        })
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_finds_the_upstreams_capacity_without_a_halving_or_a_cooldown() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|c| {
        c.max_concurrency = Some(CAP as usize);
        c.latency_ms = (150, 250);
    })
    .await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let agents: Vec<Proc> = ["cloud-a", "cloud-b", "cloud-c"]
        .iter()
        .map(|id| cloud_agent(dir.path(), &hub, id, &up))
        .collect();
    for id in ["cloud-a", "cloud-b", "cloud-c"] {
        hub.wait_for_agent(id).await;
    }
    let (code, result) = hub
        .push(push_body(json!({"code-assistant": "cloud"})))
        .await;
    assert_eq!(code, 200, "{result}");
    for id in ["cloud-a", "cloud-b", "cloud-c"] {
        wait_for_cloud(&hub, id, 3).await;
    }
    eventually("discovered: 16 permits", || async {
        (hub.status().await["budget"]["ceiling"] == 16).then_some(())
    })
    .await;

    // 48 clients, each sending its next chat when the last is answered.
    let sent = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (http, url, sent) = (
                hub.http.clone(),
                hub.url("/v1/chat/completions"),
                sent.clone(),
            );
            tokio::spawn(async move {
                let mut codes = Vec::new();
                while sent.fetch_add(1, Ordering::Relaxed) < CHATS {
                    let body = json!({"model": "code-assistant",
                        "messages": [{"role": "user", "content": format!("client {c}")}]});
                    let r = http.post(&url).json(&body).send().await.unwrap();
                    codes.push(r.status().as_u16());
                }
                codes
            })
        })
        .collect();

    // The start grows the route from 8 into the wall at 10; the 429 that finds it ends it.
    let ended = eventually("the start met the upstream's wall", || async {
        let r = chat_route(&hub).await?;
        (r["throttles"].as_u64()? >= 1 && r.get("start_target").is_none()).then_some(r)
    })
    .await;
    println!("the start ended: {ended}");

    let mut codes = Vec::new();
    for c in clients {
        codes.extend(c.await.unwrap());
    }
    assert_eq!(codes.len(), CHATS);
    assert!(codes.iter().all(|c| *c == 200), "every chat is served");
    assert_eq!(
        up.state.served_by_slug("poolside"),
        CHATS as u64,
        "each once"
    );
    let (throttled, calls) = (up.state.throttled_429(), up.state.requests());
    assert!(
        throttled * 100 <= calls,
        "429s at most 1 % of calls: {throttled} of {calls}"
    );
    // No halving and no cooldown: the 429s of the start are told as the wall they found.
    let status = hub.status().await;
    let kinds: Vec<&str> = status["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert!(kinds.contains(&"wall"), "{kinds:?}");
    assert!(!kinds.contains(&"cooldown"), "{}", status["events"]);
    // It holds at the known-good limit: the cap, one under the wall.
    let r = chat_route(&hub).await.unwrap();
    println!("chats {CHATS}: upstream calls {calls}, 429s {throttled}; route {r}");
    assert_eq!(r["known_good"], CAP, "{r}");
    assert_eq!(r["limit"], CAP, "{r}");
    drop(agents);
}
