//! `wss://` and `https://`: the hub serves TLS from a certificate (rustls), an agent that
//! trusts its CA connects and serves; plain connections to the TLS port get nowhere; a hub
//! listening beyond loopback without TLS warns that tokens would cross in the clear.

use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_over_wss_with_a_trusted_ca() {
    let dir = tempfile::tempdir().unwrap();
    let certified =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let (cert, key) = (dir.path().join("hub.pem"), dir.path().join("hub.key"));
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    let (cert_arg, key_arg) = (cert.display().to_string(), key.display().to_string());
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--tls-cert", &cert_arg, "--tls-key", &key_arg],
        &[],
        "hub.log",
    );
    let addr = hub.proc.addr;
    let _agent = start_agent_with(
        dir.path(),
        &format!("wss://{addr}/v1/agent"),
        &hub.fleet_file,
        "gpu-tls",
        &format!("ca_file = \"{cert_arg}\""),
        &[],
    );
    let https = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(certified.cert.pem().as_bytes()).unwrap(),
        )
        .build()
        .unwrap();
    eventually("the agent connected over wss", || async {
        let s: serde_json::Value = https
            .get(format!("https://{addr}/admin/status"))
            .bearer_auth(&hub.admin)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        s["agents"]
            .as_array()?
            .iter()
            .any(|a| a["id"] == "gpu-tls")
            .then_some(())
    })
    .await;
    let r = https
        .post(format!("https://{addr}/v1/embeddings"))
        .json(&json!({"model": "embedding", "input": ["over TLS"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["data"][0]["provenance"]["agent"], "gpu-tls");

    // Plain HTTP and ws:// to the TLS port fail; an agent that does not trust the CA too.
    let plain = reqwest::get(format!("http://{addr}/health")).await;
    assert!(!plain.is_ok_and(|r| r.status().is_success()));
    assert!(
        RawAgent::connect(&format!("ws://{addr}/v1/agent"), Some(&hub.fleet))
            .await
            .is_err()
    );
    assert!(
        RawAgent::connect(&format!("wss://{addr}/v1/agent"), Some(&hub.fleet))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_beyond_loopback_without_tls_warns_that_tokens_would_cross_in_the_clear() {
    let dir = tempfile::tempdir().unwrap();
    let all = "0.0.0.0:0".parse().unwrap();
    let _open = HubProc::start(dir.path(), Some(all), &[], &[], "open.log");
    let log = std::fs::read_to_string(dir.path().join("open.log")).unwrap();
    assert!(
        log.contains("in the clear") && log.contains("--tls-cert"),
        "the warning says what crosses and how to fix it: {log}"
    );
    let quiet = tempfile::tempdir().unwrap();
    let _local = HubProc::start(quiet.path(), None, &[], &[], "local.log");
    let log = std::fs::read_to_string(quiet.path().join("local.log")).unwrap();
    assert!(
        !log.contains("in the clear"),
        "loopback is not the network: {log}"
    );
}
