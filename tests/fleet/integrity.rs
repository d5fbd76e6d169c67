//! One request, one space, one scale, at the seams of a mixed fleet: a rerank request is
//! scored by one scorer identity, an embedding request is served in the one space it was
//! admitted under, and what can never be served fails at once with the reason (a width no
//! provider has, a suspension, a hard 402, a rejected key). A client that goes away cancels
//! the upstream call; a chat is never batched with another.
//!
//! Real hub processes; real agents (the MiniLM cross-encoder, cloud routes against the
//! OpenRouter stand-in) where the seam is the fleet, protocol-level agents where a test must
//! hold a lease or answer a probe at a chosen moment.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fantom_sidecar::config::model::ModelChoice;
use fantom_sidecar::inference::RerankOptions;
use fantom_sidecar::model_spec::Task;
use serde_json::{Value, json};

use crate::cloud::{CHAT_MODEL, KEY, RERANK_MODEL, cloud_agent, upstream, wait_for_cloud};
use crate::support::*;

/// A request running on its own; its answer is the task's output.
pub fn spawn_post(hub: &HubProc, path: &str, body: Value) -> tokio::task::JoinHandle<(u16, Value)> {
    let (http, url) = (hub.http.clone(), hub.url(path));
    tokio::spawn(async move {
        let r = http.post(url).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    })
}

/// `n` embedding vectors of `width` for a work frame.
fn vectors(work: &Value, width: usize) -> Value {
    let n = work["input"]["texts"].as_array().unwrap().len();
    let mut v = vec![0.0f32; width];
    v[0] = 1.0;
    json!({"embeddings": vec![v; n]})
}

fn done(work: &Value, output: Value) -> Value {
    json!({"type":"done","lease":work["lease"],"output":output,"latency_ms":1.0})
}

fn embedder(model: &str, dims: usize, max_items: usize) -> Value {
    json!([{"id":"embedding","role":"embedding","backend":"local","model":model,"dims":dims,
            "max_batch_items":max_items,"max_batch_tokens":1_000_000}])
}

fn reranker(model: &str, max_items: usize) -> Value {
    json!([{"id":"reranker","role":"reranker","backend":"local","model":model,
            "revision":"r1","score_activation":"sigmoid",
            "max_batch_items":max_items,"max_batch_tokens":1_000_000}])
}

/// Documents that share words with the test queries, in many proportions.
fn documents(n: usize) -> Vec<String> {
    let words = [
        "lease", "queue", "vector", "space", "gate", "agent", "budget", "cosine", "probe",
        "rerank", "cloud", "local", "table", "encoder", "token",
    ];
    (0..n)
        .map(|i| {
            let k = 2 + (i * 7) % 9;
            let body: Vec<&str> = (0..k)
                .map(|j| words[(i * 5 + j * 3) % words.len()])
                .collect();
            format!("doc {i}: {}", body.join(" "))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rerank_response_is_scored_by_one_scorer_in_its_own_order() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    // Its cloud route (from the push) calls the stand-in too: nothing leaves loopback.
    let cross_encoder = format!(
        "openrouter_url = \"{}\"\n{}",
        up.base_url,
        cross_encoder_models_toml(dir.path())
    );
    let _gpu = start_agent_toml(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "gpu",
        &cross_encoder,
        &[],
    );
    let _cloud = cloud_agent(dir.path(), &hub, "cloud", &up);
    // The key reaches the agents connected when it is pushed.
    hub.wait_for_agent("gpu").await;
    hub.wait_for_agent("cloud").await;
    let (code, body) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"reranker": {"model": RERANK_MODEL}},
            "modeByRole": {"reranker": "aggregate"}}}))
        .await;
    assert_eq!(code, 200, "{body}");
    wait_for_cloud(&hub, "cloud", 1).await;

    // The cloud's calls are held, so it takes what its budget permits (4 leases: the first
    // request) and the cross-encoder takes the rest; then the cloud answers.
    up.state.set_hold(true);
    let docs = documents(200);
    let queries: Vec<String> = (0..8)
        .map(|i| format!("which lease queue budget gate {i} probe"))
        .collect();
    let requests: Vec<_> = queries
        .iter()
        .map(|q| {
            spawn_post(
                &hub,
                "/v1/rerank",
                json!({"model": "reranker", "query": q, "documents": docs}),
            )
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(60), up.state.wait_for_requests(1))
        .await
        .expect("the cloud took a lease");
    eventually("the cross-encoder served some documents", || async {
        let a = hub.wait_for_agent("gpu").await;
        let local = a["providers"]
            .as_array()?
            .iter()
            .find(|p| p["backend"] == "local")?
            .clone();
        (local["served_items"].as_u64()? > 0).then_some(())
    })
    .await;
    up.state.set_hold(false);

    // The local identity's own scores, in this process.
    let choice: ModelChoice = toml::from_str(&format!(
        "model_dir = \"{}\"\ndevice = \"cpu\"",
        dir.path().join("minilm-cross-encoder").display()
    ))
    .unwrap();
    let engine = choice.load(Task::Rerank).await.unwrap();
    let mut scorers = BTreeSet::new();
    for (query, request) in queries.iter().zip(requests) {
        let (code, body) = request.await.unwrap();
        assert_eq!(code, 200, "{body}");
        let scorer = body["scorer"].clone();
        let backend = scorer["backend"].as_str().unwrap().to_string();
        let results = body["results"].as_array().unwrap();
        assert_eq!(results.len(), 200);
        for r in results {
            assert_eq!(
                r["provenance"]["backend"], backend,
                "one response, one scorer: {scorer} vs {}",
                r["provenance"]
            );
        }
        // Its own scores for these documents: the local model, or the cloud route itself.
        let own: Vec<f64> = if backend == "local" {
            engine
                .rerank(query.clone(), docs.clone(), RerankOptions::default())
                .await
                .unwrap()
                .iter()
                .map(|s| f64::from(s.probability.unwrap()))
                .collect()
        } else {
            let r: Value = hub
                .http
                .post(format!("{}/rerank", up.base_url))
                .bearer_auth(KEY)
                .json(&json!({"model": RERANK_MODEL, "query": query, "documents": docs}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let mut own = vec![0.0; docs.len()];
            for x in r["results"].as_array().unwrap() {
                own[x["index"].as_u64().unwrap() as usize] = x["relevance_score"].as_f64().unwrap();
            }
            own
        };
        let got: Vec<(usize, f64)> = results
            .iter()
            .map(|r| {
                (
                    r["index"].as_u64().unwrap() as usize,
                    r["relevance_score"].as_f64().unwrap(),
                )
            })
            .collect();
        for (i, s) in &got {
            assert!(
                (s - own[*i]).abs() < 1e-3,
                "{backend} doc {i}: {s} vs {}",
                own[*i]
            );
        }
        for pair in got.windows(2) {
            assert!(
                own[pair[0].0] >= own[pair[1].0] - 1e-4,
                "the order is the scorer's own: {pair:?}"
            );
        }
        scorers.insert(scorer["id"].as_str().unwrap().to_string());
    }
    let backends: BTreeSet<&str> = scorers
        .iter()
        .map(|s| s.split(' ').next().unwrap())
        .collect();
    assert_eq!(
        backends,
        BTreeSet::from(["cloud", "local"]),
        "both scorers served: {scorers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerank_request_whose_scorer_leaves_is_scored_again_whole_by_another() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut a = hub.raw_agent().await;
    a.hello("a", reranker("scorer-a", 2)).await;
    a.send(json!({"type":"pull","provider":"reranker","credits":1}))
        .await;
    let client = spawn_post(
        &hub,
        "/v1/rerank",
        json!({"query": "q", "documents": ["d0", "d1", "d2", "d3"]}),
    );
    let first = a.recv_kind("work").await;
    assert_eq!(first["input"]["documents"], json!(["d0", "d1"]));
    let mut b = hub.raw_agent().await;
    b.hello("b", reranker("scorer-b", 8)).await;
    b.send(json!({"type":"pull","provider":"reranker","credits":4}))
        .await;
    let score = |p: f64| json!({"score": (p / (1.0 - p)).ln(), "probability": p});
    a.send(done(&first, json!({"scores": [score(0.9), score(0.8)]})))
        .await;
    a.send(json!({"type":"pull","provider":"reranker","credits":1}))
        .await;
    let second = a.recv_kind("work").await;
    assert_eq!(
        second["input"]["documents"],
        json!(["d2", "d3"]),
        "the request is scorer-a's: b, with more credits, took none of it"
    );
    // Scorer a leaves with half the request scored: every document goes to b, whole.
    a.close().await;
    let mine = |d: &str| match d {
        "d0" => 0.1,
        "d1" => 0.4,
        "d2" => 0.3,
        _ => 0.2,
    };
    let mut scored = Vec::new();
    while scored.len() < 4 {
        let work = b.recv_kind("work").await;
        let docs: Vec<String> = serde_json::from_value(work["input"]["documents"].clone()).unwrap();
        let scores: Vec<Value> = docs.iter().map(|d| score(mine(d))).collect();
        b.send(done(&work, json!({"scores": scores}))).await;
        scored.extend(docs);
    }
    scored.sort();
    assert_eq!(scored, ["d0", "d1", "d2", "d3"], "b scored every document");
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body["scorer"]["id"].as_str().unwrap().contains("scorer-b"),
        "{body}"
    );
    let order: Vec<u64> = body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect();
    assert_eq!(order, [1, 2, 3, 0]);
    for r in body["results"].as_array().unwrap() {
        assert_eq!(r["provenance"]["agent"], "b");
    }
    assert_eq!(hub.metric("fantom_hub_rescored_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cutover_mid_request_never_mixes_spaces_in_one_response() {
    let dir = tempfile::tempdir().unwrap();
    // Scripted vectors: their frames carry no canary.
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--gate-no-canary", "a/embedding,b/embedding"],
        &[],
        "hub.log",
    );
    // a: 2 wide, the reference (first in order); b: 3 wide, refused for a's space.
    let mut a = hub.raw_agent().await;
    a.hello("a", embedder("model-a", 2, 500)).await;
    a.answer_one_probe().await;
    let mut b = hub.raw_agent().await;
    b.probe_dims = 3;
    b.hello("b", embedder("model-b", 3, 500)).await;
    let refused = crate::gate::verdict(&hub, "b/embedding", &["refused"]).await;
    assert!(
        refused["reason"].as_str().unwrap().contains("dims 3"),
        "{refused}"
    );

    let texts = many_texts(2000);
    let client = spawn_post(
        &hub,
        "/v1/embeddings",
        json!({"model": "embedding", "input": texts}),
    );
    a.send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    let work = a.recv_kind("work").await;
    a.send(done(&work, vectors(&work, 2))).await;

    // The table is pushed 3 wide: the role's space stays (only an operator changes it). The
    // operator migrates to b's model at 3 dims and cuts over while the request is in flight.
    let (code, body) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"embedding": {"model": "m", "provider": "p/fp32", "dims": 3}}}}))
        .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = hub
        .post_admin(
            "/admin/migrations",
            &json!({"role": "embedding", "founder": {"backend": "local", "model": "model-b", "dims": 3}}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    b.answer_one_probe().await;
    eventually("b passes the next space", || async {
        let all = hub.admin_get("/admin/migrations").await;
        let passing = all["roles"][0]["next"]["passing"].clone();
        (passing == json!(["b/embedding"])).then_some(())
    })
    .await;
    let (code, body) = hub
        .post_admin("/admin/migrations/embedding/cutover", &json!({}))
        .await;
    assert_eq!(code, 200, "{body}");
    hub.wait_for_current_space("embedding:model-b:3").await;
    b.send(json!({"type":"pull","provider":"embedding","credits":4}))
        .await;
    // The rest of the request stays in its admitted space (previous now), with a.
    for _ in 0..3 {
        a.send(json!({"type":"pull","provider":"embedding","credits":1}))
            .await;
        let work = a.recv_kind("work").await;
        a.send(done(&work, vectors(&work, 2))).await;
    }
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 200, "{body}");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 2000);
    let spaces: BTreeSet<&str> = data
        .iter()
        .map(|d| d["space"]["id"].as_str().unwrap())
        .collect();
    let widths: BTreeSet<usize> = data
        .iter()
        .map(|d| d["embedding"].as_array().unwrap().len())
        .collect();
    assert_eq!(spaces, BTreeSet::from(["embedding:model-a:2"]));
    assert_eq!(widths, BTreeSet::from([2]));

    // A new request is the new space's, served by b; b's first work is that request's.
    let fresh = spawn_post(
        &hub,
        "/v1/embeddings",
        json!({"model": "embedding", "input": ["after the change"]}),
    );
    let work = b.recv_kind("work").await;
    assert_eq!(work["input"]["texts"], json!(["after the change"]));
    b.send(done(&work, vectors(&work, 3))).await;
    let (code, body) = fresh.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["data"][0]["space"]["id"], "embedding:model-b:3");
    // A wider `dimensions` than the space is refused.
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": ["x"], "dimensions": 4}),
        )
        .await;
    assert_eq!(code, 400, "{body}");
    assert_eq!(body["error"]["code"], "dimensions_too_large", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_width_no_provider_has_is_refused_at_once_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    // Its cloud route (from the push) points at a closed port: nothing leaves loopback.
    let closed = format!(
        "openrouter_url = \"{}\"",
        crate::local_support::closed_endpoint()
    );
    // The table is 256 wide before any model connects (a role's first space is as wide as
    // its table; once founded, a space stays the role's whatever is pushed); the only model
    // makes 384: no space can be founded.
    let (code, body) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"embedding": {"model": "m", "provider": "p/fp32", "dims": 256}},
            "modeByRole": {"embedding": "local"}}}))
        .await;
    assert_eq!(code, 200, "{body}");
    let _gpu = start_agent_with(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "gpu",
        &closed,
        &[],
    );
    hub.wait_for_agent("gpu").await;
    crate::gate::verdict(&hub, "gpu/embedding", &["refused"]).await;
    let started = Instant::now();
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": ["x"]}),
        )
        .await;
    let took = started.elapsed();
    assert_eq!(code, 503, "{body}");
    // At once, not after the admission wait (10 s): nothing can ever serve it.
    assert!(took < Duration::from_secs(5), "answered in {took:?}");
    assert_eq!(body["error"]["code"], "gate_refused", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("dims 384 where the table is 256 wide"),
        "{message}"
    );
    // The other embedding role (no width configured) is not affected.
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "code-embedding", "input": ["x"]}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    let status = hub.status().await;
    assert_eq!(
        status["roles"]["embedding"]["unservable"]["code"], "gate_refused",
        "{}",
        status["roles"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_passing_provider_suspended_mid_request_fails_the_waiting_items_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--gate-sentinel-s", "1"],
        &[],
        "hub.log",
    );
    let mut a = hub.raw_agent().await;
    a.hello("a", embedder("model-a", 2, 4)).await;
    a.answer_one_probe().await;
    let client = spawn_post(
        &hub,
        "/v1/embeddings",
        json!({"model": "embedding", "input": many_texts(10)}),
    );
    a.send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    let held = a.recv_kind("work").await;
    // The sentinel's next probe finds other vectors (another width): suspended.
    a.probe_dims = 3;
    a.answer_one_probe().await;
    let answered = Instant::now();
    let (code, body) = client.await.unwrap();
    let took = answered.elapsed();
    assert_eq!(code, 503, "{body}");
    assert!(
        took < Duration::from_secs(5),
        "answered {took:?} after the suspension"
    );
    assert_eq!(body["error"]["code"], "gate_refused", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("suspended"),
        "{body}"
    );
    // The held lease carried only that request's items: the agent is told to stop.
    let cancel = a.recv_kind("cancel").await;
    assert_eq!(cancel["lease"], held["lease"]);
}

/// A chat request body.
pub fn chat(content: &str, stream: bool) -> Value {
    json!({"model": "code-assistant", "stream": stream,
           "messages": [{"role": "user", "content": content}]})
}

/// Sets the budget override (permits; `null` clears it).
async fn budget_override(hub: &HubProc, permits: Value) {
    let (code, body) = hub
        .post_admin("/admin/budget", &json!({"permits": permits}))
        .await;
    assert_eq!(code, 200, "{body}");
}

/// Five chats at once behind one permit: all fail with `code` within seconds, after `calls`
/// upstream calls.
async fn five_chats_fail(hub: &HubProc, up: &crate::upstream::Upstream, code: &str, says: &str) {
    let before = up.state.requests();
    let started = Instant::now();
    let chats: Vec<_> = (0..5)
        .map(|i| {
            spawn_post(
                hub,
                "/v1/chat/completions",
                chat(&format!("hello {i}"), false),
            )
        })
        .collect();
    for c in chats {
        let (status, body) = c.await.unwrap();
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["code"], code, "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(says),
            "{body}"
        );
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "all five answered in {took:?}"
    );
    assert_eq!(
        up.state.requests() - before,
        1,
        "one upstream call, then none"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_402_and_a_rejected_key_fail_waiting_cloud_work_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _cloud = cloud_agent(dir.path(), &hub, "cloud", &up);
    hub.wait_for_agent("cloud").await;
    let push = |key: &str| {
        json!({"openrouter": {"apiKey": key,
            "allowedModels": {"code-assistant": {"model": CHAT_MODEL}},
            "modeByRole": {"code-assistant": "cloud"}}})
    };
    let (code, body) = hub.push(push(KEY)).await;
    assert_eq!(code, 200, "{body}");
    wait_for_cloud(&hub, "cloud", 1).await;
    budget_override(&hub, json!(1)).await;

    up.state.set_hard_402(true);
    five_chats_fail(&hub, &up, "cloud_stopped", "credits").await;
    up.state.set_hard_402(false);
    let (code, body) = hub.push(push(KEY)).await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = hub
        .post("/v1/chat/completions", &chat("topped up", false))
        .await;
    assert_eq!(code, 200, "{body}");

    // A key OpenRouter does not know: the same, with the reason.
    let (code, body) = hub
        .push(push("sk-or-v1-not-a-key-0123456789abcdef0123456789"))
        .await;
    assert_eq!(code, 200, "{body}");
    five_chats_fail(&hub, &up, "cloud_refused", "refused the key").await;
    let (code, body) = hub.push(push(KEY)).await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = hub
        .post("/v1/chat/completions", &chat("the right key", false))
        .await;
    assert_eq!(code, 200, "{body}");

    // A pin no endpoint matches (404 `no_endpoints`): the same, for that route.
    let (code, body) = hub
        .push(json!({"openrouter": {"allowedModels":
            {"code-assistant": {"model": CHAT_MODEL, "provider": "nowhere"}}}}))
        .await;
    assert_eq!(code, 200, "{body}");
    eventually("the pinned route is in place", || async {
        let a = hub.wait_for_agent("cloud").await;
        a["providers"]
            .as_array()?
            .iter()
            .find(|p| p["upstream"] == "nowhere")
            .map(|_| ())
    })
    .await;
    five_chats_fail(
        &hub,
        &up,
        "no_endpoint",
        "no endpoint for the pinned upstream",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_the_upstream_call_and_frees_the_permit() {
    let dir = tempfile::tempdir().unwrap();
    let (up, hub, _cloud) = crate::liveness::chat_fleet(dir.path(), "cloud").await;
    up.state.set_hold(true);
    for (n, stream) in [(1u64, false), (2, true)] {
        let client = spawn_post(&hub, "/v1/chat/completions", chat("a long one", stream));
        tokio::time::timeout(Duration::from_secs(60), up.state.wait_for_requests(n))
            .await
            .expect("the chat reached the upstream");
        let budget = hub.status().await["budget"].clone();
        assert_eq!(budget["in_flight"], 1, "{budget}");
        // The client goes away: its connection closes.
        client.abort();
        let _ = client.await;
        eventually("the upstream call was aborted", || async {
            (up.state.aborted() == n).then_some(())
        })
        .await;
        eventually("the permit came back", || async {
            let b = hub.status().await["budget"].clone();
            (b["in_flight"] == 0).then_some(())
        })
        .await;
        assert_eq!(
            hub.metric("fantom_hub_leases_total{outcome=\"cancelled\"}")
                .await,
            n as f64
        );
    }
    up.state.set_hold(false);
    let (code, body) = hub
        .post("/v1/chat/completions", &chat("still here", false))
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        up.state.served(),
        1,
        "the cancelled chats never completed upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_identical_chats_are_two_work_frames_and_two_answers() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut agent = hub.raw_agent().await;
    agent
        .hello(
            "chatty",
            json!([{"id":"chat","role":"code-assistant","backend":"local","model":"m",
                    "server":"vllm","max_batch_items":8,"max_batch_tokens":1_000_000}]),
        )
        .await;
    agent
        .send(json!({"type":"pull","provider":"chat","credits":2}))
        .await;
    let body = chat("the same question", false);
    let first = spawn_post(&hub, "/v1/chat/completions", body.clone());
    let second = spawn_post(&hub, "/v1/chat/completions", body);
    for answer in ["one answer", "another answer"] {
        let work = agent.recv_kind("work").await;
        assert_eq!(work["op"], "chat", "{work}");
        let completion = json!({"id": format!("gen-{}", work["lease"]), "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                         "finish_reason": "stop"}]});
        agent.send(done(&work, json!({"chat": completion}))).await;
    }
    let mut contents = BTreeSet::new();
    for c in [first, second] {
        let (code, body) = c.await.unwrap();
        assert_eq!(code, 200, "{body}");
        contents.insert(
            body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    assert_eq!(
        contents,
        BTreeSet::from(["one answer".to_string(), "another answer".to_string()])
    );
}
