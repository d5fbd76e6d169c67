//! The hub's state store as an operator meets it: one hub per state dir, refused with the
//! holder's name, free again the moment the holder dies.

use crate::support::{HubProc, run_to_exit};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_hub_on_a_held_state_dir_exits_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = HubProc::start(dir.path(), None, &[], &[], "first.log");
    let state = first.state.display().to_string();
    let holder = format!("pid {}", first.proc.pid());
    let second = |command: &str, log: &str| {
        let args: Vec<String> = [command, "--listen", "127.0.0.1:0", "--state-dir", &state]
            .map(String::from)
            .to_vec();
        run_to_exit(&args, &dir.path().join(log))
    };
    for (command, log) in [("hub", "second.log"), ("serve", "serve.log")] {
        let (status, stderr) = second(command, log);
        assert_eq!(status.code(), Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains(&format!("the state dir {state} is held by another hub")),
            "{command}: {stderr}"
        );
        assert!(stderr.contains(&holder), "{command}: {stderr}");
    }
    // Refused before it touched anything: the first hub's tokens are as they were.
    let read = |name: &str| std::fs::read_to_string(first.state.join(name)).unwrap();
    assert_eq!(read("admin.token").trim(), first.admin);
    assert_eq!(read("fleet.token").trim(), first.fleet);
    let (code, _) = first.get("/health").await;
    assert_eq!(code, 200, "the holder serves on");

    // However the holder ends, the dir is free at once: no stale lock to clear.
    first.proc.kill();
    let next = HubProc::start(dir.path(), None, &[], &[], "next.log");
    assert_eq!(
        next.admin, first.admin,
        "the same state dir, the same tokens"
    );
    let (code, _) = next.get("/health").await;
    assert_eq!(code, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_field_names_itself_and_is_set_aside_only_when_the_operator_asks() {
    let dir = tempfile::tempdir().unwrap();
    // A state whose day usage holds a number JSON cannot carry (as an older hub wrote it:
    // `null`), beside a budget override that must survive.
    let first = HubProc::start(dir.path(), None, &[], &[], "first.log");
    let (code, body) = first
        .post_admin("/admin/budget", &serde_json::json!({"permits": 6}))
        .await;
    assert_eq!(code, 200, "{body}");
    let state_dir = first.state.clone();
    drop(first);
    let file = state_dir.join("hub-state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    state["projectUsage"] = serde_json::json!({"alpha": {"day": 1, "cloudTokens": 5, "cloudUsd": null, "callsWithoutCost": 0}});
    let broken = serde_json::to_string_pretty(&state).unwrap();
    std::fs::write(&file, &broken).unwrap();

    let state_arg = state_dir.display().to_string();
    let args = |more: &[&str]| -> Vec<String> {
        ["hub", "--listen", "127.0.0.1:0", "--state-dir", &state_arg]
            .iter()
            .chain(more)
            .map(|s| s.to_string())
            .collect()
    };
    let (status, log) = run_to_exit(&args(&[]), &dir.path().join("refused.log"));
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("projectUsage.alpha.cloudUsd"), "{log}");
    assert!(log.contains("--set-aside-unreadable-state"), "{log}");
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        broken,
        "nothing was written"
    );

    let hub = HubProc::start(
        dir.path(),
        None,
        &["--set-aside-unreadable-state"],
        &[],
        "recovered.log",
    );
    let status = hub.status().await;
    assert_eq!(status["budget"]["override_permits"], 6, "the rest loaded");
    let aside = &status["ha"]["set_aside"][0];
    assert_eq!(
        aside["field"], "projectUsage.alpha.cloudUsd",
        "{}",
        status["ha"]
    );
    let copy = aside["copy"].as_str().unwrap();
    assert_eq!(std::fs::read_to_string(copy).unwrap(), broken);
    let log = std::fs::read_to_string(&hub.proc.log).unwrap();
    assert!(log.contains("copied aside"), "never silently: {log}");
}

#[test]
fn serve_refuses_a_config_file_that_asks_for_tls_rather_than_serve_plain_http() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hub.toml");
    std::fs::write(
        &config,
        "tls_cert = \"/etc/ssl/hub.pem\"\ntls_key = \"/etc/ssl/hub.key\"\n",
    )
    .unwrap();
    let state = dir.path().join("state");
    let args: Vec<String> = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        &state.display().to_string(),
        "--config",
        &config.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    let (status, stderr) = run_to_exit(&args, &dir.path().join("serve.log"));
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("serves no TLS"), "{stderr}");
    assert!(stderr.contains("fantom-sidecar hub --config"), "{stderr}");
    assert!(
        !stderr.contains("\"listening\""),
        "never listened: {stderr}"
    );
}
