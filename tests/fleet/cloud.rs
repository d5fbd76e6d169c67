//! Cloud routes end to end: a real hub and real agent processes whose cloud providers call the
//! OpenRouter stand-in ([`crate::upstream`]) over loopback HTTP. Routing policies, pinning,
//! chat, and the global budget under throttling.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{
    HubProc, Proc, eventually, fake_provider, start_agent_toml, streamed_content,
};
use crate::upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

pub const KEY: &str = "sk-or-v1-cloud-test-0123456789abcdef0123456789abcdef";
const EMBED_MODEL: &str = "sentence-transformers/all-minilm-l6-v2";
const EMBED_SLUG: &str = "deepinfra/fp32";
pub const RERANK_MODEL: &str = "cohere/rerank-v3.5";
pub const CHAT_MODEL: &str = "poolside/laguna-s-2.1";

pub fn endpoints() -> Vec<Endpoint> {
    let e = |model: &str, slug: &str, q: &str, kind| Endpoint {
        model: model.into(),
        slug: slug.into(),
        quantization: q.into(),
        kind,
    };
    vec![
        e(
            EMBED_MODEL,
            EMBED_SLUG,
            "fp32",
            EndpointKind::Embed { dims: 384 },
        ),
        e(
            EMBED_MODEL,
            "deepinfra/turbo",
            "fp8",
            EndpointKind::Embed { dims: 384 },
        ),
        e(RERANK_MODEL, "cohere", "unknown", EndpointKind::Rerank),
        e(CHAT_MODEL, "poolside", "unknown", EndpointKind::Chat),
    ]
}

pub async fn upstream(configure: impl FnOnce(&mut UpstreamConfig)) -> Upstream {
    let mut cfg = UpstreamConfig {
        key: KEY.into(),
        endpoints: endpoints(),
        ..Default::default()
    };
    configure(&mut cfg);
    Upstream::start(cfg).await
}

/// An agent with no local model, whose cloud routes call `upstream`.
pub fn cloud_agent(dir: &std::path::Path, hub: &HubProc, id: &str, upstream: &Upstream) -> Proc {
    let body = format!(
        "openrouter_url = \"{}\"\ncloud_pipeline_depth = 8",
        upstream.base_url
    );
    start_agent_toml(dir, &hub.ws_url(), &hub.fleet_file, id, &body, &[])
}

/// The push of these tests: the key, every route, and `modes`.
pub fn push_body(modes: Value) -> Value {
    json!({"openrouter": {
        "apiKey": KEY,
        "allowedModels": {
            "embedding": {"model": EMBED_MODEL, "provider": EMBED_SLUG, "quantization": "fp32", "dims": 384},
            "reranker": {"model": RERANK_MODEL},
            "code-assistant": {"model": CHAT_MODEL},
        },
        "modeByRole": modes,
    }})
}

/// Waits until `agent` announces `n` cloud providers.
pub async fn wait_for_cloud(hub: &HubProc, agent: &str, n: usize) -> Value {
    eventually(&format!("{agent} has {n} cloud providers"), || async {
        let a = hub.wait_for_agent(agent).await;
        let cloud = a["providers"]
            .as_array()?
            .iter()
            .filter(|p| p["backend"] == "cloud")
            .count();
        (cloud == n).then_some(a)
    })
    .await
}

async fn embed(hub: &HubProc, texts: Vec<String>) -> (u16, Value) {
    hub.post(
        "/v1/embeddings",
        &json!({"model": "embedding", "input": texts}),
    )
    .await
}

/// An embeddings request running on its own; its answer is the task's output.
fn spawn_embed(hub: &HubProc, n: usize, tag: &str) -> tokio::task::JoinHandle<(u16, Value)> {
    let (client, url) = (hub.http.clone(), hub.url("/v1/embeddings"));
    let input = texts(n, tag);
    tokio::spawn(async move {
        let r = client
            .post(url)
            .json(&json!({"model": "embedding", "input": input}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    })
}

fn texts(n: usize, tag: &str) -> Vec<String> {
    (0..n).map(|i| format!("{tag} text number {i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_policy_serves_every_op_through_two_agents_without_local_models() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _a = cloud_agent(dir.path(), &hub, "cloud-a", &up);
    let _b = cloud_agent(dir.path(), &hub, "cloud-b", &up);
    hub.wait_for_agent("cloud-a").await;
    hub.wait_for_agent("cloud-b").await;
    let (code, result) = hub
        .push(push_body(
            json!({"embedding": "cloud", "reranker": "cloud", "code-assistant": "cloud"}),
        ))
        .await;
    assert_eq!(code, 200, "{result}");
    wait_for_cloud(&hub, "cloud-a", 3).await;
    wait_for_cloud(&hub, "cloud-b", 3).await;

    // Embeddings: every vector from the pinned upstream, with its provenance.
    let (code, body) = embed(&hub, texts(150, "cloud")).await;
    assert_eq!(code, 200, "{body}");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 150);
    for d in data {
        assert_eq!(d["embedding"].as_array().unwrap().len(), 384);
        assert_eq!(d["provenance"]["backend"], "cloud");
        assert_eq!(d["provenance"]["model"], EMBED_MODEL);
        assert_eq!(d["provenance"]["upstream"], "deepinfra/fp32:fp32");
    }
    assert_eq!(up.state.served_by_slug(EMBED_SLUG), 150);
    assert_eq!(
        up.state.served_by_slug("deepinfra/turbo"),
        0,
        "the pin is exact"
    );
    // Every embeddings call pinned its endpoint with no fallbacks.
    let objects = up.state.provider_objects();
    assert!(!objects.is_empty());
    for o in &objects {
        assert_eq!(
            *o,
            json!({"only": [EMBED_SLUG], "allow_fallbacks": false, "require_parameters": true, "quantizations": ["fp32"]})
        );
    }

    // Rerank through the cloud.
    let (code, body) = hub
        .post(
            "/v1/rerank",
            &json!({"query": "rust tokio runtime", "documents": ["a tokio runtime in rust", "a cake recipe", "rust"]}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert_eq!(results[0]["index"], 0, "{body}");
    assert_eq!(results[0]["provenance"]["backend"], "cloud");

    // Chat, plain and streamed.
    let chat = json!({"model": "code-assistant", "messages": [{"role": "user", "content": "hello fleet"}]});
    let (code, body) = hub.post("/v1/chat/completions", &chat).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "echo: hello fleet"
    );
    assert_eq!(body["provenance"]["model"], CHAT_MODEL);
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let events = hub.post_events("/v1/chat/completions", &streamed).await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let content = streamed_content(&events);
    assert_eq!(content, "echo: hello fleet", "{events:?}");
    assert!(
        chunks.len() >= 4,
        "the upstream's chunks, one by one: {events:?}"
    );
    assert_eq!(
        chunks.last().unwrap()["provenance"]["model"],
        CHAT_MODEL,
        "the last chunk names who served it"
    );
    // A chat role under `local` with no local chat model has no provider.
    let (code, body) = hub
        .post(
            "/v1/chat/completions",
            &json!({"model": "rlm-sandbox", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(code, 503, "{body}");

    // The key went out as a header only, and the budget learned the account (funded, the
    // deprecated rate limit ignored): 16 permits from credits.
    assert!(!up.state.bodies_seen_contain(KEY));
    let budget = eventually("the account's limits were discovered", || async {
        let s = hub.status().await;
        (s["budget"]["ceiling_source"] == "credits").then(|| s["budget"].clone())
    })
    .await;
    assert_eq!(budget["ceiling"], 16, "{budget}");
    assert_eq!(budget["rpm"], Value::Null, "{budget}");
    assert!(budget["granted"].as_u64().unwrap() >= 5, "{budget}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpinned_embedding_route_is_refused_and_serves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _a = cloud_agent(dir.path(), &hub, "cloud-a", &up);
    hub.wait_for_agent("cloud-a").await;
    let (code, result) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"embedding": {"model": EMBED_MODEL, "dims": 384},
                              "reranker": {"model": RERANK_MODEL}},
            "modeByRole": {"embedding": "cloud", "reranker": "cloud"}}}))
        .await;
    assert_eq!(code, 200, "{result}");
    let outcome = &result["roles"]["embedding"]["model"];
    assert_eq!(outcome["status"], "refused", "{result}");
    assert!(
        outcome["reason"].as_str().unwrap().contains("pin"),
        "{result}"
    );
    // The reranker route exists; no embedding route does, anywhere.
    let agent = wait_for_cloud(&hub, "cloud-a", 1).await;
    assert_eq!(agent["providers"][0]["role"], "reranker", "{agent}");
    let (code, body) = embed(&hub, texts(3, "unpinned")).await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no provider"),
        "{body}"
    );
    assert_eq!(up.state.served_by_slug(EMBED_SLUG), 0);
    let config = hub.admin_get("/admin/config").await;
    assert!(
        config["openrouter"]["allowedModels"]
            .get("embedding")
            .is_none(),
        "{config}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_uses_the_cloud_only_after_a_local_failure_or_without_a_healthy_local() {
    let dir = tempfile::tempdir().unwrap();
    // The fake local provider and the upstream agree on every probe (one unit vector), so
    // both pass the gate.
    let e0: crate::upstream::Embedder = std::sync::Arc::new(|texts: &[String]| {
        let mut unit = vec![0.0f32; 384];
        unit[0] = 1.0;
        vec![unit; texts.len()]
    });
    let up = upstream(|c| c.embedder = Some(e0)).await;
    // The scripted local agent's frames carry no canary (the cloud's do).
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--gate-no-canary", "gpu/embedding"],
        &[],
        "hub.log",
    );
    let _cloud = cloud_agent(dir.path(), &hub, "cloud-a", &up);
    hub.wait_for_agent("cloud-a").await;
    let (code, result) = hub.push(push_body(json!({"embedding": "backup"}))).await;
    assert_eq!(code, 200, "{result}");
    // Embedding, and the reranker and chat routes (both `backup` by default).
    wait_for_cloud(&hub, "cloud-a", 3).await;
    let mut local = hub.raw_agent().await;
    local.probe_dims = 384;
    let mut provider = fake_provider("embedding", "embedding", 64);
    provider["dims"] = json!(384);
    local.hello("gpu", json!([provider])).await;
    // The local provider is the reference: it fingerprints the space, the cloud is then
    // judged against it (the upstream answers the same unit vectors).
    local.answer_one_probe().await;
    crate::gate::verdict(&hub, "gpu/", &["pass"]).await;
    crate::gate::verdict(&hub, "cloud-a/", &["pass"]).await;
    local
        .send(json!({"type":"pull","provider":"embedding","credits":1}))
        .await;
    hub.wait_for_agent("gpu").await;

    // A healthy local provider takes the work; the cloud does not.
    let send = |n: usize, tag: &'static str| spawn_embed(&hub, n, tag);
    let first = send(3, "backup");
    let work = local.recv_kind("work").await;
    assert_eq!(work["input"]["texts"].as_array().unwrap().len(), 3);
    assert_eq!(
        up.state.requests(),
        0,
        "backup: no cloud while a local provider is healthy"
    );

    // It fails there: the same items may now go to the cloud (the local one is still healthy).
    local
        .send(json!({"type":"failed","lease":work["lease"],"class":"transient","message":"CUDA out of memory"}))
        .await;
    let (code, body) = first.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["provenance"]["backend"] == "cloud")
    );
    assert_eq!(up.state.served_by_slug(EMBED_SLUG), 3);

    // New work waits for the healthy local provider (it has no credit now), not the cloud.
    let second = send(2, "waits");
    eventually("the second request is queued", || async {
        let s = hub.status().await;
        (s["roles"]["embedding"]["queue_depth"] == 2).then_some(())
    })
    .await;
    assert_eq!(
        up.state.served_by_slug(EMBED_SLUG),
        3,
        "held for the local provider"
    );
    // Without a healthy local provider, the cloud serves.
    local.close().await;
    let (code, body) = second.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["provenance"]["backend"] == "cloud")
    );
    assert_eq!(up.state.served_by_slug(EMBED_SLUG), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_429_shrinks_its_route_and_a_hard_402_stops_cloud_work_until_a_new_key() {
    let dir = tempfile::tempdir().unwrap();
    // The upstream serves two calls at once; the rest get 429 with Retry-After 1 s.
    let up = upstream(|c| c.max_concurrency = Some(2)).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _a = cloud_agent(dir.path(), &hub, "cloud-a", &up);
    let _b = cloud_agent(dir.path(), &hub, "cloud-b", &up);
    hub.wait_for_agent("cloud-a").await;
    hub.wait_for_agent("cloud-b").await;
    let (code, result) = hub
        .push(push_body(
            json!({"embedding": "cloud", "code-assistant": "cloud"}),
        ))
        .await;
    assert_eq!(code, 200, "{result}");
    wait_for_cloud(&hub, "cloud-a", 3).await;
    wait_for_cloud(&hub, "cloud-b", 3).await;
    eventually("discovered: 16 permits", || async {
        (hub.status().await["budget"]["ceiling"] == 16).then_some(())
    })
    .await;

    // Hold admitted calls so the count in flight is exact: 5 leases of 63 texts (and a canary
    // each) go out at once,
    // 2 are admitted, 3 get 429 from the upstream.
    // Both pass the gate first (their probes must not meet the held calls below).
    crate::gate::verdict(&hub, "cloud-a/", &["pass"]).await;
    crate::gate::verdict(&hub, "cloud-b/", &["pass"]).await;
    up.state.set_hold(true);
    let request = spawn_embed(&hub, 315, "throttled");
    tokio::time::timeout(Duration::from_secs(60), up.state.wait_for_requests(5))
        .await
        .expect("five upstream calls");
    let route = format!("embedding:{EMBED_MODEL}@deepinfra/fp32:fp32");
    let budget = eventually("the route was throttled", || async {
        let b = hub.status().await["budget"].clone();
        let r = b["routes"]
            .as_array()?
            .iter()
            .find(|r| r["route"] == route.as_str())?
            .clone();
        (r["throttles"].as_u64()? >= 3).then_some(b)
    })
    .await;
    let r = budget["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["route"] == route.as_str())
        .unwrap();
    // The route was in its start (8 of 16): the 429s end it at the wall they found, one
    // under what was in flight at each (5, then 4, then 3), with no halving: 2.
    assert_eq!(r["limit"], 2, "{budget}");
    assert_eq!(r["known_good"], 2, "{budget}");
    assert!(r.get("start_target").is_none(), "{budget}");
    assert_eq!(
        (&budget["limit"], &budget["start_target"]),
        (&json!(8), &json!(16)),
        "the global limit is untouched (still in its start): {budget}"
    );
    assert_eq!(budget["throttles"], 0, "{budget}");
    assert_eq!(up.state.throttled_429(), 3);
    // Chat is another route: it is served while the embedding route waits.
    up.state.set_hold(false);
    let chat =
        json!({"model": "code-assistant", "messages": [{"role": "user", "content": "still here"}]});
    let (code, body) = hub.post("/v1/chat/completions", &chat).await;
    assert_eq!(code, 200, "{body}");
    // Every text comes back once; none was lost to the 429s.
    let (code, body) = request.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 315);
    assert_eq!(up.state.served_by_slug(EMBED_SLUG), 315);

    // Out of credits: cloud work stops and status says why; the request waiting for the
    // cloud fails at once with the reason instead of waiting out its timeout.
    up.state.set_hard_402(true);
    let waiting = spawn_embed(&hub, 4, "broke");
    let stopped = eventually("the budget stopped", || async {
        let b = hub.status().await["budget"].clone();
        b["stopped"].as_str().map(str::to_string)
    })
    .await;
    assert!(stopped.contains("credits"), "{stopped}");
    assert_eq!(hub.metric("fantom_hub_budget_stopped").await, 1.0);
    let (code, body) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiting request is answered within seconds")
        .unwrap();
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["error"]["code"], "cloud_stopped", "{body}");
    let refused = up.state.refused_402();
    assert_eq!(refused, 1, "one 402, then no more calls");
    // New work that only the cloud could serve is refused at once, with the reason.
    let (code, body) = embed(&hub, texts(2, "after the stop")).await;
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["error"]["code"], "cloud_stopped", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("credits"),
        "{body}"
    );
    // A new key (the account was topped up) serves again.
    up.state.set_hard_402(false);
    let (code, result) = hub.push(json!({"openrouter": {"apiKey": KEY}})).await;
    assert_eq!(code, 200, "{result}");
    let (code, body) = spawn_embed(&hub, 4, "topped up").await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 4);
    assert_eq!(hub.status().await["budget"]["stopped"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_override_is_live_and_persisted() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let set = |permits: Value| {
        let (client, url, admin) = (
            hub.http.clone(),
            hub.url("/admin/budget"),
            hub.admin.clone(),
        );
        async move {
            let r = client
                .post(url)
                .bearer_auth(admin)
                .json(&json!({"permits": permits}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (code, body) = set(json!(40)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["budget"]["limit"], 40);
    assert_eq!(body["budget"]["ceiling_source"], "override");
    for bad in [json!(0), json!(257), json!("many")] {
        let (code, body) = set(bad).await;
        assert_eq!(code, 400, "{body}");
    }
    assert_eq!(hub.metric("fantom_hub_budget_limit").await, 40.0);
    // It survives a restart.
    let addr = hub.proc.addr;
    let mut hub = hub;
    assert!(hub.proc.terminate().success());
    drop(hub);
    let hub = HubProc::start(dir.path(), Some(addr), &[], &[], "hub-2.log");
    let budget = hub.status().await["budget"].clone();
    assert_eq!(
        (budget["limit"].clone(), budget["override_permits"].clone()),
        (json!(40), json!(40))
    );
    let (code, body) = {
        let r = hub
            .http
            .post(hub.url("/admin/budget"))
            .bearer_auth(&hub.admin)
            .json(&json!({"permits": null}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["budget"]["limit"], 4, "back to the default: {body}");
}

/// How many items of one request the local and the cloud providers served.
async fn split(hub: &HubProc, n: usize, tag: &str) -> (usize, usize) {
    let (code, body) = embed(hub, texts(n, tag)).await;
    assert_eq!(code, 200, "{body}");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), n);
    let local = data
        .iter()
        .filter(|d| d["provenance"]["backend"] == "local")
        .count();
    (local, n - local)
}

/// The rate half of "a cloud rate limit never slows the GPUs" is measured by
/// `cargo bench --bench aggregate_rate` (a ratio, side by side); this test checks the
/// behaviour: under `aggregate` the local provider and a throttled cloud share one queue, the
/// throttle holds back only the cloud, and every item is served once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregate_shares_the_queue_and_a_throttled_cloud_holds_back_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    // A throttled upstream: four calls a minute (two are the cloud agents' gate probes), then
    // 429s with X-RateLimit-Reset. It serves the real model, so the cloud passes the gate.
    let embedder = crate::gate::minilm_embedder().await;
    let up = upstream(|c| {
        c.rpm = Some(4);
        c.embedder = Some(embedder);
    })
    .await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _gpu = crate::support::start_agent(dir.path(), &hub, "gpu", &[]);
    let _a = cloud_agent(dir.path(), &hub, "cloud-a", &up);
    let _b = cloud_agent(dir.path(), &hub, "cloud-b", &up);
    for id in ["gpu", "cloud-a", "cloud-b"] {
        hub.wait_for_agent(id).await;
    }
    let (code, result) = hub.push(push_body(json!({"embedding": "aggregate"}))).await;
    assert_eq!(code, 200, "{result}");
    wait_for_cloud(&hub, "cloud-a", 3).await;
    wait_for_cloud(&hub, "cloud-b", 3).await;
    crate::gate::verdict(&hub, "cloud-a/", &["pass"]).await;
    crate::gate::verdict(&hub, "cloud-b/", &["pass"]).await;
    let (local, cloud) = split(&hub, 1500, "mixed").await;
    // The upstream took two calls of up to 64 texts in its minute; the 429s after them paused
    // the budget, and the local provider served everything else meanwhile.
    assert_eq!(up.state.served_by_slug(EMBED_SLUG) as usize, cloud);
    assert!((1..=128).contains(&cloud), "cloud served {cloud}");
    assert_eq!(local + cloud, 1500);
    assert!(up.state.throttled_429() > 0, "the upstream throttled");
    let budget = hub.status().await["budget"].clone();
    assert!(budget["throttles"].as_u64().unwrap() > 0, "{budget}");
    assert!(
        budget["cooldown_remaining_ms"].as_u64().unwrap() > 0,
        "the cloud is cooling down: {budget}"
    );
    // A second request while the cloud cools down is served by the GPU alone.
    let (local, cloud) = split(&hub, 300, "cooling").await;
    assert_eq!((local, cloud), (300, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_policy_routes_embeddings_reranks_and_chat_as_designed() {
    let dir = tempfile::tempdir().unwrap();
    // The cloud route serves MiniLM's own vectors: it passes the role's space (founded by the
    // local MiniLM), so every policy can serve embeddings from it. (A route of another encoder
    // would be refused: a policy never changes the role's space.)
    let minilm = crate::gate::minilm_embedder().await;
    let up = upstream(|cfg| cfg.embedder = Some(minilm)).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let reranker = crate::local_support::fixtures().join("qwen3/tiny-qwen3-reranker");
    let body = format!(
        r#"[[models]]
roles = ["embedding"]
model = "all-minilm-l6-v2"
model_dir = "{}"
device = "cpu"

[[models]]
roles = ["reranker"]
model_dir = "{}"
device = "cpu"
"#,
        crate::support::minilm_dir().display(),
        reranker.display()
    );
    let _gpu = start_agent_toml(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "gpu",
        &body,
        &[],
    );
    let _cloud = cloud_agent(dir.path(), &hub, "cloud-a", &up);
    hub.wait_for_agent("gpu").await;
    hub.wait_for_agent("cloud-a").await;
    let (code, result) = hub.push(push_body(json!({}))).await;
    assert_eq!(code, 200, "{result}");

    let backends = |body: &Value, list: &str| -> Vec<String> {
        body[list]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["provenance"]["backend"].as_str().unwrap().to_string())
            .collect()
    };
    for policy in ["local", "cloud", "aggregate", "backup"] {
        let modes = json!({"embedding": policy, "reranker": policy, "code-assistant": policy});
        let (code, result) = hub.push(json!({"openrouter": {"modeByRole": modes}})).await;
        assert_eq!(code, 200, "{result}");
        // `local` takes every cloud route away; the others give the cloud agent all three.
        wait_for_cloud(&hub, "cloud-a", if policy == "local" { 0 } else { 3 }).await;
        let status = hub.status().await;
        assert_eq!(status["roles"]["reranker"]["policy"], policy);

        let (code, body) = embed(&hub, texts(20, policy)).await;
        assert_eq!(code, 200, "{policy}: {body}");
        let embedded = backends(&body, "data");
        let (code, body) = hub
            .post(
                "/v1/rerank",
                &json!({"query": "q", "documents": ["a", "b", "c"]}),
            )
            .await;
        assert_eq!(code, 200, "{policy}: {body}");
        let reranked = backends(&body, "results");
        let chat =
            json!({"model": "code-assistant", "messages": [{"role": "user", "content": policy}]});
        let (chat_code, chat_body) = hub.post("/v1/chat/completions", &chat).await;

        let all = |v: &[String], b: &str| v.iter().all(|x| x == b);
        match policy {
            "local" => {
                assert!(
                    all(&embedded, "local") && all(&reranked, "local"),
                    "{policy}"
                );
                assert_eq!(chat_code, 503, "no local chat model: {chat_body}");
            }
            "cloud" => {
                assert!(
                    all(&embedded, "cloud") && all(&reranked, "cloud"),
                    "{policy}"
                );
                assert_eq!(chat_code, 200, "{chat_body}");
            }
            "backup" => {
                // Healthy local providers serve; chat has none, so the cloud does.
                assert!(
                    all(&embedded, "local") && all(&reranked, "local"),
                    "{policy}: {embedded:?} {reranked:?} {}",
                    hub.status().await["gate"]
                );
                assert_eq!(chat_code, 200, "{chat_body}");
            }
            _ => {
                assert_eq!(embedded.len(), 20);
                assert_eq!(chat_code, 200, "{chat_body}");
            }
        }
        if chat_code == 200 {
            assert_eq!(chat_body["provenance"]["backend"], "cloud");
            assert_eq!(
                chat_body["choices"][0]["message"]["content"],
                format!("echo: {policy}")
            );
        }
    }
    // The cloud served exactly what `cloud` and `aggregate` sent it.
    assert!(up.state.served_by_slug(EMBED_SLUG) >= 20);
}
