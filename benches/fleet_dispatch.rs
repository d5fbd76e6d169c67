//! What the hub and the fleet protocol cost, with no inference at all: a hub and two agents
//! in this process, talking over real loopback sockets (HTTP for the client, WebSocket for the
//! agents), each agent hosting a provider that answers instantly with a fixed 8-float vector
//! (compiled only here).
//!
//! `cargo bench --bench fleet_dispatch` measures with criterion:
//! * `items/1000_per_request`: one client request of 1 000 texts, split into items, formed
//!   into work frames for the pullers, answered, reassembled: items per second.
//! * `roundtrip/direct_http` (the reference: the same axum + reqwest stack answering one
//!   embedding straight from a handler) and `roundtrip/hub_one_text` (one text through the hub,
//!   a work frame out and a done frame back). Their difference is the latency the hub and the
//!   protocol add; their ratio is printed.
//!
//! After criterion, it prints a summary (p50/p95 over 2 000 sequential requests of each kind,
//! items/s over 20 requests of 1 000 with 4 in flight).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use tokio::runtime::Runtime;

#[path = "support/inprocess_hub.rs"]
mod inprocess_hub;
#[path = "support/latency.rs"]
mod latency;
#[allow(dead_code)]
#[path = "support/null_provider.rs"]
mod null_provider;

use latency::percentile;
use null_provider::{embed, null_agent, start_direct};

struct Fleet {
    hub_addr: SocketAddr,
    direct_addr: SocketAddr,
    client: reqwest::Client,
    _hub: inprocess_hub::BenchHub,
}

fn start(rt: &Runtime) -> Fleet {
    rt.block_on(async {
        let bench_hub = inprocess_hub::start();
        let (hub, hub_addr, fleet_token) = (
            bench_hub.hub.clone(),
            bench_hub.addr,
            bench_hub.fleet_token.clone(),
        );
        // The reference server: one embedding straight from a handler, same stack.
        let direct_addr = start_direct();
        for i in 0..2 {
            let agent = null_agent(
                vec![format!("ws://{hub_addr}/v1/agent")],
                format!("bench-{i}"),
                &fleet_token,
            );
            let (_tx, rx) = tokio::sync::watch::channel(false);
            tokio::spawn(async move {
                let _keep = _tx;
                agent.run(rx).await
            });
        }
        let client = reqwest::Client::new();
        // Ready when both agents are connected.
        let deadline = Instant::now() + Duration::from_secs(30);
        while hub.core().agents().len() < 2 {
            assert!(Instant::now() < deadline, "agents did not connect");
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Fleet {
            hub_addr,
            direct_addr,
            client,
            _hub: bench_hub,
        }
    })
}

fn latencies(rt: &Runtime, fleet: &Fleet, addr: SocketAddr, n: usize) -> Vec<f64> {
    let one = vec!["fn main() {}".to_string()];
    let mut out: Vec<f64> = rt.block_on(async {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            embed(&fleet.client, addr, &one).await;
            v.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        v
    });
    out.sort_by(f64::total_cmp);
    out
}

fn main() {
    let rt = latency::runtime();
    let fleet = start(&rt);
    let batch: Vec<String> = (0..1000).map(|i| format!("text number {i}")).collect();
    let one = vec!["fn main() {}".to_string()];

    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));
    {
        let mut g = c.benchmark_group("items");
        g.throughput(Throughput::Elements(batch.len() as u64));
        g.bench_function("1000_per_request", |b| {
            b.to_async(&rt)
                .iter(|| embed(&fleet.client, fleet.hub_addr, &batch))
        });
        g.finish();
    }
    {
        let mut g = c.benchmark_group("roundtrip");
        g.bench_function("direct_http", |b| {
            b.to_async(&rt)
                .iter(|| embed(&fleet.client, fleet.direct_addr, &one))
        });
        g.bench_function("hub_one_text", |b| {
            b.to_async(&rt)
                .iter(|| embed(&fleet.client, fleet.hub_addr, &one))
        });
        g.finish();
    }
    c.final_summary();

    // Summary of record: percentiles and sustained items/s with requests in flight.
    let direct = latencies(&rt, &fleet, fleet.direct_addr, 2000);
    let via_hub = latencies(&rt, &fleet, fleet.hub_addr, 2000);
    let (d50, h50) = (percentile(&direct, 0.5), percentile(&via_hub, 0.5));
    let (d95, h95) = (percentile(&direct, 0.95), percentile(&via_hub, 0.95));
    let started = Instant::now();
    let requests = 20;
    rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        let sem = Arc::new(tokio::sync::Semaphore::new(4));
        for _ in 0..requests {
            let (client, addr, batch, sem) = (
                fleet.client.clone(),
                fleet.hub_addr,
                batch.clone(),
                sem.clone(),
            );
            set.spawn(async move {
                let _permit = sem.acquire_owned().await.unwrap();
                embed(&client, addr, &batch).await
            });
        }
        while set.join_next().await.is_some() {}
    });
    let items_per_s = (requests * batch.len()) as f64 / started.elapsed().as_secs_f64();
    println!("\nfleet_dispatch summary (2 agents, null provider, loopback):");
    println!("  items/s, 1000-text requests, 4 in flight: {items_per_s:.0}");
    println!("  one text, direct HTTP (reference): p50 {d50:.3} ms, p95 {d95:.3} ms");
    println!("  one text, through the hub:          p50 {h50:.3} ms, p95 {h95:.3} ms");
    println!(
        "  added by hub + protocol: p50 {:.3} ms (ratio {:.2}×)",
        h50 - d50,
        h50 / d50
    );
}
