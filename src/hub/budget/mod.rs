//! The global cloud budget (DESIGN §5): one number of permits above every cloud provider of
//! the fleet, because every agent holds the same key and OpenRouter limits per key. A permit
//! is one outstanding cloud lease; local providers never touch the budget.
//!
//! * **Ceiling**: the operator's override (1..=256) if set; else the larger of the RPM-derived
//!   value (Little's Law, only for a trusted RPM) and the credits-derived value (16 for a
//!   funded account); else 4. Never above 256.
//! * **Little's Law**: `ceil(rpm / 60 × latency_s)` with the latency EWMA of successful cloud
//!   calls (α 0.2, seeded 2 s, floor 50 ms), re-derived as latency drifts. A trusted RPM is
//!   also enforced as a 60 s sliding window of starts (errors return fast; concurrency alone
//!   would not bound the rate).
//! * **Throttle**: a 429 or an in-flight-budget 402 halves the limit of its scope, from what
//!   is actually in flight, at most once per 15 s window, and cools the scope down for
//!   `base × [0.5, 1.5)`, never under Retry-After (`base`: the Retry-After of a first throttle
//!   after a clean spell, else max(Retry-After, backoff)); the backoff doubles 2 s → 60 s and
//!   resets after a clean window. Each further refusal of the burst that caused the halving
//!   lowers the limit the wall is remembered at by one (k refusals of a burst at limit L: the
//!   capacity is about L − k).
//! * **Ramp**: capacity comes back in round trips below the last known-good limit, slowly
//!   above it. A halving remembers the limit its 429 came at (`last_bad`, TCP's `W_max`);
//!   while the limit is under `last_bad − 1` (the known-good limit), each clean round trip
//!   (a window of [`BudgetSettings::round_trips_per_step`] latency EWMAs in which a call came
//!   back done and none was refused) in which at least half the limit was used doubles the
//!   limit, up to the known-good one (TCP's slow start to its threshold), so a halving
//!   recovers in a round trip or two. At the
//!   known-good limit it holds while `last_bad` is remembered (so it does not walk into the
//!   wall again); `last_bad` is forgotten after [`BudgetSettings::bad_memory`] without a
//!   halving (the upstream's capacity changes), and from there, as when nothing was learnt,
//!   each clean, well-used 15 s window adds one permit, up to the ceiling.
//! * **Start**: a ceiling nothing has confirmed (the funded 16, Little's Law) is not jumped to.
//!   A limit that rises to one, and a new route's, opens at half of it (never under
//!   [`BudgetSettings::default_ceiling`], so the default itself is taken at once) and grows by
//!   one per call that came back done while the limit was all in use: it doubles per round
//!   trip at full use, as TCP's slow start does, and reaches the ceiling in about a round trip.
//!   A 429 during the start ends it at the wall it found: the limit goes to one under what was
//!   in flight, each further refusal of that round trip lowers it by one, and none of them
//!   halves or cools down (the calls still out are not refused, so the scope is at the wall,
//!   not over it); only a key-wide 429's own Retry-After is waited out. A 429 after that round
//!   trip is a throttle, below. An operator's override and a limit restored from a checkpoint
//!   start at their own number.
//! * **Scopes**: platform 429s and the in-flight 402 shrink the global limit; an upstream 429
//!   shrinks only its route (role + model + pinned upstream), under the global ceiling.
//! * **Hard stop**: a credits or key-limit 402 stops cloud work until a new key is pushed.
//!
//! Time comes in as arguments (`now`) and jitter from a seeded generator, so the tests and the
//! simulation bench run on a fake clock.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;

use super::events::{EventKind, EventRing};
use super::measured::LatencyMs;
use crate::protocol::{AccountLimits, LimitKind};

mod checkpoint;
mod limiter;
#[cfg(test)]
mod tests;

pub use checkpoint::{BudgetCheckpoint, LimiterCheckpoint};
use limiter::Limiter;

/// The budget's constants (DESIGN §5); tests and the simulation may change them.
#[derive(Clone, Debug)]
pub struct BudgetSettings {
    /// The ceiling when nothing is known.
    pub default_ceiling: u32,
    /// The ceiling of a funded account without a trusted RPM.
    pub funded_ceiling: u32,
    /// No ceiling goes above this.
    pub hard_ceiling: u32,
    pub latency_seed_ms: f64,
    pub latency_floor_ms: f64,
    pub latency_alpha: f64,
    /// The sliding window a trusted RPM is enforced over.
    pub rpm_window: Duration,
    /// An RPM under this on a funded account is not believed.
    pub min_trusted_rpm: f64,
    /// One halving per window at most; one permit back per clean window (above the
    /// known-good limit).
    pub clean_window: Duration,
    /// Below the known-good limit, a permit comes back per clean window of this many
    /// latency EWMAs (a round trip).
    pub round_trips_per_step: f64,
    /// How long the limit a 429 came at is remembered after the halving it caused.
    pub bad_memory: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Whether a ceiling nothing has confirmed is approached by the start (see the module
    /// comment); `false` jumps to it (the reference `budget_sim` measures the start against).
    pub slow_start: bool,
    /// How often the account's limits are asked again.
    pub rediscover_every: Duration,
    /// How long a `discover` may go unanswered before it is asked again.
    pub discover_timeout: Duration,
}

impl Default for BudgetSettings {
    fn default() -> Self {
        Self {
            default_ceiling: 4,
            funded_ceiling: 16,
            hard_ceiling: 256,
            latency_seed_ms: 2000.0,
            latency_floor_ms: 50.0,
            latency_alpha: 0.2,
            rpm_window: Duration::from_secs(60),
            min_trusted_rpm: 60.0,
            clean_window: Duration::from_secs(15),
            round_trips_per_step: 1.0,
            bad_memory: Duration::from_secs(120),
            backoff_initial: Duration::from_secs(2),
            backoff_max: Duration::from_secs(60),
            slow_start: true,
            rediscover_every: Duration::from_secs(600),
            discover_timeout: Duration::from_secs(30),
        }
    }
}

/// A ceiling and where it came from.
pub type Ceiling = (u32, CeilingSource);

/// Where the ceiling came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CeilingSource {
    Override,
    Rpm,
    Credits,
    Default,
}

/// How a cloud lease ended, as far as the budget cares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    /// Done; the upstream call took this long.
    Success { latency: LatencyMs },
    /// Refused by a limit.
    Limited {
        kind: LimitKind,
        retry_after: Option<Duration>,
    },
    /// Anything else (a failure, an expired or lost lease): no signal, no latency sample.
    Other,
}

impl Outcome {
    /// Done in `ms` milliseconds, bounded as a stored figure is ([`LatencyMs::restored`]); a
    /// figure that is no latency at all is [`Outcome::Other`].
    pub fn done_in_ms(ms: f64) -> Outcome {
        LatencyMs::restored(ms).map_or(Outcome::Other, |latency| Outcome::Success { latency })
    }
}

/// The scope of a [`Hold`] that is the whole budget's, not one route's.
pub const GLOBAL_SCOPE: &str = "global";

/// Why a cloud provider gets no item now (shown in status).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    Stopped(String),
    CoolingDown { scope: String, remaining: Duration },
    Full { scope: String, limit: u32 },
    RpmWindow { rpm: u32 },
}

/// The budget: one global limiter, one per cloud route, what the account is known to allow.
#[derive(Debug)]
pub struct Budget {
    settings: BudgetSettings,
    rng: StdRng,
    override_permits: Option<u32>,
    account: AccountLimits,
    /// Latency EWMA of successful cloud calls (ms), seeded.
    latency_ewma_ms: f64,
    global: Limiter,
    routes: BTreeMap<String, Limiter>,
    /// Starts within the RPM window (only kept while an RPM is trusted).
    starts: VecDeque<Instant>,
    stopped: Option<String>,
    /// OpenRouter refused the key itself (401/403): no cloud work until a new key.
    key_rejected: Option<String>,
    last_discovery: Option<Instant>,
    discover_sent: Option<Instant>,
    granted: u64,
    /// When this hub took the lead over a shared store: the old leader's starts are unknown,
    /// so the RPM window counts as full until a window has passed since.
    took_over: Option<Instant>,
    /// What the budget did, in time (for the console).
    events: EventRing,
}

impl Budget {
    pub fn new(settings: BudgetSettings, seed: u64, now: Instant) -> Self {
        let global = Limiter::new(settings.default_ceiling, settings.backoff_initial, now);
        Self {
            latency_ewma_ms: settings.latency_seed_ms,
            rng: StdRng::seed_from_u64(seed),
            override_permits: None,
            account: AccountLimits::default(),
            global,
            routes: BTreeMap::new(),
            starts: VecDeque::new(),
            stopped: None,
            key_rejected: None,
            last_discovery: None,
            discover_sent: None,
            granted: 0,
            took_over: None,
            events: EventRing::default(),
            settings,
        }
    }

    /// Cooldowns, walls a start found, stops, resumptions and overrides, oldest first.
    pub fn events(&self) -> &EventRing {
        &self.events
    }
    /// The RPM the budget believes, if any (absent, `-1` and implausibly low ones are not).
    pub fn trusted_rpm(&self) -> Option<f64> {
        // Under one a minute would block every start of the window: not a usable number.
        let rpm = self.account.rpm.filter(|r| r.is_finite() && *r >= 1.0)?;
        if self.account.funded == Some(true) && rpm < self.settings.min_trusted_rpm {
            return None;
        }
        Some(rpm)
    }

    /// The ceiling and where it came from.
    pub fn ceiling(&self) -> Ceiling {
        let hard = self.settings.hard_ceiling;
        if let Some(o) = self.override_permits {
            return (o.clamp(1, hard), CeilingSource::Override);
        }
        let from_rpm = self.trusted_rpm().map(|rpm| {
            let latency_s = self.latency_ewma_ms.max(self.settings.latency_floor_ms) / 1000.0;
            ((rpm / 60.0 * latency_s).ceil() as u32).max(1)
        });
        let from_credits =
            (self.account.funded == Some(true)).then_some(self.settings.funded_ceiling);
        let chosen = match (from_rpm, from_credits) {
            (Some(r), Some(c)) if r >= c => (r, CeilingSource::Rpm),
            (Some(_), Some(c)) | (None, Some(c)) => (c, CeilingSource::Credits),
            (Some(r), None) => (r, CeilingSource::Rpm),
            (None, None) => (self.settings.default_ceiling, CeilingSource::Default),
        };
        (chosen.0.min(hard), chosen.1)
    }

    /// Re-applies the ceiling after it moved: down at once; up (by the start, or at once to
    /// an operator's number) unless a throttle happened recently (then the ramp brings it
    /// back, one permit per clean window).
    fn retarget(&mut self, now: Instant) {
        let ceiling = self.ceiling();
        let s = &self.settings;
        let apply = |l: &mut Limiter| {
            // A halving, or a start that ended at a wall, holds the limit where the ramp
            // brings it for a while: a new ceiling does not restart a walk into that wall.
            let calm = [l.last_halving, l.start_ended]
                .into_iter()
                .flatten()
                .all(|t| now.saturating_duration_since(t) >= s.rediscover_every);
            if ceiling.0 <= l.limit {
                l.lower_to(ceiling.0);
            } else if calm {
                l.raise_to(ceiling, s);
            }
        };
        apply(&mut self.global);
        self.routes.values_mut().for_each(apply);
    }

    /// Advances the windows to `now` (call before reading or deciding).
    pub fn tick(&mut self, now: Instant) {
        let (ceiling, _) = self.ceiling();
        let latency = self.latency_ewma_ms;
        self.global.roll(now, ceiling, latency, &self.settings);
        for route in self.routes.values_mut() {
            let own = route.latency_ewma_ms.unwrap_or(latency);
            route.roll(now, ceiling, own, &self.settings);
        }
        let window = self.settings.rpm_window;
        while self
            .starts
            .front()
            .is_some_and(|&t| now.saturating_duration_since(t) >= window)
        {
            self.starts.pop_front();
        }
    }

    fn route_mut(&mut self, route: &str, now: Instant) -> &mut Limiter {
        let ceiling = self.ceiling();
        route_entry(&mut self.routes, route, ceiling, &self.settings, now)
    }

    /// Why a lease on `route` may not start now, or `None`: it may.
    pub fn check(&mut self, route: &str, now: Instant) -> Option<Hold> {
        self.tick(now);
        if let Some(why) = self.stopped.as_ref().or(self.key_rejected.as_ref()) {
            return Some(Hold::Stopped(why.clone()));
        }
        if let Some(remaining) = self.global.cooling(now) {
            return Some(Hold::CoolingDown {
                scope: GLOBAL_SCOPE.into(),
                remaining,
            });
        }
        if self.global.in_flight >= self.global.limit {
            return Some(Hold::Full {
                scope: GLOBAL_SCOPE.into(),
                limit: self.global.limit,
            });
        }
        if let Some(rpm) = self.trusted_rpm()
            && (self.starts.len() as f64 >= rpm.floor()
                || self
                    .took_over
                    .is_some_and(|t| now.saturating_duration_since(t) < self.settings.rpm_window))
        {
            return Some(Hold::RpmWindow { rpm: rpm as u32 });
        }
        let r = self.route_mut(route, now);
        if let Some(remaining) = r.cooling(now) {
            return Some(Hold::CoolingDown {
                scope: route.to_string(),
                remaining,
            });
        }
        if r.in_flight >= r.limit {
            let limit = r.limit;
            return Some(Hold::Full {
                scope: route.to_string(),
                limit,
            });
        }
        None
    }

    /// Whether `route` is held for more than capacity (the budget stopped, the budget or the
    /// route cooling down): a freed permit would not let a call on it start either.
    pub fn held_beyond_capacity(&mut self, route: &str, now: Instant) -> bool {
        self.tick(now);
        self.stopped.is_some()
            || self.key_rejected.is_some()
            || self.global.cooling(now).is_some()
            || self.route_mut(route, now).cooling(now).is_some()
    }

    /// Takes a permit for a lease on `route` if one is free now.
    pub fn try_acquire(&mut self, route: &str, now: Instant) -> bool {
        if self.check(route, now).is_some() {
            return false;
        }
        self.global.acquire();
        self.route_mut(route, now).acquire();
        if self.trusted_rpm().is_some() {
            self.starts.push_back(now);
        }
        self.granted += 1;
        true
    }

    /// Counts a call on `route` that is already under way and that this budget did not grant
    /// (a keyed chat an agent still runs for the hub before): it holds a permit, whatever the
    /// budget's room, until [`Budget::release`].
    pub fn hold_running(&mut self, route: &str, now: Instant) {
        self.tick(now);
        self.global.acquire();
        self.route_mut(route, now).acquire();
    }

    /// Returns a permit of `route` and learns from how its lease ended.
    pub fn release(&mut self, route: &str, outcome: Outcome, now: Instant) {
        self.tick(now);
        match outcome {
            Outcome::Success { latency } => {
                let s = &self.settings;
                let sample = latency.ms().max(s.latency_floor_ms);
                self.latency_ewma_ms += s.latency_alpha * (sample - self.latency_ewma_ms);
                let ceiling = self.ceiling();
                self.global.succeeded();
                let r = route_entry(&mut self.routes, route, ceiling, &self.settings, now);
                r.record_latency(latency, &self.settings);
                r.succeeded();
                if self.override_permits.is_none() && self.trusted_rpm().is_some() {
                    self.retarget(now);
                }
            }
            Outcome::Limited { kind, retry_after } => match kind {
                LimitKind::Platform | LimitKind::InFlightBudget => {
                    let latency = self.latency_ewma_ms;
                    if let Some(h) = self.global.throttle(
                        retry_after,
                        true,
                        latency,
                        now,
                        &self.settings,
                        &mut self.rng,
                    ) {
                        let what = format!("a 429 for the whole key (via {route})");
                        self.events.push(h.kind(), "budget", h.describe(&what));
                    }
                }
                LimitKind::Upstream => {
                    let (ceiling, latency) = (self.ceiling(), self.latency_ewma_ms);
                    if let Some(h) =
                        route_entry(&mut self.routes, route, ceiling, &self.settings, now).throttle(
                            retry_after,
                            false,
                            latency,
                            now,
                            &self.settings,
                            &mut self.rng,
                        )
                    {
                        self.events.push(
                            h.kind(),
                            route,
                            h.describe("a 429 from the route's upstream"),
                        );
                    }
                }
                LimitKind::Credits | LimitKind::KeyLimit => {
                    let why = match kind {
                        LimitKind::Credits => "the account is out of credits (hard 402)",
                        _ => "the key's spending limit is reached (hard 402)",
                    };
                    if self.stopped.is_none() {
                        tracing::error!(
                            reason = why,
                            "cloud work stopped until a push with apiKey (the same key after a top-up works) or a rediscovery that finds money"
                        );
                        self.events.push(EventKind::Stopped, "budget", why);
                    }
                    self.stopped = Some(why.to_string());
                }
            },
            Outcome::Other => {}
        }
        self.global.release();
        if let Some(r) = self.routes.get_mut(route) {
            r.release();
        }
    }

    /// The operator's live override (`None` clears it).
    pub fn set_override(&mut self, permits: Option<u32>, now: Instant) {
        self.override_permits = permits.map(|p| p.clamp(1, self.settings.hard_ceiling));
        self.events.push(
            EventKind::Override,
            "budget",
            match self.override_permits {
                Some(p) => format!("an operator set the override to {p} calls in flight"),
                None => "an operator cleared the override".to_string(),
            },
        );
        self.tick(now);
        let ceiling = self.ceiling();
        // An operator's number applies at once, both ways; a cleared one leaves the computed
        // ceiling to approach as any guessed one is (down at once, up by the start).
        let s = &self.settings;
        let apply = |l: &mut Limiter| {
            if ceiling.1 == CeilingSource::Override {
                l.limit = ceiling.0;
                l.start_target = None;
            } else if ceiling.0 <= l.limit {
                l.lower_to(ceiling.0);
            } else {
                l.raise_to(ceiling, s);
            }
        };
        apply(&mut self.global);
        self.routes.values_mut().for_each(apply);
    }

    pub fn override_permits(&self) -> Option<u32> {
        self.override_permits
    }

    /// What an agent learned about the account.
    pub fn set_account(&mut self, limits: AccountLimits, now: Instant) {
        let limits = super::measured::account(limits);
        self.discover_sent = None;
        self.last_discovery = Some(now);
        if limits.error.is_some() {
            // Keep what was known; try again at the next period.
            self.account.error = limits.error;
            return;
        }
        // Money again (a topped-up account, a key limit that reset): cloud work resumes.
        let money = |v: Option<f64>| v.is_some_and(|x| x > 0.0);
        if self.stopped.is_some()
            && (money(limits.credits_remaining_usd) || money(limits.limit_remaining_usd))
        {
            tracing::info!("the account has money again: cloud work resumes");
            self.events
                .push(EventKind::Resumed, "budget", "the account has money again");
            self.stopped = None;
        }
        self.account = limits;
        self.retarget(now);
    }

    /// Why cloud work is stopped, when a hard 402 stopped it.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// OpenRouter refused the key (HTTP 401/403): every cloud route shares it, so cloud work
    /// stops until a push brings a new key.
    pub fn reject_key(&mut self, why: &str) {
        if self.key_rejected.is_none() {
            tracing::error!(
                reason = why,
                "OpenRouter refused the key: cloud work stopped until a push with a new apiKey"
            );
            self.events.push(
                EventKind::Stopped,
                "budget",
                format!("OpenRouter refused the key: {why}"),
            );
        }
        self.key_rejected = Some(format!("OpenRouter refused the key: {why}"));
    }

    /// Why cloud work is refused, when the key was rejected.
    pub fn key_rejected(&self) -> Option<&str> {
        self.key_rejected.as_deref()
    }

    /// A new key arrived: forget a hard stop and what the old key's account allowed.
    pub fn key_changed(&mut self, now: Instant) {
        if self.stopped.is_some() || self.key_rejected.is_some() {
            self.events
                .push(EventKind::Resumed, "budget", "a push brought a new key");
        }
        self.stopped = None;
        self.key_rejected = None;
        self.account = AccountLimits::default();
        self.last_discovery = None;
        self.discover_sent = None;
        self.retarget(now);
    }

    /// Whether the account's limits should be asked now; marks the ask as sent when so.
    pub fn take_discovery_due(&mut self, now: Instant) -> bool {
        let asked_recently = self
            .discover_sent
            .is_some_and(|t| now.saturating_duration_since(t) < self.settings.discover_timeout);
        let stale = self
            .last_discovery
            .is_none_or(|t| now.saturating_duration_since(t) >= self.settings.rediscover_every);
        if stale && !asked_recently {
            self.discover_sent = Some(now);
            return true;
        }
        false
    }

    pub fn in_flight(&self) -> u32 {
        self.global.in_flight
    }

    pub fn limit(&self) -> u32 {
        self.global.limit
    }

    /// What `/admin/status` and `/metrics` show.
    pub fn view(&self, now: Instant) -> BudgetView {
        let (ceiling, source) = self.ceiling();
        let cooldown_ms = |l: &Limiter| l.cooling(now).map_or(0, |d| d.as_millis() as u64);
        BudgetView {
            ceiling,
            ceiling_source: source,
            limit: self.global.limit,
            known_good: self.global.known_good(),
            start_target: self.global.start_target,
            in_flight: self.global.in_flight,
            override_permits: self.override_permits,
            cooldown_remaining_ms: cooldown_ms(&self.global),
            backoff_ms: self.global.backoff.as_millis() as u64,
            throttles: self.global.throttles,
            latency_ewma_ms: self.latency_ewma_ms,
            rpm: self.account.rpm,
            rpm_trusted: self.trusted_rpm().is_some(),
            rpm_window_starts: self.starts.len(),
            funded: self.account.funded,
            discovery_error: self.account.error.clone(),
            last_discovery_s_ago: self
                .last_discovery
                .map(|t| now.saturating_duration_since(t).as_secs()),
            stopped: self.stopped.clone(),
            key_rejected: self.key_rejected.clone(),
            granted: self.granted,
            routes: self
                .routes
                .iter()
                .map(|(route, l)| RouteView {
                    route: route.clone(),
                    limit: l.limit,
                    known_good: l.known_good(),
                    start_target: l.start_target,
                    in_flight: l.in_flight,
                    cooldown_remaining_ms: cooldown_ms(l),
                    throttles: l.throttles,
                    latency_ewma_ms: l.latency_ewma_ms,
                })
                .collect(),
        }
    }
}

/// A route's limiter; a new route (an upstream nothing is known of) opens as a start does.
fn route_entry<'a>(
    routes: &'a mut BTreeMap<String, Limiter>,
    route: &str,
    ceiling: Ceiling,
    settings: &BudgetSettings,
    now: Instant,
) -> &'a mut Limiter {
    routes
        .entry(route.to_string())
        .or_insert_with(|| Limiter::opening(ceiling, settings, now))
}

/// The budget as status shows it.
#[derive(Clone, Debug, Serialize)]
pub struct BudgetView {
    pub ceiling: u32,
    pub ceiling_source: CeilingSource,
    /// The effective limit now (≤ ceiling).
    pub limit: u32,
    /// See [`RouteView::known_good`].
    pub known_good: Option<u32>,
    /// See [`RouteView::start_target`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_target: Option<u32>,
    pub in_flight: u32,
    pub override_permits: Option<u32>,
    pub cooldown_remaining_ms: u64,
    pub backoff_ms: u64,
    pub throttles: u64,
    pub latency_ewma_ms: f64,
    pub rpm: Option<f64>,
    pub rpm_trusted: bool,
    pub rpm_window_starts: usize,
    pub funded: Option<bool>,
    pub discovery_error: Option<String>,
    pub last_discovery_s_ago: Option<u64>,
    pub stopped: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_rejected: Option<String>,
    pub granted: u64,
    pub routes: Vec<RouteView>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RouteView {
    pub route: String,
    pub limit: u32,
    /// One under the limit the last halving's 429 came at, while it is remembered: capacity
    /// comes back a permit per clean round trip up to it.
    pub known_good: Option<u32>,
    /// The ceiling the start grows the limit towards (one per call that came back done while
    /// the limit was all in use), while it runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_target: Option<u32>,
    pub in_flight: u32,
    pub cooldown_remaining_ms: u64,
    pub throttles: u64,
    pub latency_ewma_ms: Option<f64>,
}
