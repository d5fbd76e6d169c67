//! The operator's console as a server answers it: the page and its files under their
//! Content-Security-Policy, `no-store` on every admin answer, and the history the charts read
//! (bounded, newer-than filtering, samples that follow the fleet).

use std::time::Duration;

use serde_json::Value;

use crate::support::*;

const CSP: &str = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_under_its_policy_and_the_history_follows_the_hub() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    for (path, kind) in [
        ("/console", "text/html"),
        ("/console/console.js", "text/javascript"),
        ("/console/console.css", "text/css"),
    ] {
        let r = hub.http.get(hub.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let h = r.headers();
        assert_eq!(h["content-security-policy"], CSP, "{path}");
        assert!(
            h["content-type"].to_str().unwrap().starts_with(kind),
            "{path}"
        );
        assert_eq!(h["x-content-type-options"], "nosniff");
        let body = r.text().await.unwrap();
        if path == "/console" {
            assert!(body.contains("<script src=\"/console/console.js\" defer></script>"));
            assert!(!body.contains("<style") && !body.contains(" style="));
        }
    }

    // Every admin answer is no-store, a refusal too.
    let r = hub.http.get(hub.url("/admin/status")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["cache-control"], "no-store");
    let r = hub
        .http
        .get(hub.url("/admin/status"))
        .bearer_auth(&hub.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["cache-control"], "no-store");

    // The history: samples twice a second, bounded, filtered by `since_ms`.
    let history = |since: Option<u64>| {
        let (http, admin) = (hub.http.clone(), hub.admin.clone());
        let url = match since {
            Some(ms) => hub.url(&format!("/admin/history?since_ms={ms}")),
            None => hub.url("/admin/history"),
        };
        async move {
            let r = http.get(url).bearer_auth(admin).send().await.unwrap();
            assert_eq!(r.headers()["cache-control"], "no-store");
            r.json::<Value>().await.unwrap()
        }
    };
    let first = eventually("two samples", || async {
        let h = history(None).await;
        (h["samples"].as_array()?.len() >= 2).then_some(h)
    })
    .await;
    assert_eq!(first["every_ms"], 500);
    assert_eq!(first["keep_s"], 900);
    let samples = first["samples"].as_array().unwrap();
    let last = &samples[samples.len() - 1];
    assert_eq!(last["agents"], 0);
    assert_eq!(last["in_flight"], 0);
    for role in [
        "embedding",
        "code-embedding",
        "reranker",
        "code-assistant",
        "rlm-sandbox",
    ] {
        assert_eq!(last["queue_depth"][role], 0, "{last}");
    }
    let t = last["t_ms"].as_u64().unwrap();
    let newer = eventually("a newer sample", || async {
        let h = history(Some(t)).await;
        let s = h["samples"].as_array()?.clone();
        (!s.is_empty()).then_some(s)
    })
    .await;
    assert!(newer.iter().all(|s| s["t_ms"].as_u64().unwrap() > t));
    // An agent joins: the samples say so.
    let mut agent = hub.raw_agent().await;
    agent.hello("sampled", serde_json::json!([])).await;
    eventually("a sample with the agent", || async {
        let h = history(None).await;
        (h["samples"].as_array()?.last()?["agents"] == 1).then_some(())
    })
    .await;
    let r = hub
        .http
        .get(hub.url("/admin/history?since_ms=soon"))
        .bearer_auth(&hub.admin)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    agent.close().await;
}

/// Debian's chromium (`.ci/run` installs it), or `FANTOM_TEST_CHROMIUM`.
fn chromium() -> std::path::PathBuf {
    let path = std::env::var_os("FANTOM_TEST_CHROMIUM")
        .map_or_else(|| "/usr/bin/chromium".into(), std::path::PathBuf::from);
    assert!(
        path.exists(),
        "no chromium at {}: install Debian's (`apt-get install chromium`) or set FANTOM_TEST_CHROMIUM",
        path.display()
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_runs_the_fleet_from_the_console_in_a_real_browser() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let gpu_body = minilm_models_toml();
    let start_gpu = {
        let (dir, ws, fleet) = (
            dir.path().to_path_buf(),
            hub.ws_url(),
            hub.fleet_file.clone(),
        );
        move || start_agent_toml(&dir, &ws, &fleet, "gpu", &gpu_body, &[])
    };
    let mut gpu = start_gpu();
    hub.wait_for_current_space("embedding:all-minilm-l6-v2:384")
        .await;
    // A host whose name holds markup: the page shows it as text.
    let mut markup = hub.raw_agent().await;
    markup
        .send(serde_json::json!({"type": "hello", "agent_id": "markup",
            "hostname": "<b>markup</b>", "version": "0", "protocol_version": 1, "providers": []}))
        .await;
    assert_eq!(markup.recv().await["type"], "welcome");
    let keepalive = tokio::spawn(async move {
        loop {
            markup
                .send(serde_json::json!({"type": "heartbeat", "providers": []}))
                .await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });

    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root.join("target"), std::path::PathBuf::from);
    let screenshot = target.join("console.png");
    let mut args: Vec<std::ffi::OsString> = vec!["--base-url".into(), hub.url("").into()];
    args.extend(["--screenshot".into(), screenshot.clone().into_os_string()]);
    args.extend([
        "--admin-token-file".into(),
        hub.state.join("admin.token").into_os_string(),
    ]);
    // The script asks for the fleet to change; the test acts, then answers.
    let (lines, stderr) = drive_browser(args, move |step| match step {
        "kill-agent" => gpu.kill(),
        "start-agent" => gpu = start_gpu(),
        _ => {}
    })
    .await;
    keepalive.abort();
    assert_all_passed(&lines, &stderr, 16);
    assert!(screenshot.exists());
}

/// Runs `tests/clients/console_browser.py` with `args` (and the chromium), calling `act` with
/// each step it asks for before answering it; its JSON lines and its stderr.
async fn drive_browser(
    args: Vec<std::ffi::OsString>,
    mut act: impl FnMut(&str) + Send + 'static,
) -> (Vec<Value>, String) {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut child = std::process::Command::new(crate::clients::clients_python())
        .arg(root.join("tests/clients/console_browser.py"))
        .args(args)
        .arg("--chromium")
        .arg(chromium())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    tokio::task::spawn_blocking(move || {
        use std::io::{BufRead, Write};
        let mut input = child.stdin.take().unwrap();
        let output = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut lines: Vec<Value> = Vec::new();
        for line in output.lines().map_while(Result::ok) {
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if let Some(step) = v["step"].as_str() {
                act(step);
                let _ = writeln!(input, "done");
            }
            lines.push(v);
        }
        let mut stderr = String::new();
        let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
        let _ = child.wait();
        (lines, stderr)
    })
    .await
    .unwrap()
}

/// Every check passed, and there were `n`.
fn assert_all_passed(lines: &[Value], stderr: &str, n: u64) {
    let failed: Vec<&Value> = lines.iter().filter(|l| l["ok"] == false).collect();
    let summary = lines.iter().find(|l| l["summary"].is_object());
    assert!(
        failed.is_empty() && summary.is_some(),
        "failed: {failed:#?}\nall: {lines:#?}\nstderr: {stderr}"
    );
    assert_eq!(summary.unwrap()["summary"]["passed"], n, "{lines:#?}");
}

/// The console through a standby served over TLS, in a phone-sized window driven from the
/// keyboard; and the leader's page over plain http to a name that is not loopback, which
/// warns before the token is typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_works_through_a_standby_behind_tls_from_the_keyboard_in_a_narrow_window() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = crate::etcd_cluster::Cluster::start(dir.path()).await;
    let a = crate::ha::etcd_hub(dir.path(), "a", &cluster);
    crate::ha::leads(&a).await;
    let certified =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let (cert, key) = (dir.path().join("b.pem"), dir.path().join("b.key"));
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    let (cert_arg, key_arg) = (cert.display().to_string(), key.display().to_string());
    let b = crate::ha::etcd_hub_with(
        dir.path(),
        "b",
        &cluster,
        &["--tls-cert", &cert_arg, "--tls-key", &key_arg],
    );
    let b_url = format!("https://localhost:{}", b.proc.addr.port());
    let https = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(certified.cert.pem().as_bytes()).unwrap(),
        )
        .build()
        .unwrap();
    eventually("b stands by behind a over TLS", || async {
        let r = https.get(format!("{b_url}/health")).send().await.ok()?;
        let body: Value = r.json().await.ok()?;
        (body["status"] == "standby").then_some(())
    })
    .await;
    // An agent on the leader: the page through the standby shows it.
    let mut agent = a.raw_agent().await;
    agent
        .send(
            serde_json::json!({"type": "hello", "agent_id": "leaders-agent",
            "hostname": "gpu-host-7", "version": "0", "protocol_version": 1, "providers": []}),
        )
        .await;
    assert_eq!(agent.recv().await["type"], "welcome");
    let keepalive = tokio::spawn(async move {
        loop {
            agent
                .send(serde_json::json!({"type": "heartbeat", "providers": []}))
                .await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let args: Vec<std::ffi::OsString> = vec![
        "--scenario".into(),
        "standby".into(),
        "--base-url".into(),
        b_url.into(),
        "--plain-url".into(),
        format!("http://console.test:{}", a.proc.addr.port()).into(),
        "--loopback-url".into(),
        a.url("").into(),
        "--admin-token-file".into(),
        a.state.join("admin.token").into_os_string(),
    ];
    let (lines, stderr) = drive_browser(args, |_| {}).await;
    keepalive.abort();
    assert_all_passed(&lines, &stderr, 9);
}
