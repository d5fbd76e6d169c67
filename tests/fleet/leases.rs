//! Lease rules with protocol-level agents: expiry sends items back to the front and drops the
//! late result; transient failures requeue; fatal ones fail the request with its message; a
//! full queue answers 429 with Retry-After and loses nothing it accepted. These agents answer
//! scripted frames exactly, so their work frames carry no canary (`--gate-no-canary`; canaries
//! have their own tests in gate.rs and the core's).

use serde_json::{Value, json};

use crate::support::*;

fn spawn_embed(hub: &HubProc, input: Value) -> tokio::task::JoinHandle<(u16, Value)> {
    let (http, url) = (hub.http.clone(), hub.url("/v1/embeddings"));
    tokio::spawn(async move {
        let r = http
            .post(url)
            .json(&json!({"model": "embedding", "input": input}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    })
}

fn vectors_for(work: &Value, value: f32) -> Value {
    let n = work["input"]["texts"].as_array().unwrap().len();
    json!({"embeddings": vec![vec![value, 1.0]; n]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_goes_back_to_the_front_and_its_late_result_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(
        dir.path(),
        None,
        &[
            "--lease-s",
            "1",
            "--heartbeat-ms",
            "500",
            "--gate-no-canary",
            "slow/embedding,fast/embedding",
        ],
        &[],
        "hub.log",
    );
    let mut slow = hub.raw_agent().await;
    slow.hello("slow", json!([fake_provider("embedding", "embedding", 8)]))
        .await;
    slow.send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;

    let client = spawn_embed(&hub, json!(["one", "two", "three"]));
    let first = slow.recv_kind("work").await;
    assert_eq!(first["input"]["texts"], json!(["one", "two", "three"]));

    let mut fast = hub.raw_agent().await;
    fast.hello("fast", json!([fake_provider("embedding", "embedding", 8)]))
        .await;
    fast.send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;

    // The slow agent's lease expires: it is told, and the same items go to the fast one.
    let cancel = slow.recv_kind("cancel").await;
    assert_eq!(cancel["lease"], first["lease"]);
    let second = fast.recv_kind("work").await;
    assert_eq!(second["input"]["texts"], json!(["one", "two", "three"]));
    assert_ne!(second["lease"], first["lease"]);

    // The late result arrives first and is dropped; the live lease's result wins.
    slow.send(json!({"type":"done","lease":first["lease"],"output":vectors_for(&first, 9.0),"latency_ms":1.0}))
        .await;
    fast.send(json!({"type":"done","lease":second["lease"],"output":vectors_for(&second, 0.0),"latency_ms":1.0}))
        .await;
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 200, "{body}");
    for item in body["data"].as_array().unwrap() {
        assert_eq!(item["embedding"], json!([0.0, 1.0]));
        assert_eq!(item["provenance"]["provider"], "fast/embedding");
    }
    assert_eq!(
        hub.metric("fantom_hub_leases_total{outcome=\"expired\"}")
            .await,
        1.0
    );
    assert_eq!(hub.metric("fantom_hub_late_results_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_requeue_and_fatal_ones_fail_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--gate-no-canary", "flaky/embedding"],
        &[],
        "hub.log",
    );
    let mut agent = hub.raw_agent().await;
    agent
        .hello("flaky", json!([fake_provider("embedding", "embedding", 8)]))
        .await;
    agent
        .send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;

    let client = spawn_embed(&hub, json!(["a", "b"]));
    let work = agent.recv_kind("work").await;
    agent
        .send(json!({"type":"failed","lease":work["lease"],"class":"transient","message":"CUDA hiccup"}))
        .await;
    agent
        .send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    let again = agent.recv_kind("work").await;
    assert_eq!(
        again["input"]["texts"],
        json!(["a", "b"]),
        "requeued at the front"
    );
    agent
        .send(json!({"type":"done","lease":again["lease"],"output":vectors_for(&again, 0.5),"latency_ms":2.0}))
        .await;
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);

    // A wrong number of outputs is refused and the items are requeued, not half-answered.
    let client = spawn_embed(&hub, json!(["c", "d"]));
    agent
        .send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    let work = agent.recv_kind("work").await;
    agent
        .send(json!({"type":"done","lease":work["lease"],"output":{"embeddings":[[1.0,0.0]]},"latency_ms":1.0}))
        .await;
    let err = agent.recv_kind("error").await;
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("1 outputs for 2 items"),
        "{err}"
    );
    agent
        .send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    let work = agent.recv_kind("work").await;
    assert_eq!(work["input"]["texts"], json!(["c", "d"]));

    // Fatal on a batch: one item may be at fault, so each goes again on its own.
    agent
        .send(json!({"type":"failed","lease":work["lease"],"class":"fatal","message":"input 1 is longer than the model's 512 tokens"}))
        .await;
    agent
        .send(json!({"type":"pull","provider":"embedding","credits":2}))
        .await;
    // Two credits, one batch frame at a time: the other credit is kept for interactive work.
    let solo_c = agent.recv_kind("work").await;
    assert_eq!(solo_c["input"]["texts"], json!(["c"]), "solo, in order");
    agent
        .send(json!({"type":"done","lease":solo_c["lease"],"output":vectors_for(&solo_c, 0.5),"latency_ms":1.0}))
        .await;
    let solo_d = agent.recv_kind("work").await;
    assert_eq!(solo_d["input"]["texts"], json!(["d"]));
    // Fatal on one item: the client is told why, with the provider's message.
    agent
        .send(json!({"type":"failed","lease":solo_d["lease"],"class":"fatal","message":"input 1 is longer than the model's 512 tokens"}))
        .await;
    let (code, body) = client.await.unwrap();
    assert_eq!(code, 422, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("flaky/embedding") && message.contains("512 tokens"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after_and_loses_nothing_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(
        dir.path(),
        None,
        &[
            "--queue-capacity",
            "10",
            "--gate-no-canary",
            "one/embedding",
        ],
        &[],
        "hub.log",
    );
    let mut agent = hub.raw_agent().await;
    agent
        .hello("one", json!([fake_provider("embedding", "embedding", 1)]))
        .await;
    agent
        .send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;

    let texts: Vec<String> = (0..10).map(|i| format!("t{i}")).collect();
    let accepted = spawn_embed(&hub, json!(texts));
    let first = agent.recv_kind("work").await; // one item out, nine waiting
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model":"embedding","input":["x","y"]}),
        )
        .await;
    assert_eq!(code, 429, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("full"));
    let r = hub
        .http
        .post(hub.url("/v1/embeddings"))
        .json(&json!({"model":"embedding","input":["x","y"]}))
        .send()
        .await
        .unwrap();
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry));
    let (code, _) = hub
        .post(
            "/v1/embeddings",
            &json!({"model":"embedding","input": vec!["z"; 11]}),
        )
        .await;
    assert_eq!(code, 413, "larger than the queue can ever hold");

    // Everything accepted is served, in order.
    let mut work = first;
    for i in 0..10 {
        let text = work["input"]["texts"][0].as_str().unwrap().to_string();
        assert_eq!(text, format!("t{i}"));
        agent
            .send(json!({"type":"done","lease":work["lease"],"output":{"embeddings":[[i as f32, 1.0]]},"latency_ms":1.0}))
            .await;
        if i < 9 {
            agent
                .send(json!({"type":"pull","provider":"embedding","credits":1}))
                .await;
            work = agent.recv_kind("work").await;
        }
    }
    let (code, body) = accepted.await.unwrap();
    assert_eq!(code, 200, "{body}");
    for (i, item) in body["data"].as_array().unwrap().iter().enumerate() {
        assert_eq!(item["embedding"][0].as_f64().unwrap(), i as f64);
    }
}
