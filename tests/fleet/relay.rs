//! The agent as a drop-in for Fantom's GPU sidecar: a real agent process (no hub) dials a test
//! master ([`crate::fantom_master`], written from the relay reference) and speaks the relay:
//! register first, heartbeats in the master's shape, results for commands, config pushes that
//! apply and never leak the key, one socket per master across reconnects, and the
//! `master-identity` correction of a slot's `wsPort`.

use std::path::Path;
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::fantom_master::{HEARTBEAT_PREFIX, TestMaster, TestMasterOpts};
use crate::support::*;
use crate::upstream::{Upstream, UpstreamConfig};

/// The identity every register and heartbeat carries (the master never calls it here).
pub(crate) const AGENT_URL: &str = "http://127.0.0.1:8098";
const ROLES: [&str; 2] = ["embedding", "code-embedding"];
pub(crate) const TRACE: (&str, &str) = (
    "RUST_LOG",
    "trace,tungstenite::protocol=trace,tokio_tungstenite=trace",
);

/// The reference's timings, but a ping every 2 s (a client is dropped after 3 missed pongs),
/// so the tests see the agent answer pings.
pub(crate) fn opts() -> TestMasterOpts {
    TestMasterOpts {
        ping_every: Duration::from_secs(2),
        ..Default::default()
    }
}

/// The agent's TOML body: `agent_url`, extra top-level lines, one `[[fantom_master]]` per
/// `(server_url, ws_port)`, and MiniLM for both embedding roles.
pub(crate) fn relay_toml(masters: &[(&str, u16)], top: &str) -> String {
    let mut toml = format!("agent_url = \"{AGENT_URL}\"\n{top}\n");
    for (server_url, ws_port) in masters {
        toml.push_str(&format!(
            "\n[[fantom_master]]\nserver_url = \"{server_url}\"\nws_port = {ws_port}\n"
        ));
    }
    toml.push_str(&minilm_models_toml());
    toml
}

pub(crate) fn start(
    dir: &Path,
    id: &str,
    master: &TestMaster,
    top: &str,
    envs: &[(&str, &str)],
) -> Proc {
    let body = relay_toml(&[(master.http_url.as_str(), master.ws_port)], top);
    start_relay_agent(dir, id, &body, envs)
}

/// `statusData.masters` of a heartbeat, as `(serverUrl, wsPort)` rows.
fn master_rows(heartbeat: &Value) -> Vec<(String, u64)> {
    heartbeat["statusData"]["masters"]
        .as_array()
        .unwrap_or_else(|| panic!("statusData.masters: {heartbeat}"))
        .iter()
        .map(|m| {
            (
                m["serverUrl"].as_str().unwrap_or_default().to_string(),
                m["wsPort"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_registers_and_heartbeats_in_the_masters_shape() {
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(opts()).await;
    let _agent = start(dir.path(), "relay-a", &master, "", &[]);

    let register = master.wait_registered(AGENT_URL).await;
    assert_eq!(register["agentUrl"], AGENT_URL, "{register}");
    assert!(
        register["hostname"].as_str().is_some_and(|h| !h.is_empty()),
        "{register}"
    );
    let containers: Vec<&str> = register["containers"]
        .as_array()
        .unwrap_or_else(|| panic!("register.containers: {register}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for role in ROLES {
        assert!(
            containers.contains(&format!("ss-{role}").as_str()),
            "{register}"
        );
    }
    // `register` was the first frame on its socket, and it was answered.
    let first = master.frames().into_iter().next().unwrap();
    assert_eq!(first.kind(), Some("register"), "{}", first.text);
    assert_eq!(master.registered_sent(), 1);

    // Heartbeats: `type` first, the status snapshot with every container's status and port.
    master.wait_running(&ROLES).await;
    let beats = master.wait_heartbeats(2).await;
    for beat in &beats {
        let status = &beat["statusData"];
        assert!(
            status["agent"]["version"]
                .as_str()
                .is_some_and(|v| !v.is_empty()),
            "agent.version: {beat}"
        );
        let containers = status["containers"]
            .as_object()
            .unwrap_or_else(|| panic!("statusData.containers: {beat}"));
        for role in ROLES {
            let c = containers
                .get(role)
                .unwrap_or_else(|| panic!("no {role} container: {beat}"));
            assert_eq!(c["name"], format!("ss-{role}"), "{c}");
        }
        for (role, c) in containers {
            assert!(c["status"].is_string(), "{role}: {c}");
            assert!(
                c["config"]["port"]
                    .as_u64()
                    .is_some_and(|p| (1..=65535).contains(&p)),
                "{role}: config.port must always be sent: {c}"
            );
        }
        // The slot this master is, as the master's wsPort correction reads it.
        assert_eq!(
            master_rows(beat),
            vec![(master.http_url.clone(), u64::from(master.ws_port))],
            "{beat}"
        );
    }
    for f in master.frames() {
        if f.kind() == Some("heartbeat") {
            assert!(f.text.starts_with(HEARTBEAT_PREFIX), "{:.200}", f.text);
        }
    }
    assert_eq!(master.prefix_violations(), 0);
    assert_eq!(master.errors_sent(), Vec::<String>::new());

    // WebSocket pings are answered (no JSON ping), and one socket carried it all.
    master
        .wait_until("the agent answered pings", |m| m.pongs() >= 2)
        .await;
    assert_eq!(master.ping_terminations(), 0);
    assert_eq!(master.registrations(AGENT_URL), 1);
    assert_eq!(master.max_concurrent_sockets(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_commands_get_an_error_result_echoing_the_id() {
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(opts()).await;
    let _agent = start(dir.path(), "relay-b", &master, "", &[]);
    master.wait_registered(AGENT_URL).await;

    let payload = |role: &str| {
        let mut p = Map::new();
        p.insert("role".into(), json!(role));
        p
    };
    // Two at once: each result carries its own command's id (the master matches on it).
    let (bogus, chat) = tokio::join!(
        master.command("bogus", payload("embedding")),
        master.command("virtual-chat", payload("code-assistant")),
    );
    assert_eq!(bogus["type"], "result", "{bogus}");
    assert!(
        bogus["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cmd-")),
        "{bogus}"
    );
    assert_eq!(bogus["error"], "Unknown action: bogus", "{bogus}");
    assert_eq!(chat["error"], "Unknown action: virtual-chat", "{chat}");
    assert_ne!(bogus["id"], chat["id"]);

    // The socket carries on.
    master.wait_heartbeats_after(master.seq(), 1).await;
    assert_eq!(master.registrations(AGENT_URL), 1);
    assert_eq!(master.errors_sent(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_push_applies_and_the_key_never_shows() {
    let key = format!("sk-or-v1-relay-test-{}", std::process::id());
    let upstream = Upstream::start(UpstreamConfig {
        key: key.clone(),
        ..Default::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(opts()).await;
    let top = format!("openrouter_url = \"{}\"", upstream.base_url);
    let agent = start(dir.path(), "relay-c", &master, &top, &[TRACE]);
    master.wait_registered(AGENT_URL).await;
    master.wait_heartbeats(1).await;

    // Fantom's push: `apiKey` first (as its frame has it), every role's mode, the sandbox
    // model under `rlm-sandbox`, `domain: code`.
    let rest = json!({
        "allowedModels": {
            "embedding": {"model": "qwen/qwen3-embedding-8b", "provider": "Nebius", "dims": 4096},
            "code-embedding": {"model": "qwen/qwen3-embedding-8b", "provider": "Nebius", "dims": 4096},
            "reranker": {"model": "qwen/qwen3-reranker-8b", "provider": "Fireworks"},
            "code-assistant": {"model": "poolside/laguna-s-2.1"},
            "rlm-sandbox": {"model": "deepseek/deepseek-v4-flash"}
        },
        "modeByRole": {
            "embedding": "local-first", "code-embedding": "cloud-only", "reranker": "cloud-only",
            "code-assistant": "cloud-only", "rlm": "local-only", "rlm-sandbox": "local-only"
        },
        "domain": "code"
    });
    let mark = master.seq();
    master.push_openrouter_with_key(&key, rest).await;

    // It applied: the agent says so in its log, or its /api/status shows this master's slot
    // configured.
    let http = reqwest::Client::new();
    let how = eventually("the config push applied", || async {
        let log = std::fs::read_to_string(&agent.log).unwrap_or_default();
        if log.lines().any(|l| l.contains("config push applied")) {
            return Some("log");
        }
        let status: Value = http
            .get(agent.url("/api/status"))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let row = status["masters"]
            .as_array()?
            .iter()
            .find(|m| m["serverUrl"] == master.http_url)?
            .clone();
        (row["virtualInference"]["openrouter"] == "configured").then_some("status")
    })
    .await;
    eprintln!("the push was seen applied through the agent's {how}");
    // No result for a config frame, and the socket carries on.
    let after = master.wait_heartbeats_after(mark, 2).await;
    assert!(after.iter().all(|f| f.text.starts_with(HEARTBEAT_PREFIX)));
    assert!(
        master.frames().iter().all(|f| f.kind() != Some("result")),
        "a config frame got a result"
    );
    assert_eq!(master.registrations(AGENT_URL), 1);

    // The key: in no frame the master received (nor their logged heads), no HTTP-fallback
    // body, no agent endpoint, no file, no log line.
    for text in master.frames_text().iter().chain(&master.http_texts()) {
        assert!(!text.contains(&key), "a frame carries the key: {text:.200}");
    }
    for path in AGENT_GET_ROUTES {
        if let Ok(r) = http.get(agent.url(path)).send().await {
            let body = r.text().await.unwrap_or_default();
            assert!(!body.contains(&key), "{path} shows the key: {body:.200}");
        }
    }
    let log = agent.log.clone();
    assert_eq!(
        files_containing(dir.path(), &key, &[log.as_path()]),
        Vec::<String>::new()
    );
    drop(agent);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines().any(|l| l.contains("\"TRACE\"")),
        "the agent was not logging at trace level"
    );
    for line in text.lines() {
        assert!(!line.contains(&key), "{}: {line:.300}", log.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_socket_reconnects_without_a_second_socket() {
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(opts()).await;
    let _agent = start(dir.path(), "relay-d", &master, "", &[]);
    let first = master.wait_registered(AGENT_URL).await;
    master.wait_heartbeats(1).await;

    // The master closes the socket (a close frame): the agent registers again, same identity,
    // register first on the new socket.
    master.close_all().await;
    let again = master.wait_registrations(AGENT_URL, 2).await;
    assert_eq!(again[1]["agentUrl"], first["agentUrl"]);
    assert_eq!(again[1]["hostname"], first["hostname"]);
    master.wait_heartbeats_after(master.seq(), 2).await;

    // The socket drops without a close frame (a dead peer): the same again.
    master.terminate_all().await;
    master.wait_registrations(AGENT_URL, 3).await;
    master.wait_heartbeats_after(master.seq(), 2).await;

    // Never two sockets at once, nothing superseded, no heartbeat before a register, and no
    // extra reconnects.
    assert_eq!(master.max_concurrent_sockets_for(AGENT_URL), 1);
    assert_eq!(master.open_sockets(AGENT_URL), 1);
    assert_eq!(master.supersedes(), 0);
    assert_eq!(master.errors_sent(), Vec::<String>::new());
    assert_eq!(master.registrations(AGENT_URL), 3);
    assert_eq!(master.prefix_violations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_identity_fixes_the_ws_port() {
    // The slot is configured with a stale wsPort; the master serves a relay there too, sees
    // its own HTTP port with that wsPort in the heartbeat's `masters`, and says which port is
    // right. The slot moves in place: same serverUrl, no new slot.
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(TestMasterOpts {
        old_relay: true,
        ..opts()
    })
    .await;
    let old = master.old_ws_port.unwrap();
    let body = relay_toml(&[(master.http_url.as_str(), old)], "");
    let _agent = start_relay_agent(dir.path(), "relay-e", &body, &[]);

    let stale = master
        .wait_frame("a register on the stale port", |f| {
            f.kind() == Some("register") && f.port == old
        })
        .await;
    let moved = master
        .wait_frame("a register on the relay port", |f| {
            f.kind() == Some("register") && f.port == master.ws_port
        })
        .await;
    assert_eq!(moved.value.as_ref().unwrap()["agentUrl"], AGENT_URL);
    let identities = master.identities_sent();
    assert_eq!(
        identities,
        vec![
            json!({"type":"master-identity","canonicalUrl":master.http_url,
                    "wsPort":master.ws_port})
        ]
    );

    // Heartbeats on the relay port show the one slot, corrected.
    let beat = master
        .wait_frame("a heartbeat on the relay port", |f| {
            f.registered && f.kind() == Some("heartbeat") && f.port == master.ws_port
        })
        .await;
    assert_eq!(
        master_rows(beat.value.as_ref().unwrap()),
        vec![(master.http_url.clone(), u64::from(master.ws_port))],
        "{}",
        beat.text
    );
    // The agent closed the stale socket itself (not the master's supersede sweep).
    master
        .wait_until("the stale socket closed", |m| m.open_sockets_on(old) == 0)
        .await;
    let closed = master.closed();
    let why = &closed
        .iter()
        .find(|c| c.conn == stale.conn)
        .expect("the stale socket's close")
        .why;
    assert_ne!(why, "superseded", "the agent left its stale socket open");
    assert_eq!(master.open_sockets(AGENT_URL), 1);
    assert_eq!(master.identities_sent().len(), 1);
    assert_eq!(master.prefix_violations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_identity_that_changes_nothing_keeps_the_socket_and_adds_no_slot() {
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(opts()).await;
    let _agent = start(dir.path(), "relay-f", &master, "", &[]);
    master.wait_registered(AGENT_URL).await;
    master.wait_heartbeats(1).await;

    // The port already in use, and a master the agent has no slot for.
    master.send_identity(&master.http_url, master.ws_port).await;
    master.send_identity("http://10.9.9.9:3848", 3003).await;
    // Two heartbeats: the second was certainly sent after both frames were read.
    let beats = master.wait_heartbeats_after(master.seq(), 2).await;
    for beat in &beats {
        assert_eq!(
            master_rows(beat.value.as_ref().unwrap()),
            vec![(master.http_url.clone(), u64::from(master.ws_port))],
            "{}",
            beat.text
        );
    }
    assert_eq!(master.registrations(AGENT_URL), 1);
    assert!(master.closed().is_empty(), "{:?}", master.closed());
}
