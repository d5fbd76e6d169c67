//! Telemetry an operator scrapes, read by the Prometheus project's own client: `/metrics` (in
//! OpenMetrics, as Prometheus negotiates it; Prometheus' older text format otherwise) of a
//! hub, of an agent process, and of `serve`'s hub and in-process agent (two registries in one
//! process) is parsed by `prometheus_client`'s OpenMetrics parser (in the client SDKs' venv),
//! and the Grafana dashboard and alert rules in `monitoring/` are checked against what those
//! scrapes hold (`tests/clients/telemetry_check.py`): a panel or rule naming a series or label
//! that does not exist fails the test.
//!
//! Traces: a hub and an agent export to the in-repo OTLP receiver ([`crate::otlp_receiver`]); a
//! client's request with a W3C `traceparent` yields one trace holding the hub's `request` span
//! (the client's span its parent) and the agent's `work` span (its child, linked to it), with
//! the engine's `tokenize` and `batch` inside.

use std::path::PathBuf;
use std::process::Command;

use serde_json::{Value, json};

use crate::clients::clients_python;
use crate::otlp_receiver::OtlpReceiver;
use crate::support::*;

/// `/metrics` as Prometheus asks for it (OpenMetrics first).
async fn scrape(url: &str) -> String {
    let response = reqwest::Client::new()
        .get(url)
        .header(
            "accept",
            "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.2",
        )
        .send()
        .await
        .unwrap();
    let kind = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        kind.starts_with("application/openmetrics-text"),
        "{url}: {kind}"
    );
    response.text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_with_the_prometheus_client_and_the_dashboard_and_rules_name_only_real_series()
 {
    let dir = tempfile::tempdir().unwrap();
    // A hub with an agent process, and `serve` with its own agent's --http.
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let agent = start_agent(dir.path(), &hub, "gpu", &[]);
    let agent_http = format!("127.0.0.1:{}", free_port());
    let serve_dir = dir.path().join("serve");
    std::fs::create_dir_all(&serve_dir).unwrap();
    let serve = start_serve(&serve_dir, &["--http", &agent_http]);
    for h in [&hub, &serve] {
        eventually("an embedding served", || async {
            let (code, _) = h
                .post(
                    "/v1/embeddings",
                    &json!({"model": "embedding", "input": ["queue time", "and tokens"]}),
                )
                .await;
            (code == 200).then_some(())
        })
        .await;
    }
    let urls = [
        hub.url("/metrics"),
        agent.url("/metrics"),
        serve.url("/metrics"),
        format!("http://{agent_http}/metrics"),
    ];

    // One registry per instance: serve's hub and agent keep apart, each says which it is.
    let (serve_hub, serve_agent) = (scrape(&urls[2]).await, scrape(&urls[3]).await);
    assert!(serve_hub.contains("component=\"hub\""), "{serve_hub}");
    assert!(!serve_hub.contains("fantom_agent_"), "{serve_hub}");
    assert!(serve_agent.contains("component=\"agent\""), "{serve_agent}");
    assert!(!serve_agent.contains("fantom_hub_"), "{serve_agent}");
    for text in [
        &serve_hub,
        &serve_agent,
        &scrape(&urls[0]).await,
        &scrape(&urls[1]).await,
    ] {
        assert!(text.ends_with("# EOF\n"));
        assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(
                !name.ends_with("_ms"),
                "a unit other than a base unit: {line}"
            );
        }
    }
    assert!(serve_hub.contains("fantom_hub_queue_seconds_count{role=\"embedding\"} "));
    // A client that names no format (curl, TEI's contract) gets Prometheus' text format 0.0.4.
    let plain = reqwest::get(&urls[2]).await.unwrap();
    assert_eq!(
        plain.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let plain = plain.text().await.unwrap();
    assert!(
        !plain.contains("# EOF") && plain.contains("\nfantom_hub_requests_total{"),
        "{plain}"
    );
    assert!(
        serve_agent.contains("fantom_agent_latency_ewma_seconds{"),
        "{serve_agent}"
    );

    // The Prometheus client parses every scrape; the dashboard and rules name only what exists.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(clients_python())
        .arg(root.join("tests/clients/telemetry_check.py"))
        .arg("--dashboard")
        .arg(root.join("monitoring/grafana/fantom-sidecar.json"))
        .arg("--rules")
        .arg(root.join("monitoring/prometheus/alerts.yml"))
        .args(&urls)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap();
    println!("telemetry check: {summary}");
    assert!(summary["expressions"].as_u64().unwrap() >= 20, "{summary}");
    assert!(
        summary["families_scraped"].as_u64().unwrap() >= 40,
        "{summary}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_trace_holds_the_hubs_spans_and_the_agents_linked_to_them() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = OtlpReceiver::start().await;
    // The batch processor sends every 100 ms (its default is 5 s).
    let envs = [("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--otlp-endpoint", &receiver.url],
        &envs,
        "hub.log",
    );
    let agent_envs = [
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("FANTOM_OTLP_ENDPOINT", receiver.url.as_str()),
    ];
    let _agent = start_agent(dir.path(), &hub, "gpu", &agent_envs);
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{client_trace}-{client_span}-01");
    eventually("an embedding served under the client's trace", || async {
        let r = hub
            .http
            .post(hub.url("/v1/embeddings"))
            .header("traceparent", &traceparent)
            .json(&json!({"model": "embedding", "input": ["trace me", "and me"]}))
            .send()
            .await
            .unwrap();
        (r.status() == 200).then_some(())
    })
    .await;

    // The client may have tried more than once (admission before the fleet settled): the
    // request span that matters is the one whose work the agent did.
    let work = receiver
        .wait_for("the agent's work span in the client's trace", |spans| {
            spans
                .iter()
                .find(|s| {
                    s.service == "fantom-sidecar-agent"
                        && s.name == "work"
                        && s.trace_id == client_trace
                })
                .cloned()
        })
        .await;
    let request = receiver
        .wait_for("the hub's request span the work joined", |spans| {
            spans
                .iter()
                .find(|s| s.service == "fantom-sidecar-hub" && s.span_id == work.parent_span_id)
                .cloned()
        })
        .await;
    assert_eq!(request.name, "request");
    assert_eq!(request.trace_id, client_trace, "the client's trace");
    assert_eq!(
        request.parent_span_id, client_span,
        "the client's span is its parent"
    );
    assert!(
        work.links
            .contains(&(client_trace.to_string(), request.span_id.clone())),
        "the work span links to the request it served: {work:?}"
    );
    let inside = receiver
        .wait_for("the engine's spans inside the work span", |spans| {
            let names: std::collections::BTreeSet<&str> = spans
                .iter()
                .filter(|s| s.parent_span_id == work.span_id)
                .map(|s| s.name.as_str())
                .collect();
            (names.contains("tokenize") && names.contains("batch")).then_some(names.len())
        })
        .await;
    assert!(inside >= 2);
    // Nothing the agent did for this request left the trace: every span of the agent's that
    // links to the request is in it.
    for s in receiver.spans() {
        if s.links.iter().any(|(t, _)| t == client_trace) {
            assert_eq!(s.trace_id, client_trace, "{s:?}");
        }
    }
}
