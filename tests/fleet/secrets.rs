//! The OpenRouter key is write-only. After a push at trace-level logging, it appears in no
//! log line (hub or agent), no admin/health/metrics response, no file under the hub's state
//! dir or the agent's dirs, and never in the first 120 characters of a frame. The fleet and
//! admin tokens stay out of the logs too.

use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_never_reaches_logs_endpoints_files_or_frame_heads() {
    let key = format!("sk-or-v1-leaktest-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    // Trace everywhere, and asked for by name where frames are logged: the cap still holds.
    let trace = [(
        "RUST_LOG",
        "trace,tungstenite::protocol=trace,tokio_tungstenite=trace",
    )];
    let hub = HubProc::start(dir.path(), None, &[], &trace, "hub.log");
    let agent_dir = dir.path().join("agent");
    std::fs::create_dir_all(&agent_dir).unwrap();
    let agent = start_agent(&agent_dir, &hub, "gpu-k", &trace);
    hub.wait_for_agent("gpu-k").await;
    // A protocol-level agent sees the config frame exactly as it goes over the wire.
    let mut spy = hub.raw_agent().await;
    spy.hello("spy", json!([])).await;

    let (code, answer) = hub
        .push(json!({"openrouter": {"apiKey": key, "domain": "code"}}))
        .await;
    assert_eq!(code, 200, "{answer}");
    assert!(!answer.to_string().contains(&key));

    let frame = spy.recv_text().await.unwrap();
    let at = frame.find(&key).expect("the key does travel to agents");
    assert!(at >= 120, "the key starts at character {at}");
    assert!(
        frame
            .chars()
            .take(120)
            .collect::<String>()
            .find("sk-or")
            .is_none()
    );

    // The agent applied it (its ack is in the hub's status).
    let status = eventually("the agent's config ack", || async {
        let s = hub.status().await;
        let agent = s["agents"]
            .as_array()?
            .iter()
            .find(|a| a["id"] == "gpu-k")?
            .clone();
        (agent["last_config_ack"]["applied"] == true).then_some(s)
    })
    .await;
    // A second push without the key (the normal case) merges.
    let (code, _) = hub
        .push(json!({"openrouter": {"modeByRole": {"reranker": "local"}}}))
        .await;
    assert_eq!(code, 200);

    let mut responses = vec![status.to_string()];
    for path in ["/admin/config", "/admin/status"] {
        responses.push(hub.admin_get(path).await.to_string());
    }
    for url in [
        hub.url("/health"),
        hub.url("/metrics"),
        agent.url("/health"),
        agent.url("/metrics"),
    ] {
        responses.push(reqwest::get(url).await.unwrap().text().await.unwrap());
    }
    let agent_health: serde_json::Value = reqwest::get(agent.url("/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        agent_health["cloud_key_held"], true,
        "the agent holds it, in memory"
    );
    for r in &responses {
        assert!(!r.contains(&key), "a response carries the key: {r:.200}");
    }

    // Files: the hub's state dir and the agent's dir hold no copy (logs are checked below).
    let (hub_log, agent_log) = (hub.proc.log.clone(), agent.log.clone());
    let skip = [hub_log.as_path(), agent_log.as_path()];
    assert_eq!(
        files_containing(&hub.state, &key, &skip),
        Vec::<String>::new()
    );
    assert_eq!(
        files_containing(dir.path(), &key, &skip),
        Vec::<String>::new()
    );

    // Logs at trace level: plenty of lines, none with the key.
    drop(agent);
    for log in [&hub_log, &agent_log] {
        let text = std::fs::read_to_string(log).unwrap();
        let trace_lines = text.lines().filter(|l| l.contains("\"TRACE\"")).count();
        assert!(
            trace_lines > 0,
            "{} was not logged at trace level",
            log.display()
        );
        for line in text.lines() {
            for secret in [&key, &hub.fleet, &hub.admin] {
                assert!(
                    !line.contains(secret.as_str()),
                    "{}: {line:.300}",
                    log.display()
                );
            }
        }
    }
}
