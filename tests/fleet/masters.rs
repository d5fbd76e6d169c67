//! One agent, two masters: each master sees, changes and spends only its own slot. Two
//! in-repo test masters ([`crate::fantom_master`]) on their own ports, one real agent process
//! with a token per master and an operator token, and the OpenRouter stand-in behind the chat
//! proxy. Also: an agent with no token at all opens no door, and a key pasted into any field of
//! a push (to the hub, or over a relay) is never echoed.

use std::path::Path;

use serde_json::{Value, json};

use crate::fantom_master::TestMaster;
use crate::relay::{AGENT_URL, TRACE, opts};
use crate::relay_commands::{AgentApi, call, encode_uri_component};
use crate::support::*;
use crate::upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

const KEY: &str = "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";
const MODEL_A: &str = "vendor/sandbox-a";
const MODEL_B: &str = "vendor/sandbox-b";
const CHAT: &str = "/api/v1/chat/completions";

async fn upstream() -> Upstream {
    let chat = |model: &str, slug: &str| Endpoint {
        model: model.into(),
        slug: slug.into(),
        quantization: "unknown".into(),
        kind: EndpointKind::Chat,
    };
    Upstream::start(UpstreamConfig {
        key: KEY.into(),
        endpoints: vec![chat(MODEL_A, "host-a"), chat(MODEL_B, "host-b")],
        ..Default::default()
    })
    .await
}

fn token_file(dir: &Path, name: &str) -> (String, std::path::PathBuf) {
    let token = format!("{name}-token-{}-0123456789", std::process::id());
    let path = dir.join(format!("{name}.token"));
    std::fs::write(&path, &token).unwrap();
    (token, path)
}

/// `[[fantom_master]]` for `master`, with its token file when given.
fn master_table(master: &TestMaster, token: Option<&Path>) -> String {
    let mut t = format!(
        "\n[[fantom_master]]\nserver_url = \"{}\"\nws_port = {}\n",
        master.http_url, master.ws_port
    );
    if let Some(path) = token {
        t.push_str(&format!("auth_token_file = \"{}\"\n", path.display()));
    }
    t
}

fn ask() -> Value {
    json!({"model": "caller/whatever", "messages": [{"role": "user", "content": "hello"}]})
}

/// The `serverUrl`s of a `masters` list.
fn urls(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("a list: {list}"))
        .iter()
        .map(|m| m["serverUrl"].as_str().unwrap().to_string())
        .collect()
}

/// Waits until `master` has received a `result` frame whose error contains `says`.
async fn refused_with(master: &TestMaster, says: &str) {
    master
        .wait_frame(&format!("an error result: {says}"), |f| {
            f.kind() == Some("result")
                && f.value.as_ref().unwrap()["error"]
                    .as_str()
                    .is_some_and(|e| e.contains(says))
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_master_sees_changes_and_spends_only_its_own_slot() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream().await;
    let (a, b) = (
        TestMaster::start(opts()).await,
        TestMaster::start(opts()).await,
    );
    let (op_token, op_file) = token_file(dir.path(), "operator");
    let (a_token, a_file) = token_file(dir.path(), "master-a");
    let (b_token, b_file) = token_file(dir.path(), "master-b");
    let body = format!(
        "agent_url = \"{AGENT_URL}\"\nhttp_token_file = \"{}\"\nopenrouter_url = \"{}\"\n{}{}{}",
        op_file.display(),
        up.base_url,
        master_table(&a, Some(&a_file)),
        master_table(&b, Some(&b_file)),
        minilm_models_toml()
    );
    let agent = start_relay_agent(dir.path(), "two-masters", &body, &[]);
    a.wait_registered(AGENT_URL).await;
    b.wait_registered(AGENT_URL).await;
    a.push_openrouter_with_key(
        KEY,
        json!({"allowedModels": {"rlm-sandbox": {"model": MODEL_A}}}),
    )
    .await;
    b.push_openrouter_with_key(
        KEY,
        json!({"allowedModels": {"rlm-sandbox": {"model": MODEL_B}}}),
    )
    .await;
    let (op, api_a, api_b, nobody) = (
        AgentApi::new(&agent, Some(&op_token)),
        AgentApi::new(&agent, Some(&a_token)),
        AgentApi::new(&agent, Some(&b_token)),
        AgentApi::new(&agent, None),
    );
    eventually("both slots hold a key", || async {
        let (_, body) = call(op.get("/api/masters")).await;
        let rows = body["masters"].as_array()?.clone();
        (rows.len() == 2 && rows.iter().all(|r| r["keyHeld"] == true)).then_some(())
    })
    .await;

    // Spending: A's token spends A's key whatever header it carries; a header naming B is 403.
    let chat = |api: &AgentApi, header: Option<&str>| {
        let r = api.post(CHAT, &ask());
        match header {
            Some(h) => r.header("X-FantomMCP-Master", h),
            None => r,
        }
    };
    let (code, body) = call(chat(&api_a, None)).await;
    assert_eq!(
        (code, body["model"].as_str()),
        (200, Some(MODEL_A)),
        "{body}"
    );
    let (code, body) = call(chat(&api_a, Some(&a.http_url))).await;
    assert_eq!(
        (code, body["model"].as_str()),
        (200, Some(MODEL_A)),
        "{body}"
    );
    let (code, body) = call(chat(&api_a, Some(&b.http_url))).await;
    assert_eq!(code, 403, "{body}");
    assert!(
        body["error"]["message"].is_string(),
        "Fantom's envelope: {body}"
    );
    let (code, body) = call(chat(&api_b, None)).await;
    assert_eq!(
        (code, body["model"].as_str()),
        (200, Some(MODEL_B)),
        "{body}"
    );
    let (code, body) = call(api_a.get("/api/v1/models")).await;
    assert_eq!(
        (code, body["data"][0]["id"].as_str()),
        (200, Some(MODEL_A)),
        "{body}"
    );
    // The operator names any slot; with two keyed slots it must name one.
    let (code, body) = call(chat(&op, Some(&b.http_url))).await;
    assert_eq!(
        (code, body["model"].as_str()),
        (200, Some(MODEL_B)),
        "{body}"
    );
    let (code, body) = call(chat(&op, None)).await;
    assert_eq!(code, 409, "{body}");

    // Reading: A sees its own slot, the operator both; A's heartbeats carry only A.
    for path in ["/api/status", "/api/masters"] {
        let (code, body) = call(api_a.get(path)).await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(urls(&body["masters"]), vec![a.http_url.clone()], "{path}");
        let (_, body) = call(op.get(path)).await;
        assert_eq!(urls(&body["masters"]).len(), 2, "{path}");
    }
    let beat = a
        .wait_frame("a heartbeat", |f| {
            f.registered && f.kind() == Some("heartbeat")
        })
        .await;
    assert_eq!(
        urls(&beat.value.unwrap()["statusData"]["masters"]),
        vec![a.http_url.clone()]
    );

    // Replacing, re-porting, removing: A's token cannot touch B's slot, nor add a master.
    let b_row = |body: &Value| {
        body["masters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["serverUrl"] == b.http_url.as_str())
            .cloned()
    };
    let replace =
        json!({"serverUrl": b.http_url, "wsPort": 1, "authToken": "a-takes-over-0123456789"});
    let (code, body) = call(api_a.post("/api/masters", &replace)).await;
    assert_eq!(code, 403, "{body}");
    let gone = format!("/api/masters/{}", encode_uri_component(&b.http_url));
    let (code, body) = call(api_a.req(reqwest::Method::DELETE, &gone)).await;
    assert_eq!(code, 403, "{body}");
    let new = json!({"serverUrl": "http://127.0.0.1:9", "wsPort": 9});
    let (code, body) = call(api_a.post("/api/masters", &new)).await;
    assert_eq!(code, 403, "{body}");
    let (code, _) = call(api_b.get("/api/status")).await;
    assert_eq!(code, 200, "B's token still works");
    let (_, body) = call(op.get("/api/masters")).await;
    assert_eq!(b_row(&body).unwrap()["wsPort"], b.ws_port, "{body}");
    // A's own slot is A's to change.
    let own = json!({"serverUrl": a.http_url, "wsPort": a.ws_port});
    let (code, body) = call(api_a.post("/api/masters", &own)).await;
    assert_eq!(
        (code, body["created"].as_bool()),
        (200, Some(false)),
        "{body}"
    );

    // Relay frames on A's socket act on A's slot only.
    a.push_config(json!({"revokeServerUrl": b.http_url, "openrouter": {"modeByRole": {"reranker": "local-only"}}}))
        .await;
    refused_with(&a, "revokeServerUrl may name only this master's own slot").await;
    a.send_identity(&b.http_url, 1).await;
    refused_with(&a, "master-identity may name only this master's own slot").await;
    let (_, body) = call(op.get("/api/masters")).await;
    let row = b_row(&body).unwrap();
    assert_eq!(
        (row["keyHeld"].as_bool(), row["wsPort"].as_u64()),
        (Some(true), Some(u64::from(b.ws_port))),
        "{row}"
    );
    let (code, body) = call(chat(&api_b, None)).await;
    assert_eq!(
        (code, body["model"].as_str()),
        (200, Some(MODEL_B)),
        "B's key is B's: {body}"
    );

    // The operator can: add a master and remove it.
    let (code, body) = call(op.post("/api/masters", &new)).await;
    assert_eq!(
        (code, body["created"].as_bool()),
        (200, Some(true)),
        "{body}"
    );
    let (code, body) = call(op.req(
        reqwest::Method::DELETE,
        &format!(
            "/api/masters/{}",
            encode_uri_component("http://127.0.0.1:9")
        ),
    ))
    .await;
    assert_eq!(
        (code, body["removed"].as_bool()),
        (200, Some(true)),
        "{body}"
    );

    // Nobody can do anything but /health and /metrics.
    let routes = [
        ("GET", "/api/status"),
        ("GET", "/api/masters"),
        ("POST", "/api/masters"),
        ("POST", "/stop"),
        ("POST", CHAT),
        ("POST", "/api/embed"),
    ];
    for (method, path) in routes {
        let m: reqwest::Method = method.parse().unwrap();
        let (code, body) = call(nobody.req(m, path).json(&json!({}))).await;
        assert_eq!(code, 401, "{method} {path}: {body}");
    }
    for path in ["/health", "/metrics"] {
        let (code, _) = call(nobody.get(path)).await;
        assert_eq!(code, 200, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_no_token_refuses_what_changes_state_or_spends_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let a = TestMaster::start(opts()).await;
    let body = format!(
        "agent_url = \"{AGENT_URL}\"\n{}{}",
        master_table(&a, None),
        minilm_models_toml()
    );
    let agent = start_relay_agent(dir.path(), "no-token", &body, &[]);
    a.wait_registered(AGENT_URL).await;
    let open = AgentApi::new(&agent, None);
    for (method, path, body) in [
        (
            "POST",
            "/api/masters",
            json!({"serverUrl": "http://127.0.0.1:9", "authToken": "mine-now-0123456789"}),
        ),
        (
            "DELETE",
            "/api/masters/http%3A%2F%2F127.0.0.1%3A9",
            json!({}),
        ),
        ("POST", "/stop", json!({"role": "embedding"})),
        ("POST", "/acquire", json!({"role": "embedding"})),
        ("POST", CHAT, ask()),
    ] {
        let m: reqwest::Method = method.parse().unwrap();
        let (code, answer) = call(open.req(m, path).json(&body)).await;
        assert_eq!(code, 403, "{method} {path}: {answer}");
        assert!(
            answer.to_string().contains("http_token_file"),
            "says how: {answer}"
        );
    }
    // Inference and reading stay open, as Ollama's do.
    let (code, body) = call(open.get("/api/status")).await;
    assert_eq!(code, 200, "{body}");
    let model = body["containers"]["embedding"]["config"]["model"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, body) =
        call(open.post("/api/embed", &json!({"model": model, "input": ["hi"]}))).await;
    assert_eq!(code, 200, "{body}");
    // Without a token nobody is anybody: no slot is shown.
    let (_, body) = call(open.get("/api/masters")).await;
    assert_eq!(urls(&body["masters"]), Vec::<String>::new(), "{body}");
    drop(agent);
    let log = std::fs::read_to_string(dir.path().join("no-token.log")).unwrap();
    assert!(log.contains("no bearer token is configured"), "{log}");
}

/// A push's `payload.openrouter` with the key typed into each field but `apiKey`.
fn pastes() -> Vec<Value> {
    vec![
        json!({"allowedModels": {"reranker": {"model": KEY}}}),
        json!({"allowedModels": {"embedding": {"model": "m/e", "provider": KEY, "dims": 384}}}),
        json!({"allowedModels": {"embedding": {"model": "m/e", "provider": "p/fp32", "quantization": KEY, "dims": 384}}}),
        json!({"allowedModels": {"reranker": {"model": "m/r", "note": KEY}}}),
        json!({"allowedModels": {"embedding": {"model": "m/e", "provider": "p/fp32", "dims": KEY}}}),
        json!({"modeByRole": {"reranker": KEY}}),
        json!({"modeByRole": {KEY: "local-only"}}),
        json!({"allowedModels": {KEY: {"model": "m/r"}}}),
        json!({"domain": KEY}),
    ]
}

/// Asserts `text` (named `what`) holds no trace of the key.
fn clean(what: &str, text: &str) {
    assert!(!text.contains(KEY), "{what} echoes the key: {text:.300}");
    assert!(!text.contains(&KEY[9..40]), "{what} echoes part of the key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_pasted_into_any_push_field_is_never_echoed() {
    let dir = tempfile::tempdir().unwrap();
    // Over the hub: the admin's answer, the agents' acks in status, the config, files, logs.
    let hub = HubProc::start(dir.path(), None, &[], &[TRACE], "hub.log");
    let _gpu = start_agent(dir.path(), &hub, "gpu", &[TRACE]);
    hub.wait_for_agent("gpu").await;
    let (code, body) = hub.push(json!({"openrouter": {"apiKey": KEY}})).await;
    assert_eq!(code, 200, "{body}");
    for (i, paste) in pastes().into_iter().enumerate() {
        let (code, body) = hub.push(json!({"openrouter": paste})).await;
        clean(
            &format!("push {i}: the hub's answer ({code})"),
            &body.to_string(),
        );
        eventually(&format!("push {i} acknowledged"), || async {
            let s = hub.status().await;
            let ack = &s["agents"][0]["last_config_ack"];
            (code != 200 || ack["id"] == body["id"]).then_some(())
        })
        .await;
        clean(
            &format!("push {i}: /admin/status"),
            &hub.status().await.to_string(),
        );
        clean(
            &format!("push {i}: /admin/config"),
            &hub.admin_get("/admin/config").await.to_string(),
        );
    }
    // Over a relay: the master's own frames, the agent's status and masters views.
    let (op_token, op_file) = token_file(dir.path(), "operator");
    let a = TestMaster::start(opts()).await;
    let body = format!(
        "agent_url = \"{AGENT_URL}\"\nhttp_token_file = \"{}\"\n{}{}",
        op_file.display(),
        master_table(&a, None),
        minilm_models_toml()
    );
    let relay_agent = start_relay_agent(dir.path(), "relay", &body, &[TRACE]);
    a.wait_registered(AGENT_URL).await;
    let op = AgentApi::new(&relay_agent, Some(&op_token));
    a.push_openrouter_with_key(
        KEY,
        json!({"allowedModels": {"reranker": {"model": "m/r"}}}),
    )
    .await;
    for paste in pastes() {
        let mut payload = json!({"openrouter": paste});
        payload["openrouter"]["apiKey"] = json!(KEY);
        a.push_config(payload).await;
    }
    let after = a.seq();
    a.wait_heartbeats_after(after, 1).await;
    for path in ["/api/status", "/api/masters"] {
        let (code, body) = call(op.get(path)).await;
        assert_eq!(code, 200);
        clean(path, &body.to_string());
    }
    for f in a.frames() {
        clean("a frame to the master", &f.text);
    }
    drop(relay_agent);
    let relay_log = dir.path().join("relay.log");
    let (hub_log, gpu_log) = (hub.proc.log.clone(), dir.path().join("gpu.log"));
    drop(hub);
    for log in [hub_log, gpu_log, relay_log] {
        clean(
            &log.display().to_string(),
            &std::fs::read_to_string(&log).unwrap(),
        );
    }
    let skip: [&Path; 0] = [];
    assert_eq!(
        files_containing(dir.path(), KEY, &skip),
        Vec::<String>::new()
    );
}
