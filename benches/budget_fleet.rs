//! The cloud budget with real processes: a hub and three cloud-only agents (this build's
//! binary, each its own process, on loopback sockets) in front of the OpenRouter stand-in of
//! the tests (`tests/fleet/upstream.rs`), which holds a hidden number of calls at once for
//! 0.8–1.2 s each (1 s on average), refuses one more with a fast 429 (`Retry-After: 1`) and
//! reports no RPM (a funded key: a ceiling of 16 permits). 48 clients send chats until 400 are
//! answered. Two shapes, as `budget_sim`'s last rows:
//!
//! * **cap 10**: the upstream holds fewer than the ceiling, so the budget must find the wall;
//! * **cap 20**: it holds more, so the ceiling of 16 is the limit and the run's time is what
//!   a start below the ceiling could cost.
//!
//! `cargo bench --bench budget_fleet` prints, per shape, the run's time, the goodput over the
//! whole run, start included (chats answered over what the upstream could answer in the run's
//! time at the smaller of its cap and the ceiling, 1 s each), the upstream's 429s, and a
//! timeline of calls in flight at the upstream per second, to see where any shortfall goes.

#[path = "support/latency.rs"]
#[allow(dead_code)]
mod latency;
#[path = "../tests/fleet/upstream.rs"]
mod upstream;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

const KEY: &str = "sk-or-v1-bench-budget-0123456789abcdef0123456789abcdef";
const MODEL: &str = "poolside/laguna-s-2.1";
/// The upstream's hidden concurrency, per shape.
const CAPS: [usize; 2] = [10, 20];
/// The budget's ceiling for a funded key without an RPM.
const CEILING: usize = 16;
const LATENCY_MS: (u64, u64) = (800, 1200);
const CLIENTS: usize = 48;
const CHATS: usize = 400;
const AGENTS: [&str; 3] = ["cloud-a", "cloud-b", "cloud-c"];

/// A child process killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    l.local_addr().expect("its address").port()
}

fn spawn(args: &[&str], log: &Path) -> Running {
    let log = std::fs::File::create(log).expect("a log file");
    let child = Command::new(env!("CARGO_BIN_EXE_fantom-sidecar"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("the binary starts");
    Running(child)
}

/// Polls `probe` every 20 ms until it answers, for at most 60 s.
async fn until<F: AsyncFnMut() -> bool>(what: &str, mut probe: F) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !probe().await {
        assert!(Instant::now() < deadline, "{what} did not happen in 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // `cargo bench --bench budget_fleet -- <name>` runs the shapes whose name contains it.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let shapes = [
        ("cap10", CAPS[0], Start::Settled),
        ("cap20", CAPS[1], Start::Settled),
        ("cap10-whole-run", CAPS[0], Start::AtPush),
    ];
    for (name, cap, start) in shapes {
        if filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str())) {
            latency::runtime().block_on(run(cap, start));
        }
    }
}

/// When the clients start.
#[derive(Clone, Copy, PartialEq)]
enum Start {
    /// Once every agent serves the route and the budget knows the account (its ceiling).
    Settled,
    /// As soon as the push is answered: the whole run, the routes reaching the agents and the
    /// account's discovery included, as an operator's first minute goes.
    AtPush,
}

async fn run(cap: usize, start: Start) {
    let up = Upstream::start(UpstreamConfig {
        key: KEY.into(),
        endpoints: vec![Endpoint {
            model: MODEL.into(),
            slug: "poolside".into(),
            quantization: "unknown".into(),
            kind: EndpointKind::Chat,
        }],
        max_concurrency: Some(cap),
        latency_ms: LATENCY_MS,
        ..Default::default()
    })
    .await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let state = dir.path().join("state");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _hub = spawn(
        &[
            "hub",
            "--listen",
            &listen,
            "--state-dir",
            &state.display().to_string(),
        ],
        &dir.path().join("hub.log"),
    );
    let http = reqwest::Client::new();
    let base = format!("http://{listen}");
    until("the hub answers", async || {
        http.get(format!("{base}/health")).send().await.is_ok()
    })
    .await;
    let admin = std::fs::read_to_string(state.join("admin.token")).expect("admin token");
    let admin = admin.trim().to_string();
    let mut agents = Vec::new();
    for id in AGENTS {
        let config = dir.path().join(format!("{id}.toml"));
        std::fs::write(
            &config,
            format!(
                "hub_url = \"ws://{listen}/v1/agent\"\nagent_id = \"{id}\"\nfleet_token_file = \"{}\"\nopenrouter_url = \"{}\"\ncloud_pipeline_depth = 8\n",
                state.join("fleet.token").display(),
                up.base_url
            ),
        )
        .expect("agent config");
        agents.push(spawn(
            &[
                "agent",
                "--config",
                &config.display().to_string(),
                "--http",
                "127.0.0.1:0",
            ],
            &dir.path().join(format!("{id}.log")),
        ));
    }
    let status = async || -> Value {
        http.get(format!("{base}/admin/status"))
            .bearer_auth(&admin)
            .send()
            .await
            .expect("status")
            .json()
            .await
            .expect("json")
    };
    until("three agents", async || {
        status().await["agents"].as_array().map_or(0, Vec::len) == AGENTS.len()
    })
    .await;
    let push = json!({"openrouter": {"apiKey": KEY,
        "allowedModels": {"code-assistant": {"model": MODEL}},
        "modeByRole": {"code-assistant": "cloud"}}});
    let r = http
        .post(format!("{base}/admin/config"))
        .bearer_auth(&admin)
        .json(&push)
        .send()
        .await
        .expect("push");
    assert!(r.status().is_success(), "{}", r.status());
    let pushed = Instant::now();
    until("every agent's cloud route", async || {
        if start == Start::AtPush {
            return true;
        }
        let s = status().await;
        let routes = s["agents"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["providers"].as_array().is_some_and(|p| !p.is_empty()))
            .count();
        routes == AGENTS.len() && s["budget"]["ceiling"] == 16
    })
    .await;

    // The run: 48 clients, each sending its next chat when the last is answered.
    let sent = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let sampler = {
        let state = up.state.clone();
        let mut stopped = stopped;
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tokio::select! {
                    _ = tick.tick() => samples.push((started.elapsed(), state.in_flight())),
                    _ = stopped.changed() => return samples,
                }
            }
        })
    };
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (http, url, sent) = (
                http.clone(),
                format!("{base}/v1/chat/completions"),
                sent.clone(),
            );
            tokio::spawn(async move {
                let mut failed = 0;
                while sent.fetch_add(1, Ordering::Relaxed) < CHATS {
                    let body = json!({"model": "code-assistant",
                        "messages": [{"role": "user", "content": format!("client {c}")}]});
                    let r = http.post(&url).json(&body).send().await.expect("sent");
                    let ok = r.status().is_success();
                    let answer = r.bytes().await.unwrap_or_default();
                    if !ok {
                        if failed == 0 {
                            eprintln!("  a failed chat: {}", String::from_utf8_lossy(&answer));
                        }
                        failed += 1;
                    }
                }
                failed
            })
        })
        .collect();
    let mut failed = 0;
    for c in clients {
        failed += c.await.expect("a client");
    }
    let took = started.elapsed();
    let _ = stop.send(true);
    let route = status().await["budget"]["routes"].clone();
    let samples = sampler.await.expect("the sampler");

    let mean_s = (LATENCY_MS.0 + LATENCY_MS.1) as f64 / 2000.0;
    let possible = cap.min(CEILING) as f64 * took.as_secs_f64() / mean_s;
    let served = up.state.served();
    let (throttled, calls) = (up.state.throttled_429(), up.state.requests());
    let from = match start {
        Start::Settled => "once the budget knew the account",
        Start::AtPush => "from the push (the whole run)",
    };
    println!(
        "budget_fleet: {CHATS} chats from {CLIENTS} clients through 3 agent processes, upstream cap {cap} at {}-{} ms, {from}:",
        LATENCY_MS.0, LATENCY_MS.1
    );
    if start == Start::AtPush {
        println!(
            "  the clients started {:.0} ms after the push was answered",
            started.duration_since(pushed).as_secs_f64() * 1000.0
        );
    }
    println!(
        "  {:.1} s, {served} answered ({failed} failed): goodput {:.3} of the cap; {throttled} upstream 429s in {calls} calls ({:.2} %)",
        took.as_secs_f64(),
        served as f64 / possible,
        100.0 * throttled as f64 / calls.max(1) as f64
    );
    // Calls in flight at the upstream, averaged per second, against the cap.
    let mut line = String::new();
    for second in 0..=took.as_secs() {
        let window: Vec<usize> = samples
            .iter()
            .filter(|(at, _)| at.as_secs() == second)
            .map(|(_, n)| *n)
            .collect();
        if window.is_empty() {
            continue;
        }
        let mean = window.iter().sum::<usize>() as f64 / window.len() as f64;
        line.push_str(&format!(" {mean:.1}"));
    }
    println!("  in flight per second (cap {cap}):{line}");
    println!("  route at the end: {route}");
    drop(agents);
}
