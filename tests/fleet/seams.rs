//! Integrity at the seams of a fleet that lives for months: an agent that missed a push never
//! serves or spends with what it held, only what the merge accepted leaves the hub, a retired
//! space never mixes its generations, a probe to an agent that left fails at once, a local
//! lease's "limit" counts as the failure it is, and a model that refuses long inputs still
//! passes the gate.
//!
//! Real hub and agent processes (cloud agents against the OpenRouter stand-in, MiniLM agents);
//! protocol-level agents where a test must answer a probe or a lease at a chosen moment.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::black_hole::cloud_agent_behind_proxy;
use crate::cloud::{CHAT_MODEL, KEY, RERANK_MODEL, cloud_agent, upstream, wait_for_cloud};
use crate::integrity::{chat, spawn_post};
use crate::support::*;

/// The key a push replaces [`KEY`] with.
const NEW_KEY: &str = "sk-or-v1-cloud-test-fedcba9876543210fedcba9876543210";
/// A key typed into fields where keys never go.
const PASTED: &str = "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef0123456789ab";

fn embedder(model: &str, max_items: usize) -> Value {
    json!([{"id":"embedding","role":"embedding","backend":"local","model":model,"dims":2,
            "max_batch_items":max_items,"max_batch_tokens":1_000_000}])
}

/// One vector per text of an embedding work frame, along `axis`.
fn done_with(work: &Value, axis: usize) -> Value {
    let n = work["input"]["texts"].as_array().unwrap().len();
    let mut v = vec![0.0f32; 2];
    v[axis] = 1.0;
    json!({"type":"done","lease":work["lease"],"output":{"embeddings": vec![v; n]},"latency_ms":1.0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_missed_a_push_serves_nothing_spends_nothing_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(dir.path(), None, &["--heartbeat-ms", "500"], &[], "hub.log");
    let (proxy, _stale) = cloud_agent_behind_proxy(dir.path(), &hub, "stale", &up).await;
    let _fresh = cloud_agent(dir.path(), &hub, "fresh", &up);
    hub.wait_for_agent("stale").await;
    hub.wait_for_agent("fresh").await;
    let (code, result) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"reranker": {"model": RERANK_MODEL},
                              "code-assistant": {"model": CHAT_MODEL}},
            "modeByRole": {"reranker": "cloud", "code-assistant": "cloud"}}}))
        .await;
    assert_eq!(code, 200, "{result}");
    wait_for_cloud(&hub, "stale", 2).await;
    wait_for_cloud(&hub, "fresh", 2).await;
    let rerank = json!({"query": "rust", "documents": ["rust", "cake"]});
    let (code, body) = hub.post("/v1/rerank", &rerank).await;
    assert_eq!(code, 200, "{body}");

    // The stale agent's socket goes silent; the push that removes the reranker's route and
    // replaces the key reaches only the fresh agent (the other frame is lost in the hole).
    proxy.black_hole();
    up.state.set_key(NEW_KEY);
    let (code, result) = hub
        .push(json!({"openrouter": {"apiKey": NEW_KEY, "allowedModels": {"reranker": null}}}))
        .await;
    assert_eq!(code, 200, "{result}");

    // It redials with its old routes and key: the hub sends it the whole config, it drops the
    // key it cannot use, and status names it.
    let status = eventually("the stale agent is back and named", || async {
        let s = hub.status().await;
        let back = s["sockets"]["stale"]["total"] == 2 && s["sockets"]["stale"]["open"] == 1;
        let named = s["config"]["agentsNeedingKey"] == json!(["stale"]);
        let agent = s["agents"]
            .as_array()?
            .iter()
            .find(|a| a["id"] == "stale")?;
        let cloud = agent["providers"]
            .as_array()?
            .iter()
            .filter(|p| p["backend"] == "cloud")
            .count();
        (back && named && cloud == 0).then_some(s)
    })
    .await;
    let stale = status["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "stale")
        .unwrap();
    assert_eq!(stale["needs_key_push"], true, "{stale}");
    assert_eq!(
        stale["holds"]["config_revision"],
        status["config"]["revision"]
    );

    // Nothing is served on the removed route; the fresh agent keeps serving with the new key.
    let (code, body) = hub.post("/v1/rerank", &rerank).await;
    assert_eq!(code, 503, "{body}");
    for i in 0..8 {
        let (code, body) = hub
            .post("/v1/chat/completions", &chat(&format!("after {i}"), false))
            .await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["provenance"]["agent"], "fresh", "{body}");
    }
    assert_eq!(up.state.unauthorised(), 0, "nothing spent with the old key");
    let s = hub.status().await;
    assert!(
        s["roles"]["code-assistant"]["unservable"].is_null(),
        "the current key is not stopped: {}",
        s["roles"]["code-assistant"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_typed_into_any_other_field_reaches_no_agent() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut raw = hub.raw_agent().await;
    raw.hello("raw", json!([])).await;
    let (code, _) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"reranker": {"model": RERANK_MODEL}}}}))
        .await;
    assert_eq!(code, 200);
    let first = raw.recv_kind("config").await;
    assert_eq!(first["payload"]["openrouter"]["apiKey"], KEY);
    let pushes = [
        json!({"allowedModels": {"reranker": {"model": RERANK_MODEL, "note": PASTED}}}),
        json!({"allowedModels": {"reranker": {"model": PASTED}}}),
        json!({"modeByRole": {"reranker": PASTED}}),
        json!({"allowedModels": {"embedding": {"model": "m", "provider": PASTED, "dims": 8}}}),
        json!({"allowedModels": {"embedding": {"model": "m", "provider": "p", "quantization": PASTED, "dims": 8}}}),
        json!({"allowedModels": {PASTED: {"model": "m"}}}),
        json!({"modeByRole": {PASTED: "cloud"}}),
    ];
    for push in pushes {
        let (code, result) = hub.push(json!({ "openrouter": push })).await;
        assert!(!result.to_string().contains(PASTED), "{result}");
        if code != 200 {
            continue;
        }
        let frame = raw.recv_text().await.unwrap();
        let v: Value = serde_json::from_str(&frame).unwrap();
        assert_eq!(v["type"], "config", "{frame}");
        assert!(!frame.contains(PASTED), "the key is in no frame: {frame}");
        assert!(
            !frame.contains(KEY),
            "a push without a key carries none: {frame}"
        );
    }
    let log = std::fs::read_to_string(dir.path().join("hub.log")).unwrap();
    assert!(!log.contains(PASTED));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_hub_restart_agents_holding_the_current_config_keep_serving_without_a_push() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let mut hub = HubProc::start(dir.path(), None, &["--heartbeat-ms", "500"], &[], "hub.log");
    let addr = hub.proc.addr;
    let _agent = cloud_agent(dir.path(), &hub, "cloud-a", &up);
    hub.wait_for_agent("cloud-a").await;
    let (code, _) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"code-assistant": {"model": CHAT_MODEL}},
            "modeByRole": {"code-assistant": "cloud"}}}))
        .await;
    assert_eq!(code, 200);
    wait_for_cloud(&hub, "cloud-a", 1).await;
    let before = hub.status().await["config"].clone();

    hub.proc.kill();
    let hub = HubProc::start(
        dir.path(),
        Some(addr),
        &["--heartbeat-ms", "500"],
        &[],
        "hub-2.log",
    );
    wait_for_cloud(&hub, "cloud-a", 1).await;
    let after = hub.status().await["config"].clone();
    assert_eq!(after["revision"], before["revision"]);
    assert_eq!(after["keyGeneration"], before["keyGeneration"]);
    assert_eq!(after["agentsNeedingKey"], json!([]), "{after}");
    let (code, body) = hub
        .post("/v1/chat/completions", &chat("after the restart", false))
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["provenance"]["agent"], "cloud-a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_a_space_mid_request_answers_one_generation_or_409() {
    let dir = tempfile::tempdir().unwrap();
    // Scripted vectors: the frames carry no canary.
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--gate-no-canary", "a/embedding"],
        &[],
        "hub.log",
    );
    let mut a = hub.raw_agent().await;
    a.hello("a", embedder("model-a", 500)).await;
    a.answer_one_probe().await;
    let space = "embedding:model-a:2";
    let first = hub.wait_for_current_space(space).await["generation"]
        .as_u64()
        .unwrap();
    let texts = many_texts(2000);
    let client = spawn_post(
        &hub,
        "/v1/embeddings",
        json!({"model": "embedding", "input": texts}),
    );
    a.send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    let work = a.recv_kind("work").await;
    a.send(done_with(&work, 0)).await;

    // The reference's stack changes: the operator retires the space, and the reference
    // fingerprints it again with other vectors while the request is in flight.
    let (code, body) = hub
        .post_admin("/admin/gate/verify", &json!({ "retire_space": space }))
        .await;
    assert_eq!(code, 200, "{body}");
    a.probe_axis = 1;
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 409, "{body}");
    assert_eq!(body["error"]["code"], "space_changed", "{body}");

    // A new request is served in the new generation, every item of it.
    a.send(json!({"type":"pull","provider":"embedding","credits":4}))
        .await;
    let fresh = spawn_post(
        &hub,
        "/v1/embeddings",
        json!({"model": "embedding", "input": many_texts(600)}),
    );
    let mut served = 0;
    while served < 600 {
        let work = a.recv_kind("work").await;
        served += work["input"]["texts"].as_array().unwrap().len();
        a.send(done_with(&work, 1)).await;
        a.send(json!({"type":"pull","provider":"embedding","credits":1}))
            .await;
    }
    let (code, body) = fresh.await.unwrap();
    assert_eq!(code, 200, "{body}");
    let generations: BTreeSet<u64> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["space"]["generation"].as_u64().unwrap())
        .collect();
    assert_eq!(generations.len(), 1, "{generations:?}");
    assert!(generations.iter().all(|g| *g > first), "{generations:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_that_leaves_mid_fingerprint_is_replaced_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut a = hub.raw_agent().await;
    a.hello("a", embedder("m", 8)).await;
    let probe = a.recv_unanswered().await;
    assert_eq!(probe["type"], "probe", "{probe}");
    let mut b = hub.raw_agent().await;
    b.hello("b", embedder("m", 8)).await;
    // The reference dies with its fingerprint probe unanswered.
    let left = Instant::now();
    a.close().await;
    b.answer_one_probe().await;
    hub.wait_for_current_space("embedding:m:2").await;
    let took = left.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "founded {took:?} after the reference left (the probe timeout is 60 s)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_agent_answering_limit_to_every_lease_fails_the_request_at_the_attempt_cap() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut a = hub.raw_agent().await;
    // Three providers of one scorer: at most two failures each before a bench, so the
    // request meets its attempt cap (5) before every provider is benched.
    let providers: Vec<Value> = (1..=3)
        .map(|i| {
            json!({"id": format!("reranker-{i}"),"role":"reranker","backend":"local",
                "model":"m","revision":"r1","score_activation":"sigmoid",
                "max_batch_items":8,"max_batch_tokens":1_000_000})
        })
        .collect();
    a.hello("a", json!(providers)).await;
    for i in 1..=3 {
        a.send(json!({"type":"pull","provider":format!("reranker-{i}"),"credits":4}))
            .await;
    }
    let started = Instant::now();
    // The agent answers every lease with a limit, as long as leases come.
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = failures.clone();
    let agent = tokio::spawn(async move {
        loop {
            let frame = a.recv().await;
            if frame["type"] != "work" {
                continue;
            }
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            a.send(
                json!({"type":"failed","lease":frame["lease"],"class":"rate_limited",
                "limit":"platform","retry_after_ms":10,
                "message":"this local agent says it met a limit"}),
            )
            .await;
        }
    });
    let outcome = spawn_post(
        &hub,
        "/v1/rerank",
        json!({"query": "q", "documents": ["a", "b"]}),
    )
    .await
    .unwrap();
    agent.abort();
    let failures = failures.load(std::sync::atomic::Ordering::SeqCst);
    let (code, body) = outcome;
    assert_eq!(code, 502, "{body}");
    assert_eq!(body["error"]["code"], "provider_failures", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("says it met a limit"), "{message}");
    assert_eq!(failures, 5, "one attempt per lease, the cap is 5");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minilm_that_refuses_long_inputs_passes_the_gate_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _reference = start_agent(dir.path(), &hub, "ref", &[]);
    let strict = minilm_models_toml().replace(
        "pipeline_depth = 2",
        "pipeline_depth = 2\nno_truncate = true",
    );
    let _strict = start_agent_toml(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "strict",
        &strict,
        &[],
    );
    let passed = crate::gate::verdict(&hub, "strict/embedding", &["pass"]).await;
    assert!(
        passed["evidence"]["min_cosine"].as_f64().unwrap() > 0.999,
        "{passed}"
    );
    crate::gate::verdict(&hub, "ref/embedding", &["pass"]).await;
    let texts: Vec<String> = (0..160)
        .map(|i| format!("text {i} about leases and queues"))
        .collect();
    let mut from_strict = 0;
    for _ in 0..4 {
        let (code, body) = hub
            .post(
                "/v1/embeddings",
                &json!({"model": "embedding", "input": texts}),
            )
            .await;
        assert_eq!(code, 200, "{body}");
        from_strict += body["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["provenance"]["agent"] == "strict")
            .count();
    }
    assert!(from_strict > 0, "the strict agent served");
    assert_eq!(
        hub.metric("fantom_hub_canary_failures_total{provider=\"strict/embedding\"}")
            .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpinned_model_is_named_by_its_bytes_and_no_host_path_reaches_a_client() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    // The MiniLM folder without its pinned id: an unpinned model.
    let unpinned = minilm_models_toml().replace("model = \"all-minilm-l6-v2\"\n", "");
    assert!(!unpinned.contains("model = "), "{unpinned}");
    let _gpu = start_agent_toml(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "gpu",
        &unpinned,
        &[],
    );
    crate::gate::verdict(&hub, "gpu/embedding", &["pass"]).await;
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": ["fn main() {}"]}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    let d = &body["data"][0];
    let model = d["provenance"]["model"].as_str().unwrap();
    assert!(model.starts_with("sha256:") && model.len() == 7 + 24, "{d}");
    assert_eq!(d["provenance"]["revision"], model);
    assert_eq!(d["space"]["id"], format!("embedding:{model}:384"));
    let path = minilm_dir().display().to_string();
    let (_, models) = hub.get("/v1/models").await;
    for shown in [
        body.to_string(),
        models.to_string(),
        hub.status().await.to_string(),
    ] {
        assert!(!shown.contains(&path), "a host path in {shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fantoms_defaults_are_proposed_and_bill_nothing_until_a_push_takes_them() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let config = hub.admin_get("/admin/config").await;
    let proposed = &config["defaults"];
    assert_eq!(proposed["inForce"], false, "{config}");
    assert_eq!(
        proposed["allowedModels"]["reranker"]["model"],
        "qwen/qwen3-reranker-8b"
    );
    assert_eq!(
        proposed["allowedModels"]["reranker"]["provider"],
        "Fireworks"
    );
    assert_eq!(
        proposed["allowedModels"]["rlm-sandbox"]["model"],
        "deepseek/deepseek-v4-flash"
    );
    assert!(proposed["allowedModels"].get("embedding").is_none());
    assert_eq!(config["openrouter"]["allowedModels"], json!({}));

    // A key alone maps nothing; `useDefaults` maps what no push chose.
    let (code, _) = hub.push(json!({"openrouter": {"apiKey": KEY}})).await;
    assert_eq!(code, 200);
    assert_eq!(
        hub.admin_get("/admin/config").await["openrouter"]["allowedModels"],
        json!({})
    );
    let (code, result) = hub
        .push(json!({"openrouter": {"useDefaults": true,
            "allowedModels": {"code-assistant": {"model": "qwen/qwen3-coder"}}}}))
        .await;
    assert_eq!(code, 200, "{result}");
    let config = hub.admin_get("/admin/config").await;
    let held = &config["openrouter"]["allowedModels"];
    assert_eq!(held["reranker"]["model"], "qwen/qwen3-reranker-8b");
    assert_eq!(
        held["code-assistant"]["model"], "qwen/qwen3-coder",
        "a choice wins"
    );
    assert_eq!(held["rlm-sandbox"]["model"], "deepseek/deepseek-v4-flash");
    assert_eq!(config["openrouter"]["modeByRole"]["rlm-sandbox"], "local");
    assert_eq!(config["defaults"]["allowedModels"], json!({}));
}
