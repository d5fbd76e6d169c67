//! Time to first token of a streamed chat: what the hub adds over calling the upstream
//! directly. The OpenRouter stand-in of the tests (`tests/fleet/upstream.rs`, streaming its
//! chunks piece by piece), a hub in this process and one real agent with the cloud chat route,
//! all over loopback HTTP and WebSocket.
//!
//! `cargo bench --bench chat_ttft` sends 300 streamed chats one after another each way
//! (straight to the stand-in with the key, and through the hub: client → hub → agent →
//! stand-in → `chunk` frames → server-sent events) and prints the time to the first content
//! chunk, p50 and p99, and the difference and ratio of the p50s.

#[path = "../tests/fleet/upstream.rs"]
mod upstream;

#[path = "support/inprocess_hub.rs"]
mod inprocess_hub;
#[path = "support/latency.rs"]
mod latency;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fantom_sidecar::agent::{Agent, AgentOptions, CloudOptions};
use fantom_sidecar::config::push::OpenRouterPush;
use fantom_sidecar::protocol::codec::DEFAULT_MAX_FRAME_BYTES;
use latency::percentile;
use serde_json::{Value, json};
use upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

const KEY: &str = "sk-or-v1-bench-key";
const MODEL: &str = "poolside/laguna-s-2.1";
const CHATS: usize = 300;

/// Sends one streamed chat and returns the milliseconds until its first content chunk (the
/// rest is read to the end).
async fn first_token_ms(request: reqwest::RequestBuilder) -> f64 {
    let started = Instant::now();
    let mut r = request.send().await.expect("sent");
    assert!(r.status().is_success(), "{}", r.status());
    let (mut pending, mut first) = (String::new(), None);
    while let Some(bytes) = r.chunk().await.expect("read") {
        pending.push_str(&String::from_utf8_lossy(&bytes));
        if first.is_none() && pending.contains("\"content\"") {
            first = Some(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    assert!(pending.contains("[DONE]"), "{pending}");
    first.expect("a content chunk")
}

async fn measure(make: impl Fn() -> reqwest::RequestBuilder) -> Vec<f64> {
    let mut v = Vec::with_capacity(CHATS);
    for _ in 0..CHATS {
        v.push(first_token_ms(make()).await);
    }
    v.sort_by(f64::total_cmp);
    v
}

fn body(stream_to: &str) -> Value {
    json!({"model": stream_to, "stream": true,
           "messages": [{"role": "user", "content": "three words here"}]})
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rt = latency::runtime();
    rt.block_on(async {
        let up = Upstream::start(UpstreamConfig {
            key: KEY.into(),
            endpoints: vec![Endpoint {
                model: MODEL.into(),
                slug: "poolside".into(),
                quantization: "unknown".into(),
                kind: EndpointKind::Chat,
            }],
            ..Default::default()
        })
        .await;
        let bench_hub = inprocess_hub::start();
        let (hub, addr): (_, SocketAddr) = (bench_hub.hub.clone(), bench_hub.addr);
        let agent = Agent::new(AgentOptions {
            hub_urls: vec![format!("ws://{addr}/v1/agent")],
            agent_id: "ttft".into(),
            fleet_token: bench_hub.fleet_token.clone(),
            ca_file: None,
            drain_timeout: Duration::from_secs(5),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            providers: Vec::new(),
            servers: Default::default(),
            cloud: CloudOptions {
                openrouter_url: up.base_url.clone(),
                ..CloudOptions::default()
            },
        });
        let (_stop, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(agent.run(rx));
        let deadline = Instant::now() + Duration::from_secs(60);
        while hub.core().agents().is_empty() {
            assert!(Instant::now() < deadline, "the agent did not connect");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let push: OpenRouterPush = serde_json::from_value(json!({"apiKey": KEY,
            "allowedModels": {"code-assistant": {"model": MODEL}},
            "modeByRole": {"code-assistant": "cloud"}}))
        .expect("a push");
        hub.push_config(push).await.expect("applied");
        let client = reqwest::Client::new();
        let via_hub = || {
            client
                .post(format!("http://{addr}/v1/chat/completions"))
                .json(&body("code-assistant"))
        };
        // The cloud route comes up with the push's ack; the first chat waits for it.
        let ready = Instant::now() + Duration::from_secs(60);
        loop {
            let r = via_hub().send().await.expect("sent");
            if r.status().is_success() {
                let _ = r.bytes().await;
                break;
            }
            assert!(
                Instant::now() < ready,
                "the chat route never served: {}",
                r.status()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let direct = measure(|| {
            client
                .post(format!("{}/chat/completions", up.base_url))
                .bearer_auth(KEY)
                .json(&body(MODEL))
        })
        .await;
        let hubbed = measure(via_hub).await;
        let (d50, d99) = (percentile(&direct, 0.5), percentile(&direct, 0.99));
        let (h50, h99) = (percentile(&hubbed, 0.5), percentile(&hubbed, 0.99));
        println!("chat_ttft ({CHATS} streamed chats each way, loopback, the stand-in upstream):");
        println!("  straight to the upstream:   first token p50 {d50:.3} ms, p99 {d99:.3} ms");
        println!("  through hub + agent:        first token p50 {h50:.3} ms, p99 {h99:.3} ms");
        println!(
            "  added by hub + agent + protocol: p50 {:.3} ms (ratio {:.2}x), p99 {:.3} ms",
            h50 - d50,
            h50 / d50,
            h99 - d99
        );
    });
}
