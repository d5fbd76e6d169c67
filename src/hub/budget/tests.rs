//! The budget's rules on a fake clock.

use super::*;

const S: Duration = Duration::from_secs(1);

fn budget() -> (Budget, Instant) {
    let t0 = Instant::now();
    (Budget::new(BudgetSettings::default(), 42, t0), t0)
}

fn account(rpm: Option<f64>, funded: Option<bool>) -> AccountLimits {
    AccountLimits {
        rpm,
        funded,
        ..Default::default()
    }
}

/// Takes `n` permits on `route` at `now`; panics if one is refused.
fn take(b: &mut Budget, route: &str, n: u32, now: Instant) {
    for i in 0..n {
        assert!(
            b.try_acquire(route, now),
            "permit {i} of {n} refused: {:?}",
            b.check(route, now)
        );
    }
}

/// A refusal by a limit.
fn limited(kind: LimitKind, retry_after: Option<Duration>) -> Outcome {
    Outcome::Limited { kind, retry_after }
}

/// The view of the route whose name starts with `prefix`.
fn route_of(b: &Budget, prefix: &str, now: Instant) -> RouteView {
    let v = b.view(now);
    v.routes
        .into_iter()
        .find(|r| r.route.starts_with(prefix))
        .unwrap()
}

/// Runs the start of the global limit and `route`'s to the ceiling: the limit kept full, one
/// call back done at a time (each grows it by one); every permit is returned at the end.
fn finish_start(b: &mut Budget, route: &str, now: Instant) {
    let started = |b: &mut Budget| {
        let v = b.view(now);
        v.start_target.is_none()
            && v.routes
                .iter()
                .all(|r| r.route != route || r.start_target.is_none())
    };
    let mut held = 0;
    for _ in 0..300 {
        while b.try_acquire(route, now) {
            held += 1;
        }
        if held > 0 && started(b) {
            break;
        }
        b.release(route, Outcome::done_in_ms(1000.0), now);
        held -= 1;
    }
    assert!(
        started(b),
        "the start ran to the ceiling: {:?}",
        b.view(now)
    );
    for _ in 0..held {
        b.release(route, Outcome::Other, now);
    }
}

/// A funded account (16 permits) whose calls take about a second: a round trip is about
/// a second.
fn funded_at_one_second() -> (Budget, Instant) {
    let (mut b, t) = budget();
    b.set_account(account(None, Some(true)), t);
    finish_start(&mut b, "r", t);
    for _ in 0..30 {
        round(&mut b, 1, 1000.0, t);
    }
    (b, t)
}

#[test]
fn ceiling_comes_from_override_then_rpm_or_credits_then_the_default() {
    let (mut b, t) = budget();
    assert_eq!(b.ceiling(), (4, CeilingSource::Default));
    b.set_account(account(None, Some(true)), t);
    assert_eq!(b.ceiling(), (16, CeilingSource::Credits));
    // 600/min at the 2 s seed latency: 20 in flight, more than the funded 16.
    b.set_account(account(Some(600.0), Some(true)), t);
    assert_eq!(b.ceiling(), (20, CeilingSource::Rpm));
    // The deprecated -1 is no RPM at all.
    b.set_account(account(Some(-1.0), Some(true)), t);
    assert_eq!(b.ceiling(), (16, CeilingSource::Credits));
    // Implausibly low on a funded account: not believed.
    b.set_account(account(Some(30.0), Some(true)), t);
    assert_eq!(b.trusted_rpm(), None);
    assert_eq!(b.ceiling(), (16, CeilingSource::Credits));
    // A free-tier 20/min is believed: ceil(20/60 × 2 s) = 1.
    b.set_account(account(Some(20.0), Some(false)), t);
    assert_eq!(b.ceiling(), (1, CeilingSource::Rpm));
    // A huge RPM stops at the hard ceiling.
    b.set_account(account(Some(1e9), Some(true)), t);
    assert_eq!(b.ceiling(), (256, CeilingSource::Rpm));
    b.set_override(Some(1000), t);
    assert_eq!(b.ceiling(), (256, CeilingSource::Override));
    b.set_override(Some(0), t);
    assert_eq!(b.ceiling(), (1, CeilingSource::Override));
}

#[test]
fn littles_law_follows_the_success_latency_and_ignores_failures() {
    let (mut b, t) = budget();
    b.set_account(account(Some(600.0), None), t);
    assert_eq!(b.ceiling().0, 20, "seeded at 2 s");
    for i in 0..60 {
        let now = t + Duration::from_millis(i);
        take(&mut b, "r", 1, now);
        b.release("r", Outcome::done_in_ms(450.0), now);
    }
    assert_eq!(b.ceiling(), (5, CeilingSource::Rpm), "ceil(10/s × 0.45 s)");
    assert_eq!(b.limit(), 5, "a lower ceiling applies at once");
    // Fast failures never count as latency.
    for _ in 0..60 {
        take(&mut b, "r", 1, t);
        b.release("r", Outcome::Other, t);
    }
    assert_eq!(b.ceiling().0, 5);
    // Latency drifts up: the ceiling grows with it (the RPM window still bounds the rate).
    for _ in 0..60 {
        take(&mut b, "r", 1, t);
        b.release("r", Outcome::done_in_ms(3000.0), t);
    }
    assert_eq!(b.ceiling().0, 30);
    // The floor: 1 ms calls count as 50 ms.
    for _ in 0..200 {
        take(&mut b, "r", 1, t);
        b.release("r", Outcome::done_in_ms(1.0), t);
    }
    assert_eq!(b.ceiling().0, 1, "ceil(10/s × 0.05 s)");
}

#[test]
fn a_trusted_rpm_is_a_sliding_window_of_starts() {
    let (mut b, t) = budget();
    b.set_account(account(Some(120.0), None), t);
    b.set_override(Some(256), t); // concurrency out of the way
    for i in 0..120 {
        let now = t + Duration::from_millis(100 * i);
        take(&mut b, "r", 1, now);
        b.release("r", Outcome::Other, now);
    }
    let at = t + 12 * S;
    assert_eq!(b.check("r", at), Some(Hold::RpmWindow { rpm: 120 }));
    // The first start leaves the window 60 s after it was made.
    assert!(b.check("r", t + 59 * S).is_some());
    assert!(b.try_acquire("r", t + 60 * S));
    // No trusted RPM, no window.
    let (mut b, t) = budget();
    b.set_override(Some(256), t);
    for _ in 0..1000 {
        take(&mut b, "r", 1, t);
        b.release("r", Outcome::Other, t);
    }
}

#[test]
fn a_new_leader_starts_from_the_checkpoint_and_counts_the_rpm_window_full() {
    // What the last leader learned: a funded 600/min account, calls of about 450 ms, a
    // platform 429 with 9 in flight.
    let (mut old, t) = budget();
    old.set_account(account(Some(600.0), Some(true)), t);
    for _ in 0..60 {
        take(&mut old, "r", 1, t);
        old.release("r", Outcome::done_in_ms(450.0), t);
    }
    take(&mut old, "r", 9, t);
    // The funded ceiling of 16 was still being approached: the wall is what was in
    // flight, not the limit.
    assert_eq!(old.view(t).start_target, Some(16));
    let wall = 9;
    let limited = Outcome::Limited {
        kind: LimitKind::Platform,
        retry_after: None,
    };
    old.release("r", limited, t);
    let cp = old.checkpoint(Some("kg-1"));
    assert_eq!(cp.global.last_bad, Some(wall));
    assert!(old.limit() < wall);
    let json = serde_json::to_string(&cp).unwrap();
    assert_eq!(serde_json::from_str::<BudgetCheckpoint>(&json).unwrap(), cp);

    let (mut new, t1) = budget();
    new.take_over(Some(&cp), Some("kg-1"), t1);
    assert_eq!(new.trusted_rpm(), Some(600.0), "the account came with it");
    assert_eq!(
        new.limit(),
        old.limit(),
        "the halved limit, not the default"
    );
    assert_eq!(
        new.global.known_good(),
        Some(wall - 1),
        "the wall is remembered"
    );
    // The old leader's starts are unknown: no cloud permit for one RPM window.
    assert_eq!(new.check("r", t1), Some(Hold::RpmWindow { rpm: 600 }));
    assert!(new.check("r", t1 + 59 * S).is_some());
    assert!(new.try_acquire("r", t1 + 60 * S));

    // A checkpoint of another key's account is not taken; the window is full all the same.
    let (mut other, t2) = budget();
    other.take_over(Some(&cp), Some("kg-2"), t2);
    assert_eq!(other.trusted_rpm(), None);
    assert_eq!(other.limit(), 4);
    // Without a trusted RPM there is no window to count full.
    assert!(other.try_acquire("r", t2));
}

#[test]
fn a_throttle_halves_from_what_is_in_flight_once_per_window() {
    let (mut b, t) = budget();
    b.set_override(Some(32), t);
    b.set_override(None, t);
    b.set_account(account(None, Some(true)), t);
    finish_start(&mut b, "r", t);
    assert_eq!(b.limit(), 16);
    take(&mut b, "r", 10, t);
    let platform = Outcome::Limited {
        kind: LimitKind::Platform,
        retry_after: None,
    };
    b.release("r", platform, t);
    assert_eq!(b.limit(), 5, "min(16, 10 in flight) / 2");
    // More 429s of the same burst do not shrink it again.
    b.release("r", platform, t + S);
    b.release("r", platform, t + 2 * S);
    assert_eq!(b.limit(), 5);
    assert_eq!(b.view(t).throttles, 3);
    // One cooldown event for the burst (the override's two events before it).
    let kinds: Vec<EventKind> = b.events().iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::Override,
            EventKind::Override,
            EventKind::Cooldown
        ]
    );
    let cooled = b.events().iter().last().unwrap();
    assert!(cooled.detail.contains("from 16 to 5"), "{}", cooled.detail);
    // A window later, a new 429 halves again, from what is in flight (7 still out).
    b.release("r", platform, t + 16 * S);
    assert_eq!(b.limit(), 2, "min(5, 7) / 2");
    for _ in 0..6 {
        b.release("r", Outcome::Other, t + 16 * S);
    }
    assert_eq!(b.in_flight(), 0);
    // Never below one.
    let t2 = t + 40 * S;
    assert!(b.check("r", t2 + 120 * S).is_none());
    take(&mut b, "r", 1, t2 + 120 * S);
    b.release("r", platform, t2 + 120 * S);
    assert_eq!(b.limit(), 1);
}

#[test]
fn cooldown_is_jittered_around_the_backoff_and_never_under_retry_after() {
    for seed in 0..200 {
        let t = Instant::now();
        let mut b = Budget::new(BudgetSettings::default(), seed, t);
        take(&mut b, "r", 2, t);
        let limited = |s| Outcome::Limited {
            kind: LimitKind::Platform,
            retry_after: Some(Duration::from_secs(s)),
        };
        // The first throttle after a clean spell: Retry-After 1 s is the base (the 2 s
        // backoff is for throttles that repeat), cooldown in [1 s, 1.5 s).
        b.release("r", limited(1), t);
        b.release("r", Outcome::Other, t);
        let cd = b.view(t).cooldown_remaining_ms;
        assert!((1000..1500).contains(&cd), "seed {seed}: {cd} ms");
        assert!(matches!(b.check("r", t), Some(Hold::CoolingDown { .. })));
        assert_eq!(b.view(t).backoff_ms, 4000, "the backoff doubles");
        // Retry-After 10 s: base 10 s, jitter upward only past the floor.
        let t2 = t + 20 * S;
        take(&mut b, "r", 1, t2);
        b.release("r", limited(10), t2);
        let cd = b.view(t2).cooldown_remaining_ms;
        assert!((10_000..15_000).contains(&cd), "seed {seed}: {cd} ms");
    }
    // The backoff stops at 60 s.
    let (mut b, t) = budget();
    for i in 0..10 {
        let now = t + Duration::from_secs(16 * i);
        b.release(
            "r",
            Outcome::Limited {
                kind: LimitKind::Platform,
                retry_after: None,
            },
            now,
        );
    }
    assert_eq!(b.view(t).backoff_ms, 60_000);
}

#[test]
fn the_backoff_resets_only_after_a_window_that_ran_clean() {
    let (mut b, t) = budget();
    let platform = Outcome::Limited {
        kind: LimitKind::Platform,
        retry_after: None,
    };
    // Throttles a window apart: 2 → 4 → 8 → 16 → 32 s.
    let mut now = t;
    for _ in 0..4 {
        b.release("r", platform, now);
        now += 16 * S;
    }
    assert_eq!(b.view(now).backoff_ms, 32_000);
    // Idle windows, and windows spent cooling down, prove nothing.
    now += 60 * S;
    b.tick(now);
    assert_eq!(b.view(now).backoff_ms, 32_000);
    // A window in which calls ran and none was refused does.
    take(&mut b, "r", 1, now);
    b.release("r", Outcome::done_in_ms(100.0), now);
    now += 30 * S;
    b.tick(now);
    assert_eq!(b.view(now).backoff_ms, 2_000);
}

#[test]
fn an_rpm_under_one_is_not_trusted() {
    let (mut b, t) = budget();
    b.set_account(account(Some(0.5), Some(false)), t);
    assert_eq!(b.trusted_rpm(), None);
    assert!(b.try_acquire("r", t), "no window blocks every start");
}

#[test]
fn a_clean_window_adds_a_permit_only_while_half_the_budget_is_used() {
    let (mut b, t) = budget();
    b.set_account(account(None, Some(true)), t);
    finish_start(&mut b, "r", t);
    take(&mut b, "r", 16, t);
    b.release(
        "r",
        Outcome::Limited {
            kind: LimitKind::InFlightBudget,
            retry_after: None,
        },
        t,
    );
    for _ in 0..15 {
        b.release("r", Outcome::Other, t);
    }
    assert_eq!(b.limit(), 8);
    // Idle clean windows: no growth (the budget was not in use).
    b.tick(t + 120 * S);
    assert_eq!(b.limit(), 8);
    // Windows with 4 of 8 in use grow it by one each, up to the ceiling.
    let mut now = t + 120 * S;
    for expected in 9..=16 {
        let held = b.limit() / 2 + 1;
        take(&mut b, "r", held, now);
        for _ in 0..held {
            b.release("r", Outcome::done_in_ms(100.0), now);
        }
        now += 15 * S;
        b.tick(now);
        assert_eq!(b.limit(), expected);
    }
    take(&mut b, "r", 16, now);
    now += 15 * S;
    b.tick(now);
    assert_eq!(b.limit(), 16, "never above the ceiling");
}

/// One round trip's worth of use: `n` calls of `latency_ms` start and end at `now`.
fn round(b: &mut Budget, n: u32, latency_ms: f64, now: Instant) {
    take(b, "r", n, now);
    for _ in 0..n {
        b.release("r", Outcome::done_in_ms(latency_ms), now);
    }
}

#[test]
fn after_a_halving_the_limit_doubles_per_clean_round_trip_up_to_the_known_good_limit() {
    let (mut b, t) = funded_at_one_second();
    take(&mut b, "r", 16, t);
    let platform = Outcome::Limited {
        kind: LimitKind::Platform,
        retry_after: None,
    };
    b.release("r", platform, t);
    for _ in 0..15 {
        b.release("r", Outcome::Other, t);
    }
    assert_eq!(b.limit(), 8);
    assert_eq!(
        b.view(t).known_good,
        Some(15),
        "one under the limit the 429 came at"
    );
    // Past the cooldown, each clean, well-used round trip doubles it, up to 15.
    let mut now = t + 5 * S;
    b.tick(now);
    let n = b.limit() / 2 + 1;
    round(&mut b, n, 1000.0, now);
    now += Duration::from_millis(1100);
    b.tick(now);
    assert_eq!(b.limit(), 15, "8 doubled, capped at the known-good limit");
    // It holds there while the 429's limit is remembered, however clean the trips.
    for _ in 0..20 {
        let n = b.limit();
        round(&mut b, n, 1000.0, now);
        now += Duration::from_millis(1100);
        b.tick(now);
    }
    assert_eq!(b.limit(), 15);
    // Forgotten after two minutes: the slow ramp probes on, one per clean 15 s window.
    now = t + 121 * S;
    b.tick(now);
    assert_eq!(b.view(now).known_good, None);
    for _ in 0..2 {
        let n = b.limit();
        round(&mut b, n, 1000.0, now);
        now += 15 * S;
        b.tick(now);
    }
    assert_eq!(b.limit(), 16);
}

#[test]
fn a_429_while_ramping_steps_back_under_it_without_halving_again() {
    let (mut b, t) = funded_at_one_second();
    let upstream = Outcome::Limited {
        kind: LimitKind::Upstream,
        retry_after: Some(S),
    };
    // A lone refusal at 16: the wall is remembered at 16, known good 15.
    take(&mut b, "r", 16, t);
    b.release("r", upstream, t);
    for _ in 0..15 {
        b.release("r", Outcome::Other, t);
    }
    let route = |b: &Budget| b.view(t).routes[0].clone();
    assert_eq!(route(&b).limit, 8);
    assert_eq!(route(&b).known_good, Some(15));
    let mut now = t + 5 * S;
    let n = route(&b).limit;
    take(&mut b, "r", n, now);
    for _ in 0..n {
        b.release("r", Outcome::done_in_ms(1000.0), now);
    }
    now += Duration::from_millis(1100);
    b.tick(now);
    assert_eq!(route(&b).limit, 15);
    // The upstream holds 10: the five calls past it are refused within the halving's
    // window; each steps back one, not a second halving.
    take(&mut b, "r", 15, now);
    for _ in 0..5 {
        b.release("r", upstream, now);
    }
    let r = route(&b);
    assert_eq!(
        r.limit, 10,
        "one step back per refusal, not a second halving"
    );
    assert_eq!(r.known_good, Some(10));
}

#[test]
fn the_refusals_of_one_burst_say_where_the_wall_is() {
    let (mut b, t) = funded_at_one_second();
    let upstream = Outcome::Limited {
        kind: LimitKind::Upstream,
        retry_after: Some(S),
    };
    // 16 sent at once to an upstream that holds 10: six refused, fast.
    take(&mut b, "r", 16, t);
    for _ in 0..6 {
        b.release("r", upstream, t);
    }
    let r = b.view(t).routes[0].clone();
    assert_eq!(r.limit, 8, "halved once, from the 16 in flight");
    assert_eq!(r.known_good, Some(10), "16 less the six refused");
    // One clean round trip past the Retry-After: straight back to 10, not past it.
    for _ in 0..10 {
        b.release("r", Outcome::done_in_ms(1000.0), t);
    }
    let mut now = t + 2 * S;
    b.tick(now);
    let n = b.view(now).routes[0].limit;
    take(&mut b, "r", n, now);
    for _ in 0..n {
        b.release("r", Outcome::done_in_ms(1000.0), now);
    }
    now += Duration::from_millis(1100);
    b.tick(now);
    assert_eq!(b.view(now).routes[0].limit, 10);
}

#[test]
fn an_upstream_429_shrinks_its_route_not_the_others() {
    let (mut b, t) = budget();
    b.set_account(account(None, Some(true)), t);
    finish_start(&mut b, "embedding:m@deepinfra/bf16", t);
    take(&mut b, "embedding:m@deepinfra/bf16", 8, t);
    let refused = limited(LimitKind::Upstream, Some(5 * S));
    b.release("embedding:m@deepinfra/bf16", refused, t);
    assert_eq!(b.limit(), 16, "the global limit is untouched");
    assert!(matches!(
        b.check("embedding:m@deepinfra/bf16", t + S),
        Some(Hold::CoolingDown { .. })
    ));
    take(&mut b, "code-assistant:chat", 8, t + S);
    let emb = route_of(&b, "embedding", t + S);
    assert_eq!((emb.limit, emb.throttles), (4, 1));
    // A new route is an upstream nothing is known of: it opens at half the ceiling and
    // grows by one per call back done while it was full.
    let chat = |b: &Budget| {
        let r = route_of(b, "code", t + S);
        (r.limit, r.start_target)
    };
    assert_eq!(chat(&b), (8, Some(16)));
    b.release("code-assistant:chat", Outcome::done_in_ms(900.0), t + S);
    assert_eq!(chat(&b), (9, Some(16)));
    take(&mut b, "code-assistant:chat", 2, t + S);
    // The global ceiling still holds over all routes: 7 + 9 out, none more.
    assert_eq!(b.in_flight(), 16);
    assert!(matches!(
        b.check("code-assistant:chat", t + S),
        Some(Hold::Full { scope, .. }) if scope == GLOBAL_SCOPE
    ));
}

#[test]
fn a_guessed_ceiling_is_approached_by_a_start_that_doubles_per_round_trip_at_full_use() {
    let (mut b, t) = budget();
    b.set_account(account(None, Some(true)), t);
    let v = b.view(t);
    assert_eq!((v.ceiling, v.limit, v.start_target), (16, 8, Some(16)));
    // Calls one at a time prove nothing about 16 at once: no growth.
    for _ in 0..20 {
        take(&mut b, "r", 1, t);
        b.release("r", Outcome::done_in_ms(1000.0), t);
    }
    assert_eq!(b.limit(), 8);
    // A full round trip of 8 calls, each back done while the limit was full (a freed
    // permit taken again at once, as a waiting queue does): 8 → 16.
    take(&mut b, "r", 8, t);
    for _ in 0..8 {
        b.release("r", Outcome::done_in_ms(1000.0), t);
        while b.try_acquire("r", t) {}
    }
    let v = b.view(t);
    assert_eq!((v.limit, v.start_target), (16, None), "{v:?}");
    assert_eq!((v.routes[0].limit, v.routes[0].start_target), (16, None));
    assert_eq!(v.throttles, 0);
}

#[test]
fn a_429_in_the_start_ends_it_under_the_wall_with_no_halving_and_no_cooldown() {
    let (mut b, t) = budget();
    b.set_account(account(None, Some(true)), t);
    let upstream_429 = limited(LimitKind::Upstream, Some(S));
    let route = |b: &Budget, now| b.view(now).routes[0].clone();
    // The route's upstream holds 10: the start grows it to 12 before the first refusal
    // comes back (two calls over the wall).
    take(&mut b, "r", 8, t);
    for _ in 0..4 {
        b.release("r", Outcome::done_in_ms(1000.0), t);
        while b.try_acquire("r", t) {}
    }
    assert_eq!((route(&b, t).limit, route(&b, t).in_flight), (12, 12));
    b.release("r", upstream_429, t);
    let r = route(&b, t);
    assert_eq!(
        (
            r.limit,
            r.known_good,
            r.start_target,
            r.cooldown_remaining_ms
        ),
        (11, Some(11), None, 0),
        "one under the 12 that were out, no cooldown"
    );
    // The other call over the wall, refused within the same round trip: one lower.
    b.release("r", upstream_429, t + Duration::from_millis(20));
    let r = route(&b, t + Duration::from_millis(20));
    assert_eq!(
        (r.limit, r.known_good, r.cooldown_remaining_ms),
        (10, Some(10), 0)
    );
    assert_eq!(r.throttles, 2);
    // The calls still out go on; a permit freed is taken again at once.
    assert!(!b.held_beyond_capacity("r", t + Duration::from_millis(20)));
    let walls: Vec<_> = b
        .events()
        .iter()
        .filter(|e| e.kind == EventKind::Wall)
        .map(|e| e.detail.clone())
        .collect();
    assert_eq!(walls.len(), 1, "{walls:?}");
    assert!(walls[0].contains("from 12 to 11"), "{walls:?}");
    // A 429 past the round trip that ended the start is congestion: a halving from what
    // is in flight (10) and a cooldown, even with no Retry-After at all.
    let bare_429 = limited(LimitKind::Upstream, None);
    b.release("r", bare_429, t + 3 * S);
    let r = route(&b, t + 3 * S);
    assert_eq!((r.limit, r.throttles), (5, 3), "{r:?}");
    assert!(b.held_beyond_capacity("r", t + 3 * S));
}

#[test]
fn a_key_wide_429_in_the_start_ends_it_and_still_waits_out_its_retry_after() {
    let (mut b, t) = budget();
    b.set_account(account(None, Some(true)), t);
    take(&mut b, "r", 8, t);
    b.release("r", limited(LimitKind::Platform, Some(3 * S)), t);
    let v = b.view(t);
    assert_eq!((v.limit, v.known_good, v.start_target), (7, Some(7), None));
    // No halving, but the shared key's own Retry-After holds every cloud call.
    assert!(b.held_beyond_capacity("r", t + 2 * S));
    assert!(!b.held_beyond_capacity("r", t + 3 * S));
    let wall = b
        .events()
        .iter()
        .find(|e| e.kind == EventKind::Wall)
        .unwrap();
    assert!(
        wall.detail.contains("Retry-After (3.0 s)"),
        "{}",
        wall.detail
    );
}

#[test]
fn an_override_and_a_restored_checkpoint_start_at_their_own_number() {
    let (mut b, t) = budget();
    b.set_account(account(None, Some(true)), t);
    take(&mut b, "r", 8, t);
    b.release("r", Outcome::done_in_ms(1000.0), t);
    // A takeover in the middle of the start goes on from where it was.
    let cp = b.checkpoint(None);
    assert_eq!((cp.global.limit, cp.global.start_target), (9, Some(16)));
    let (mut new, t1) = budget();
    new.take_over(Some(&cp), None, t1);
    let v = new.view(t1);
    assert_eq!((v.limit, v.start_target), (9, Some(16)));
    assert_eq!((v.routes[0].limit, v.routes[0].start_target), (9, Some(16)));
    // An operator's number applies at once, to every route and to a new one.
    b.set_override(Some(12), t);
    let v = b.view(t);
    assert_eq!((v.limit, v.start_target), (12, None));
    take(&mut b, "new", 4, t);
    let fresh = route_of(&b, "new", t);
    assert_eq!((fresh.limit, fresh.start_target), (12, None));
    // Cleared, the computed ceiling is a guess again: approached from where the limit is.
    b.set_override(None, t);
    let v = b.view(t);
    assert_eq!((v.limit, v.start_target), (12, Some(16)));
}

#[test]
fn the_override_is_live_and_a_hard_402_stops_until_a_new_key() {
    let (mut b, t) = budget();
    b.set_override(Some(40), t);
    assert_eq!(b.limit(), 40);
    take(&mut b, "r", 40, t);
    assert!(!b.try_acquire("r", t));
    b.set_override(Some(2), t);
    assert_eq!(b.limit(), 2);
    b.set_override(None, t);
    assert_eq!((b.limit(), b.ceiling().1), (4, CeilingSource::Default));
    b.release(
        "r",
        Outcome::Limited {
            kind: LimitKind::Credits,
            retry_after: None,
        },
        t,
    );
    for _ in 0..39 {
        b.release("r", Outcome::Other, t);
    }
    assert!(matches!(b.check("r", t), Some(Hold::Stopped(_))));
    assert!(b.view(t).stopped.is_some());
    b.key_changed(t);
    assert!(b.try_acquire("r", t));
    // A rediscovery that finds money lifts a stop too; one that finds nothing does not.
    b.release(
        "r",
        Outcome::Limited {
            kind: LimitKind::KeyLimit,
            retry_after: None,
        },
        t,
    );
    b.set_account(account(None, Some(true)), t);
    assert!(b.stopped().is_some());
    let topped_up = AccountLimits {
        limit_remaining_usd: Some(5.0),
        ..Default::default()
    };
    b.set_account(topped_up, t);
    assert_eq!(b.stopped(), None);
    // Each stop and each resumption is an event, once.
    let stops: Vec<EventKind> = b
        .events()
        .iter()
        .map(|e| e.kind)
        .filter(|k| matches!(k, EventKind::Stopped | EventKind::Resumed))
        .collect();
    assert_eq!(
        stops,
        [
            EventKind::Stopped,
            EventKind::Resumed,
            EventKind::Stopped,
            EventKind::Resumed
        ]
    );
}

#[test]
fn limits_are_rediscovered_every_ten_minutes() {
    let (mut b, t) = budget();
    assert!(b.take_discovery_due(t), "nothing known yet");
    assert!(!b.take_discovery_due(t + S), "asked, not answered yet");
    assert!(b.take_discovery_due(t + 31 * S), "unanswered: ask again");
    b.set_account(account(None, Some(true)), t + 32 * S);
    assert!(!b.take_discovery_due(t + 300 * S));
    assert!(b.take_discovery_due(t + 632 * S));
    // A failed discovery keeps what was known.
    b.set_account(
        AccountLimits {
            error: Some("401".into()),
            ..Default::default()
        },
        t + 633 * S,
    );
    assert_eq!(b.ceiling(), (16, CeilingSource::Credits));
}
