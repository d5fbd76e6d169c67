//! Bad input at every front door gets a clear error and leaves the process (and, where the
//! stream is sound, the socket) up: wrong tokens, malformed frames, unknown types, frames
//! before hello, oversized frames, unknown roles, malformed request bodies, requests past the
//! hub's limits (413 naming the limit).

use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_required_for_agents_admin_and_configured_clients() {
    let dir = tempfile::tempdir().unwrap();
    let client_token = dir.path().join("client.token");
    std::fs::write(&client_token, "client-key-1\n").unwrap();
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--client-token-file", &client_token.display().to_string()],
        &[],
        "hub.log",
    );
    for token in [None, Some("wrong"), Some(hub.admin.as_str())] {
        let err = RawAgent::connect(&hub.ws_url(), token).await.err();
        match err {
            Some(tokio_tungstenite::tungstenite::Error::Http(r)) => assert_eq!(r.status(), 401),
            other => panic!("agent socket with {token:?} was not refused: {other:?}"),
        }
    }
    assert!(
        RawAgent::connect(&hub.ws_url(), Some(&hub.fleet))
            .await
            .is_ok()
    );

    let get = |path: &str, token: Option<&str>| {
        let mut r = hub.http.get(hub.url(path));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    for token in [None, Some(hub.fleet.as_str()), Some("nope")] {
        let r = get("/admin/status", token).await.unwrap();
        assert_eq!(r.status(), 401, "admin with {token:?}");
        assert_eq!(r.headers()["www-authenticate"], "Bearer");
    }
    assert_eq!(
        get("/admin/status", Some(&hub.admin))
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(get("/health", None).await.unwrap().status(), 200);

    let body = json!({"model":"embedding","input":"x"});
    let post = |token: Option<&str>| {
        let mut r = hub.http.post(hub.url("/v1/embeddings")).json(&body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    assert_eq!(post(None).await.unwrap().status(), 401);
    assert_eq!(post(Some("client-key-2")).await.unwrap().status(), 401);
    // The right key passes auth (and then hears that no provider serves the role yet).
    let r = post(Some("client-key-1")).await.unwrap();
    assert_eq!(r.status(), 503);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("no provider serves role 'embedding'"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_get_error_frames_and_the_socket_stays_open() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut a = hub.raw_agent().await;
    let expect_error = async |a: &mut RawAgent, frame: &str, needle: &str| {
        a.send_text(frame).await;
        let e = a.recv().await;
        assert_eq!(e["type"], "error", "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(message.contains(needle), "{frame:.60} → {message}");
    };
    expect_error(
        &mut a,
        "{\"type\":\"pull\",\"provider\":\"x\",\"credits\":1}",
        "first frame must be hello",
    )
    .await;
    expect_error(&mut a, "not json at all", "malformed frame").await;
    expect_error(
        &mut a,
        "{\"type\":\"launch_missiles\"}",
        "unknown frame type 'launch_missiles'",
    )
    .await;
    expect_error(&mut a, "{\"lease\":3}", "\"type\"").await;
    let big = format!(
        "{{\"type\":\"heartbeat\",\"providers\":[],\"pad\":\"{}\"}}",
        "x".repeat(1_200_000)
    );
    expect_error(&mut a, &big, "over the 1048576-byte limit").await;
    a.send_binary(vec![1, 2, 3]).await;
    assert!(
        a.recv().await["message"]
            .as_str()
            .unwrap()
            .contains("binary")
    );
    let bad_role = json!({"type":"hello","agent_id":"x","hostname":"h","version":"0","protocol_version":1,
        "providers":[fake_provider("p","embeddings",4)]});
    expect_error(&mut a, &bad_role.to_string(), "embeddings").await;

    // After all that, the same socket still says hello and works.
    a.hello(
        "survivor",
        json!([fake_provider("embedding", "embedding", 4)]),
    )
    .await;
    expect_error(
        &mut a,
        "{\"type\":\"pull\",\"provider\":\"nope\",\"credits\":1}",
        "unknown provider 'nope'",
    )
    .await;
    let again = json!({"type":"hello","agent_id":"survivor","hostname":"h","version":"0","protocol_version":1,"providers":[]});
    expect_error(&mut a, &again.to_string(), "already").await;
    hub.wait_for_agent("survivor").await;

    // A protocol version the hub does not speak: told why, then closed.
    let mut old = hub.raw_agent().await;
    old.send(json!({"type":"hello","agent_id":"old","hostname":"h","version":"0","protocol_version":99,"providers":[]}))
        .await;
    let e = old.recv().await;
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("protocol version 99"),
        "{e}"
    );
    assert_eq!(old.recv_text().await, None);

    // The hub is still up and the survivor still connected.
    hub.wait_for_agent("survivor").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_http_requests_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut a = hub.raw_agent().await;
    a.hello("a", json!([fake_provider("embedding", "embedding", 4)]))
        .await;
    let raw = hub
        .http
        .post(hub.url("/v1/embeddings"))
        .header("content-type", "application/json")
        .body("{\"model\": \"embedding\", \"input\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    let body: serde_json::Value = raw.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid request body")
    );

    let cases = [
        (
            json!({"model":"embeddings","input":"x"}),
            404,
            "unknown role 'embeddings'",
        ),
        (
            json!({"model":"reranker","input":"x"}),
            400,
            "use /v1/rerank",
        ),
        (json!({"model":"code-assistant","input":"x"}), 400, "chat"),
        (
            json!({"model":"embedding","input":[]}),
            400,
            "input is empty",
        ),
        (
            json!({"model":"embedding","input":["a",""]}),
            400,
            "input[1] is an empty string",
        ),
        (
            json!({"model":"embedding","input":"a","encoding_format":"hex"}),
            400,
            "encoding_format",
        ),
        (
            json!({"model":"embedding","input":"a","dimensions":0}),
            400,
            "dimensions",
        ),
        (
            json!({"model":"code-embedding","input":"a"}),
            503,
            "no provider serves role 'code-embedding'",
        ),
    ];
    for (body, status, needle) in cases {
        let (code, answer) = hub.post("/v1/embeddings", &body).await;
        assert_eq!(code, status, "{body} → {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body} → {message}");
    }
    let (code, answer) = hub
        .post("/v1/rerank", &json!({"query":"","documents":["a"]}))
        .await;
    assert_eq!(code, 400, "{answer}");
    let (code, _) = hub.post("/v1/nothing", &json!({})).await;
    assert_eq!(code, 404);

    // Bad config pushes: refused with the reason, nothing applied.
    let cases = [
        (
            json!({"openrouter":{"modeByRole":{"reranker":"local"}}}),
            "first push must carry",
        ),
        (json!({"openrouter":{}}), "changes nothing"),
        (json!({"openrouter":{"apiKey":"   "}}), "empty"),
        (json!({"openrouter":{"apiKey": 5}}), "invalid config push"),
    ];
    for (body, needle) in cases {
        let (code, answer) = hub.push(body.clone()).await;
        assert_eq!(code, 400, "{body} → {answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains(needle),
            "{answer}"
        );
    }
    let config = hub.admin_get("/admin/config").await;
    assert_eq!(config["keyPushed"], false);
    assert_eq!(
        config["openrouter"]["modeByRole"]["reranker"], "backup",
        "unchanged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_hubs_limits_get_413_naming_the_limit_and_reach_no_agent() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--max-inputs", "3", "--max-input-chars", "10"],
        &[],
        "hub.log",
    );
    let mut agent = hub.raw_agent().await;
    agent
        .hello(
            "scorer",
            json!([{"id":"reranker","role":"reranker","backend":"local","model":"m",
                    "revision":"r1","score_activation":"sigmoid",
                    "max_batch_items":8,"max_batch_tokens":1_000_000}]),
        )
        .await;
    let rerank = |docs: serde_json::Value| json!({"query": "q", "documents": docs});
    let (code, body) = hub
        .post("/v1/rerank", &rerank(json!(["a", "b", "c", "d"])))
        .await;
    assert_eq!(code, 413, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("max_inputs") && message.contains('3'),
        "{message}"
    );
    let (code, body) = hub
        .post("/v1/rerank", &rerank(json!(["short", "eleven chars"])))
        .await;
    assert_eq!(code, 413, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("input 1") && message.contains("max_input_chars"),
        "{message}"
    );
    assert_eq!(body["error"]["code"], "input_too_large");
    let status = hub.status().await;
    assert_eq!(status["settings"]["max_inputs"], 3);
    assert_eq!(status["held_bytes"], 0, "nothing refused is held");
    assert_eq!(
        status["roles"]["reranker"]["leases"], 0,
        "nothing reached the agent"
    );
}
