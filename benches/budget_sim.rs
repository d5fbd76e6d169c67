//! The global cloud budget against a simulated OpenRouter, in virtual time.
//!
//! The upstream model is the test upstream's (tests/fleet/upstream.rs): a request-rate
//! capacity over a 60 s sliding window (the account's RPM, reported by `/key`), optionally a
//! concurrency capacity, a latency drawn uniformly in ±20 % of a mean that drifts mid-run, and
//! a fast 429 (20 ms, with Retry-After) when a capacity is exceeded. Three cloud providers
//! pull from an endless queue. Two fleets run against it:
//!
//! * **budget**: the hub's [`Budget`] decides every lease (providers hold 32 credits each, so
//!   the budget, not the credits, is the limit; 16 in the 48-waiting row);
//! * **naive**: 8 in flight per provider, retried at once, no budget.
//!
//! * **15 s ramp**: the same budget with the ramp of before (capacity back only one permit per
//!   clean 15 s window), the reference the round-trip ramp is measured against.
//! * **jump**: the same budget without the start (a guessed ceiling applied at once), the
//!   reference the start is measured against.
//!
//! It prints goodput as a fraction of the capacity and the share of requests refused with
//! 429, per scenario; then, for the hidden-concurrency shapes, a finite run of 400 requests
//! from 48 waiting (the shape `budget_fleet` measures with processes): its time, goodput over
//! that whole time (start included) and 429s, with the start and with the jump. Run:
//! `cargo bench --bench budget_sim`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use fantom_sidecar::hub::budget::{Budget, BudgetSettings, Outcome};
use fantom_sidecar::protocol::{AccountLimits, LimitKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PROVIDERS: usize = 3;
const ROUTE: &str = "embedding:qwen/qwen3-embedding-4b@deepinfra/bf16";
const REJECT_MS: u64 = 20;
const TICK_MS: u64 = 250;

#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    /// Requests per minute the upstream accepts (None: no rate cap).
    rpm: Option<u32>,
    /// Requests the upstream serves at once (None: no concurrency cap).
    concurrency: Option<usize>,
    /// Mean latency before and after the drift at half time.
    latency_ms: (u64, u64),
    /// What `/key` tells the budget.
    reported_rpm: Option<f64>,
    minutes: u64,
    /// Work frames each provider of the budget fleet may hold (its demand: the clients'
    /// requests waiting for it).
    credits: usize,
    /// Requests to serve, then stop (a refused one goes back to the queue); `None`: endless.
    work: Option<u64>,
}

#[derive(Default)]
struct Tally {
    requests: u64,
    ok: u64,
    throttled: u64,
    /// When the last of a finite run's requests was served.
    done_ms: Option<u64>,
}

/// The simulated upstream: a sliding window of arrivals and the calls in progress.
struct Upstream {
    s: Scenario,
    window: VecDeque<u64>,
    in_flight: usize,
    rng: StdRng,
}

enum Answer {
    Ok {
        at_ms: u64,
        latency_ms: u64,
    },
    Throttled {
        at_ms: u64,
        kind: LimitKind,
        retry_after_ms: u64,
    },
}

impl Upstream {
    fn call(&mut self, now_ms: u64, total_ms: u64) -> Answer {
        while self.window.front().is_some_and(|&t| now_ms - t >= 60_000) {
            self.window.pop_front();
        }
        if let Some(rpm) = self.s.rpm {
            // Like the test upstream: a request the window refuses does not count in it (so
            // X-RateLimit-Reset stays truthful); every other arrival does.
            if self.window.len() >= rpm as usize {
                let oldest = self.window.front().copied().unwrap_or(now_ms);
                let wait = (oldest + 60_000).saturating_sub(now_ms).div_ceil(1000) * 1000;
                return Answer::Throttled {
                    at_ms: now_ms + REJECT_MS,
                    kind: LimitKind::Platform,
                    retry_after_ms: wait.max(1000),
                };
            }
            self.window.push_back(now_ms);
        }
        if let Some(c) = self.s.concurrency
            && self.in_flight >= c
        {
            return Answer::Throttled {
                at_ms: now_ms + REJECT_MS,
                kind: LimitKind::Upstream,
                retry_after_ms: 1000,
            };
        }
        self.in_flight += 1;
        let mean = if now_ms < total_ms / 2 {
            self.s.latency_ms.0
        } else {
            self.s.latency_ms.1
        } as f64;
        let latency_ms = (mean * self.rng.random_range(0.8..1.2)) as u64;
        Answer::Ok {
            at_ms: now_ms + latency_ms,
            latency_ms,
        }
    }
}

/// One completion waiting in virtual time: (time, provider, outcome).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Event {
    at_ms: u64,
    seq: u64,
    provider: usize,
    /// 0: success (latency in `value`); 1: platform 429; 2: upstream 429 (Retry-After in value).
    kind: u8,
    value: u64,
}

fn run(s: Scenario, with_budget: bool, settings: BudgetSettings) -> Tally {
    let total_ms = s.minutes * 60_000;
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut budget = Budget::new(settings, 7, t0);
    budget.set_account(
        AccountLimits {
            rpm: s.reported_rpm,
            funded: Some(true),
            ..Default::default()
        },
        t0,
    );
    let depth = if with_budget { s.credits } else { 8 };
    let mut credits = [depth; PROVIDERS];
    let mut upstream = Upstream {
        s,
        window: VecDeque::new(),
        in_flight: 0,
        rng: StdRng::seed_from_u64(11),
    };
    let mut events: BinaryHeap<Reverse<Event>> = BinaryHeap::new();
    let mut tally = Tally::default();
    let (mut now, mut seq, mut turn, mut next_tick) = (0u64, 0u64, 0usize, 0u64);
    let mut waiting = s.work.unwrap_or(u64::MAX);
    while now < total_ms && tally.done_ms.is_none() {
        // Dispatch: providers in turn while one has credit and the budget allows.
        while let Some(p) = (0..PROVIDERS)
            .map(|k| (turn + k) % PROVIDERS)
            .find(|&p| credits[p] > 0)
        {
            if waiting == 0 || (with_budget && !budget.try_acquire(ROUTE, at(now))) {
                break;
            }
            waiting -= 1;
            turn = p + 1;
            credits[p] -= 1;
            tally.requests += 1;
            seq += 1;
            let event = match upstream.call(now, total_ms) {
                Answer::Ok { at_ms, latency_ms } => Event {
                    at_ms,
                    seq,
                    provider: p,
                    kind: 0,
                    value: latency_ms,
                },
                Answer::Throttled {
                    at_ms,
                    kind,
                    retry_after_ms,
                } => Event {
                    at_ms,
                    seq,
                    provider: p,
                    kind: if kind == LimitKind::Platform { 1 } else { 2 },
                    value: retry_after_ms,
                },
            };
            events.push(Reverse(event));
        }
        // Advance to the next completion or maintenance tick.
        let next_event = events.peek().map_or(u64::MAX, |Reverse(e)| e.at_ms);
        if next_tick <= next_event {
            now = next_tick;
            next_tick += TICK_MS;
            continue;
        }
        let Some(Reverse(e)) = events.pop() else {
            break;
        };
        now = e.at_ms;
        credits[e.provider] += 1;
        let outcome = match e.kind {
            0 => {
                upstream.in_flight -= 1;
                if now <= total_ms {
                    tally.ok += 1;
                }
                if s.work == Some(tally.ok) {
                    tally.done_ms = Some(now);
                }
                Outcome::done_in_ms(e.value as f64)
            }
            k => {
                tally.throttled += 1;
                if s.work.is_some() {
                    waiting += 1;
                }
                Outcome::Limited {
                    kind: if k == 1 {
                        LimitKind::Platform
                    } else {
                        LimitKind::Upstream
                    },
                    retry_after: Some(Duration::from_millis(e.value)),
                }
            }
        };
        if with_budget {
            budget.release(ROUTE, outcome, at(now));
        }
    }
    tally
}

/// What the upstream could have served in the run (requests).
fn capacity(s: &Scenario) -> f64 {
    let minutes = s.minutes as f64;
    let by_rate = s.rpm.map(|r| r as f64 * minutes);
    let by_concurrency = s.concurrency.map(|c| {
        let half = minutes * 30_000.0;
        c as f64 * (half / s.latency_ms.0 as f64 + half / s.latency_ms.1 as f64)
    });
    match (by_rate, by_concurrency) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => f64::INFINITY,
    }
}

fn main() {
    let scenarios = [
        Scenario {
            name: "120 rpm, 1.0 s -> 2.5 s",
            rpm: Some(120),
            concurrency: None,
            latency_ms: (1000, 2500),
            reported_rpm: Some(120.0),
            minutes: 30,
            credits: 32,
            work: None,
        },
        Scenario {
            name: "600 rpm, 1.0 s -> 2.5 s",
            rpm: Some(600),
            concurrency: None,
            latency_ms: (1000, 2500),
            reported_rpm: Some(600.0),
            minutes: 30,
            credits: 32,
            work: None,
        },
        Scenario {
            name: "1800 rpm, 0.8 s -> 2.0 s",
            rpm: Some(1800),
            concurrency: None,
            latency_ms: (800, 2000),
            reported_rpm: Some(1800.0),
            minutes: 30,
            credits: 32,
            work: None,
        },
        Scenario {
            name: "600 rpm, 2.0 s -> 0.5 s",
            rpm: Some(600),
            concurrency: None,
            latency_ms: (2000, 500),
            reported_rpm: Some(600.0),
            minutes: 30,
            credits: 32,
            work: None,
        },
        Scenario {
            name: "hidden: 12 at once, rpm unknown",
            rpm: None,
            concurrency: Some(12),
            latency_ms: (1000, 2000),
            reported_rpm: None,
            minutes: 30,
            credits: 32,
            work: None,
        },
        // A funded key whose upstream allows 10 in flight and reports no RPM; 48 clients'
        // requests waiting (16 per provider), as measured with the real processes (issue 20).
        Scenario {
            name: "hidden: 10 at once, 1 s, 48 waiting",
            rpm: None,
            concurrency: Some(10),
            latency_ms: (1000, 1000),
            reported_rpm: None,
            minutes: 30,
            credits: 16,
            work: None,
        },
        // The same with an upstream that holds more than the funded ceiling of 16: the
        // ceiling is the limit, and the start is what it could cost.
        Scenario {
            name: "hidden: 20 at once, 1 s, 48 waiting",
            rpm: None,
            concurrency: Some(20),
            latency_ms: (1000, 1000),
            reported_rpm: None,
            minutes: 30,
            credits: 16,
            work: None,
        },
    ];
    // The reference: the same budget with the ramp of before (one permit per clean 15 s
    // window only): a 429's limit is forgotten at once, so the round-trip ramp never runs.
    let slow_ramp = BudgetSettings {
        bad_memory: Duration::ZERO,
        ..BudgetSettings::default()
    };
    // The reference of the start: a guessed ceiling applied at once.
    let jump = BudgetSettings {
        slow_start: false,
        ..BudgetSettings::default()
    };
    let rate = |t: &Tally| 100.0 * t.throttled as f64 / t.requests.max(1) as f64;
    println!(
        "{:<36} {:>13} {:>10} {:>9} {:>13} {:>10} {:>12} {:>10}",
        "scenario (capacity, latency drift)",
        "budget good/C",
        "budget 429",
        "jump",
        "15 s ramp",
        "its 429",
        "naive good/C",
        "naive 429"
    );
    for s in scenarios {
        let c = capacity(&s);
        let ours = run(s, true, BudgetSettings::default());
        let jumped = run(s, true, jump.clone());
        let before = run(s, true, slow_ramp.clone());
        let naive = run(s, false, BudgetSettings::default());
        println!(
            "{:<36} {:>13.3} {:>9.2}% {:>9.3} {:>13.3} {:>9.2}% {:>12.3} {:>9.2}%",
            s.name,
            ours.ok as f64 / c,
            rate(&ours),
            jumped.ok as f64 / c,
            before.ok as f64 / c,
            rate(&before),
            naive.ok as f64 / c,
            rate(&naive),
        );
    }

    // The start itself: 400 requests from 48 waiting, from a cold budget (the funded ceiling
    // of 16 just discovered). Goodput is over the run's whole time at the smaller of the
    // upstream's concurrency and the ceiling.
    println!();
    println!(
        "{:<36} {:>9} {:>9} {:>6} {:>9} {:>9} {:>6}",
        "400 requests, 48 waiting", "start s", "good/C", "429s", "jump s", "good/C", "429s"
    );
    for cap in [10usize, 20] {
        let s = Scenario {
            name: "",
            rpm: None,
            concurrency: Some(cap),
            latency_ms: (1000, 1000),
            reported_rpm: None,
            minutes: 10,
            credits: 16,
            work: Some(400),
        };
        let at_once = cap.min(16) as f64;
        let cols = |t: &Tally| {
            let secs = t.done_ms.map_or(f64::NAN, |ms| ms as f64 / 1000.0);
            (secs, t.ok as f64 / (at_once * secs), t.throttled)
        };
        let (a, b) = (
            cols(&run(s, true, BudgetSettings::default())),
            cols(&run(s, true, jump.clone())),
        );
        println!(
            "{:<36} {:>9.2} {:>9.3} {:>6} {:>9.2} {:>9.3} {:>6}",
            format!("hidden: {cap} at once, 1 s"),
            a.0,
            a.1,
            a.2,
            b.0,
            b.1,
            b.2
        );
    }
}
