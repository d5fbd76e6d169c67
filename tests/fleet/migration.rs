//! Changing an embedding role's encoder without breaking its index, with real processes: a
//! MiniLM agent founds the role's current space; a cloud route (the OpenRouter stand-in
//! serving another encoder's vectors) founds a migration's next space; clients re-embed
//! pinned to it while unpinned queries stay in the current space; the operator cuts over and
//! closes. The role's space never changes without the operator, not even when its reference
//! host dies while another model is connected; and a takeover on etcd keeps a migration.

use std::path::Path;

use serde_json::{Value, json};

use crate::gate::minilm_embedder;
use crate::ha::{leader_and_standby, leads};
use crate::support::{
    HubProc, eventually, minilm_dir, minilm_models_toml, start_agent, start_agent_toml,
};
use crate::upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

const KEY: &str = "sk-or-v1-migration-test-0123456789abcdef";
const CURRENT: &str = "embedding:all-minilm-l6-v2:384";
const NEXT_MODEL: &str = "acme/code-embed-2";
const NEXT_SLUG: &str = "acme/fp32";
const NEXT: &str = "embedding:acme/code-embed-2:384";

/// The stand-in serving the next encoder: MiniLM's vectors turned 0.9 away, text by text (a
/// different encoder, consistent with itself).
async fn next_encoder() -> Upstream {
    let up = Upstream::start(UpstreamConfig {
        key: KEY.into(),
        endpoints: vec![Endpoint {
            model: NEXT_MODEL.into(),
            slug: NEXT_SLUG.into(),
            quantization: "fp32".into(),
            kind: EndpointKind::Embed { dims: 384 },
        }],
        embedder: Some(minilm_embedder().await),
        ..Default::default()
    })
    .await;
    up.state.set_cosine(NEXT_SLUG, Some(0.9));
    up
}

fn cloud_founder() -> Value {
    json!({"backend": "cloud", "model": NEXT_MODEL, "provider": NEXT_SLUG, "dims": 384})
}

/// A key for the cloud agents, the embedding role kept local.
async fn push_key(hub: &HubProc) {
    let (code, body) = hub
        .push(json!({"openrouter": {"apiKey": KEY, "modeByRole": {"embedding": "local"}}}))
        .await;
    assert_eq!(code, 200, "{body}");
}

/// The embedding role's live spaces as `/admin/migrations` shows them.
async fn live(hub: &HubProc) -> Value {
    let all = hub.admin_get("/admin/migrations").await;
    all["roles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["role"] == "embedding")
        .cloned()
        .unwrap_or(Value::Null)
}

/// Waits until a provider passes the migration's next space.
async fn next_passes(hub: &HubProc) {
    eventually("a provider passes the next space", || async {
        let l = live(hub).await;
        (!l["next"]["passing"].as_array()?.is_empty()).then_some(())
    })
    .await
}

/// `POST /admin/migrations/embedding/<what>`: the status and error code.
async fn step(hub: &HubProc, what: &str) -> String {
    let path = format!("/admin/migrations/embedding/{what}");
    let (code, body) = hub.post_admin(&path, &json!({})).await;
    format!(
        "{code} {}",
        body["error"]["code"].as_str().unwrap_or_default()
    )
}

/// `POST /admin/migrations`: the status and error code.
async fn open(hub: &HubProc, body: Value) -> String {
    let (code, body) = hub.post_admin("/admin/migrations", &body).await;
    format!(
        "{code} {}",
        body["error"]["code"].as_str().unwrap_or_default()
    )
}

/// `POST /v1/embeddings` with an optional `X-Fantom-Space`: the status and body.
async fn embed(hub: &HubProc, texts: &[String], pin: Option<&str>) -> (u16, Value) {
    let mut r = hub.http.post(hub.url("/v1/embeddings")).json(&json!({
        "model": "embedding",
        "input": texts,
    }));
    if let Some(pin) = pin {
        r = r.header("x-fantom-space", pin);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// The space a one-text request is served in, once one is (agents may still be moving to
/// a new leader).
async fn served_in(hub: &HubProc, pin: Option<&str>) -> String {
    let one = vec!["fn takeover() {}".to_string()];
    eventually("a request is served", || async {
        let (code, body) = embed(hub, &one, pin).await;
        (code == 200).then(|| one_space(&body))
    })
    .await
}

/// Every vector's space id, checked to be one.
fn one_space(body: &Value) -> String {
    let data = body["data"].as_array().unwrap();
    let id = data[0]["space"]["id"].as_str().unwrap().to_string();
    assert!(
        data.iter().all(|d| d["space"]["id"] == id.as_str()),
        "mixed: {body}"
    );
    id
}

fn vector(d: &Value) -> Vec<f32> {
    d["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (n(a) * n(b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_rebuilds_the_index_pinned_while_queries_stay_in_the_current_space() {
    let dir = tempfile::tempdir().unwrap();
    let up = next_encoder().await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    let cloud_body = format!("openrouter_url = \"{}\"", up.base_url);
    let _cloud = start_agent_toml(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "cloud-a",
        &cloud_body,
        &[],
    );
    hub.wait_for_agent("gpu").await;
    hub.wait_for_agent("cloud-a").await;
    push_key(&hub).await;
    hub.wait_for_current_space(CURRENT).await;

    // Steps that cannot apply are refused with the reason, and change nothing.
    assert_eq!(step(&hub, "cutover").await, "409 no_migration");
    assert_eq!(step(&hub, "close").await, "409 no_previous");
    let reranker = json!({"role": "reranker", "founder": cloud_founder()});
    assert_eq!(open(&hub, reranker).await, "400 not_embedding");
    let same = json!({"role": "embedding",
        "founder": {"backend": "local", "model": "all-minilm-l6-v2", "dims": 384}});
    assert_eq!(open(&hub, same).await, "409 same_as_current");
    // A founder nobody serves: open, cutover refused (not founded), abort.
    let nobody = json!({"role": "embedding",
        "founder": {"backend": "local", "model": "nobody/serves-this"}});
    assert_eq!(open(&hub, nobody).await, "200 ");
    assert_eq!(step(&hub, "cutover").await, "409 next_not_founded");
    assert_eq!(step(&hub, "abort").await, "200 ");

    // The migration: the cloud route is built beside the local model and founds next.
    let (code, body) = hub
        .post_admin(
            "/admin/migrations",
            &json!({"role": "embedding", "founder": cloud_founder(), "policy": "cloud"}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["spaces"]["next"]["id"], NEXT, "{body}");
    next_passes(&hub).await;

    // Bad pins: a clear 4xx, nothing served.
    let one = vec!["fn main() {}".to_string()];
    for (pin, want) in [
        ("embedding:nobody:384", 409),
        (&format!("{CURRENT}@1") as &str, 409),
        ("not a space", 400),
        ("embedding:m:wide", 400),
        ("sk-or-v1-0123456789abcdef0123456789abcdef", 400),
    ] {
        let (code, body) = embed(&hub, &one, Some(pin)).await;
        assert_eq!(code, want, "{pin}: {body}");
        assert!(body["data"].is_null(), "{body}");
        assert!(
            !body.to_string().contains("0123456789abcdef0123"),
            "never echoed: {body}"
        );
    }
    let (code, body) = embed(&hub, &one, Some("embedding:nobody:384")).await;
    let said = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        said.contains(CURRENT) && said.contains(NEXT),
        "{code}: {body}"
    );

    // Re-embedding 2 000 texts pinned to next (half by header, half by the body's `space`)
    // while unpinned one-text queries run.
    let texts: Vec<String> = (0..2000)
        .map(|i| format!("fn chunk_{i}() -> usize {{ {i} * 2 }} // row {i} of the index"))
        .collect();
    let rebuild = {
        let (http, url) = (hub.http.clone(), hub.url("/v1/embeddings"));
        let texts = texts.clone();
        tokio::spawn(async move {
            let mut spaces = Vec::new();
            let mut sample = Vec::new();
            for (n, chunk) in texts.chunks(100).enumerate() {
                let mut body = json!({"model": "embedding", "input": chunk});
                let mut r = http.post(&url);
                if n % 2 == 0 {
                    r = r.header("x-fantom-space", NEXT);
                } else {
                    body["space"] = json!(NEXT);
                }
                let r = r.json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
                let body: Value = r.json().await.unwrap();
                spaces.push(one_space(&body));
                sample.push((chunk[0].clone(), vector(&body["data"][0])));
            }
            (spaces, sample)
        })
    };
    let mut queries: Vec<(String, Vec<f32>)> = Vec::new();
    while !rebuild.is_finished() {
        let q = format!("where is chunk {} parsed", queries.len());
        let (code, body) = embed(&hub, std::slice::from_ref(&q), None).await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(
            one_space(&body),
            CURRENT,
            "an unpinned query stays in the current space"
        );
        queries.push((q, vector(&body["data"][0])));
    }
    let (spaces, sample) = rebuild.await.unwrap();
    assert_eq!(spaces.len(), 20);
    assert!(spaces.iter().all(|s| s == NEXT), "{spaces:?}");
    assert!(!queries.is_empty());
    // The unpinned answers are MiniLM's own vectors; the pinned ones another encoder's.
    let minilm = minilm_embedder().await;
    let (q_texts, q_vectors): (Vec<String>, Vec<Vec<f32>>) = queries.into_iter().unzip();
    let reference = tokio::task::spawn_blocking({
        let (m, t) = (minilm.clone(), q_texts.clone());
        move || m(&t)
    })
    .await
    .unwrap();
    for (got, want) in q_vectors.iter().zip(&reference) {
        assert!(cosine(got, want) > 0.9999, "{}", cosine(got, want));
    }
    let (s_texts, s_vectors): (Vec<String>, Vec<Vec<f32>>) = sample.into_iter().unzip();
    let clean = tokio::task::spawn_blocking(move || minilm(&s_texts))
        .await
        .unwrap();
    for (got, clean) in s_vectors.iter().zip(&clean) {
        let c = cosine(got, clean);
        assert!((0.85..0.95).contains(&c), "another encoder's vector: {c}");
    }
    // Progress: rows per space, provider and project.
    let l = live(&hub).await;
    assert_eq!(l["next"]["rows"], 2000, "{l}");
    assert_eq!(l["next"]["rows_by_project"]["default"], 2000, "{l}");
    assert!(
        l["current"]["rows"].as_u64().unwrap() >= q_vectors.len() as u64,
        "{l}"
    );
    let counted = hub
        .metric(&format!(
            "fantom_hub_space_project_rows_total{{space=\"{NEXT}\",project=\"default\"}}"
        ))
        .await;
    assert_eq!(counted, 2000.0);

    // Cutover: unpinned answers in next; the old space still served when pinned.
    let (code, body) = hub
        .post_admin("/admin/migrations/embedding/cutover", &json!({}))
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["spaces"]["current"]["id"], NEXT, "{body}");
    assert_eq!(body["spaces"]["previous"]["id"], CURRENT, "{body}");
    let (code, body) = embed(&hub, &one, None).await;
    assert_eq!((code, one_space(&body)), (200, NEXT.to_string()), "{body}");
    let (code, body) = embed(&hub, &one, Some(CURRENT)).await;
    assert_eq!(
        (code, one_space(&body)),
        (200, CURRENT.to_string()),
        "{body}"
    );
    let events = hub.status().await["events"].to_string();
    assert!(events.contains("cut over"), "{events}");
    // Close: the previous space answers 409.
    let (code, body) = hub
        .post_admin("/admin/migrations/embedding/close", &json!({}))
        .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = embed(&hub, &one, Some(CURRENT)).await;
    assert_eq!(
        (code, body["error"]["code"].as_str()),
        (409, Some("space_not_served")),
        "{body}"
    );
}

/// A copy of the MiniLM folder with 1 MiB of its first feed-forward weights negated (an
/// encoder that is not interchangeable with the original).
fn negated_minilm(dir: &Path) -> std::path::PathBuf {
    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let (from, to) = (entry.path(), to.join(entry.file_name()));
            if entry.file_type().unwrap().is_dir() {
                copy_dir(&from, &to);
            } else {
                std::fs::copy(&from, &to).unwrap();
            }
        }
    }
    let to = dir.join("minilm-negated");
    copy_dir(&minilm_dir(), &to);
    let path = to.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let tensors: Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let at = &tensors["encoder.layer.0.intermediate.dense.weight"]["data_offsets"];
    let (begin, end) = (
        at[0].as_u64().unwrap() as usize,
        at[1].as_u64().unwrap() as usize,
    );
    let start = 8 + header + begin;
    let len = (end - begin).min(1 << 20);
    for word in bytes[start..start + len].chunks_exact_mut(4) {
        word[3] ^= 0x80; // the sign bit of a little-endian f32
    }
    std::fs::write(&path, bytes).unwrap();
    to
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_host_killed_beside_another_model_leaves_the_space_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    hub.wait_for_current_space(CURRENT).await;
    let negated = negated_minilm(dir.path());
    let other_body = format!(
        "[[models]]\nroles = [\"embedding\"]\nmodel_dir = \"{}\"\ndevice = \"cpu\"\n",
        negated.display()
    );
    let _other = start_agent_toml(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "other",
        &other_body,
        &[],
    );
    let refused = crate::gate::verdict(&hub, "other/embedding", &["refused"]).await;
    eprintln!(
        "the negated copy: lowest cosine {}",
        refused["evidence"]["min_cosine"]
    );
    assert_eq!(refused["space"], CURRENT, "{refused}");
    gpu.kill();
    eventually("the reference host is gone", || async {
        let s = hub.status().await;
        let gone = !s["agents"].as_array()?.iter().any(|a| a["id"] == "gpu");
        gone.then_some(())
    })
    .await;
    // Whatever the hub does next, it never makes the refused model the role's space: a
    // request fails naming the space and the way to another encoder.
    let (code, body) = eventually("a request is refused for good", || async {
        let (code, body) = embed(&hub, &["q".to_string()], None).await;
        (code == 503 && body["error"]["code"] == "gate_refused").then_some((code, body))
    })
    .await;
    let said = body["error"]["message"].as_str().unwrap();
    assert!(
        said.contains(CURRENT) && said.contains("migration"),
        "{code}: {said}"
    );
    let s = hub.status().await;
    let spaces: Vec<&Value> = s["gate"]["spaces"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["role"] == "embedding")
        .collect();
    assert_eq!(spaces.len(), 1, "no new space: {spaces:?}");
    assert_eq!(spaces[0]["id"], CURRENT);
    assert_eq!(spaces[0]["current"], true);
    let other = s["gate"]["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["provider"] == "other/embedding")
        .map(|v| v["state"].as_str().unwrap().to_string())
        .collect::<Vec<_>>();
    assert_eq!(other, ["refused"], "refused, not promoted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_mid_migration_serves_both_spaces_and_the_cutover_after_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = crate::etcd_cluster::Cluster::start(dir.path()).await;
    let up = next_encoder().await;
    let (mut a, b) = leader_and_standby(dir.path(), &cluster).await;
    let both = |first: &HubProc, other: &HubProc, id: &str, body: &str| {
        let body = format!("hub_urls = [\"{}\"]\n{body}", other.ws_url());
        start_agent_toml(
            dir.path(),
            &first.ws_url(),
            &first.fleet_file,
            id,
            &body,
            &[],
        )
    };
    let _gpu = both(&a, &b, "gpu", &minilm_models_toml());
    let _cloud = both(
        &a,
        &b,
        "cloud-a",
        &format!("openrouter_url = \"{}\"", up.base_url),
    );
    a.wait_for_agent("gpu").await;
    a.wait_for_agent("cloud-a").await;
    push_key(&a).await;
    a.wait_for_current_space(CURRENT).await;
    let (code, body) = a
        .post_admin(
            "/admin/migrations",
            &json!({"role": "embedding", "founder": cloud_founder()}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    next_passes(&a).await;

    a.proc.kill();
    leads(&b).await;
    b.wait_for_agent("gpu").await;
    b.wait_for_agent("cloud-a").await;
    let l = live(&b).await;
    assert_eq!(
        (l["current"]["id"].as_str(), l["next"]["id"].as_str()),
        (Some(CURRENT), Some(NEXT)),
        "{l}"
    );
    assert_eq!(served_in(&b, None).await, CURRENT);
    assert_eq!(served_in(&b, Some(NEXT)).await, NEXT);
    next_passes(&b).await;
    let (code, body) = b
        .post_admin("/admin/migrations/embedding/cutover", &json!({}))
        .await;
    assert_eq!(code, 200, "{body}");

    // A hub that takes over from this one finds the cutover in etcd.
    let mut b = b;
    let c = crate::ha::etcd_hub(dir.path(), "c", &cluster);
    b.proc.kill();
    leads(&c).await;
    let l = live(&c).await;
    assert_eq!(
        (l["current"]["id"].as_str(), l["previous"]["id"].as_str()),
        (Some(NEXT), Some(CURRENT)),
        "{l}"
    );
}
