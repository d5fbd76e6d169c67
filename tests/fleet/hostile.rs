//! An agent that lies with numbers: a scripted agent (a cloud chat provider that holds the
//! pushed key) takes real leases from a leader on etcd and answers each with hostile figures
//! (a latency of 1e300, of f64::MAX, negative, zero, NaN as a string; tokens of u64::MAX; a cost
//! of 1e300 and a negative one; an account with an absurd RPM and balances). The hub bounds each
//! where it enters: it goes on serving, its status answers with bounded figures, and the
//! handover it checkpoints lets a second hub take over and serve.

use std::time::Duration;

use serde_json::{Value, json};

use crate::cloud::{CHAT_MODEL, push_body};
use crate::etcd_cluster::Cluster;
use crate::ha::{leader_and_standby, leader_status, leads};
use crate::support::{HubProc, RawAgent, eventually};

/// The chat role's call timeout (its default): the most a latency can count for.
const CHAT_CALL_TIMEOUT_MS: f64 = 600_000.0;

const PROVIDER: &str = "cloud:code-assistant:hostile";

/// A scripted agent on `hub` with one cloud chat provider that holds the hub's pushed config,
/// and that config as its heartbeats say it.
async fn cloud_chat_agent(hub: &HubProc) -> (RawAgent, Value) {
    let mut agent = hub.raw_agent().await;
    agent.hello("liar", json!([])).await;
    let config = agent.recv_kind("config").await;
    agent
        .send(
            json!({"type": "config_ack", "id": config["id"], "applied": true,
            "config_revision": config["revision"], "key_generation": config["key_generation"]}),
        )
        .await;
    agent
        .send(json!({"type": "providers", "providers": [{
            "id": PROVIDER, "role": "code-assistant", "backend": "cloud",
            "model": CHAT_MODEL, "max_batch_items": 1, "max_batch_tokens": 100000}]}))
        .await;
    agent
        .send(json!({"type": "pull", "provider": PROVIDER, "credits": 64}))
        .await;
    // Serving: the hub lists the provider, holding the current config.
    eventually("the scripted provider serves", || async {
        let status = hub.status().await;
        let providers = status["agents"]
            .as_array()?
            .iter()
            .find(|a| a["id"] == "liar")?["providers"]
            .clone();
        let p = providers.as_array()?.first()?.clone();
        (p["stale"].is_null() && p["credits"].as_u64()? > 0).then_some(())
    })
    .await;
    (
        agent,
        json!({"config_revision": config["revision"], "key_generation": config["key_generation"]}),
    )
}

fn completion(text: &str) -> Value {
    json!({"chat": {"id": "chatcmpl-hostile", "object": "chat.completion", "model": CHAT_MODEL,
        "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": text}}]}})
}

/// Serves the next work frame with `done` figures `numbers` (a JSON object's members, spliced
/// in as text so that a string where a number belongs reaches the hub as sent); answers
/// `discover` with an absurd account on the way.
async fn serve_one((agent, held): &mut (RawAgent, Value), numbers: &str) -> u64 {
    let work = loop {
        let frame = agent.recv().await;
        match frame["type"].as_str() {
            Some("work") => break frame,
            Some("discover") => {
                agent
                    // An RPM under one a minute is no usable number (a trusted one would
                    // hold new calls for a minute after the takeover below).
                    .send(json!({"type": "limits", "rpm": 1e-300, "funded": true,
                        "credits_remaining_usd": 1e300, "limit_remaining_usd": -1e300}))
                    .await
            }
            _ => {}
        }
    };
    let lease = work["lease"].as_u64().unwrap();
    let output = completion("fine");
    agent
        .send_text(&format!(
            r#"{{"type":"done","lease":{lease},"output":{output},{numbers}}}"#
        ))
        .await;
    let mut heartbeat = json!({"type": "heartbeat", "providers": [], "leases": []});
    heartbeat
        .as_object_mut()
        .unwrap()
        .extend(held.as_object().unwrap().clone());
    agent.send(heartbeat).await;
    lease
}

/// A chat sent to `hub` on a task of its own (its lease is served by the test's agent).
fn chat(hub: &HubProc) -> tokio::task::JoinHandle<(u16, String)> {
    let (url, http) = (hub.url("/v1/chat/completions"), hub.http.clone());
    tokio::spawn(async move {
        let body =
            json!({"model": "code-assistant", "messages": [{"role": "user", "content": "hi"}]});
        let r = http.post(url).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    })
}

/// The default project's usage, as `/admin/projects` shows it.
async fn default_usage(hub: &HubProc) -> Value {
    let projects = hub.admin_get("/admin/projects").await;
    projects["projects"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "default"))
        .map(|p| p["usage"].clone())
        .unwrap_or(Value::Null)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The budget's figures of a leader's status: each latency finite and within the call timeout.
fn assert_bounded(status: &Value) {
    let budget = &status["budget"];
    let latency = budget["latency_ewma_ms"]
        .as_f64()
        .expect("a latency figure");
    assert!(
        latency.is_finite() && (0.0..=CHAT_CALL_TIMEOUT_MS).contains(&latency),
        "{budget}"
    );
    for route in budget["routes"].as_array().into_iter().flatten() {
        if let Some(l) = route["latency_ewma_ms"].as_f64() {
            assert!((0.0..=CHAT_CALL_TIMEOUT_MS).contains(&l), "{route}");
        }
    }
    assert!(
        budget["ceiling"].as_u64().is_some_and(|c| c <= 256),
        "{budget}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_numbers_from_an_agent_leave_the_hub_serving_and_its_successor_too() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path()).await;
    let (mut a, b) = leader_and_standby(dir.path(), &cluster).await;
    let (code, pushed) = a.push(push_body(json!({"code-assistant": "cloud"}))).await;
    assert_eq!(code, 200, "{pushed}");
    let mut agent = cloud_chat_agent(&a).await;

    // Each chat's lease is answered with one hostile set of figures. A `done` whose latency
    // is a string is no frame at all: the same lease is then answered properly.
    let hostile = [
        r#""latency_ms":1e300,"tokens":18446744073709551615,"cost_usd":1e300"#,
        r#""latency_ms":1.7976931348623157e308,"tokens":0,"cost_usd":-5"#,
        r#""latency_ms":-1e300,"tokens":1,"cost_usd":0"#,
        r#""latency_ms":0,"tokens":0"#,
        r#""latency_ms":"NaN","tokens":3"#,
    ];
    for numbers in hostile {
        let client = chat(&a);
        serve_one(&mut agent, numbers).await;
        if numbers.contains("\"NaN\"") {
            // No frame at all: refused, saying so, and its lease goes back at once (not at
            // its expiry): the next work frame is the same chat, answered properly.
            let refused = agent.0.recv_kind("error").await;
            assert!(
                refused["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("'done'")),
                "{refused}"
            );
            serve_one(&mut agent, r#""latency_ms":5"#).await;
        }
        let (code, body) = tokio::time::timeout(Duration::from_secs(30), client)
            .await
            .expect("the chat is answered in time")
            .unwrap();
        assert_eq!(code, 200, "{numbers}: {body}");
    }

    // The hub still serves, and says so with bounded figures, past its next ticks and the
    // handover it wrote for the next leader.
    let served_at = now_ms();
    let status = eventually("the leader checkpoints its handover", || async {
        let s = leader_status(&a).await?;
        (s["ha"]["handover_saved_ms"].as_u64()? > served_at).then_some(s)
    })
    .await;
    assert_bounded(&status);
    // A cost is one call's at most, tokens a chat's at most: the day's figures stay finite.
    let usage = default_usage(&a).await;
    let usd = usage["today"]["cloud_usd"].as_f64().expect("a cost figure");
    assert!((1_000.0..=1_000.0 * 5.0).contains(&usd), "{usage}");
    assert!(
        usage["today"]["cloud_tokens"]
            .as_u64()
            .is_some_and(|t| t <= 8 << 21),
        "{usage}"
    );
    let client = chat(&a);
    serve_one(&mut agent, r#""latency_ms":12"#).await;
    assert_eq!(client.await.unwrap().0, 200);

    // The leader dies; the standby takes over from its checkpoint and serves.
    a.proc.kill();
    agent.0.close().await;
    leads(&b).await;
    assert_bounded(&b.status().await);
    let mut agent = cloud_chat_agent(&b).await;
    let client = chat(&b);
    serve_one(&mut agent, r#""latency_ms":1e300,"tokens":5"#).await;
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 200, "{body}");
    // Past the new leader's next tick with that figure folded in: still whole.
    let status = eventually("the new leader's status", || async {
        let s = leader_status(&b).await?;
        (s["budget"]["granted"].as_u64()? >= 1).then_some(s)
    })
    .await;
    assert_bounded(&status);
}
