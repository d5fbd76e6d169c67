//! The agent as Fantom's GPU sidecar beyond the socket itself: what a master does with it once
//! it is registered. Real agent processes (no hub) and the test master
//! ([`crate::fantom_master`]); the OpenRouter stand-in ([`crate::upstream`]) answers cloud calls.
//!
//! * relay commands (§2.2): `virtual-embed` / `virtual-rerank` served from the slot's pinned
//!   cloud model, their refusals (no key, `local-only`, a model mismatch), upstream errors
//!   carrying the status, and `virtual-key-info` with numbers only;
//! * the agent's HTTP port as the master calls it (§3.1, §3.2): `/api/status` with containers,
//!   `masters[]`, `virtualInference` and `virtualContainers`; `/api/health`; `/api/masters`
//!   GET / POST / DELETE; `/start` `/stop` `/acquire` `/release`; the role endpoints (`/api/embed`,
//!   `/v1/embeddings`, `/v1/rerank`, `/v1/score`) and their errors;
//! * `[role_ports]` and the bearer token, which never leaks;
//! * the chat proxy (§3.3): the slot's key and sandbox model, the status codes Fantom expects;
//! * the HTTP-fallback heartbeat (§3.4) while the relay port cannot be reached.

use std::collections::BTreeMap;

use reqwest::{Method, RequestBuilder};
use serde_json::{Map, Value, json};

use crate::fantom_master::TestMaster;
use crate::relay::{AGENT_URL, TRACE, opts, relay_toml, start};
use crate::support::*;
use crate::upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

const EMBED_MODEL: &str = "qwen/qwen3-embedding-8b";
/// The pinned upstream of both embedding roles (the stand-in's endpoint slug).
const EMBED_PROVIDER: &str = "nebius";
const DIMS: usize = 64;
const RERANK_MODEL: &str = "qwen/qwen3-reranker-8b";
const RERANK_PROVIDER: &str = "fireworks";
const SANDBOX_MODEL: &str = "deepseek/deepseek-v4-flash";
const SANDBOX_PROVIDER: &str = "deepseek";
/// The roles the agent serves locally in these tests, as a master knows them (containers).
const LOCAL_ROLES: [&str; 3] = ["embedding", "code-embedding", "reranker"];
const MASTER_HEADER: &str = "X-FantomMCP-Master";
const LEGACY_MASTER_HEADER: &str = "X-SoundSuite-Master";
const CHAT_PATH: &str = "/api/v1/chat/completions";

fn key(tag: &str) -> String {
    format!("sk-or-v1-relay-cmd-{tag}-{}", std::process::id())
}

/// The OpenRouter stand-in with one endpoint per pushed model, accepting `key` only. Its `/key`
/// and `/credits` answers are set before any push, so whatever the agent reads (at a push or
/// on `virtual-key-info`) is known.
async fn upstream(key: &str) -> Upstream {
    let endpoint = |model: &str, slug: &str, kind| Endpoint {
        model: model.into(),
        slug: slug.into(),
        quantization: "unknown".into(),
        kind,
    };
    let up = Upstream::start(UpstreamConfig {
        key: key.into(),
        endpoints: vec![
            endpoint(
                EMBED_MODEL,
                EMBED_PROVIDER,
                EndpointKind::Embed { dims: DIMS },
            ),
            endpoint(RERANK_MODEL, RERANK_PROVIDER, EndpointKind::Rerank),
            endpoint(SANDBOX_MODEL, SANDBOX_PROVIDER, EndpointKind::Chat),
        ],
        ..Default::default()
    })
    .await;
    up.state.set_key_answer(json!({"data": {
        "label": "sk-or-v1-abc...xyz", "limit": 50, "limit_remaining": 40.5, "limit_reset": null,
        "usage": 9.5, "usage_daily": 0.5, "is_free_tier": false,
        "rate_limit": {"requests": 100, "interval": "10s"}}}));
    up.state.set_credits_answer(
        200,
        json!({"data": {"total_credits": 25, "total_usage": 3.5}}),
    );
    up
}

/// `allowedModels` entries of the pushes here.
fn embed_allowed() -> Value {
    json!({"model": EMBED_MODEL, "provider": EMBED_PROVIDER, "dims": DIMS})
}

fn rerank_allowed() -> Value {
    json!({"model": RERANK_MODEL, "provider": RERANK_PROVIDER})
}

/// A command payload from a JSON object.
fn payload(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("a command payload is an object: {other}"),
    }
}

/// A `virtual-embed` as Fantom sends it.
fn virtual_embed(role: &str, texts: &[&str], model: &str) -> Map<String, Value> {
    payload(
        json!({"role": role, "texts": texts, "localAvailable": false,
        "localErrorReason": "fantom fan-out: this provider is the cloud peer, not a local fallback",
        "model": model}),
    )
}

/// The `error` of a result frame; panics on a success.
fn refusal(result: &Value) -> &str {
    result["error"]
        .as_str()
        .unwrap_or_else(|| panic!("expected an error result: {result}"))
}

/// Asserts a result frame is a success (no `error`).
fn success(result: &Value) {
    assert!(result.get("error").is_none(), "{result}");
}

/// `(index, score)` of each entry of `list` (results or data), in order.
fn scored(list: &Value, score: &str) -> Vec<(u64, f64)> {
    list.as_array()
        .unwrap_or_else(|| panic!("a list: {list}"))
        .iter()
        .map(|r| {
            let index = r["index"].as_u64().unwrap_or_else(|| panic!("index: {r}"));
            let s = r[score].as_f64().unwrap_or_else(|| panic!("{score}: {r}"));
            (index, s)
        })
        .collect()
}

fn assert_descending(scores: &[(u64, f64)]) {
    for w in scores.windows(2) {
        assert!(w[0].1 >= w[1].1, "not sorted by score: {scores:?}");
    }
}

/// `encodeURIComponent`.
pub(crate) fn encode_uri_component(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' => (b as char).to_string(),
            b'-' | b'_' | b'.' | b'!' | b'~' | b'*' | b'\'' | b'(' | b')' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Sends `req`; the status and the body (JSON, else the text as a JSON string).
pub(crate) async fn call(req: RequestBuilder) -> (u16, Value) {
    let r = req.send().await.expect("the agent answers");
    let code = r.status().as_u16();
    let text = r.text().await.expect("a body");
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The agent's HTTP port (or a role port) as a master calls it: a bearer when `token` is set.
pub(crate) struct AgentApi {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl AgentApi {
    pub(crate) fn new(agent: &Proc, token: Option<&str>) -> AgentApi {
        AgentApi::at(agent.url(""), token)
    }

    pub(crate) fn at(base: String, token: Option<&str>) -> AgentApi {
        AgentApi {
            http: reqwest::Client::new(),
            base,
            token: token.map(str::to_string),
        }
    }

    pub(crate) fn req(&self, method: Method, path: &str) -> RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    pub(crate) fn get(&self, path: &str) -> RequestBuilder {
        self.req(Method::GET, path)
    }

    pub(crate) fn post(&self, path: &str, body: &Value) -> RequestBuilder {
        self.req(Method::POST, path).json(body)
    }

    /// A POST whose body is `text` as is, declared JSON.
    fn post_raw(&self, path: &str, text: &str) -> RequestBuilder {
        self.req(Method::POST, path)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(text.to_string())
    }

    /// `GET /api/status`, asserting 200.
    pub(crate) async fn status(&self) -> Value {
        let (code, body) = call(self.get("/api/status")).await;
        assert_eq!(code, 200, "{body}");
        body
    }

    /// The `/api/status` `masters[]` row of `server_url`.
    async fn master_row(&self, server_url: &str) -> Option<Value> {
        self.status().await["masters"]
            .as_array()?
            .iter()
            .find(|m| m["serverUrl"] == server_url)
            .cloned()
    }

    /// That row, once `pred` holds on it (bounded).
    async fn wait_row(&self, server_url: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let pred = &pred;
        eventually(what, || async {
            let row = self.master_row(server_url).await?;
            pred(&row).then_some(row)
        })
        .await
    }

    /// The slot's row once its push applied (`virtualInference.openrouter` configured).
    async fn wait_configured(&self, server_url: &str) -> Value {
        self.wait_row(server_url, &format!("{server_url}'s push applied"), |row| {
            row["virtualInference"]["openrouter"] == "configured"
        })
        .await
    }
}

/// A key, the OpenRouter stand-in that takes it, a scratch dir, and the agent's
/// `openrouter_url` line pointing at the stand-in.
/// The key, the stand-in, a directory, the agent's top-level TOML lines (the stand-in's URL, an
/// operator token file) and that operator token.
async fn with_upstream(name: &str) -> (String, Upstream, tempfile::TempDir, String, String) {
    let key = key(name);
    let up = upstream(&key).await;
    let dir = tempfile::tempdir().unwrap();
    let (token, line) = operator_token(dir.path());
    let top = format!("openrouter_url = \"{}\"\n{line}", up.base_url);
    (key, up, dir, top, token)
}

/// An operator token (the agent's `http_token`) written under `dir`: the token and its TOML
/// line. Routes that change the agent or spend a key need a token.
pub(crate) fn operator_token(dir: &std::path::Path) -> (String, String) {
    let token = format!("relay-operator-token-{}-0123456789", std::process::id());
    let file = dir.join("operator.token");
    std::fs::write(&file, &token).unwrap();
    (token, format!("http_token_file = \"{}\"", file.display()))
}

/// The `virtualContainers` rows of a `masters[]` row, by role.
fn virtual_rows(row: &Value) -> BTreeMap<String, Value> {
    row["virtualContainers"]
        .as_array()
        .unwrap_or_else(|| panic!("virtualContainers: {row}"))
        .iter()
        .map(|r| {
            (
                r["role"].as_str().unwrap_or_default().to_string(),
                r.clone(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_commands_serve_pinned_cloud_answers_and_refuse_mismatches() {
    let (key, up, dir, top, op) = with_upstream("virtual").await;
    let master = TestMaster::start(opts()).await;
    let agent = start(dir.path(), "relay-cmd-a", &master, &top, &[TRACE]);
    master.wait_registered(AGENT_URL).await;
    let api = AgentApi::new(&agent, Some(&op));
    let texts = [
        "fn add(a: i32, b: i32) -> i32 { a + b }",
        "struct Point { x: f32, y: f32 }",
        "let v = vec![1, 2, 3];",
    ];

    // Before any push: this slot has no key.
    let r = master
        .command(
            "virtual-embed",
            virtual_embed("code-embedding", &texts, EMBED_MODEL),
        )
        .await;
    assert!(refusal(&r).contains("no OpenRouter key"), "{r}");
    let r = master.command("virtual-key-info", Map::new()).await;
    refusal(&r);
    assert_eq!(up.state.requests(), 0);

    // Fantom's push: the key first; code-embedding and the reranker cloud-only, embedding
    // local-only.
    master
        .push_openrouter_with_key(
            &key,
            json!({
                "allowedModels": {
                    "embedding": embed_allowed(),
                    "code-embedding": embed_allowed(),
                    "reranker": rerank_allowed()
                },
                "modeByRole": {
                    "embedding": "local-only", "code-embedding": "cloud-only",
                    "reranker": "cloud-only"
                },
                "domain": "code"
            }),
        )
        .await;
    api.wait_configured(&master.http_url).await;

    // Served from the pinned upstream: one vector per text, each the table's width.
    let r = master
        .command(
            "virtual-embed",
            virtual_embed("code-embedding", &texts, EMBED_MODEL),
        )
        .await;
    success(&r);
    assert_eq!(r["source"], "openrouter", "{r}");
    assert_eq!(r["model"], EMBED_MODEL, "{r}");
    assert_eq!(r["dims"], DIMS, "{r}");
    assert!(r["totalTokens"].as_u64().is_some_and(|t| t > 0), "{r}");
    let vectors = r["embeddings"].as_array().expect("embeddings");
    assert_eq!(vectors.len(), texts.len());
    for v in vectors {
        assert_eq!(vector(v).len(), DIMS);
    }
    assert_eq!(up.state.served_by_slug(EMBED_PROVIDER), texts.len() as u64);
    let pins = up.state.provider_objects();
    assert!(!pins.is_empty(), "the call named no provider");
    for p in &pins {
        assert_eq!(p["only"], json!([EMBED_PROVIDER]), "{p}");
        assert_eq!(p["allow_fallbacks"], false, "{p}");
    }

    // Refusals reach no upstream: another model than the slot's, a local-only role.
    let calls = up.state.requests();
    let r = master
        .command(
            "virtual-embed",
            virtual_embed("code-embedding", &texts, "openai/text-embedding-3-large"),
        )
        .await;
    assert!(refusal(&r).starts_with("model mismatch"), "{r}");
    let r = master
        .command(
            "virtual-embed",
            virtual_embed("embedding", &texts, EMBED_MODEL),
        )
        .await;
    assert!(refusal(&r).contains("local-only"), "{r}");

    // Rerank: every document scored, best first; topN honoured; a model mismatch refused.
    let rerank = |top_n: usize, model: &str| {
        payload(json!({"role": "reranker", "query": "open sax file",
            "documents": ["a cake recipe with flour", "open a sax file in rust", "rust"],
            "topN": top_n, "localAvailable": false,
            "localErrorReason": "fantom: no healthy local reranker, or the local request failed",
            "model": model}))
    };
    let r = master
        .command("virtual-rerank", rerank(1, "qwen/another-reranker"))
        .await;
    assert!(refusal(&r).starts_with("model mismatch"), "{r}");
    assert_eq!(up.state.requests(), calls, "a refusal called the upstream");
    let r = master
        .command("virtual-rerank", rerank(3, RERANK_MODEL))
        .await;
    success(&r);
    assert_eq!(r["source"], "openrouter", "{r}");
    assert_eq!(r["model"], RERANK_MODEL, "{r}");
    let results = scored(&r["results"], "relevance_score");
    assert_eq!(results.len(), 3, "{r}");
    assert_descending(&results);
    assert_eq!(results[0].0, 1, "the matching document first: {r}");
    let mut indices: Vec<u64> = results.iter().map(|x| x.0).collect();
    indices.sort_unstable();
    assert_eq!(indices, vec![0, 1, 2]);
    let r = master
        .command("virtual-rerank", rerank(2, RERANK_MODEL))
        .await;
    success(&r);
    let top = scored(&r["results"], "relevance_score");
    assert_eq!(top.len(), 2, "{r}");
    assert_eq!(top[0].0, 1, "{r}");

    // The status counts what each role served.
    let row = api
        .master_row(&master.http_url)
        .await
        .expect("the slot's row");
    let rows = virtual_rows(&row);
    assert_eq!(rows["code-embedding"]["served"], 1, "{row}");
    assert!(rows["code-embedding"]["lastServedAt"].is_u64(), "{row}");
    assert_eq!(rows["reranker"]["served"], 2, "{row}");
    assert_eq!(rows["embedding"]["served"], 0, "{row}");

    // Key info: the account's numbers, never its label or the key.
    let r = master.command("virtual-key-info", Map::new()).await;
    success(&r);
    let result = r.as_object().unwrap();
    for (field, value) in result {
        if field != "type" && field != "id" {
            assert!(!value.is_string(), "{field} is text: {r}");
        }
    }
    for (field, want) in [
        ("total_credits", 25.0),
        ("total_usage", 3.5),
        ("limit", 50.0),
        ("usage", 9.5),
        ("limit_remaining", 40.5),
    ] {
        assert_eq!(r[field].as_f64(), Some(want), "{field}: {r}");
    }
    assert_eq!(r["is_free_tier"], false, "{r}");
    if let Some(rate) = r.get("rate_limit") {
        assert_eq!(rate["requests"].as_f64(), Some(100.0), "{r}");
    }
    let frame = master
        .frames()
        .into_iter()
        .find(|f| f.kind() == Some("result") && f.value.as_ref().unwrap()["id"] == r["id"])
        .expect("the key-info result frame");
    assert!(!frame.text.contains("label"), "{}", frame.text);
    assert!(!frame.text.contains("sk-or-v1"), "{}", frame.text);

    // An upstream 429 comes back as an error carrying the status.
    up.state.set_capacity(Some(0));
    let r = master
        .command(
            "virtual-embed",
            virtual_embed("code-embedding", &texts, EMBED_MODEL),
        )
        .await;
    assert!(refusal(&r).contains("429"), "{r}");
    up.state.set_capacity(None);
    let row = api
        .master_row(&master.http_url)
        .await
        .expect("the slot's row");
    let rows = virtual_rows(&row);
    let failed = &rows["code-embedding"];
    assert!(failed["failures"].as_u64().is_some_and(|n| n >= 1), "{row}");
    assert!(failed["lastError"].is_string(), "{row}");

    // The key: in no frame, no upstream body, no log line.
    for text in master.frames_text() {
        assert!(!text.contains(&key), "a frame carries the key: {text:.200}");
    }
    assert!(!up.state.bodies_seen_contain(&key));
    let log = agent.log.clone();
    drop(agent);
    let text = std::fs::read_to_string(&log).unwrap();
    for line in text.lines() {
        assert!(!line.contains(&key), "{}: {line:.300}", log.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_http_surface_answers_as_the_master_expects() {
    let (key, _up, dir, top, op) = with_upstream("surface").await;
    let master = TestMaster::start(opts()).await;
    let body = format!(
        "{}{}",
        relay_toml(&[(master.http_url.as_str(), master.ws_port)], &top),
        cross_encoder_models_toml(dir.path())
    );
    let agent = start_relay_agent(dir.path(), "relay-cmd-b", &body, &[]);
    master.wait_registered(AGENT_URL).await;
    let api = AgentApi::new(&agent, Some(&op));
    let port = agent.addr.port();

    // The model names the master routes by are the heartbeat's `containers[role].config.model`.
    let beat = master.wait_running(&LOCAL_ROLES).await;
    let beat = beat.value.unwrap();
    let model_of = |role: &str| {
        beat["statusData"]["containers"][role]["config"]["model"]
            .as_str()
            .unwrap_or_else(|| panic!("containers.{role}.config.model: {beat}"))
            .to_string()
    };
    let (embed_model, rerank_model) = (model_of("embedding"), model_of("reranker"));

    // GET /api/status: the local containers at the agent port, the slot unset before a push.
    let status = api.status().await;
    for role in LOCAL_ROLES {
        let c = &status["containers"][role];
        assert_eq!(c["name"], format!("ss-{role}"), "{c}");
        assert_eq!(c["status"], "running", "{c}");
        assert_eq!(c["config"]["port"], port, "{c}");
        assert_eq!(c["config"]["model"], model_of(role), "{c}");
    }
    assert_eq!(status["agentUrl"], AGENT_URL, "{status}");
    let row = api
        .master_row(&master.http_url)
        .await
        .expect("the slot's row");
    assert_eq!(row["wsPort"], master.ws_port, "{row}");
    assert_eq!(row["virtualInference"]["openrouter"], "unset", "{row}");
    assert_eq!(
        row["virtualContainers"].as_array().map_or(0, Vec::len),
        0,
        "{row}"
    );
    let (code, legacy) = call(api.get("/status")).await;
    assert_eq!(code, 200, "{legacy}");
    assert_eq!(legacy["containers"]["embedding"]["status"], "running");
    let (code, health) = call(api.get("/api/health")).await;
    assert_eq!(code, 200, "{health}");
    assert_eq!(health["ok"], true, "{health}");
    assert!(health.get("capabilities").is_none(), "{health}");
    let (code, health) = call(api.get("/health")).await;
    assert_eq!((code, health["ok"].clone()), (200, json!(true)), "{health}");

    // The push: virtual containers per allowed role, the mode pushed or local-only, the
    // sandbox model as role `rlm`.
    master
        .push_openrouter_with_key(
            &key,
            json!({
                "allowedModels": {
                    "embedding": embed_allowed(),
                    "code-embedding": embed_allowed(),
                    "reranker": rerank_allowed(),
                    "rlm-sandbox": {"model": SANDBOX_MODEL}
                },
                "modeByRole": {
                    "embedding": "local-first", "reranker": "cloud-only",
                    "rlm": "cloud-only", "rlm-sandbox": "cloud-only"
                },
                "domain": "code"
            }),
        )
        .await;
    let row = api.wait_configured(&master.http_url).await;
    assert_eq!(
        row["virtualInference"]["modeByRole"]["reranker"], "cloud-only",
        "{row}"
    );
    let rows = virtual_rows(&row);
    assert_eq!(
        rows.keys().map(String::as_str).collect::<Vec<_>>(),
        vec!["code-embedding", "embedding", "reranker", "rlm"],
        "{row}"
    );
    for (role, model, mode) in [
        ("embedding", EMBED_MODEL, "local-first"),
        ("code-embedding", EMBED_MODEL, "local-only"),
        ("reranker", RERANK_MODEL, "cloud-only"),
        ("rlm", SANDBOX_MODEL, "cloud-only"),
    ] {
        let r = &rows[role];
        assert_eq!(
            (r["model"].as_str(), r["mode"].as_str()),
            (Some(model), Some(mode)),
            "{r}"
        );
        assert_eq!(r["state"], "idle", "{r}");
        assert_eq!(r["served"], 0, "{r}");
        assert_eq!(r["failures"], 0, "{r}");
    }
    assert_eq!(rows["embedding"]["provider"], EMBED_PROVIDER);
    assert_eq!(rows["embedding"]["dims"], DIMS);
    assert_eq!(rows["reranker"]["provider"], RERANK_PROVIDER);

    // /api/masters: the slot; a second master added (it is dialled), then removed (its socket
    // closed with a close frame).
    let (code, list) = call(api.get("/api/masters")).await;
    assert_eq!(code, 200, "{list}");
    let slots = list["masters"].as_array().expect("masters");
    assert_eq!(slots.len(), 1, "{list}");
    assert_eq!(slots[0]["serverUrl"], master.http_url, "{list}");
    assert_eq!(slots[0]["wsPort"], master.ws_port, "{list}");
    assert_eq!(slots[0]["connected"], true, "{list}");
    assert_eq!(slots[0]["keyHeld"], true, "{list}");
    let second = TestMaster::start(opts()).await;
    let add = json!({"serverUrl": second.http_url, "wsPort": second.ws_port});
    let (code, added) = call(api.post("/api/masters", &add)).await;
    assert_eq!(code, 200, "{added}");
    assert_eq!(added["ok"], true, "{added}");
    assert_eq!(added["created"], true, "{added}");
    assert_eq!(added["serverUrl"], second.http_url, "{added}");
    assert_eq!(added["wsPort"], second.ws_port, "{added}");
    second.wait_registered(AGENT_URL).await;
    let (code, again) = call(api.post("/api/masters", &add)).await;
    assert_eq!(
        (code, again["created"].clone()),
        (200, json!(false)),
        "{again}"
    );
    let (_, list) = call(api.get("/api/masters")).await;
    assert_eq!(list["masters"].as_array().map(Vec::len), Some(2), "{list}");
    for bad in [
        json!({"serverUrl": "ftp://127.0.0.1:21", "wsPort": 3003}),
        json!({"wsPort": 3003}),
    ] {
        let (code, body) = call(api.post("/api/masters", &bad)).await;
        assert_eq!(code, 400, "{bad}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }
    let path = format!("/api/masters/{}", encode_uri_component(&second.http_url));
    let (code, gone) = call(api.req(Method::DELETE, &path)).await;
    assert_eq!(code, 200, "{gone}");
    assert_eq!(
        (gone["ok"].clone(), gone["removed"].clone()),
        (json!(true), json!(true)),
        "{gone}"
    );
    second
        .wait_until("the removed slot's socket closed", |m| {
            m.open_sockets(AGENT_URL) == 0
        })
        .await;
    let closed = second.closed();
    assert!(
        closed.iter().any(|c| c.why.starts_with("client closed")),
        "closed without a close frame: {closed:?}"
    );
    let (code, gone) = call(api.req(Method::DELETE, &path)).await;
    assert_eq!(
        (code, gone["removed"].clone()),
        (200, json!(false)),
        "{gone}"
    );
    let (_, list) = call(api.get("/api/masters")).await;
    assert_eq!(list["masters"].as_array().map(Vec::len), Some(1), "{list}");

    // Container actions over HTTP: stop, seen in a later heartbeat, the role refuses work;
    // start, it serves again.
    let rerank_body = |top_n: Option<usize>| {
        let mut b = json!({"model": rerank_model, "query": "how do I open a file in rust",
            "documents": ["A recipe for chocolate cake.",
                          "Use std::fs::File::open to open a file in Rust.",
                          "The weather is sunny today.",
                          "Rust files are read with std::fs."]});
        if let Some(n) = top_n {
            b["top_n"] = json!(n);
        }
        b
    };
    let mark = master.seq();
    let (code, stopped) = call(api.post("/stop", &json!({"role": "reranker"}))).await;
    assert_eq!(code, 200, "{stopped}");
    assert_eq!(stopped["ok"], true, "{stopped}");
    assert_eq!(stopped["role"], "reranker", "{stopped}");
    assert_eq!(stopped["model"], rerank_model, "{stopped}");
    assert_eq!(stopped["status"], "exited", "{stopped}");
    let beat = master
        .wait_frame("a heartbeat with the reranker exited", |f| {
            f.seq > mark
                && f.registered
                && f.kind() == Some("heartbeat")
                && f.value.as_ref().unwrap()["statusData"]["containers"]["reranker"]["status"]
                    == "exited"
        })
        .await;
    let reranker = &beat.value.as_ref().unwrap()["statusData"]["containers"]["reranker"];
    assert!(
        reranker["loadedModels"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "{reranker}"
    );
    let (code, body) = call(api.post("/v1/rerank", &rerank_body(None))).await;
    assert_eq!(code, 503, "{body}");
    assert!(body["error"].is_string(), "{body}");
    let (code, started) = call(api.post("/start", &json!({"role": "reranker"}))).await;
    assert_eq!(code, 200, "{started}");
    assert_eq!(started["status"], "running", "{started}");
    let (code, body) = call(api.post("/v1/rerank", &rerank_body(None))).await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = call(api.post("/stop", &json!({"role": "code-assistant"}))).await;
    assert_eq!(code, 404, "{body}");
    assert_eq!(body["error"], "no local container for role code-assistant");
    let other = json!({"role": "embedding", "model": "some/other-model"});
    let (code, body) = call(api.post("/acquire", &other)).await;
    assert_eq!(code, 409, "{body}");
    assert!(body["error"].is_string(), "{body}");
    for action in ["/acquire", "/release"] {
        let (code, body) = call(api.post(action, &json!({"role": "embedding"}))).await;
        assert_eq!(code, 200, "{action}: {body}");
        assert_eq!(body["status"], "running", "{action}: {body}");
    }
    let status = api.status().await;
    assert!(
        status["roles"]["embedding"]["lastRelease"].is_u64(),
        "{}",
        status["roles"]
    );

    // Role endpoints, routed by the heartbeat's model name. Ollama's /api/embed and OpenAI's
    // /v1/embeddings give the same vectors.
    let texts = [
        "The quick brown fox jumps over the lazy dog.",
        "fn main() { println!(\"hello\"); }",
    ];
    let (code, body) =
        call(api.post("/api/embed", &json!({"model": embed_model, "input": texts}))).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["model"], embed_model, "{body}");
    let ollama: Vec<Vec<f32>> = body["embeddings"]
        .as_array()
        .expect("embeddings")
        .iter()
        .map(vector)
        .collect();
    assert_eq!(ollama.len(), texts.len());
    for v in &ollama {
        assert_eq!(v.len(), 384);
        let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-3, "norm {norm}");
    }
    let (code, body) = call(api.post(
        "/v1/embeddings",
        &json!({"model": embed_model, "input": texts[0]}),
    ))
    .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["object"], "list", "{body}");
    assert_eq!(body["data"][0]["index"], 0, "{body}");
    let openai = vector(&body["data"][0]["embedding"]);
    assert!(cosine(&ollama[0], &openai) > 0.999);
    assert!(body["usage"]["prompt_tokens"].is_u64(), "{body}");
    let latest = json!({"model": format!("{embed_model}:latest"), "input": "one text"});
    let (code, body) = call(api.post("/api/embed", &latest)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        body["embeddings"].as_array().map(Vec::len),
        Some(1),
        "{body}"
    );
    let unknown = json!({"model": "nomic-embed-text", "input": ["x"]});
    let (code, body) = call(api.post("/api/embed", &unknown)).await;
    assert_eq!(code, 404, "{body}");
    assert_eq!(
        body["error"],
        "model \"nomic-embed-text\" not found, try pulling it first"
    );
    let (code, body) = call(api.post_raw("/api/embed", "{\"model\": ")).await;
    assert_eq!(code, 400, "{body}");
    assert!(body["error"].is_string(), "{body}");
    let empty = json!({"model": embed_model, "input": []});
    let (code, body) = call(api.post("/api/embed", &empty)).await;
    assert_eq!(code, 400, "{body}");

    // /v1/rerank sorted best first, top_n honoured; /v1/score aligned with text_2, the same
    // scores.
    let (code, body) = call(api.post("/v1/rerank", &rerank_body(None))).await;
    assert_eq!(code, 200, "{body}");
    let full = scored(&body["results"], "relevance_score");
    assert_eq!(full.len(), 4, "{body}");
    assert_descending(&full);
    let mut indices: Vec<u64> = full.iter().map(|x| x.0).collect();
    indices.sort_unstable();
    assert_eq!(indices, vec![0, 1, 2, 3]);
    let (code, body) = call(api.post("/v1/rerank", &rerank_body(Some(2)))).await;
    assert_eq!(code, 200, "{body}");
    let top = scored(&body["results"], "relevance_score");
    assert_eq!(
        top.iter().map(|x| x.0).collect::<Vec<_>>(),
        full[..2].iter().map(|x| x.0).collect::<Vec<_>>(),
        "{body}"
    );
    let rb = rerank_body(None);
    let score = json!({"model": rerank_model, "text_1": rb["query"], "text_2": rb["documents"]});
    let (code, body) = call(api.post("/v1/score", &score)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["object"], "list", "{body}");
    let scores = scored(&body["data"], "score");
    assert_eq!(scores.len(), 4, "{body}");
    for (i, (index, s)) in scores.iter().enumerate() {
        assert_eq!(*index, i as u64, "{body}");
        let ranked = full.iter().find(|x| x.0 == *index).unwrap().1;
        assert!(
            (s - ranked).abs() < 1e-3,
            "doc {i}: score {s}, rerank {ranked}"
        );
    }

    // The key shows nowhere on the agent's HTTP port; the removed master was not redialled.
    for path in AGENT_GET_ROUTES {
        let (_, body) = call(api.get(path)).await;
        assert!(!body.to_string().contains(&key), "{path} shows the key");
    }
    assert_eq!(second.registrations(AGENT_URL), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_ports_and_bearer_auth() {
    let dir = tempfile::tempdir().unwrap();
    let token = format!("relay-cmd-http-token-{}", std::process::id());
    let token_file = dir.path().join("http.token");
    std::fs::write(&token_file, &token).unwrap();
    let role_port = free_port();
    let master = TestMaster::start(opts()).await;
    let top = format!(
        "http_token_file = \"{}\"\n\n[role_ports]\nembedding = {role_port}\n",
        token_file.display()
    );
    let agent = start(dir.path(), "relay-cmd-c", &master, &top, &[TRACE]);
    master.wait_registered(AGENT_URL).await;

    // The master sends embedding work to the role's port, the rest to the agent port.
    let beat = master
        .wait_frame("a heartbeat with the embedding role running", |f| {
            f.registered
                && f.kind() == Some("heartbeat")
                && f.value.as_ref().unwrap()["statusData"]["containers"]["embedding"]["status"]
                    == "running"
        })
        .await;
    let containers = &beat.value.as_ref().unwrap()["statusData"]["containers"];
    assert_eq!(
        containers["embedding"]["config"]["port"], role_port,
        "{containers}"
    );
    assert_eq!(
        containers["code-embedding"]["config"]["port"],
        agent.addr.port(),
        "{containers}"
    );
    let model = containers["embedding"]["config"]["model"]
        .as_str()
        .expect("containers.embedding.config.model")
        .to_string();

    // The agent port: 401 without the bearer (or with another), 200 with it; /health and
    // /metrics open.
    let open = AgentApi::new(&agent, None);
    let wrong = AgentApi::new(&agent, Some("not-the-token"));
    let authed = AgentApi::new(&agent, Some(&token));
    for api in [&open, &wrong] {
        let (code, body) = call(api.get("/api/status")).await;
        assert_eq!(code, 401, "{body}");
        assert!(
            body["error"]
                .as_str()
                .is_some_and(|e| e.starts_with("unauthorized")),
            "{body}"
        );
    }
    let status = authed.status().await;
    assert_eq!(
        status["containers"]["embedding"]["config"]["port"],
        role_port
    );
    for path in ["/health", "/metrics"] {
        let (code, body) = call(open.get(path)).await;
        assert_eq!(code, 200, "{path}: {body}");
    }
    let one = json!({"model": model, "input": ["hello agent port"]});
    let (code, body) = call(open.post("/api/embed", &one)).await;
    assert_eq!(code, 401, "{body}");

    // The role port: the same bearer; no model means the role's model.
    let role_base = format!("http://127.0.0.1:{role_port}");
    let role = AgentApi::at(role_base.clone(), Some(&token));
    let role_open = AgentApi::at(role_base, None);
    let bare = json!({"input": ["hello role port"]});
    let (code, body) = call(role.post("/api/embed", &bare)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["model"], model, "{body}");
    let vectors = body["embeddings"].as_array().expect("embeddings");
    assert_eq!(vectors.len(), 1, "{body}");
    assert_eq!(vector(&vectors[0]).len(), 384);
    let (code, body) = call(role.post("/api/embed", &one)).await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = call(role_open.post("/api/embed", &bare)).await;
    assert_eq!(code, 401, "{body}");

    // The token: in no frame, no HTTP-fallback body, no file but its own, no log line.
    for text in master.frames_text().iter().chain(&master.http_texts()) {
        assert!(
            !text.contains(&token),
            "a frame carries the token: {text:.200}"
        );
    }
    let log = agent.log.clone();
    assert_eq!(
        files_containing(dir.path(), &token, &[log.as_path(), token_file.as_path()]),
        Vec::<String>::new()
    );
    drop(agent);
    let text = std::fs::read_to_string(&log).unwrap();
    for line in text.lines() {
        assert!(!line.contains(&token), "{}: {line:.300}", log.display());
    }
}

/// A chat proxy request naming its master with `headers`.
fn chat_to(api: &AgentApi, headers: &[(&str, &str)]) -> RequestBuilder {
    headers
        .iter()
        .fold(api.req(Method::POST, CHAT_PATH), |r, (k, v)| {
            r.header(*k, *v)
        })
}

/// A chat body as the RLM loop sends it, with the caller's own `model`.
fn ask(text: &str) -> Value {
    json!({"model": "caller/whatever", "stream": false, "max_tokens": 64, "temperature": 0,
        "messages": [{"role": "user", "content": text}]})
}

/// Asserts Fantom's error envelope, `{"error":{"message":…}}`.
fn envelope(body: &Value) {
    assert!(body["error"]["message"].is_string(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chat_proxy_pins_the_slots_model_and_answers_fantoms_status_codes() {
    let (key_a, key_b) = (key("chat-a"), key("chat-b"));
    // The stand-in takes A's key only: an answer proves A's key went out.
    let up = upstream(&key_a).await;
    let dir = tempfile::tempdir().unwrap();
    let a = TestMaster::start(opts()).await;
    let b = TestMaster::start(opts()).await;
    let (op, line) = operator_token(dir.path());
    let top = format!("openrouter_url = \"{}\"\n{line}", up.base_url);
    let body = relay_toml(
        &[
            (a.http_url.as_str(), a.ws_port),
            (b.http_url.as_str(), b.ws_port),
        ],
        &top,
    );
    let agent = start_relay_agent(dir.path(), "relay-cmd-d", &body, &[]);
    a.wait_registered(AGENT_URL).await;
    b.wait_registered(AGENT_URL).await;
    // The operator's token names any master's slot with the header.
    let api = AgentApi::new(&agent, Some(&op));
    let as_a = [(MASTER_HEADER, a.http_url.as_str())];

    // No push yet: A reads as "no config pushed".
    let (code, body) = call(chat_to(&api, &as_a).json(&ask("too early"))).await;
    assert_eq!(code, 404, "{body}");
    envelope(&body);

    // A pushes a key and a sandbox model; B a key and no sandbox model.
    let mark_a = a.seq();
    a.push_openrouter_with_key(
        &key_a,
        json!({"allowedModels": {"rlm-sandbox": {"model": SANDBOX_MODEL}},
               "modeByRole": {"rlm": "cloud-only", "rlm-sandbox": "cloud-only"},
               "domain": "code"}),
    )
    .await;
    b.push_openrouter_with_key(
        &key_b,
        json!({"allowedModels": {"embedding": embed_allowed()},
               "modeByRole": {"embedding": "cloud-only"}, "domain": "code"}),
    )
    .await;
    api.wait_configured(&a.http_url).await;
    api.wait_configured(&b.http_url).await;
    // A's heartbeats name the sandbox role (the chat host ranking reads it); B's do not.
    let has_sandbox = |f: &crate::fantom_master::Received| {
        f.value.as_ref().unwrap()["statusData"]["roles"]
            .get("rlm-sandbox")
            .is_some()
    };
    a.wait_frame("a heartbeat naming rlm-sandbox", |f| {
        f.seq > mark_a && f.registered && f.kind() == Some("heartbeat") && has_sandbox(f)
    })
    .await;
    let later = b.wait_heartbeats_after(b.seq(), 1).await;
    assert!(!has_sandbox(&later[0]), "{}", later[0].text);

    // Fantom's status codes: no header with two keyed slots 409, B without a sandbox 503,
    // bad JSON 400, a URL that does not byte-match 404.
    let (code, body) = call(chat_to(&api, &[]).json(&ask("who am I"))).await;
    assert_eq!(code, 409, "{body}");
    envelope(&body);
    let as_b = [(MASTER_HEADER, b.http_url.as_str())];
    let (code, body) = call(chat_to(&api, &as_b).json(&ask("no sandbox"))).await;
    assert_eq!(code, 503, "{body}");
    envelope(&body);
    let bad = chat_to(&api, &as_a)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body("{\"messages\": [");
    let (code, body) = call(bad).await;
    assert_eq!(code, 400, "{body}");
    envelope(&body);
    let slash = format!("{}/", a.http_url);
    let (code, body) =
        call(chat_to(&api, &[(MASTER_HEADER, slash.as_str())]).json(&ask("x"))).await;
    assert_eq!(code, 404, "{body}");
    envelope(&body);
    assert_eq!(
        up.state.requests(),
        0,
        "a refused call reached the upstream"
    );

    // A, as Fantom sends it: both headers; the slot's sandbox model answers, not the caller's.
    let both = [
        (MASTER_HEADER, a.http_url.as_str()),
        (LEGACY_MASTER_HEADER, a.http_url.as_str()),
        ("X-FantomMCP-Domain", "code"),
    ];
    let (code, answer) = call(chat_to(&api, &both).json(&ask("hello sandbox"))).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(
        answer["choices"][0]["message"]["content"], "echo: hello sandbox",
        "{answer}"
    );
    assert_eq!(answer["model"], SANDBOX_MODEL, "{answer}");
    assert_eq!(up.state.served_by_slug(SANDBOX_PROVIDER), 1);
    assert!(up.state.bodies_seen_contain(SANDBOX_MODEL));
    assert!(!up.state.bodies_seen_contain("caller/whatever"));
    // The legacy header alone, and a synthesis body with no model.
    let legacy = [(LEGACY_MASTER_HEADER, a.http_url.as_str())];
    let synthesis = json!({"messages": [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "synthesise"}], "max_tokens": 1024,
        "reasoning": {"enabled": false}});
    let (code, answer) = call(chat_to(&api, &legacy).json(&synthesis)).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(
        answer["choices"][0]["message"]["content"], "echo: synthesise",
        "{answer}"
    );

    // GET /api/v1/models: the slot's sandbox model.
    let models = as_a
        .iter()
        .fold(api.get("/api/v1/models"), |r, (k, v)| r.header(*k, *v));
    let (code, list) = call(models).await;
    assert_eq!(code, 200, "{list}");
    assert_eq!(list["object"], "list", "{list}");
    assert_eq!(list["data"][0]["id"], SANDBOX_MODEL, "{list}");
    let (code, body) = call(api.get("/api/v1/models")).await;
    assert_eq!(code, 409, "{body}");

    // `stream: true`: the upstream's chunks relayed as server-sent events as they come.
    let mut streamed = ask("stream it");
    streamed["stream"] = json!(true);
    let r = chat_to(&api, &as_a).json(&streamed).send().await.unwrap();
    let events = read_sse(r).await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(streamed_content(&events), "echo: stream it", "{events:?}");
    assert!(events.len() >= 5, "chunk by chunk: {events:?}");

    // A's `rlm` virtual container counts the three answers.
    let row = api.master_row(&a.http_url).await.expect("A's row");
    assert_eq!(virtual_rows(&row)["rlm"]["served"], 3, "{row}");

    // An upstream 429 is passed on with Fantom's envelope.
    up.state.set_capacity(Some(0));
    let (code, body) = call(chat_to(&api, &as_a).json(&ask("throttled"))).await;
    assert_eq!(code, 429, "{body}");
    envelope(&body);
    up.state.set_capacity(None);

    // The keys went out as a header only.
    assert!(!up.state.bodies_seen_contain(&key_a));
    assert!(!up.state.bodies_seen_contain(&key_b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_fallback_heartbeats_while_the_relay_port_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(opts()).await;
    // The slot's relay port has no listener; the master's HTTP port does.
    let dead = free_port();
    let body = relay_toml(&[(master.http_url.as_str(), dead)], "");
    let _agent = start_relay_agent(dir.path(), "relay-cmd-e", &body, &[]);

    // Two: the first after the first failed dial, then on the heartbeat period.
    let beats = master.wait_http_heartbeats(2).await;
    for beat in &beats {
        assert_eq!(beat["type"], "heartbeat", "{beat}");
        assert_eq!(beat["agentUrl"], AGENT_URL, "{beat}");
        assert!(beat["activeRequests"].is_u64(), "{beat}");
        let row = beat["statusData"]["masters"]
            .as_array()
            .unwrap_or_else(|| panic!("statusData.masters: {beat}"))
            .iter()
            .find(|m| m["serverUrl"] == master.http_url)
            .unwrap_or_else(|| panic!("no row for the slot: {beat}"));
        assert_eq!(row["connectionMode"], "http", "{beat}");
        assert_eq!(row["wsPort"], dead, "{beat}");
    }
    for text in master.http_texts() {
        assert!(text.starts_with(r#"{"type":"heartbeat""#), "{text:.200}");
    }
    // Nothing came over a relay socket.
    assert!(master.frames().is_empty(), "{}", master.summary());
    assert_eq!(master.open_sockets_on(master.ws_port), 0);
    assert!(master.closed().is_empty(), "{:?}", master.closed());
}
