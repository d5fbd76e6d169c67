//! The hub at fleet scale: one real `fantom-sidecar hub` process, and 1, 10, 100 then 1 000
//! agents connected to it from this process (real [`Agent`]s over real loopback WebSockets,
//! each hosting a provider that answers at once with 8 floats). For each fleet size:
//!
//! * items/s: 1 000-text embedding requests, 8 in flight, for a fixed count;
//! * added latency: one-text requests one after another, p50/p99, next to the same request
//!   answered straight from an axum handler in this process (the reference; their difference
//!   is what the hub and the protocol add);
//! * hub memory per connected agent: the hub process's resident set (`/proc/<pid>/status`)
//!   with the fleet connected and idle, minus before any agent, over the agents (measured
//!   first, as the fleet grows with no traffic; then the fleet leaves and grows again for the
//!   traffic).
//!
//! `cargo bench --bench fleet_scale` prints the table (the one in `docs/benchmarks.md`).
//! Bounded: every wait has a deadline, and the hub process is killed at the end.

use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use fantom_sidecar::secret::Secret;

#[path = "support/hub_process.rs"]
mod hub_process;
#[path = "support/latency.rs"]
mod latency;
#[path = "support/null_provider.rs"]
mod null_provider;

use hub_process::spawn_hub;
use latency::percentile;
use null_provider::{embed, items_per_s, null_agent, start_direct};

const FLEETS: [usize; 4] = [1, 10, 100, 1000];
const BIG_REQUESTS: usize = 200;
const IN_FLIGHT: usize = 8;
const ONE_TEXT_REQUESTS: usize = 1000;
const WAIT: Duration = Duration::from_secs(120);

/// The hub process, killed when dropped.
struct HubProcess {
    child: Child,
    addr: SocketAddr,
    fleet_token: Secret,
    _state: tempfile::TempDir,
}

impl Drop for HubProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_hub() -> HubProcess {
    let state = tempfile::tempdir().expect("a temp dir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fantom-sidecar"));
    cmd.args(["--log-format", "json", "hub", "--listen", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(state.path());
    let (child, addr) = spawn_hub(cmd);
    let token = std::fs::read_to_string(state.path().join("fleet.token")).expect("its token");
    HubProcess {
        child,
        addr,
        fleet_token: Secret::new(token.trim()),
        _state: state,
    }
}

/// The hub's resident set, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

async fn metrics(client: &reqwest::Client, addr: SocketAddr) -> String {
    match client.get(format!("http://{addr}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// `fantom_hub_agents_connected` in a `/metrics` text.
fn agents_connected(metrics: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("fantom_hub_agents_connected "))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits until `n` agents are connected and their providers pass the gate.
async fn wait_for_fleet(client: &reqwest::Client, addr: SocketAddr, n: usize) {
    let deadline = Instant::now() + WAIT;
    loop {
        let text = metrics(client, addr).await;
        let connected = agents_connected(&text).unwrap_or(0.0) as usize;
        let passing = text
            .lines()
            .filter(|l| l.starts_with("fantom_hub_gate_verdict{") && l.contains("state=\"pass\""))
            .count();
        if connected >= n && passing >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{connected}/{n} agents connected, {passing} passing"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn one_text_latencies(client: &reqwest::Client, addr: SocketAddr) -> Vec<f64> {
    let one = vec!["fn main() {}".to_string()];
    let mut v = Vec::with_capacity(ONE_TEXT_REQUESTS);
    for _ in 0..ONE_TEXT_REQUESTS {
        let t = Instant::now();
        embed(client, addr, &one).await;
        v.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    v.sort_by(f64::total_cmp);
    v
}

/// The agents of this process, each with a stop switch.
#[derive(Default)]
struct Fleet {
    stops: Vec<tokio::sync::watch::Sender<bool>>,
    next_id: usize,
}

impl Fleet {
    /// Connects agents until `n` serve (dialling in waves of 100: the accept backlog holds).
    async fn grow(&mut self, client: &reqwest::Client, hub: &HubProcess, n: usize) {
        while self.stops.len() < n {
            let agent = null_agent(
                vec![format!("ws://{}/v1/agent", hub.addr)],
                format!("scale-{}", self.next_id),
                &hub.fleet_token,
            );
            self.next_id += 1;
            let (stop, rx) = tokio::sync::watch::channel(false);
            self.stops.push(stop);
            tokio::spawn(agent.run(rx));
            if self.stops.len().is_multiple_of(100) {
                wait_for_fleet(client, hub.addr, self.stops.len()).await;
            }
        }
        wait_for_fleet(client, hub.addr, n).await;
    }

    /// Every agent drains and leaves.
    async fn leave(&mut self, client: &reqwest::Client, addr: SocketAddr) {
        for stop in self.stops.drain(..) {
            let _ = stop.send(true);
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let connected = agents_connected(&metrics(client, addr).await).unwrap_or(f64::MAX);
            if connected == 0.0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{connected} agents still connected"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        // `cargo test --benches` / `cargo bench -- --list`: nothing to list, nothing to run.
        return;
    }
    let rt = latency::runtime();
    let hub = start_hub();
    let pid = hub.child.id();
    let client = reqwest::Client::new();
    let mut rows = Vec::new();
    rt.block_on(async {
        let direct = start_direct();
        let reference = one_text_latencies(&client, direct).await;
        let ref_p50 = percentile(&reference, 0.5);
        let _ = metrics(&client, hub.addr).await;
        // Memory first, with no traffic: the fleet grows, idle, and the hub's resident set is
        // read at each size (then the fleet leaves).
        let baseline_kib = rss_kib(pid);
        let mut fleet = Fleet::default();
        let mut memory = Vec::new();
        for n in FLEETS {
            fleet.grow(&client, &hub, n).await;
            memory.push(rss_kib(pid).saturating_sub(baseline_kib) as f64 / n as f64);
        }
        fleet.leave(&client, hub.addr).await;
        // Then traffic, at each size.
        for (n, per_agent_kib) in FLEETS.into_iter().zip(memory) {
            fleet.grow(&client, &hub, n).await;
            let rate = items_per_s(&client, hub.addr, BIG_REQUESTS, IN_FLIGHT).await;
            let via_hub = one_text_latencies(&client, hub.addr).await;
            let (p50, p99) = (percentile(&via_hub, 0.5), percentile(&via_hub, 0.99));
            println!(
                "{n} agents: {rate:.0} items/s; one text p50 {p50:.3} ms, p99 {p99:.3} ms (direct p50 {ref_p50:.3} ms); {per_agent_kib:.1} KiB of hub memory per idle agent"
            );
            rows.push((n, rate, p50 - ref_p50, p99 - ref_p50, per_agent_kib));
        }
        fleet.leave(&client, hub.addr).await;
    });
    println!("\nfleet_scale (one hub process, agents over loopback WebSockets, null provider):");
    println!(
        "| agents | items/s (1 000-text requests, 8 in flight) | added p50 | added p99 | hub memory per idle agent |"
    );
    println!("|---:|---:|---:|---:|---:|");
    for (n, rate, p50, p99, kib) in rows {
        println!("| {n} | {rate:.0} | {p50:.3} ms | {p99:.3} ms | {kib:.1} KiB |");
    }
}
