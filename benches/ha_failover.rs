//! Hubs on etcd: failover and the dispatch path. Real processes: a three-member etcd on
//! loopback (the HA tests' cluster), two `fantom-sidecar hub` processes on it, ten agents of
//! this process (real [`Agent`]s listing both hubs, each with a provider that answers at once).
//!
//! * **Failover**, 10 kills: eight clients send one-text embeddings back to back, each to the
//!   hub that last answered it and to the other one after a failure (a 50 ms pause after a
//!   failure, as a retrying client would). The leader is killed (SIGKILL); measured: the time
//!   from the kill to the first request served after it, and the requests that failed in
//!   between. The killed hub is started again on its port (it stands by) before the next kill.
//! * **Faults a kill does not show**, 3 runs each: the leader frozen (SIGSTOP; measured like a
//!   kill, then SIGCONT: it exits 75 and is started again), and the leader cut off from etcd
//!   only (its etcd traffic through a loopback cutter; measured: the time from the cut until a
//!   request sent to its address is served by the new leader, forwarded after it stepped
//!   aside).
//! * **Dispatch**: items/s over 200 requests of 1 000 texts, 8 in flight, through the leader on
//!   etcd and through a hub on a state file, with the same ten agents: the hot path never
//!   touches the store, so the two should not differ beyond the runs' spread.
//!
//! `cargo bench --bench ha_failover` prints the tables of `docs/benchmarks.md`. Bounded: every
//! wait has a deadline; the processes are killed at the end.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fantom_sidecar::secret::Secret;

#[allow(dead_code)]
#[path = "../tests/fleet/etcd_cluster.rs"]
mod etcd_cluster;
#[path = "support/hub_process.rs"]
mod hub_process;
#[path = "support/latency.rs"]
mod latency;
#[allow(dead_code)]
#[path = "support/null_provider.rs"]
mod null_provider;

/// What the HA tests' cluster takes from their support module.
mod support {
    use std::time::{Duration, Instant};

    pub const PATIENCE: Duration = Duration::from_secs(120);

    pub fn free_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        l.local_addr().expect("its address").port()
    }

    pub async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(v) = probe().await {
                return v;
            }
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

use null_provider::{items_per_s, null_agent};

const KILLS: usize = 10;
/// Frozen leaders, and leaders cut off from etcd only.
const FAULT_RUNS: usize = 3;
const AGENTS: usize = 10;
const CLIENTS: usize = 8;
const BIG_REQUESTS: usize = 200;
const IN_FLIGHT: usize = 8;
const TTL_S: &str = "5";

struct HubProcess {
    child: Child,
    addr: SocketAddr,
}

impl Drop for HubProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A hub on `listen` with the shared tokens in `tokens`; `etcd`: its endpoints, else a state
/// file in `state`.
fn start_hub(listen: &str, tokens: &Path, state: &Path, etcd: Option<&str>) -> HubProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fantom-sidecar"));
    cmd.args(["--log-format", "json", "hub", "--listen", listen])
        .arg("--state-dir")
        .arg(state)
        .arg("--admin-token-file")
        .arg(tokens.join("admin.token"))
        .arg("--fleet-token-file")
        .arg(tokens.join("fleet.token"));
    if let Some(endpoints) = etcd {
        cmd.args(["--etcd-endpoints", endpoints, "--leader-ttl-s", TTL_S]);
    }
    let (child, addr) = hub_process::spawn_hub(cmd);
    HubProcess { child, addr }
}

/// Sends signal `name` (`STOP`, `CONT`) to `child`.
fn signal(child: &Child, name: &str) {
    let sent = Command::new("kill")
        .args([format!("-{name}"), child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(sent, "kill -{name}");
}

/// Whether `addr` serves a one-text embedding within a second.
async fn serves_quickly(client: &reqwest::Client, addr: SocketAddr) -> bool {
    client
        .post(format!("http://{addr}/v1/embeddings"))
        .json(&serde_json::json!({"model": "embedding", "input": ["fn frozen() {}"]}))
        .timeout(Duration::from_secs(1))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

/// Whether `addr` serves a one-text embedding now.
async fn serves(client: &reqwest::Client, addr: SocketAddr) -> bool {
    client
        .post(format!("http://{addr}/v1/embeddings"))
        .json(&serde_json::json!({"model": "embedding", "input": ["fn main() {}"]}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

/// Whether `addr` leads (its `/health` is not a standby's).
async fn leads(client: &reqwest::Client, addr: SocketAddr) -> bool {
    match client
        .get(format!("http://{addr}/health"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
    {
        Ok(r) => r
            .json::<serde_json::Value>()
            .await
            .is_ok_and(|v| v["status"] != "standby"),
        Err(_) => false,
    }
}

/// `AGENTS` agents dialling `hubs`; their stop switches.
fn agents(hubs: &[SocketAddr], token: &Secret, tag: &str) -> Vec<tokio::sync::watch::Sender<bool>> {
    (0..AGENTS)
        .map(|i| {
            let agent = null_agent(
                hubs.iter().map(|a| format!("ws://{a}/v1/agent")).collect(),
                format!("{tag}-{i}"),
                token,
            );
            let (stop, rx) = tokio::sync::watch::channel(false);
            tokio::spawn(agent.run(rx));
            stop
        })
        .collect()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rt = latency::runtime();
    let dir = tempfile::tempdir().expect("a temp dir");
    let tokens = dir.path().join("tokens");
    std::fs::create_dir_all(&tokens).expect("the tokens' dir");
    std::fs::write(tokens.join("admin.token"), "bench-admin-token").expect("a token");
    std::fs::write(tokens.join("fleet.token"), "bench-fleet-token").expect("a token");
    let token = Secret::new("bench-fleet-token");
    let client = reqwest::Client::new();
    rt.block_on(async {
        let cluster = etcd_cluster::Cluster::start(dir.path()).await;
        let endpoints = cluster.endpoints();
        let listens = [
            format!("127.0.0.1:{}", support::free_port()),
            format!("127.0.0.1:{}", support::free_port()),
        ];
        let state = |i: usize| dir.path().join(format!("hub{i}"));
        let mut hubs: Vec<HubProcess> = (0..2)
            .map(|i| start_hub(&listens[i], &tokens, &state(i), Some(&endpoints)))
            .collect();
        let addrs = [hubs[0].addr, hubs[1].addr];
        let _fleet = agents(&addrs, &token, "ha");
        support::eventually("the fleet serves", || async {
            serves(&client, addrs[0]).await.then_some(())
        })
        .await;
        let leader = if leads(&client, addrs[0]).await { 0 } else { 1 };
        let etcd_rate = items_per_s(&client, addrs[leader], BIG_REQUESTS, IN_FLIGHT).await;

        // Clients that retry on the other hub.
        let failed = Arc::new(AtomicU64::new(0));
        // Each success: when it was sent, when it was answered.
        let served = Arc::new(Mutex::new(Vec::<(Instant, Instant)>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let load: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (client, failed, served, stop) =
                    (client.clone(), failed.clone(), served.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut at = c % 2;
                    while !stop.load(Ordering::Relaxed) {
                        let sent = Instant::now();
                        if serves(&client, addrs[at]).await {
                            let done = Instant::now();
                            served.lock().expect("the log").push((sent, done));
                        } else {
                            failed.fetch_add(1, Ordering::Relaxed);
                            at = 1 - at;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                })
            })
            .collect();
        let mut rows = Vec::new();
        for kill in 1..=KILLS {
            let leader = if leads(&client, addrs[0]).await { 0 } else { 1 };
            let failed_before = failed.load(Ordering::Relaxed);
            let _ = hubs[leader].child.kill();
            let killed = Instant::now();
            let _ = hubs[leader].child.wait();
            // The first request sent after the kill that was served: only the new leader can
            // have served it.
            let took = support::eventually("a request sent after the kill is served", || async {
                served
                    .lock()
                    .expect("the log")
                    .iter()
                    .filter(|(sent, _)| *sent > killed)
                    .map(|(_, done)| done.duration_since(killed))
                    .min()
            })
            .await;
            let lost = failed.load(Ordering::Relaxed) - failed_before;
            println!(
                "kill {kill}: served again {:.2} s after the kill; {lost} requests failed",
                took.as_secs_f64()
            );
            rows.push((took.as_secs_f64(), lost));
            hubs[leader] = start_hub(&listens[leader], &tokens, &state(leader), Some(&endpoints));
            support::eventually("the killed hub stands by", || async {
                (!leads(&client, addrs[leader]).await).then_some(())
            })
            .await;
        }
        // Frozen leaders: SIGSTOP, the time until a request sent after it is served (the
        // standby leads after the TTL; the agents pass the frozen hub over), then SIGCONT (the
        // woken hub exits 75: its lease is gone) and it is started again.
        let mut frozen_rows = Vec::new();
        for run in 1..=FAULT_RUNS {
            let leader = if leads(&client, addrs[0]).await { 0 } else { 1 };
            let failed_before = failed.load(Ordering::Relaxed);
            signal(&hubs[leader].child, "STOP");
            let stopped = Instant::now();
            // Served by the new leader at its own address (the clients' own 10 s timeout on
            // the frozen hub is theirs, not the failover's).
            let other = addrs[1 - leader];
            let took = support::eventually("the new leader serves", || async {
                serves_quickly(&client, other).await.then(|| stopped.elapsed())
            })
            .await;
            let lost = failed.load(Ordering::Relaxed) - failed_before;
            println!(
                "freeze {run}: served again {:.2} s after the SIGSTOP; {lost} requests failed",
                took.as_secs_f64()
            );
            frozen_rows.push((took.as_secs_f64(), lost));
            signal(&hubs[leader].child, "CONT");
            let _ = hubs[leader].child.wait();
            hubs[leader] = start_hub(&listens[leader], &tokens, &state(leader), Some(&endpoints));
            support::eventually("the frozen hub stands by", || async {
                (!leads(&client, addrs[leader]).await).then_some(())
            })
            .await;
        }
        stop.store(true, Ordering::Relaxed);
        for l in load {
            let _ = l.await;
        }

        // A leader cut off from etcd (its etcd traffic through a cutter), not from its agents
        // and clients: the time until the new leader serves a request sent to the cut hub's
        // address (forwarded after it stepped aside).
        let cutter = etcd_cluster::Cutter::start(&cluster.first_url()).await;
        let mut cut_rows = Vec::new();
        for run in 1..=FAULT_RUNS {
            // Hub 0 reaches etcd through the cutter only, and leads.
            let _ = hubs[0].child.kill();
            let _ = hubs[0].child.wait();
            hubs[0] = start_hub(&listens[0], &tokens, &state(0), Some(&cutter.url));
            if !leads(&client, addrs[0]).await {
                let _ = hubs[1].child.kill();
                let _ = hubs[1].child.wait();
                support::eventually("hub 0 leads", || async {
                    leads(&client, addrs[0]).await.then_some(())
                })
                .await;
                hubs[1] = start_hub(&listens[1], &tokens, &state(1), Some(&endpoints));
            }
            support::eventually("hub 1 stands by", || async {
                (!leads(&client, addrs[1]).await).then_some(())
            })
            .await;
            support::eventually("the fleet serves through hub 0", || async {
                serves(&client, addrs[0]).await.then_some(())
            })
            .await;
            // Hub 0 knows hub 1 (the list it asks when cut off is read every third of a TTL).
            let one = format!("http://{}", addrs[1]);
            support::eventually("hub 0 lists hub 1", || async {
                let s: serde_json::Value = client
                    .get(format!("http://{}/admin/status", addrs[0]))
                    .bearer_auth("bench-admin-token")
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                s["ha"]["peers"]
                    .as_array()?
                    .iter()
                    .any(|p| p == one.as_str())
                    .then_some(())
            })
            .await;
            cutter.cut_after(0);
            let cut = Instant::now();
            let took = support::eventually("the new leader serves through the cut hub", || async {
                let r = client
                    .post(format!("http://{}/v1/embeddings", addrs[0]))
                    .json(&serde_json::json!({"model": "embedding", "input": ["cut"]}))
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await
                    .ok()?;
                (r.status().is_success() && r.headers().contains_key("x-fantom-forwarded-by"))
                    .then(|| cut.elapsed())
            })
            .await;
            println!(
                "partition {run}: the new leader served through the cut hub {:.2} s after the cut",
                took.as_secs_f64()
            );
            cut_rows.push(took.as_secs_f64());
            cutter.heal();
            let _ = hubs[0].child.wait();
        }

        // The same fleet on a hub with a state file.
        let file_hub = start_hub("127.0.0.1:0", &tokens, &dir.path().join("file"), None);
        let _file_fleet = agents(&[file_hub.addr], &token, "file");
        support::eventually("the file hub's fleet serves", || async {
            serves(&client, file_hub.addr).await.then_some(())
        })
        .await;
        let file_rate = items_per_s(&client, file_hub.addr, BIG_REQUESTS, IN_FLIGHT).await;
        let leader = if leads(&client, addrs[0]).await { 0 } else { 1 };
        let etcd_rate_again = items_per_s(&client, addrs[leader], BIG_REQUESTS, IN_FLIGHT).await;

        println!("\nha_failover ({KILLS} kills of the leader, TTL {TTL_S} s, {CLIENTS} clients):");
        println!("| kill | served again after | requests failed |");
        println!("|---:|---:|---:|");
        for (i, (s, lost)) in rows.iter().enumerate() {
            println!("| {} | {s:.2} s | {lost} |", i + 1);
        }
        let mut times: Vec<f64> = rows.iter().map(|r| r.0).collect();
        times.sort_by(f64::total_cmp);
        println!(
            "median {:.2} s, worst {:.2} s; {} requests failed in all",
            latency::percentile(&times, 0.5),
            times[times.len() - 1],
            rows.iter().map(|r| r.1).sum::<u64>()
        );
        println!("\nfrozen leader (SIGSTOP, {FAULT_RUNS} runs) and a leader cut off from etcd only ({FAULT_RUNS} runs), TTL {TTL_S} s:");
        println!("| fault | served by the new leader after (median, worst) | client requests failed |");
        println!("|---|---:|---:|");
        let summary = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            (latency::percentile(&v, 0.5), v[v.len() - 1])
        };
        let (m, w) = summary(times.clone());
        println!("| kill -9 | {m:.2} s, {w:.2} s | {} |", rows.iter().map(|r| r.1).sum::<u64>());
        let (m, w) = summary(frozen_rows.iter().map(|r| r.0).collect());
        println!(
            "| SIGSTOP | {m:.2} s, {w:.2} s | {} |",
            frozen_rows.iter().map(|r| r.1).sum::<u64>()
        );
        let (m, w) = summary(cut_rows.clone());
        println!("| etcd-only partition (through the cut hub) | {m:.2} s, {w:.2} s | — |");
        println!("\ndispatch (200 requests of 1 000 texts, 8 in flight, {AGENTS} agents):");
        println!("| store | items/s |");
        println!("|---|---:|");
        println!("| etcd (leader), before the kills | {etcd_rate:.0} |");
        println!("| etcd (leader), after the kills | {etcd_rate_again:.0} |");
        println!("| state file | {file_rate:.0} |");
        drop(cluster);
    });
}
