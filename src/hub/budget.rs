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

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::events::{EventKind, EventRing};
use crate::protocol::{AccountLimits, LimitKind};

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
    Success { latency_ms: f64 },
    /// Refused by a limit.
    Limited {
        kind: LimitKind,
        retry_after: Option<Duration>,
    },
    /// Anything else (a failure, an expired or lost lease): no signal, no latency sample.
    Other,
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

/// What a throttle that halved a limit did.
#[derive(Clone, Copy, Debug)]
struct Halving {
    from: u32,
    to: u32,
    cooldown: Duration,
    /// It ended the start (no halving, no cooldown: the limit went under the wall).
    ended_start: bool,
}

impl Halving {
    fn kind(self) -> EventKind {
        if self.ended_start {
            EventKind::Wall
        } else {
            EventKind::Cooldown
        }
    }

    fn describe(self, what: &str) -> String {
        if self.ended_start {
            let wait = if self.cooldown.is_zero() {
                "with no cooldown".to_string()
            } else {
                format!(
                    "waiting out the key's Retry-After ({:.1} s)",
                    self.cooldown.as_secs_f64()
                )
            };
            return format!(
                "{what} ended the start: the limit went from {} to {}, one under the wall, {wait}",
                self.from, self.to
            );
        }
        format!(
            "{what}: the limit went from {} to {} and cools down for {:.1} s",
            self.from,
            self.to,
            self.cooldown.as_secs_f64()
        )
    }
}

/// One scope's limiter: the global one, or one route's.
#[derive(Clone, Debug)]
struct Limiter {
    limit: u32,
    in_flight: u32,
    cooldown_until: Option<Instant>,
    backoff: Duration,
    last_halving: Option<Instant>,
    window_start: Instant,
    window_throttled: bool,
    /// The most permits held at once in the current window.
    window_peak: u32,
    /// The limit the last halving's 429 came at, and when.
    last_bad: Option<(u32, Instant)>,
    /// The limit that halving left (a later 429 of the same burst finds it unchanged).
    halved_to: u32,
    /// The current round-trip window of the fast ramp (start, throttled, peak).
    trip_start: Instant,
    trip_throttled: bool,
    trip_peak: u32,
    /// Calls that came back done in the current round trip (a trip without one proves
    /// nothing: calls still out may yet be refused).
    trip_done: u32,
    throttles: u64,
    latency_ewma_ms: Option<f64>,
    /// The ceiling the start grows towards, while it runs.
    start_target: Option<u32>,
    /// When a 429 ended the start: refusals within a round trip of it are the same burst.
    start_ended: Option<Instant>,
}

impl Limiter {
    fn new(limit: u32, backoff: Duration, now: Instant) -> Self {
        Self {
            limit,
            in_flight: 0,
            cooldown_until: None,
            backoff,
            last_halving: None,
            window_start: now,
            window_throttled: false,
            window_peak: 0,
            last_bad: None,
            halved_to: 0,
            trip_start: now,
            trip_throttled: false,
            trip_peak: 0,
            trip_done: 0,
            throttles: 0,
            latency_ewma_ms: None,
            start_target: None,
            start_ended: None,
        }
    }

    /// A limiter for a new scope: at the ceiling when it is the operator's, else at the
    /// start's opening limit.
    fn opening(ceiling: Ceiling, s: &BudgetSettings, now: Instant) -> Self {
        let mut l = Self::new(1, s.backoff_initial, now);
        l.raise_to(ceiling, s);
        l
    }

    /// The ceiling rose above the limit: an operator's number applies at once; a guessed one
    /// is approached by the start from half of it.
    fn raise_to(&mut self, ceiling: Ceiling, s: &BudgetSettings) {
        let (ceiling, source) = ceiling;
        if source == CeilingSource::Override || !s.slow_start {
            self.limit = ceiling;
            self.start_target = None;
            return;
        }
        let opening = (ceiling / 2).max(s.default_ceiling).min(ceiling);
        self.limit = self.limit.max(opening).min(ceiling);
        self.start_target = (self.limit < ceiling).then_some(ceiling);
    }

    /// The ceiling went under the limit: down at once, and the start has nothing left to
    /// grow to.
    fn lower_to(&mut self, ceiling: u32) {
        self.limit = self.limit.min(ceiling);
        if self.start_target.is_some_and(|t| t > ceiling) {
            self.start_target = (self.limit < ceiling).then_some(ceiling);
        }
    }

    /// The known-good limit while a 429's limit is remembered: one under it.
    fn known_good(&self) -> Option<u32> {
        self.last_bad.map(|(bad, _)| bad.saturating_sub(1).max(1))
    }

    fn cooling(&self, now: Instant) -> Option<Duration> {
        self.cooldown_until
            .filter(|&t| t > now)
            .map(|t| t.duration_since(now))
    }

    fn acquire(&mut self) {
        self.in_flight += 1;
        self.window_peak = self.window_peak.max(self.in_flight);
        self.trip_peak = self.trip_peak.max(self.in_flight);
    }

    fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Closes every full window since the last call: a clean, well-used round trip adds a
    /// permit below the known-good limit; a clean, well-used 15 s window adds one above it,
    /// once the limit a 429 came at is forgotten (or when none was learnt).
    fn roll(&mut self, now: Instant, ceiling: u32, latency_ms: f64, s: &BudgetSettings) {
        if self
            .last_bad
            .is_some_and(|(_, at)| now.saturating_duration_since(at) >= s.bad_memory)
        {
            self.last_bad = None;
        }
        self.roll_trips(now, ceiling, latency_ms, s);
        while now.saturating_duration_since(self.window_start) >= s.clean_window {
            let used_enough = self.window_peak * 2 >= self.limit;
            // A window spent cooling down proves nothing: no call could be refused in it.
            let cooled = self.cooldown_until.is_some_and(|t| t > self.window_start);
            if !self.window_throttled && !cooled {
                if used_enough && self.limit < ceiling && self.last_bad.is_none() {
                    self.limit += 1;
                }
                if self.window_peak > 0 {
                    self.backoff = s.backoff_initial;
                }
            }
            self.window_start += s.clean_window;
            self.window_throttled = false;
            self.window_peak = self.in_flight;
        }
        self.lower_to(ceiling);
    }

    /// The fast ramp: closes every round-trip window since the last call; a clean one (a call
    /// came back done, none was refused) in which at least half the limit was used adds a
    /// permit while the limit is under the known-good one.
    fn roll_trips(&mut self, now: Instant, ceiling: u32, latency_ms: f64, s: &BudgetSettings) {
        let trip = Duration::from_secs_f64(
            (latency_ms.max(s.latency_floor_ms) * s.round_trips_per_step.max(0.1)) / 1000.0,
        )
        .min(s.clean_window);
        // Windows no event fell in repeat the last one; past a few, the rest add nothing new.
        const MOST_WINDOWS: u32 = 64;
        let mut closed = 0;
        while now.saturating_duration_since(self.trip_start) >= trip {
            closed += 1;
            if closed > MOST_WINDOWS {
                self.trip_start = now;
                break;
            }
            let cooled = self.cooldown_until.is_some_and(|t| t > self.trip_start);
            let used_enough = self.trip_peak * 2 >= self.limit;
            if let Some(good) = self.known_good()
                && !self.trip_throttled
                && self.trip_done > 0
                && !cooled
                && used_enough
                && self.limit < good.min(ceiling)
            {
                // Slow start towards a threshold that was measured: the limit doubles per
                // clean round trip, never past the known-good limit.
                self.limit = self.limit.saturating_mul(2).min(good.min(ceiling));
            }
            self.trip_start += trip;
            self.trip_throttled = false;
            self.trip_peak = self.in_flight;
            self.trip_done = 0;
        }
    }

    /// A throttle signal: halve from what is in flight (once per window) and cool down.
    /// Returns the halving (the limit before and after, and the cooldown) when it was one:
    /// a later refusal of the same burst is not.
    fn throttle(
        &mut self,
        retry_after: Option<Duration>,
        key_wide: bool,
        latency_ms: f64,
        now: Instant,
        s: &BudgetSettings,
        rng: &mut StdRng,
    ) -> Option<Halving> {
        self.throttles += 1;
        self.window_throttled = true;
        self.trip_throttled = true;
        // A key-wide 429 (the platform's rate, the in-flight budget) is the shared key's: its
        // own Retry-After is honoured even where a halving's cooldown is not taken.
        let key_wait = |l: &mut Self| {
            if let Some(ra) = retry_after.filter(|_| key_wide) {
                let floor = now + ra;
                if l.cooldown_until.is_none_or(|t| t < floor) {
                    l.cooldown_until = Some(floor);
                }
            }
        };
        if self.start_target.take().is_some() {
            // The start found the wall: what was in flight (this call included) is one over
            // what the upstream holds. No halving and no cooldown of ours: the calls still out
            // were taken, so the scope stands at the wall, not past it.
            let from = self.limit;
            let wall = self.limit.min(self.in_flight).max(1);
            self.last_bad = Some((wall, now));
            self.limit = wall.saturating_sub(1).max(1);
            self.halved_to = self.limit;
            self.start_ended = Some(now);
            key_wait(self);
            return Some(Halving {
                from,
                to: self.limit,
                cooldown: self.cooling(now).unwrap_or(Duration::ZERO),
                ended_start: true,
            });
        }
        let trip = Duration::from_secs_f64(
            self.latency_ewma_ms
                .unwrap_or(latency_ms)
                .max(s.latency_floor_ms)
                / 1000.0,
        );
        if self
            .start_ended
            .is_some_and(|t| now.saturating_duration_since(t) < trip)
        {
            // Another refusal of the round trip that ended the start: the wall is at most what
            // is in flight now (this call included; the refusals before it are back), so each
            // refusal of a burst lowers it by one.
            if let Some((bad, at)) = self.last_bad {
                let wall = bad.min(self.in_flight).max(1);
                self.last_bad = Some((wall, at));
                self.limit = self.limit.min(wall.saturating_sub(1).max(1));
                self.halved_to = self.limit;
            }
            key_wait(self);
            return None;
        }
        let retry_after = retry_after.unwrap_or(Duration::ZERO);
        let halved_recently = self
            .last_halving
            .is_some_and(|t| now.saturating_duration_since(t) < s.clean_window);
        if halved_recently {
            // Honour a later Retry-After, but do not halve twice for one burst.
            if let Some((bad, at)) = self.last_bad {
                if self.limit < bad && self.limit > self.halved_to {
                    // The ramp walked into the wall again: remember the lower limit, and step
                    // back under it.
                    self.last_bad = Some((self.limit, at));
                    self.limit = self.known_good().unwrap_or(self.limit);
                } else if self.limit <= self.halved_to && bad > self.halved_to + 1 {
                    // Another refusal of the burst that caused the halving: k refusals of a
                    // burst at limit L mean the capacity is about L − k, so the limit the wall
                    // stands at is one lower per refusal (never down to the halved limit).
                    self.last_bad = Some((bad - 1, at));
                }
            }
            let floor = now + retry_after;
            if self.cooldown_until.is_none_or(|t| t < floor) {
                self.cooldown_until = Some(floor);
            }
            return None;
        }
        let from = self.limit;
        self.last_bad = Some((self.limit, now));
        self.limit = (self.limit.min(self.in_flight) / 2).max(1);
        self.halved_to = self.limit;
        // The first throttle after a clean spell honours the upstream's Retry-After as it is
        // (the halving already took the pressure off); repeated ones back off further.
        let base = if self.backoff <= s.backoff_initial && !retry_after.is_zero() {
            retry_after
        } else {
            retry_after.max(self.backoff)
        };
        let jittered = base.mul_f64(rng.random_range(0.5..1.5));
        self.cooldown_until = Some(now + jittered.max(retry_after));
        self.backoff = (self.backoff * 2).min(s.backoff_max);
        self.last_halving = Some(now);
        Some(Halving {
            from,
            to: self.limit,
            cooldown: self.cooldown_until.map_or(Duration::ZERO, |t| t - now),
            ended_start: false,
        })
    }

    /// A call came back done (a clean round trip needs one). During the start, a limit that
    /// was all in use grows by one (the call still counts in flight here).
    fn succeeded(&mut self) {
        self.trip_done = self.trip_done.saturating_add(1);
        if let Some(target) = self.start_target {
            if self.in_flight >= self.limit {
                self.limit = (self.limit + 1).min(target);
            }
            if self.limit >= target {
                self.start_target = None;
            }
        }
    }

    fn record_latency(&mut self, latency_ms: f64, s: &BudgetSettings) {
        let sample = latency_ms.max(s.latency_floor_ms);
        self.latency_ewma_ms = Some(match self.latency_ewma_ms {
            Some(prev) => prev + s.latency_alpha * (sample - prev),
            None => sample,
        });
    }
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

/// What the budget learned, as a shared store keeps it (checkpointed every few seconds, never
/// per call): a hub that takes the lead starts from it instead of from nothing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BudgetCheckpoint {
    /// The key generation it was learned under: another key's account is not this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_generation: Option<String>,
    pub account: AccountLimits,
    pub latency_ewma_ms: f64,
    pub global: LimiterCheckpoint,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub routes: BTreeMap<String, LimiterCheckpoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_rejected: Option<String>,
}

fn round_to_50(ms: f64) -> f64 {
    (ms / 50.0).round() * 50.0
}

/// One scope's learned limit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LimiterCheckpoint {
    pub limit: u32,
    /// The ceiling a start was growing the limit towards, when one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_target: Option<u32>,
    /// The limit a 429 came at, while it is remembered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_bad: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ewma_ms: Option<f64>,
}

impl LimiterCheckpoint {
    fn of(l: &Limiter) -> Self {
        Self {
            limit: l.limit,
            start_target: l.start_target,
            last_bad: l.last_bad.map(|(bad, _)| bad),
            // In 50 ms steps: a checkpoint changes when something was learnt, not per call.
            latency_ewma_ms: l.latency_ewma_ms.map(round_to_50),
        }
    }

    /// Laid over a fresh limiter: a remembered wall counts from now (a halving just happened,
    /// as far as the ramp can tell), so the new leader does not walk into it again.
    fn restore(&self, l: &mut Limiter, now: Instant) {
        l.limit = self.limit.max(1);
        l.start_target = self.start_target.filter(|&t| t > l.limit);
        l.latency_ewma_ms = self.latency_ewma_ms.filter(|v| v.is_finite() && *v >= 0.0);
        if let Some(bad) = self.last_bad {
            l.last_bad = Some((bad, now));
            l.halved_to = l.limit;
            l.last_halving = Some(now);
        }
    }
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

    /// What it learned, for a shared store.
    pub fn checkpoint(&self, key_generation: Option<&str>) -> BudgetCheckpoint {
        BudgetCheckpoint {
            key_generation: key_generation.map(str::to_string),
            account: AccountLimits {
                error: None,
                ..self.account.clone()
            },
            latency_ewma_ms: round_to_50(self.latency_ewma_ms),
            global: LimiterCheckpoint::of(&self.global),
            routes: self
                .routes
                .iter()
                .map(|(r, l)| (r.clone(), LimiterCheckpoint::of(l)))
                .collect(),
            stopped: self.stopped.clone(),
            key_rejected: self.key_rejected.clone(),
        }
    }

    /// A hub takes the lead over a shared store: it starts from what the last leader learned
    /// (when it was learned under the key this hub holds), and counts the RPM window as full
    /// until one window has passed, since the last leader's starts were never checkpointed.
    pub fn take_over(
        &mut self,
        checkpoint: Option<&BudgetCheckpoint>,
        key_generation: Option<&str>,
        now: Instant,
    ) {
        self.took_over = Some(now);
        let Some(cp) = checkpoint.filter(|c| c.key_generation.as_deref() == key_generation) else {
            return;
        };
        self.account = cp.account.clone();
        self.last_discovery = Some(now);
        if cp.latency_ewma_ms.is_finite() && cp.latency_ewma_ms > 0.0 {
            self.latency_ewma_ms = cp.latency_ewma_ms;
        }
        self.stopped = cp.stopped.clone();
        self.key_rejected = cp.key_rejected.clone();
        cp.global.restore(&mut self.global, now);
        for (route, l) in &cp.routes {
            let mut limiter = Limiter::new(l.limit, self.settings.backoff_initial, now);
            l.restore(&mut limiter, now);
            self.routes.insert(route.clone(), limiter);
        }
        self.tick(now);
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
            Outcome::Success { latency_ms } if latency_ms.is_finite() && latency_ms >= 0.0 => {
                let s = &self.settings;
                let sample = latency_ms.max(s.latency_floor_ms);
                self.latency_ewma_ms += s.latency_alpha * (sample - self.latency_ewma_ms);
                let ceiling = self.ceiling();
                self.global.succeeded();
                let r = route_entry(&mut self.routes, route, ceiling, &self.settings, now);
                r.record_latency(latency_ms, &self.settings);
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
            Outcome::Success { .. } | Outcome::Other => {}
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

#[cfg(test)]
mod tests {
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
            b.release(route, Outcome::Success { latency_ms: 1000.0 }, now);
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
            b.release("r", Outcome::Success { latency_ms: 450.0 }, now);
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
            b.release("r", Outcome::Success { latency_ms: 3000.0 }, t);
        }
        assert_eq!(b.ceiling().0, 30);
        // The floor: 1 ms calls count as 50 ms.
        for _ in 0..200 {
            take(&mut b, "r", 1, t);
            b.release("r", Outcome::Success { latency_ms: 1.0 }, t);
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
            old.release("r", Outcome::Success { latency_ms: 450.0 }, t);
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
        b.release("r", Outcome::Success { latency_ms: 100.0 }, now);
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
                b.release("r", Outcome::Success { latency_ms: 100.0 }, now);
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
            b.release("r", Outcome::Success { latency_ms }, now);
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
            b.release("r", Outcome::Success { latency_ms: 1000.0 }, now);
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
            b.release("r", Outcome::Success { latency_ms: 1000.0 }, t);
        }
        let mut now = t + 2 * S;
        b.tick(now);
        let n = b.view(now).routes[0].limit;
        take(&mut b, "r", n, now);
        for _ in 0..n {
            b.release("r", Outcome::Success { latency_ms: 1000.0 }, now);
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
        b.release(
            "code-assistant:chat",
            Outcome::Success { latency_ms: 900.0 },
            t + S,
        );
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
            b.release("r", Outcome::Success { latency_ms: 1000.0 }, t);
        }
        assert_eq!(b.limit(), 8);
        // A full round trip of 8 calls, each back done while the limit was full (a freed
        // permit taken again at once, as a waiting queue does): 8 → 16.
        take(&mut b, "r", 8, t);
        for _ in 0..8 {
            b.release("r", Outcome::Success { latency_ms: 1000.0 }, t);
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
            b.release("r", Outcome::Success { latency_ms: 1000.0 }, t);
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
        b.release("r", Outcome::Success { latency_ms: 1000.0 }, t);
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
}
