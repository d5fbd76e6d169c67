//! Projects end to end, with real processes: one project's flood (local or cloud) never stalls
//! another's queries beyond a few engine batches, stops at its own limits with a clear 429,
//! and keys are shown once, kept as digests, rotated at once and never logged.
//!
//! The latency test measures against itself (a query alone, the flood alone, then both) on
//! the same machine, and the bound is in engine work: a frame's worth of the flood's own
//! time. The measured figures are printed (`--nocapture`) and recorded in docs/benchmarks.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::cloud::{push_body, upstream};
use crate::support::*;

/// The floods of these tests share two cores: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `serve` with the MiniLM embedder (`extra` flags added), its agent connected.
async fn serve(dir: &std::path::Path, extra: &[&str]) -> HubProc {
    let hub = start_serve(dir, extra);
    hub.wait_for_agent("solo").await;
    hub
}

/// One embedding request of `texts` with `key`.
async fn post_embed(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    texts: Vec<String>,
) -> reqwest::Response {
    http.post(url)
        .bearer_auth(key)
        .json(&json!({"model": "embedding", "input": texts}))
        .send()
        .await
        .unwrap()
}

/// Creates a project; its key.
async fn add_project(hub: &HubProc, body: Value) -> String {
    let (code, answer) = hub.post_admin("/admin/projects", &body).await;
    assert_eq!(code, 201, "{answer}");
    answer["key"].as_str().unwrap().to_string()
}

/// Code-like chunks of 8–32 words (short: the floods run on a debug build in CI), distinct.
fn code_chunks(n: usize) -> Vec<String> {
    let words = [
        "fn", "let", "mut", "self", "impl", "match", "Some", "None", "Ok", "Err", "return", "vec",
        "iter", "map", "collect", "async", "await", "pub", "struct", "String",
    ];
    (0..n)
        .map(|i| {
            let len = 8 + (i * 7919) % 24;
            let body: Vec<&str> = (0..len)
                .map(|k| words[(i * 31 + k * 17 + k * k) % words.len()])
                .collect();
            format!("// chunk {i}\n{}", body.join(" "))
        })
        .collect()
}

/// One embedding request of `key`'s project: a search query (Cohere's `input_type`) or a
/// plain OpenAI embedding; its latency and status.
async fn one_query(http: &reqwest::Client, hub: &HubProc, key: &str, marked: bool) -> (u16, f64) {
    let started = Instant::now();
    let r = if marked {
        http.post(hub.url("/v2/embed"))
            .bearer_auth(key)
            .json(
                &json!({"model": "embedding", "texts": ["where is the lease renewed?"],
                          "input_type": "search_query", "embedding_types": ["float"]}),
            )
            .send()
            .await
            .unwrap()
    } else {
        http.post(hub.url("/v1/embeddings"))
            .bearer_auth(key)
            .json(&json!({"model": "embedding", "input": "where is the lease renewed?"}))
            .send()
            .await
            .unwrap()
    };
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    (status, started.elapsed().as_secs_f64())
}

/// Sends `texts` as requests of 250 at once; checks every text came back once, in order.
async fn flood(http: reqwest::Client, url: String, key: String, texts: Arc<Vec<String>>) -> f64 {
    let started = Instant::now();
    let tasks: Vec<_> = texts
        .chunks(250)
        .map(|chunk| {
            let (http, url, key, chunk) = (http.clone(), url.clone(), key.clone(), chunk.to_vec());
            tokio::spawn(async move {
                let n = chunk.len();
                let r = post_embed(&http, &url, &key, chunk).await;
                assert_eq!(r.status(), 200);
                let body: Value = r.json().await.unwrap();
                let data = body["data"].as_array().unwrap();
                assert_eq!(data.len(), n, "every text served");
                for (i, d) in data.iter().enumerate() {
                    assert_eq!(d["index"], i, "each once, in order");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_projects_flood_does_not_stall_anothers_queries_and_stops_at_its_limit() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let hub = serve(dir.path(), &[]).await;
    let indexer = add_project(&hub, json!({"name": "indexer"})).await;
    let search = add_project(&hub, json!({"name": "search"})).await;
    let http = reqwest::Client::new();
    let texts = Arc::new(code_chunks(2000));
    let url = hub.url("/v1/embeddings");

    // Alone: the query, then the flood.
    let mut solo = Vec::new();
    for _ in 0..8 {
        let (code, s) = one_query(&http, &hub, &search, true).await;
        assert_eq!(code, 200);
        solo.push(s);
    }
    let solo = median(solo);
    let flood_solo = flood(http.clone(), url.clone(), indexer.clone(), texts.clone()).await;
    // The flood's own time per 64-text frame: the engine work one frame stands for.
    let frame_s = flood_solo * 64.0 / texts.len() as f64;

    for marked in [true, false] {
        let running = tokio::spawn(flood(
            http.clone(),
            url.clone(),
            indexer.clone(),
            texts.clone(),
        ));
        let mut during = Vec::new();
        while !running.is_finished() && during.len() < 60 {
            let (code, s) = one_query(&http, &hub, &search, marked).await;
            assert_eq!(code, 200);
            if !running.is_finished() {
                during.push(s);
            }
        }
        let flood_s = running.await.unwrap();
        assert!(
            during.len() >= 3,
            "queries ran during the flood: {during:?}"
        );
        let (mid, worst) = (
            median(during.clone()),
            during.iter().copied().fold(0.0, f64::max),
        );
        eprintln!(
            "fairness (marked as queries: {marked}): query alone {:.0} ms; under the flood median {:.0} ms, worst {:.0} ms over {} queries; flood alone {flood_solo:.1} s, with the queries {flood_s:.1} s; one frame of the flood {:.0} ms",
            solo * 1e3,
            mid * 1e3,
            worst * 1e3,
            during.len(),
            frame_s * 1e3,
        );
        // A query waits for at most the engine batches already formed (marked), or for
        // the frame the agent runs (not marked): a few frames' worth, never the flood.
        assert!(
            mid <= solo + 3.0 * frame_s,
            "median {mid:.3} s under the flood vs {solo:.3} s alone (a frame is {frame_s:.3} s)"
        );
        assert!(
            flood_s <= 2.0 * flood_solo + 5.0,
            "the flood took {flood_s:.1} s with the queries, {flood_solo:.1} s alone"
        );
    }

    // The indexer's limit is its own: a flood past it gets 429 naming the limit, while the
    // search project's requests are accepted and served.
    let r = hub
        .http
        .patch(hub.url("/admin/projects/indexer"))
        .bearer_auth(&hub.admin)
        .json(&json!({"limits": {"max_queued_items": 300}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut floods = Vec::new();
    for chunk in texts.chunks(250).take(4) {
        let (http, url, key, chunk) = (http.clone(), url.clone(), indexer.clone(), chunk.to_vec());
        floods.push(tokio::spawn(async move {
            let r = post_embed(&http, &url, &key, chunk).await;
            let retry = r.headers().get("retry-after").cloned();
            (r.status().as_u16(), retry, r.json::<Value>().await.unwrap())
        }));
    }
    let (code, _) = one_query(&http, &hub, &search, false).await;
    assert_eq!(code, 200, "the other project is served");
    let mut refused = 0;
    for f in floods {
        let (code, retry, body) = f.await.unwrap();
        if code == 429 {
            refused += 1;
            assert_eq!(body["error"]["code"], "project_limit", "{body}");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(
                message.contains("max_queued_items = 300") && message.contains("indexer"),
                "{message}"
            );
            assert!(retry.is_some(), "429 with Retry-After");
        } else {
            assert_eq!(code, 200, "{body}");
        }
    }
    assert!(
        refused >= 3,
        "1000 items against a limit of 300: {refused} refused"
    );
    let projects = hub.admin_get("/admin/projects").await;
    let indexer_view = projects["projects"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "indexer")
        .unwrap()
        .clone();
    assert_eq!(indexer_view["limits"]["max_queued_items"], 300);
    assert!(
        indexer_view["usage"]["refused"]["project_limit"]
            .as_u64()
            .unwrap()
            >= 3
    );
    assert!(indexer_view["usage"]["local_tokens"].as_u64().unwrap() > 0);
    assert!(
        !projects.to_string().contains(&indexer),
        "no key in the list"
    );
    assert!(
        hub.metric("fantom_hub_project_requests_total{project=\"search\"}")
            .await
            > 10.0
    );
}

/// `project`'s local tokens so far.
async fn local_tokens(hub: &HubProc, project: &str) -> u64 {
    let projects = hub.admin_get("/admin/projects").await;
    projects["projects"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == project)
        .map_or(0, |p| p["usage"]["local_tokens"].as_u64().unwrap_or(0))
}

/// Inside one project (no key at all: `default`, as a new user runs it) a one-text document
/// embed is not queued behind the whole of the project's own flood; and `X-Priority:
/// interactive` buys latency, not weight: a weight-1 project flooding "interactive" leaves a
/// weight-10 project's batch flood its share, while its lone queries still come first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_share_inside_a_project_and_interactive_cannot_buy_weight() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let hub = serve(dir.path(), &[]).await;
    let http = reqwest::Client::new();
    let texts = Arc::new(code_chunks(2000));
    let url = hub.url("/v1/embeddings");

    // One project: the placeholder key every OpenAI client sends is no key (`default`).
    let one_text = |http: reqwest::Client, url: String| async move {
        let started = Instant::now();
        let r = post_embed(
            &http,
            &url,
            "EMPTY",
            vec!["fn renew(lease: &mut Lease)".into()],
        )
        .await;
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await;
        started.elapsed().as_secs_f64()
    };
    let mut alone = Vec::new();
    for _ in 0..5 {
        alone.push(one_text(http.clone(), url.clone()).await);
    }
    let solo = median(alone);
    let flood_solo = flood(http.clone(), url.clone(), "EMPTY".into(), texts.clone()).await;
    let frame_s = flood_solo * 64.0 / texts.len() as f64;
    let running = tokio::spawn(flood(
        http.clone(),
        url.clone(),
        "EMPTY".into(),
        texts.clone(),
    ));
    let mut during = Vec::new();
    while !running.is_finished() && during.len() < 60 {
        let s = one_text(http.clone(), url.clone()).await;
        if !running.is_finished() {
            during.push(s);
        }
    }
    let flood_s = running.await.unwrap();
    assert!(during.len() >= 3, "texts ran during the flood: {during:?}");
    let (mid, worst) = (
        median(during.clone()),
        during.iter().copied().fold(0.0, f64::max),
    );
    eprintln!(
        "inside one project: one text alone {:.0} ms; under the project's own flood median {:.0} ms, worst {:.0} ms over {} requests; flood alone {flood_solo:.1} s, with them {flood_s:.1} s; one frame {:.0} ms",
        solo * 1e3,
        mid * 1e3,
        worst * 1e3,
        during.len(),
        frame_s * 1e3
    );
    // A round of the flood's requests, not the flood (2 000 texts, some 30 frames).
    assert!(
        mid <= solo + 3.0 * frame_s,
        "median {mid:.3} s under the project's own flood vs {solo:.3} s alone (a frame is {frame_s:.3} s)"
    );
    assert!(
        worst <= solo + 6.0 * frame_s,
        "worst {worst:.3} s (a frame is {frame_s:.3} s)"
    );

    // Weight 1 marking everything interactive against weight 10 in batch.
    let light = add_project(&hub, json!({"name": "light", "weight": 1})).await;
    let heavy = add_project(&hub, json!({"name": "heavy", "weight": 10})).await;
    let heavy_flood = tokio::spawn(flood(
        http.clone(),
        url.clone(),
        heavy.clone(),
        Arc::new(code_chunks(2000)),
    ));
    // While only the heavy project floods, the light one's lone queries come first.
    let mut lone = Vec::new();
    for _ in 0..3 {
        let (code, s) = one_query(&http, &hub, &light, true).await;
        assert_eq!(code, 200);
        lone.push(s);
    }
    assert!(
        median(lone.clone()) <= solo + 3.0 * frame_s,
        "{lone:?} (a frame is {frame_s:.3} s)"
    );
    let light_before = local_tokens(&hub, "light").await;
    let light_flood = {
        let (http, url, key) = (http.clone(), url.clone(), light.clone());
        let texts = code_chunks(1000);
        tokio::spawn(async move {
            let tasks: Vec<_> = texts
                .chunks(250)
                .map(|chunk| {
                    let (http, url, key, chunk) =
                        (http.clone(), url.clone(), key.clone(), chunk.to_vec());
                    tokio::spawn(async move {
                        let r = http
                            .post(&url)
                            .bearer_auth(&key)
                            .header("x-priority", "interactive")
                            .json(&json!({"model": "embedding", "input": chunk}))
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(r.status(), 200);
                        let _ = r.bytes().await;
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        })
    };
    // The shares while both flood: from when the light flood was first served to the heavy
    // flood's end (sampled every 200 ms: a measurement, nothing waits on it).
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut first: Option<(u64, u64)> = None;
    let mut last = (0, 0);
    while !heavy_flood.is_finished() {
        tick.tick().await;
        let now = (
            local_tokens(&hub, "light").await,
            local_tokens(&hub, "heavy").await,
        );
        if heavy_flood.is_finished() {
            break;
        }
        match first {
            None if now.0 > light_before && now.1 > 0 => first = Some(now),
            _ => {}
        }
        last = now;
    }
    heavy_flood.await.unwrap();
    light_flood.await.unwrap();
    let start = first.expect("both projects were served while the heavy one flooded");
    let end = last;
    let (light_tokens, heavy_tokens) = (end.0 - start.0, end.1 - start.1);
    let share = heavy_tokens as f64 / (light_tokens + heavy_tokens) as f64;
    eprintln!(
        "interactive cannot buy weight: heavy (10, batch) {heavy_tokens} tokens, light (1, interactive) {light_tokens}: heavy's share {share:.3}"
    );
    assert!(
        share >= 0.85,
        "the weight-10 batch flood got {share:.3} of the tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cloud_flood_leaves_others_their_permits_and_stops_at_its_allowance() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|c| {
        c.max_concurrency = Some(4);
        c.latency_ms = (60, 120);
    })
    .await;
    let hub = serve(dir.path(), &["--openrouter-url", &up.base_url]).await;
    let (code, answer) = hub
        .push(push_body(
            json!({"code-assistant": "cloud", "embedding": "local"}),
        ))
        .await;
    assert_eq!(code, 200, "{answer}");
    let (code, _) = hub
        .post_admin("/admin/budget", &json!({"permits": 4}))
        .await;
    assert_eq!(code, 200);
    eventually("the chat route serves", || async {
        let (code, _) = hub
            .post(
                "/v1/chat/completions",
                &json!({"model": "code-assistant", "messages": [{"role": "user", "content": "hi"}]}),
            )
            .await;
        (code == 200).then_some(())
    })
    .await;
    let flooder = add_project(&hub, json!({"name": "flooder"})).await;
    let steady = add_project(&hub, json!({"name": "steady"})).await;
    let chat = |key: String, n: usize| {
        let (http, url) = (hub.http.clone(), hub.url("/v1/chat/completions"));
        tokio::spawn(async move {
            let started = Instant::now();
            let r = http
                .post(&url)
                .bearer_auth(&key)
                .json(&json!({"model": "code-assistant",
                              "messages": [{"role": "user", "content": format!("question {n}")}]}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), started.elapsed())
        })
    };
    let flood: Vec<_> = (0..160).map(|n| chat(flooder.clone(), n)).collect();
    // Both wait for permits: the steady project gets its share while the flood runs.
    let steady_calls: Vec<_> = (0..12).map(|n| chat(steady.clone(), n)).collect();
    let shares = eventually(
        "the steady project holds its share of the permits",
        || async {
            let projects = hub.admin_get("/admin/projects").await;
            let in_flight = |name: &str| {
                projects["projects"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|p| p["name"] == name)
                    .map_or(0, |p| p["usage"]["cloud_in_flight"].as_u64().unwrap())
            };
            let (f, s) = (in_flight("flooder"), in_flight("steady"));
            (s >= 2 && f <= 2).then_some((f, s))
        },
    )
    .await;
    let mut worst = Duration::ZERO;
    for c in steady_calls {
        let (code, took) = c.await.unwrap();
        assert_eq!(code, 200);
        worst = worst.max(took);
    }
    let flood_left = flood.iter().filter(|t| !t.is_finished()).count();
    assert!(
        flood_left > 0,
        "the steady project was served while the flood ran"
    );
    for t in flood {
        assert_eq!(t.await.unwrap().0, 200, "nothing of the flood is lost");
    }
    eprintln!(
        "cloud fairness: permits (flooder, steady) at a sample {shares:?}; steady's worst chat {} ms under a 160-chat flood on 4 permits",
        worst.as_millis()
    );
    assert!(up.state.max_in_flight() <= 4);

    // The flooder's daily allowance: set at what it used, it is past it at once. Its cloud
    // work gets 429 project_quota with the reset; its local work goes on.
    let projects = hub.admin_get("/admin/projects").await;
    let view = |name: &str| {
        projects["projects"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()
            .clone()
    };
    let used = view("flooder")["usage"]["today"]["cloud_tokens"]
        .as_u64()
        .unwrap();
    assert!(used > 0);
    assert!(view("flooder")["usage"]["cloud_usd"].as_f64().unwrap() > 0.0);
    assert_eq!(view("flooder")["usage"]["cloud_calls"], 160);
    let r = hub
        .http
        .patch(hub.url("/admin/projects/flooder"))
        .bearer_auth(&hub.admin)
        .json(&json!({"limits": {"cloud_tokens_per_day": used}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let refused_chat = |hub: &HubProc| {
        let (http, url, key) = (
            hub.http.clone(),
            hub.url("/v1/chat/completions"),
            flooder.clone(),
        );
        async move {
            let r = http
                .post(&url)
                .bearer_auth(&key)
                .json(&json!({"model": "code-assistant", "messages": [{"role": "user", "content": "more"}]}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry: u64 = r.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let body: Value = r.json().await.unwrap();
            (status, retry, body)
        }
    };
    let (code, retry, body) = refused_chat(&hub).await;
    assert_eq!(code, 429, "{body}");
    assert_eq!(body["error"]["code"], "project_quota");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cloud_tokens_per_day")
    );
    assert!(
        (1..=86_400).contains(&retry),
        "reset at midnight UTC: {retry}"
    );
    let r = hub
        .http
        .post(hub.url("/v1/embeddings"))
        .bearer_auth(&flooder)
        .json(&json!({"model": "embedding", "input": ["local work goes on"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "local work is outside the allowance");
    let (code, _) = hub
        .post(
            "/v1/chat/completions",
            &json!({"model": "code-assistant", "messages": [{"role": "user", "content": "others"}]}),
        )
        .await;
    assert_eq!(code, 200, "other projects' cloud work goes on");

    // The day's usage and the settings survive a restart.
    let mut hub = hub;
    hub.proc.terminate();
    let again = serve(dir.path(), &["--openrouter-url", &up.base_url]).await;
    let (code, _, body) = refused_chat(&again).await;
    assert_eq!(
        code, 429,
        "still past its allowance after a restart: {body}"
    );
    assert_eq!(body["error"]["code"], "project_quota");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn project_keys_are_shown_once_kept_as_digests_and_never_logged() {
    let dir = tempfile::tempdir().unwrap();
    let trace = [("RUST_LOG", "trace")];
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--require-project-key"],
        &trace,
        "hub.log",
    );
    let state = hub.state.display().to_string();
    let cli = |args: &[&str]| -> Value {
        let mut all = vec!["projects"];
        all.extend_from_slice(args);
        let hub_url = hub.url("");
        all.extend_from_slice(&[
            "--hub",
            hub_url.trim_end_matches('/'),
            "--state-dir",
            &state,
        ]);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fantom-sidecar"))
            .args(&all)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{all:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let made = cli(&["add", "payments", "--weight", "2", "--sub-projects", "true"]);
    let first = made["key"].as_str().unwrap().to_string();
    assert!(first.starts_with("fsp-"));
    let http = reqwest::Client::new();
    let embed = |key: Option<String>, path: &'static str| {
        let (http, url) = (http.clone(), hub.url(path));
        async move {
            let mut r = http
                .post(&url)
                .header("x-fantommcp-project", "repo-a")
                .json(&json!({"model": "embedding", "input": "x", "inputs": "x", "texts": ["x"]}));
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    // No key, and an unknown key, are refused in each family's shape; nothing is echoed.
    let stranger = "fsp-00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    for path in ["/v1/embeddings", "/embed", "/v2/embed", "/api/embed"] {
        let (code, body) = embed(None, path).await;
        assert_eq!(code, 401, "{path} without a key: {body}");
        assert!(body.contains("project key"), "{path}: {body}");
        let (code, body) = embed(Some(stranger.into()), path).await;
        assert_eq!(code, 401, "{path}: {body}");
        assert!(!body.contains(stranger), "{path} echoed the key");
        assert!(
            body.contains("rotated, removed or mistyped"),
            "{path}: {body}"
        );
        // A placeholder is no key: this hub requires one.
        let (code, body) = embed(Some("placeholder-1234".into()), path).await;
        assert_eq!(code, 401, "{path}: {body}");
        assert!(body.contains("requires a project key"), "{path}: {body}");
        assert!(
            !body.contains("placeholder-1234"),
            "{path} echoed the placeholder"
        );
    }
    let (code, body) = embed(Some(first.clone()), "/v1/embeddings").await;
    assert_ne!(code, 401, "the project's key is taken: {body}");

    // Rotation: the old key stops at once, the new one works.
    let rotated = cli(&["rotate", "payments"]);
    let second = rotated["key"].as_str().unwrap().to_string();
    assert_ne!(first, second);
    assert_eq!(embed(Some(first.clone()), "/v1/embeddings").await.0, 401);
    assert_ne!(embed(Some(second.clone()), "/v1/embeddings").await.0, 401);

    // The list shows settings and usage, never a key; the state file holds digests only.
    let listed = cli(&["list"]);
    let payments = listed["projects"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "payments")
        .unwrap()
        .clone();
    assert_eq!(payments["weight"], 2);
    assert_eq!(payments["sub_projects"], true);
    assert_eq!(payments["has_key"], true);
    let text = listed.to_string();
    assert!(!text.contains(&first) && !text.contains(&second));
    let saved = std::fs::read_to_string(hub.state.join("hub-state.json")).unwrap();
    assert!(saved.contains("keySha256"), "{saved}");
    assert!(!saved.contains(&first) && !saved.contains(&second));

    // A key typed as a project name is refused without being echoed.
    let (code, answer) = hub
        .post_admin("/admin/projects", &json!({"name": second}))
        .await;
    assert_eq!(code, 400);
    assert!(!answer.to_string().contains(&second));
    // `default` has no key to rotate and cannot be removed.
    let (code, _) = hub
        .post_admin("/admin/projects/default/rotate", &json!({}))
        .await;
    assert_eq!(code, 409);

    // After a restart: the rotated key still works, the old one still does not.
    let mut hub = hub;
    hub.proc.terminate();
    let log = std::fs::read_to_string(dir.path().join("hub.log")).unwrap();
    let again = HubProc::start(
        dir.path(),
        None,
        &["--require-project-key"],
        &trace,
        "hub-2.log",
    );
    let embed_again = |key: &str| {
        let (http, url, key) = (http.clone(), again.url("/v1/embeddings"), key.to_string());
        async move {
            http.post(&url)
                .bearer_auth(key)
                .json(&json!({"model": "embedding", "input": "x"}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_ne!(embed_again(&second).await, 401);
    assert_eq!(embed_again(&first).await, 401);
    let removed = cli_remove(&again, &state);
    assert_eq!(removed["removed"], true);
    assert_eq!(
        embed_again(&second).await,
        401,
        "a removed project's key stops"
    );

    // Logged at trace level: plenty of lines, none with a key.
    let log = log + &std::fs::read_to_string(dir.path().join("hub-2.log")).unwrap();
    assert!(log.lines().count() > 20);
    for key in [&first, &second] {
        assert!(!log.contains(key.as_str()), "a key reached the log");
    }
    assert!(files_containing(dir.path(), &second, &[]).is_empty());
}

fn cli_remove(hub: &HubProc, state: &str) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fantom-sidecar"))
        .args([
            "projects",
            "remove",
            "payments",
            "--hub",
            hub.url("").trim_end_matches('/'),
            "--state-dir",
            state,
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}
