//! The compatibility gate end to end: a local MiniLM agent and cloud agents whose upstream (the
//! OpenRouter stand-in) serves the same model's vectors, optionally perturbed to a chosen
//! cosine. A provider that has not passed never serves a text; drift is caught by the sentinel.

use std::sync::Arc;

use fantom_sidecar::config::model::ModelChoice;
use fantom_sidecar::inference::EmbedOptions;
use fantom_sidecar::model_spec::Task;
use serde_json::{Value, json};

use crate::support::{HubProc, Proc, eventually, minilm_dir, start_agent, start_agent_toml};
use crate::upstream::{Embedder, Endpoint, EndpointKind, Upstream, UpstreamConfig};

const KEY: &str = "sk-or-v1-gate-test-0123456789abcdef";
const MODEL: &str = "sentence-transformers/all-minilm-l6-v2";
const SLUG: &str = "deepinfra/fp32";

/// Clean vectors from the real all-MiniLM-L6-v2, loaded in this process.
pub async fn minilm_embedder() -> Embedder {
    let choice: ModelChoice = toml::from_str(&format!(
        "model = \"all-minilm-l6-v2\"\nmodel_dir = \"{}\"\ndevice = \"cpu\"",
        minilm_dir().display()
    ))
    .unwrap();
    let engine = choice.load(Task::Embed).await.unwrap();
    Arc::new(move |texts: &[String]| {
        tokio::runtime::Handle::current()
            .block_on(engine.embed(texts.to_vec(), EmbedOptions::default()))
            .unwrap()
    })
}

async fn upstream(embedder: Option<Embedder>) -> Upstream {
    Upstream::start(UpstreamConfig {
        key: KEY.into(),
        endpoints: vec![Endpoint {
            model: MODEL.into(),
            slug: SLUG.into(),
            quantization: "fp32".into(),
            kind: EndpointKind::Embed { dims: 384 },
        }],
        embedder,
        ..Default::default()
    })
    .await
}

fn cloud_agent(dir: &std::path::Path, hub: &HubProc, id: &str, url: &str) -> Proc {
    let body = format!("openrouter_url = \"{url}\"");
    start_agent_toml(dir, &hub.ws_url(), &hub.fleet_file, id, &body, &[])
}

async fn push(hub: &HubProc, mode: &str) {
    let (code, result) = hub
        .push(json!({"openrouter": {"apiKey": KEY,
            "allowedModels": {"embedding": {"model": MODEL, "provider": SLUG, "dims": 384}},
            "modeByRole": {"embedding": mode}}}))
        .await;
    assert_eq!(code, 200, "{result}");
}

/// The verdict of the provider whose id starts with `prefix` (`agent/cloud:` …), once it
/// has one of `states`.
pub async fn verdict(hub: &HubProc, prefix: &str, states: &[&str]) -> Value {
    eventually(&format!("{prefix} has a verdict in {states:?}"), || async {
        let s = hub.status().await;
        s["gate"]["verdicts"]
            .as_array()?
            .iter()
            .find(|v| {
                v["provider"]
                    .as_str()
                    .is_some_and(|p| p.starts_with(prefix))
                    && states.iter().any(|st| v["state"] == *st)
            })
            .cloned()
    })
    .await
}

async fn embed(hub: &HubProc, n: usize, tag: &str) -> Vec<Value> {
    let texts: Vec<String> = (0..n)
        .map(|i| format!("{tag}: text {i} about leases"))
        .collect();
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": texts}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    body["data"].as_array().unwrap().clone()
}

fn backends(data: &[Value]) -> (usize, usize) {
    let cloud = data
        .iter()
        .filter(|d| d["provenance"]["backend"] == "cloud")
        .count();
    (data.len() - cloud, cloud)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_at_0_976_is_refused_and_serves_nothing_while_0_995_passes_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(Some(minilm_embedder().await)).await;
    up.state.set_cosine(SLUG, Some(0.976));
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    let _cloud = cloud_agent(dir.path(), &hub, "cloud-a", &up.base_url);
    hub.wait_for_agent("gpu").await;
    hub.wait_for_agent("cloud-a").await;
    push(&hub, "aggregate").await;

    // The local reference fingerprints the space; the cloud route is refused on evidence.
    let local = verdict(&hub, "gpu/embedding", &["pass"]).await;
    let space = local["space"].as_str().unwrap().to_string();
    assert_eq!(space, "embedding:all-minilm-l6-v2:384");
    let refused = verdict(&hub, "cloud-a/cloud:embedding", &["refused"]).await;
    let min = refused["evidence"]["min_cosine"].as_f64().unwrap();
    assert!((min - 0.976).abs() < 0.002, "{refused}");
    assert!(
        refused["reason"].as_str().unwrap().contains("under 0.99"),
        "{refused}"
    );

    // The GPU carries the load; not one text goes to the refused route.
    let data = embed(&hub, 300, "refused").await;
    assert_eq!(backends(&data), (300, 0));
    assert_eq!(up.state.served_by_slug(SLUG), 0);
    for d in &data {
        assert_eq!(d["space"]["id"], space.as_str());
        assert_eq!(d["space"]["dims"], 384);
    }

    // The upstream now serves vectors at 0.995: a forced re-check passes it, and it serves.
    up.state.set_cosine(SLUG, Some(0.995));
    let r = hub
        .http
        .post(hub.url("/admin/gate/verify"))
        .bearer_auth(&hub.admin)
        .json(&json!({"provider": refused["provider"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let passed = verdict(&hub, "cloud-a/cloud:embedding", &["pass"]).await;
    let min = passed["evidence"]["min_cosine"].as_f64().unwrap();
    assert!((0.99..0.996).contains(&min), "{passed}");
    let data = embed(&hub, 1500, "passes").await;
    let (_, cloud) = backends(&data);
    assert!(cloud > 0, "the passing route serves");
    assert_eq!(up.state.served_by_slug(SLUG) as usize, cloud);
    // Every vector names the one space, whoever served it.
    assert!(data.iter().all(|d| d["space"]["id"] == space.as_str()));
    let rows = hub
        .metric(&format!(
            "fantom_hub_space_rows_total{{space=\"{space}\",provider=\"cloud-a/"
        ))
        .await;
    assert_eq!(rows as usize, cloud);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_of_the_wrong_width_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(Some(minilm_embedder().await)).await;
    up.state.set_dims_override(SLUG, Some(383));
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    let _cloud = cloud_agent(dir.path(), &hub, "cloud-a", &up.base_url);
    hub.wait_for_agent("cloud-a").await;
    push(&hub, "aggregate").await;
    let v = verdict(
        &hub,
        "cloud-a/cloud:embedding",
        &["refused", "probe_failed"],
    )
    .await;
    // The client refuses a width other than the route's (383 ≠ 384) before the gate sees
    // it: either way, the route never serves.
    let text = v.to_string();
    assert!(text.contains("383"), "{v}");
    let data = embed(&hub, 100, "width").await;
    assert_eq!(backends(&data), (100, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_cloud_peers_are_checked_against_the_anchor_and_a_dead_anchor_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let clean = upstream(None).await;
    let skewed = upstream(None).await;
    skewed.state.set_cosine(SLUG, Some(0.976));
    // Nothing listens here: the anchor (first in order) cannot answer its probe.
    let dead = format!("{}/api/v1", crate::local_support::closed_endpoint());
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _a = cloud_agent(dir.path(), &hub, "cloud-a", &dead);
    let _b = cloud_agent(dir.path(), &hub, "cloud-b", &clean.base_url);
    let _c = cloud_agent(dir.path(), &hub, "cloud-c", &skewed.base_url);
    let _d = cloud_agent(dir.path(), &hub, "cloud-d", &clean.base_url);
    for id in ["cloud-a", "cloud-b", "cloud-c", "cloud-d"] {
        hub.wait_for_agent(id).await;
    }
    // Routes first under `aggregate` (no local reference: nothing is fingerprinted), then
    // `cloud` once all four are announced, so the anchor is the first of all four.
    push(&hub, "aggregate").await;
    for id in ["cloud-a", "cloud-b", "cloud-c", "cloud-d"] {
        eventually(&format!("{id} announced its route"), || async {
            let a = hub.wait_for_agent(id).await;
            a["providers"]
                .as_array()?
                .iter()
                .any(|p| p["backend"] == "cloud")
                .then_some(())
        })
        .await;
    }
    let (code, result) = hub
        .push(json!({"openrouter": {"modeByRole": {"embedding": "cloud"}}}))
        .await;
    assert_eq!(code, 200, "{result}");
    // b is the fallback reference (a's probe failed); c differs from it; d agrees with it.
    let b = verdict(&hub, "cloud-b/", &["pass"]).await;
    assert!(b["reference"].as_str().unwrap().contains("anchor"), "{b}");
    let c = verdict(&hub, "cloud-c/", &["refused"]).await;
    assert!(c["reason"].as_str().unwrap().contains("0.976"), "{c}");
    let d = verdict(&hub, "cloud-d/", &["pass"]).await;
    assert!(d["reference"].as_str().unwrap().contains("cloud-b/"), "{d}");
    let a = verdict(&hub, "cloud-a/", &["probe_failed"]).await;
    assert!(a["failures"].as_u64().unwrap() >= 1, "{a}");
    let status = hub.status().await;
    let space = &status["gate"]["spaces"][0];
    assert!(
        space["encoder"].as_str().unwrap().starts_with("cloud-b/"),
        "{space}"
    );
    assert!(
        space["coverage"].as_str().unwrap().contains("peers"),
        "{space}"
    );
    // Only b and d serve.
    let data = embed(&hub, 400, "peers").await;
    for d in &data {
        let agent = d["provenance"]["agent"].as_str().unwrap();
        assert!(agent == "cloud-b" || agent == "cloud-d", "{d}");
    }
    assert_eq!(skewed.state.served_by_slug(SLUG), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sole_cloud_provider_is_flagged_as_reduced_coverage() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(None).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _a = cloud_agent(dir.path(), &hub, "cloud-a", &up.base_url);
    hub.wait_for_agent("cloud-a").await;
    push(&hub, "cloud").await;
    verdict(&hub, "cloud-a/", &["pass"]).await;
    let status = hub.status().await;
    let coverage = status["gate"]["spaces"][0]["coverage"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(coverage.starts_with("reduced"), "{coverage}");
    let data = embed(&hub, 10, "sole").await;
    assert_eq!(backends(&data), (0, 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_caught_by_the_next_sentinel_check_and_no_drifted_vector_is_returned() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(Some(minilm_embedder().await)).await;
    let hub = HubProc::start(
        dir.path(),
        None,
        &["--gate-sentinel-s", "2"],
        &[],
        "hub.log",
    );
    let _gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    let _cloud = cloud_agent(dir.path(), &hub, "cloud-a", &up.base_url);
    hub.wait_for_agent("cloud-a").await;
    push(&hub, "aggregate").await;
    verdict(&hub, "cloud-a/", &["pass"]).await;
    let (_, cloud) = backends(&embed(&hub, 1500, "before").await);
    assert!(cloud > 0, "the cloud serves before the drift");

    // The upstream changes its serving stack behind the same pin. Probes go one at a time:
    // the re-probe in flight now may still carry the old answer, the one after it cannot.
    // So the drift is caught within two sentinel checks of those judged when it began
    // (counted, not timed: a loaded machine stretches a period but not the count).
    up.state.set_cosine(SLUG, Some(0.97));
    let judged_at_drift = hub.status().await["gate"]["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["provider"].as_str().unwrap().starts_with("cloud-a/"))
        .map(|v| v["checks"].as_u64().unwrap())
        .unwrap();
    let suspended = verdict(&hub, "cloud-a/", &["suspended"]).await;
    let caught_at = suspended["checks"].as_u64().unwrap();
    assert!(
        caught_at <= judged_at_drift + 2,
        "caught at check {caught_at}, {judged_at_drift} were judged when the drift began: {suspended}"
    );
    assert!(
        matches!(suspended["caught_by"].as_str(), Some("sentinel" | "canary")),
        "{suspended}"
    );
    assert!(
        suspended["reason"].as_str().unwrap().contains("0.97"),
        "{suspended}"
    );
    let served_before = up.state.served_by_slug(SLUG);
    for round in 0..3 {
        let data = embed(&hub, 500, &format!("after {round}")).await;
        assert_eq!(
            backends(&data),
            (500, 0),
            "no vector from the drifted provider"
        );
    }
    // Calls it had in flight may have finished upstream; none of their vectors came back.
    assert!(up.state.served_by_slug(SLUG) - served_before <= 64);
    assert_eq!(
        hub.metric("fantom_hub_gate_verdict{provider=\"cloud-a/")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_command_passes_a_close_route_and_refuses_a_far_one() {
    let up = upstream(Some(minilm_embedder().await)).await;
    let run = |cosine: Option<f32>| {
        up.state.set_cosine(SLUG, cosine);
        std::process::Command::new(crate::support::BIN)
            .args([
                "gate",
                "--a",
                &format!("local:{}", minilm_dir().display()),
                "--b",
                &format!("openrouter:{MODEL}@{SLUG}"),
                "--openrouter-url",
                &up.base_url,
                "--json",
            ])
            .env("OPENROUTER_API_KEY", KEY)
            .output()
            .unwrap()
    };
    let ok = tokio::task::block_in_place(|| run(None));
    let out: Value = serde_json::from_slice(&ok.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&ok.stderr)));
    assert_eq!(ok.status.code(), Some(0), "{out}");
    assert_eq!(out["verdict"], "pass");
    assert_eq!(out["dims"], 384);
    assert!(out["min_cosine"].as_f64().unwrap() > 0.999, "{out}");
    let far = tokio::task::block_in_place(|| run(Some(0.976)));
    let out: Value = serde_json::from_slice(&far.stdout).unwrap();
    assert_eq!(far.status.code(), Some(1), "{out}");
    assert_eq!(out["verdict"], "refused");
    assert!(
        (out["min_cosine"].as_f64().unwrap() - 0.976).abs() < 0.002,
        "{out}"
    );
    assert!(!String::from_utf8_lossy(&far.stderr).contains(KEY));
    assert!(!String::from_utf8_lossy(&far.stdout).contains(KEY));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_in_every_frame_suspends_a_drifted_route_on_its_first_drifted_batch() {
    let dir = tempfile::tempdir().unwrap();
    let embedder = minilm_embedder().await;
    let up = upstream(Some(embedder.clone())).await;
    // The sentinel's period is the default (600 s): only the canaries can catch the drift.
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    let _cloud = cloud_agent(dir.path(), &hub, "cloud-a", &up.base_url);
    hub.wait_for_agent("gpu").await;
    hub.wait_for_agent("cloud-a").await;
    push(&hub, "aggregate").await;
    verdict(&hub, "gpu/embedding", &["pass"]).await;
    verdict(&hub, "cloud-a/", &["pass"]).await;

    // The host redeploys behind the same slug after six more calls, while traffic flows
    // (a request whose items the drifted route also served is served again whole).
    up.state.set_cosine_after(SLUG, 6, 0.95);
    let rounds = rounds_until_drifted(&hub, &up, None).await;
    let suspended = verdict(&hub, "cloud-a/", &["suspended"]).await;
    assert_eq!(suspended["caught_by"], "canary", "{suspended}");
    let reason = suspended["reason"].as_str().unwrap();
    assert!(
        reason.contains("canary") && reason.contains("0.95"),
        "{suspended}"
    );
    assert_eq!(
        hub.metric("fantom_hub_canary_failures_total{provider=\"cloud-a/")
            .await,
        1.0,
        "suspended on its first drifted batch"
    );

    // Not one drifted vector reached a client; the canaries never did either.
    let from_cloud = cloud_vectors_all_clean(&rounds, &embedder, None).await;
    assert!(
        from_cloud > 0,
        "the cloud served before its drift: {} calls, {} canaries, {suspended}",
        up.state.requests(),
        up.state.canaries()
    );
    // The drifted calls came back (their vectors discarded); the local provider served them.
    assert!(up.state.canaries() >= 4, "one canary per cloud call");
    assert!(
        hub.metric("fantom_hub_canary_texts_total{provider=\"gpu/embedding\"}")
            .await
            > 0.0,
        "local providers carry canaries too"
    );

    // Usage counts the clients' texts only: the engine's own count for them, within the
    // estimate of the canaries' share.
    let choice: ModelChoice = toml::from_str(&format!(
        "model = \"all-minilm-l6-v2\"\nmodel_dir = \"{}\"\ndevice = \"cpu\"",
        minilm_dir().display()
    ))
    .unwrap();
    let engine = choice.load(Task::Embed).await.unwrap();
    let (texts, _) = rounds.last().unwrap();
    let (_, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": texts}),
        )
        .await;
    let usage = body["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    let own = engine
        .embed_counted(texts.clone(), EmbedOptions::default())
        .await
        .unwrap()
        .tokens as f64;
    assert!(
        (usage - own).abs() <= own * 0.04,
        "usage {usage}, the texts' own tokens {own}"
    );
}

/// Canaries at every width (issue 27): stored rows at a Matryoshka width under the space's are
/// checked as full-width ones, on the fingerprint's first entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_drifting_at_a_narrower_width_is_suspended_on_its_first_drifted_batch() {
    const WIDTH: usize = 128;
    let dir = tempfile::tempdir().unwrap();
    let embedder = minilm_embedder().await;
    let up = upstream(Some(embedder.clone())).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let _gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    let _cloud = cloud_agent(dir.path(), &hub, "cloud-a", &up.base_url);
    hub.wait_for_agent("gpu").await;
    hub.wait_for_agent("cloud-a").await;
    push(&hub, "aggregate").await;
    verdict(&hub, "gpu/embedding", &["pass"]).await;
    verdict(&hub, "cloud-a/", &["pass"]).await;

    up.state.set_cosine_after(SLUG, 6, 0.95);
    let rounds = rounds_until_drifted(&hub, &up, Some(WIDTH)).await;
    let suspended = verdict(&hub, "cloud-a/", &["suspended"]).await;
    assert_eq!(suspended["caught_by"], "canary", "{suspended}");
    assert_eq!(
        hub.metric("fantom_hub_canary_failures_total{provider=\"cloud-a/")
            .await,
        1.0,
        "suspended on its first drifted batch"
    );
    let from_cloud = cloud_vectors_all_clean(&rounds, &embedder, Some(WIDTH)).await;
    assert!(
        from_cloud > 0,
        "the cloud served at {WIDTH} dims before its drift"
    );
}

/// Requests of 200 texts (at `dimensions`, if given) while the upstream drifts after its next
/// calls, until the drift must have come; each request with its answer (all 200).
async fn rounds_until_drifted(
    hub: &HubProc,
    up: &Upstream,
    dimensions: Option<usize>,
) -> Vec<(Vec<String>, Value)> {
    let mut rounds = Vec::new();
    for round in 0..30 {
        if up.state.requests() > 8 {
            break;
        }
        let texts: Vec<String> = (0..200)
            .map(|i| format!("round {round}: text {i} about leases"))
            .collect();
        let mut body = json!({"model": "embedding", "input": texts});
        if let Some(d) = dimensions {
            body["dimensions"] = json!(d);
        }
        let (code, answer) = hub.post("/v1/embeddings", &body).await;
        assert_eq!(code, 200, "{answer}");
        rounds.push((texts, answer));
    }
    rounds
}

/// Asserts every vector answered is the clean model's for its text (cosine ≥ 0.99, cut to
/// `width` when given), one per text and no canary among them; how many came from the cloud.
async fn cloud_vectors_all_clean(
    rounds: &[(Vec<String>, Value)],
    embedder: &Embedder,
    width: Option<usize>,
) -> usize {
    let mut from_cloud = 0;
    for (texts, body) in rounds {
        let data = body["data"].as_array().unwrap();
        assert_eq!(data.len(), texts.len(), "no canary in a response");
        let clean = {
            let (embedder, texts) = (embedder.clone(), texts.clone());
            tokio::task::spawn_blocking(move || embedder(&texts))
                .await
                .unwrap()
        };
        for (i, d) in data.iter().enumerate() {
            assert_eq!(d["index"], i);
            let v = crate::support::vector(&d["embedding"]);
            let want = width.map_or(clean[i].as_slice(), |w| &clean[i][..w]);
            assert_eq!(v.len(), want.len());
            let cos = fantom_sidecar::hub::gate::measure::cosine(want, &v);
            assert!(
                cos >= 0.99,
                "round text {i}: cosine {cos} from {}",
                d["provenance"]
            );
            from_cloud += usize::from(d["provenance"]["backend"] == "cloud");
        }
    }
    from_cloud
}

/// Hubs on etcd (issue 40): a suspension the leader made just before it died is never
/// forgotten by the next, whether the write reached etcd or only its agent knew it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspension_outlives_a_leader_killed_right_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let embedder = minilm_embedder().await;
    let up = upstream(Some(embedder.clone())).await;
    let cluster = crate::etcd_cluster::Cluster::start(dir.path()).await;
    let (mut a, b) = crate::ha::leader_and_standby(dir.path(), &cluster).await;
    let both = |more: &str| format!("hub_urls = [\"{}\"]\n{more}", b.ws_url());
    let _gpu = start_agent_toml(
        dir.path(),
        &a.ws_url(),
        &a.fleet_file,
        "gpu",
        &both(&crate::support::minilm_models_toml()),
        &[],
    );
    let _cloud = start_agent_toml(
        dir.path(),
        &a.ws_url(),
        &a.fleet_file,
        "cloud-a",
        &both(&format!("openrouter_url = \"{}\"", up.base_url)),
        &[],
    );
    a.wait_for_agent("gpu").await;
    a.wait_for_agent("cloud-a").await;
    push(&a, "aggregate").await;
    verdict(&a, "gpu/embedding", &["pass"]).await;
    let pass = verdict(&a, "cloud-a/", &["pass"]).await;
    let provider = pass["provider"].as_str().unwrap().to_string();
    // The pass is in etcd: a next leader would restore it.
    cluster.part_stored("/fantom-sidecar", "verdicts").await;

    up.state.set_cosine_after(SLUG, 6, 0.95);
    rounds_until_drifted(&a, &up, None).await;
    let suspended = verdict(&a, "cloud-a/", &["suspended"]).await;
    assert_eq!(suspended["caught_by"], "canary", "{suspended}");
    // Killed at once: well within the handover's 5 s checkpoint period.
    a.proc.kill();
    crate::ha::leads(&b).await;
    b.wait_for_agent("cloud-a").await;
    let status = b.status().await;
    let now = status["gate"]["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["provider"] == provider.as_str())
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        now["state"], "suspended",
        "the new leader never restores the pass: {now}"
    );
    b.wait_for_agent("gpu").await;
    verdict(&b, "gpu/embedding", &["pass"]).await;
    let data = embed(&b, 40, "after the failover").await;
    assert_eq!(backends(&data).1, 0, "nothing from the suspended route");

    // Only an operator's verify lifts it, and only once the route is clean again.
    up.state.set_cosine(SLUG, None);
    let (code, body) = b
        .post_admin("/admin/gate/verify", &json!({"provider": provider}))
        .await;
    assert_eq!(code, 200, "{body}");
    verdict(&b, "cloud-a/", &["pass"]).await;
}
