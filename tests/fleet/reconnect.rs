//! Sessions: an agent comes back after a hub restart (and the hub's safe config survived it);
//! one socket per agent; a newer socket supersedes an older one and the older one's close
//! never tears the newer down.

use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_reconnects_after_a_hub_restart_and_the_safe_config_survives() {
    let dir = tempfile::tempdir().unwrap();
    let mut hub = HubProc::start(dir.path(), None, &[], &[], "hub-1.log");
    let addr = hub.proc.addr;
    let agent = start_agent(dir.path(), &hub, "gpu-r", &[]);
    hub.wait_for_agent("gpu-r").await;

    let (code, result) = hub
        .push(json!({"openrouter": {"apiKey": "sk-or-v1-restart-test",
            "allowedModels": {"code-embedding": {"model": "qwen/qwen3-embedding-4b", "provider": "deepinfra/bf16", "dims": 2560}},
            "modeByRole": {"reranker": "local"}}}))
        .await;
    assert_eq!(code, 200, "{result}");
    assert_eq!(result["sentTo"], json!(["gpu-r"]));

    // A hub stops cleanly on SIGTERM with an agent connected.
    let exit = hub.proc.terminate();
    assert!(exit.success(), "{exit:?}");
    let hub = HubProc::start(dir.path(), Some(addr), &[], &[], "hub-2.log");
    let back = hub.wait_for_agent("gpu-r").await;
    // Two local providers, and the cloud route the key and the pinned model made.
    let providers = back["providers"].as_array().unwrap();
    assert_eq!(providers.len(), 3, "{back}");
    let cloud: Vec<_> = providers
        .iter()
        .filter(|p| p["backend"] == "cloud")
        .collect();
    assert_eq!(cloud.len(), 1, "{back}");
    let id = cloud[0]["provider"].as_str().unwrap();
    assert!(id.starts_with("gpu-r/cloud:code-embedding:"), "{id}");
    assert_eq!(cloud[0]["upstream"], "deepinfra/bf16");

    let config = hub.admin_get("/admin/config").await;
    assert_eq!(config["keyPushed"], true);
    assert_eq!(
        config["openrouter"]["allowedModels"]["code-embedding"]["provider"],
        "deepinfra/bf16"
    );
    assert_eq!(config["openrouter"]["modeByRole"]["reranker"], "local");

    // Work flows through the reconnected session.
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": ["after the restart"]}),
        )
        .await;
    assert_eq!(code, 200, "{body}");

    // One socket at a time: the new hub saw exactly one, and the agent counts two sessions
    // in all (one per hub), never overlapping.
    let status = hub.status().await;
    assert_eq!(status["sockets"]["gpu-r"]["max_concurrent"], 1);
    assert_eq!(status["sockets"]["gpu-r"]["total"], 1);
    let health: serde_json::Value = reqwest::get(agent.url("/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["hub_connected"], true);
    assert_eq!(health["sessions"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_socket_supersedes_and_the_older_close_never_tears_it_down() {
    let dir = tempfile::tempdir().unwrap();
    // The agent answers a scripted frame exactly: no canary in it.
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--gate-no-canary", "twin/embedding"],
        &[],
        "hub.log",
    );
    let mut first = hub.raw_agent().await;
    let w1 = first
        .hello("twin", json!([fake_provider("embedding", "embedding", 8)]))
        .await;
    let mut second = hub.raw_agent().await;
    let w2 = second
        .hello("twin", json!([fake_provider("embedding", "embedding", 8)]))
        .await;
    assert_ne!(w1["session"], w2["session"]);

    // The hub closes the older socket…
    assert_eq!(first.recv_text().await, None, "superseded socket closed");
    // …and the newer session is the one that stays.
    let agent = hub.wait_for_agent("twin").await;
    assert_eq!(agent["session"], w2["session"]);

    // It still serves: a request flows to the second socket.
    second
        .send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    let http = hub.http.clone();
    let url = hub.url("/v1/embeddings");
    let client = tokio::spawn(async move {
        http.post(url)
            .json(&json!({"model":"embedding","input":["a"]}))
            .send()
            .await
            .unwrap()
            .status()
    });
    let work = second.recv_kind("work").await;
    second
        .send(json!({"type":"done","lease":work["lease"],"output":{"embeddings":[[0.6,0.8]]},"latency_ms":1.0}))
        .await;
    assert_eq!(client.await.unwrap(), 200);
    // Once the older socket's handler has ended, the newer session is still the one held.
    let status = eventually("the older socket released", || async {
        let s = hub.status().await;
        (s["sockets"]["twin"]["open"] == 1).then_some(s)
    })
    .await;
    assert_eq!(status["agents"][0]["session"], w2["session"]);
    second.close().await;
}
