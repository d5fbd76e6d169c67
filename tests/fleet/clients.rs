//! The clients people already use, unchanged, against the fleet: the official `openai`,
//! `cohere`, `huggingface_hub`, `ollama` and `langchain-openai` Python packages against a real
//! `serve` (tests/clients/ecosystem.py, each vector and ranking checked against the one-shot
//! tools), and the `openai` SDK streaming a chat through the hub (chunk by chunk as the
//! upstream sends them, raising when the stream is cut). The SDKs live in a virtual
//! environment that `scripts/client-sdks.sh` makes from the pins in
//! tests/clients/requirements.txt (`.ci/run` runs it first; here it is a no-op then), at
//! `.cache/clients-venv` or `FANTOM_TEST_CLIENTS_VENV`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use crate::liveness::chat_fleet;
use crate::local_support::assemble_cross_encoder;
use crate::serve::cli_lines;
use crate::support::*;

/// The venv's python, made (or found up to date) by `scripts/client-sdks.sh` once per run.
/// It needs PyPI, which is reachable wherever the tests run; without it the test fails saying
/// what to do.
pub fn clients_python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            let venv = std::env::var_os("FANTOM_TEST_CLIENTS_VENV")
                .map_or_else(|| root.join(".cache/clients-venv"), PathBuf::from);
            let out = Command::new("bash")
                .arg(root.join("scripts/client-sdks.sh"))
                .arg(&venv)
                .output()
                .expect("bash runs");
            assert!(
                out.status.success(),
                "the client SDKs' venv could not be made: run `scripts/client-sdks.sh {}` (it needs PyPI): {}",
                venv.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            venv.join("bin/python")
        })
        .clone()
}

/// A new project's key (what an SDK that must send a key sends).
async fn project_key(hub: &HubProc, name: &str) -> String {
    let (code, made) = hub
        .post_admin("/admin/projects", &json!({"name": name}))
        .await;
    assert_eq!(code, 201, "{made}");
    made["key"].as_str().unwrap().to_string()
}

/// The SDK's script on a thread: its JSON lines arrive on the receiver as it prints them.
fn stream_with_sdk(base_url: &str, key: &str, text: &str) -> std::sync::mpsc::Receiver<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_stream.py");
    let mut child = Command::new(clients_python())
        .arg(script)
        .args([base_url, text])
        .env("FANTOM_API_KEY", key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let stdout = child.stdout.take().expect("its stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
        let _ = child.wait();
    });
    rx
}

fn next(rx: &std::sync::mpsc::Receiver<Value>) -> Value {
    rx.recv_timeout(PATIENCE)
        .expect("the SDK said something in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_streams_a_chat_and_raises_when_the_stream_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (up, hub, mut agent) = chat_fleet(dir.path(), "sdk").await;
    let base = hub.url("/v1");
    let key = project_key(&hub, "sdk-stream").await;

    // Chunk by chunk: the SDK has the first piece while the upstream holds the rest.
    up.state.set_stream_hold(true);
    let rx = stream_with_sdk(&base, &key, "one two three");
    assert_eq!(next(&rx)["piece"], "echo:");
    up.state.set_stream_hold(false);
    let mut pieces = vec!["echo:".to_string()];
    loop {
        let line = next(&rx);
        if line["done"] == true {
            break;
        }
        pieces.push(line["piece"].as_str().expect("a piece").to_string());
    }
    assert_eq!(pieces.concat(), "echo: one two three");

    // Cut: the agent dies after the first piece; the SDK raises with the hub's code.
    up.state.set_stream_hold(true);
    let rx = stream_with_sdk(&base, &key, "cut short");
    assert_eq!(next(&rx)["piece"], "echo:");
    agent.kill();
    let end = next(&rx);
    up.state.set_stream_hold(false);
    assert_eq!(end["code"], "stream_cut", "{end}");
}

/// Short texts of several kinds (prose, code, a question, non-ASCII).
fn ecosystem_texts() -> Vec<String> {
    [
        "fn main() { println!(\"hello\"); }",
        "How do I print a line in Rust?",
        "def add(a, b):\n    return a + b",
        "The quick brown fox jumps over the lazy dog.",
        "SELECT name FROM users WHERE id = 42;",
        "Les vecteurs d'un même espace partagent une table.",
        "println! writes a line to standard output",
        "bananas are yellow",
    ]
    .map(String::from)
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_clients_work_unchanged_against_serve() {
    let python = clients_python();
    let dir = tempfile::tempdir().unwrap();
    let minilm = minilm_dir().display().to_string();
    let cross = assemble_cross_encoder(dir.path()).display().to_string();
    let log = dir.path().join("serve.log");
    let hub = start_serve(dir.path(), &["--reranker-model-dir", &cross]);

    // Ready once every role it loads can serve (the gate founded the embedding spaces).
    let ready = eventually("serve is ready", || async {
        let (status, body) = hub.get("/ready").await;
        (status == 200).then_some(body)
    })
    .await;
    for role in ["embedding", "code-embedding", "reranker"] {
        assert_eq!(ready["roles"][role]["ready"], true, "{ready}");
        assert_eq!(ready["roles"][role]["gates"], true, "{ready}");
    }

    // What the clients' answers are checked against: the one-shot tools on the same files.
    let texts = ecosystem_texts();
    let vectors = |extra: &[&str]| -> Vec<Value> {
        let mut a = vec![
            "embed",
            "--model",
            "all-minilm-l6-v2",
            "--model-dir",
            &minilm,
        ];
        a.extend_from_slice(extra);
        cli_lines(&a, &texts)
            .into_iter()
            .map(|l| l["embedding"].clone())
            .collect()
    };
    let query = "How do I print a line in Rust?";
    let documents = texts[2..].to_vec();
    let scored = cli_lines(
        &["rerank", "--model-dir", &cross, "--query", query],
        &documents,
    );
    let scores: Vec<f64> = scored
        .iter()
        .map(|l| l["probability"].as_f64().expect("a probability"))
        .collect();
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]));
    let refs = json!({
        "texts": texts,
        "document_vectors": vectors(&[]),
        "query_vectors": vectors(&["--query"]),
        "dims": 384,
        "embedding_model": "all-minilm-l6-v2",
        "rerank": {"query": query, "documents": documents, "order": order, "scores": scores},
    });
    let refs_file = dir.path().join("refs.json");
    std::fs::write(&refs_file, refs.to_string()).unwrap();

    // Every client, through its public API only.
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/ecosystem.py");
    let base = hub.url("");
    // A project key that was rotated: 401 however the client sends it.
    let rotated = project_key(&hub, "sdk-clients").await;
    let (code, _) = hub
        .post_admin("/admin/projects/sdk-clients/rotate", &json!({}))
        .await;
    assert_eq!(code, 200);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .env("FANTOM_ROTATED_KEY", rotated)
            .arg(script)
            .args(["--base-url", &base, "--refs"])
            .arg(&refs_file)
            .stdin(Stdio::null())
            .output()
            .expect("python runs")
    })
    .await
    .unwrap();
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let failed: Vec<&Value> = lines.iter().filter(|l| l["ok"] == false).collect();
    assert!(
        out.status.success() && failed.is_empty(),
        "client checks failed: {failed:#?}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let passed = lines.iter().filter(|l| l["ok"] == true).count();
    assert!(passed >= 31, "only {passed} checks ran: {lines:#?}");

    // The models list names each role's model, and an embedding role's space and width.
    let (_, models) = hub.get("/v1/models").await;
    let embedding = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "embedding")
        .expect("the embedding role is listed");
    assert_eq!(embedding["x_fantom"]["model"], "all-minilm-l6-v2");
    assert_eq!(embedding["x_fantom"]["dims"], 384);
    assert!(embedding["x_fantom"]["space"].is_string(), "{embedding}");

    // TEI's /info for the reranker role.
    let (_, info) = hub.get("/info?model=reranker").await;
    assert!(info["model_type"]["reranker"].is_object(), "{info}");
    assert_eq!(info["max_input_length"], 512, "{info}");

    // The shapes older integrations send: TEI's `POST /` with an array and `parameters`
    // embeds (only a string with `parameters` is a classification); `:latest` and a model id
    // name a role.
    let (status, body) = hub
        .post("/", &json!({"inputs": [texts[0]], "parameters": {}}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.as_array().map(Vec::len), Some(1), "{body}");
    let (status, body) = hub
        .post(
            "/api/embed",
            &json!({"model": "embedding:latest", "input": texts[0]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = hub
        .post(
            "/v1/rerank",
            &json!({"model": "reranker", "query": query, "documents": documents}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"][0]["index"], order[0], "{body}");
    let r = hub.http.get(hub.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200, "GET / answers as /health, as TEI does");
    // TEI's /rerank (no client method reaches it): sorted best first, probabilities by
    // default, logits with raw_scores, the text with return_text.
    for raw in [false, true] {
        let (status, body) = hub
            .post(
                "/rerank",
                &json!({"query": query, "texts": documents, "raw_scores": raw, "return_text": true}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let results = body.as_array().unwrap();
        let got: Vec<u64> = results
            .iter()
            .map(|r| r["index"].as_u64().unwrap())
            .collect();
        let want: Vec<u64> = order.iter().map(|i| *i as u64).collect();
        assert_eq!(got, want, "{body}");
        let top = &results[0];
        let i = order[0];
        assert_eq!(top["text"], documents[i]);
        let want = if raw {
            scored[i]["score"].as_f64().unwrap()
        } else {
            scores[i]
        };
        let got = top["score"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-4, "raw={raw}: {got} vs {want}");
    }

    // The request id: the client's echoed, a key-shaped one replaced; timings in ms.
    let r = hub
        .http
        .post(hub.url("/embed"))
        .header("x-request-id", "trace-ok-1")
        .json(&json!({"inputs": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "trace-ok-1");
    let ms = |name: &str| -> u64 { r.headers()[name].to_str().unwrap().parse().unwrap() };
    let (queue, inference, total) = (
        ms("x-queue-time"),
        ms("x-inference-time"),
        ms("x-total-time"),
    );
    assert!(
        total >= queue && total >= inference,
        "{queue} {inference} {total}"
    );
    assert!(
        r.headers()["x-fantom-space"]
            .to_str()
            .unwrap()
            .contains("embedding")
    );
    let key_shaped = "sk-or-v1-0123456789abcdef0123456789abcdef";
    let r = hub
        .http
        .post(hub.url("/embed"))
        .header("x-request-id", key_shaped)
        .json(&json!({"inputs": "hello", "truncate": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let generated = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(generated.len(), 32, "{generated}");
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["error_type"], "Validation",
        "TEI's error shape: {body}"
    );
    // Every log line about a request names it; the key-shaped value never reaches the log.
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged
            .lines()
            .any(|l| l.contains(&generated) && l.contains("\"status\":400")),
        "no log line names request {generated}"
    );
    assert!(!logged.contains(key_shaped));

    // Per-route latency, queue time, batch sizes and tokens in /metrics.
    let route = hub
        .metric("fantom_http_request_duration_seconds_count{route=\"/v2/embed\",status=\"200\"}")
        .await;
    assert!(route >= 3.0, "{route}");
    for name in [
        "fantom_hub_queue_seconds_count{role=\"embedding\"}",
        "fantom_hub_batch_items_count{role=\"reranker\"}",
        "fantom_hub_request_tokens_count{role=\"embedding\"}",
    ] {
        assert!(hub.metric(name).await > 0.0, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_is_503_with_the_reason_until_a_role_can_serve() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--ready-roles", "embedding,reranker"],
        &[],
        "hub.log",
    );
    let (status, body) = hub.get("/ready").await;
    assert_eq!(status, 503);
    assert_eq!(body["status"], "not_ready");
    for role in ["embedding", "reranker"] {
        assert_eq!(body["roles"][role]["ready"], false, "{body}");
        assert_eq!(body["roles"][role]["code"], "no_provider", "{body}");
        assert_eq!(body["roles"][role]["gates"], true, "{body}");
    }
    // Liveness is apart: the process is up.
    let r = hub.http.get(hub.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // A hub with no role at all is not ready either, and says why.
    let bare_dir = dir.path().join("bare");
    std::fs::create_dir_all(&bare_dir).unwrap();
    let bare = HubProc::start(&bare_dir, None, &[], &[], "bare.log");
    let (status, body) = bare.get("/ready").await;
    assert_eq!(status, 503);
    assert!(
        body["message"].as_str().unwrap().contains("no role"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_sends_an_idempotency_key_and_gets_the_first_answer_again() {
    let dir = tempfile::tempdir().unwrap();
    let (up, hub, _agent) = chat_fleet(dir.path(), "sdk").await;
    let key = project_key(&hub, "sdk-keyed").await;
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_idempotent.py");
    let out = Command::new(clients_python())
        .arg(script)
        .args([&hub.url("/v1"), "7c1e9f1a-keyed-chat", "asked once"])
        .env("FANTOM_API_KEY", &key)
        .stdin(Stdio::null())
        .output()
        .expect("python3 runs");
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(
        lines.len(),
        3,
        "{lines:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(lines[0]["replayed"], false, "{lines:?}");
    assert_eq!(lines[1]["replayed"], true, "{lines:?}");
    assert_eq!(lines[0]["id"], lines[1]["id"], "the first answer, again");
    assert_eq!(lines[1]["content"], "echo: asked once");
    assert_eq!(lines[2]["status"], 422, "{lines:?}");
    assert_eq!(
        lines[2]["error_code"], "idempotency_key_reused",
        "{lines:?}"
    );
    assert_eq!(
        up.state.bodies_containing("asked once"),
        1,
        "one upstream call"
    );
}
