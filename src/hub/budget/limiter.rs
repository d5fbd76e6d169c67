//! One scope's limiter (the global one, or one route's): its limit and what is in flight,
//! the start towards a guessed ceiling, the throttle (halving and cooldown), the ramp back in
//! round trips below the known-good limit and in clean windows above it. The rules are the
//! budget's ([`super`]); this is their arithmetic, on a fake clock.

use std::time::{Duration, Instant};

use rand::Rng;
use rand::rngs::StdRng;

use super::{BudgetSettings, Ceiling, CeilingSource};
use crate::hub::events::EventKind;
use crate::hub::measured::{LatencyMs, duration_of_ms};

/// What a throttle that halved a limit did.
#[derive(Clone, Copy, Debug)]
pub(super) struct Halving {
    pub(super) from: u32,
    pub(super) to: u32,
    pub(super) cooldown: Duration,
    /// It ended the start (no halving, no cooldown: the limit went under the wall).
    pub(super) ended_start: bool,
}

impl Halving {
    pub(super) fn kind(self) -> EventKind {
        if self.ended_start {
            EventKind::Wall
        } else {
            EventKind::Cooldown
        }
    }

    pub(super) fn describe(self, what: &str) -> String {
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
pub(super) struct Limiter {
    pub(super) limit: u32,
    pub(super) in_flight: u32,
    pub(super) cooldown_until: Option<Instant>,
    pub(super) backoff: Duration,
    pub(super) last_halving: Option<Instant>,
    pub(super) window_start: Instant,
    pub(super) window_throttled: bool,
    /// The most permits held at once in the current window.
    pub(super) window_peak: u32,
    /// The limit the last halving's 429 came at, and when.
    pub(super) last_bad: Option<(u32, Instant)>,
    /// The limit that halving left (a later 429 of the same burst finds it unchanged).
    pub(super) halved_to: u32,
    /// The current round-trip window of the fast ramp (start, throttled, peak).
    pub(super) trip_start: Instant,
    pub(super) trip_throttled: bool,
    pub(super) trip_peak: u32,
    /// Calls that came back done in the current round trip (a trip without one proves
    /// nothing: calls still out may yet be refused).
    pub(super) trip_done: u32,
    pub(super) throttles: u64,
    pub(super) latency_ewma_ms: Option<f64>,
    /// The ceiling the start grows towards, while it runs.
    pub(super) start_target: Option<u32>,
    /// When a 429 ended the start: refusals within a round trip of it are the same burst.
    pub(super) start_ended: Option<Instant>,
}

impl Limiter {
    pub(super) fn new(limit: u32, backoff: Duration, now: Instant) -> Self {
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
    pub(super) fn opening(ceiling: Ceiling, s: &BudgetSettings, now: Instant) -> Self {
        let mut l = Self::new(1, s.backoff_initial, now);
        l.raise_to(ceiling, s);
        l
    }

    /// The ceiling rose above the limit: an operator's number applies at once; a guessed one
    /// is approached by the start from half of it.
    pub(super) fn raise_to(&mut self, ceiling: Ceiling, s: &BudgetSettings) {
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
    pub(super) fn lower_to(&mut self, ceiling: u32) {
        self.limit = self.limit.min(ceiling);
        if self.start_target.is_some_and(|t| t > ceiling) {
            self.start_target = (self.limit < ceiling).then_some(ceiling);
        }
    }

    /// The known-good limit while a 429's limit is remembered: one under it.
    pub(super) fn known_good(&self) -> Option<u32> {
        self.last_bad.map(|(bad, _)| bad.saturating_sub(1).max(1))
    }

    pub(super) fn cooling(&self, now: Instant) -> Option<Duration> {
        self.cooldown_until
            .filter(|&t| t > now)
            .map(|t| t.duration_since(now))
    }

    pub(super) fn acquire(&mut self) {
        self.in_flight += 1;
        self.window_peak = self.window_peak.max(self.in_flight);
        self.trip_peak = self.trip_peak.max(self.in_flight);
    }

    pub(super) fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Closes every full window since the last call: a clean, well-used round trip adds a
    /// permit below the known-good limit; a clean, well-used 15 s window adds one above it,
    /// once the limit a 429 came at is forgotten (or when none was learnt).
    pub(super) fn roll(&mut self, now: Instant, ceiling: u32, latency_ms: f64, s: &BudgetSettings) {
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
    pub(super) fn roll_trips(
        &mut self,
        now: Instant,
        ceiling: u32,
        latency_ms: f64,
        s: &BudgetSettings,
    ) {
        let trip =
            duration_of_ms(latency_ms.max(s.latency_floor_ms) * s.round_trips_per_step.max(0.1))
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
    pub(super) fn throttle(
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
        let trip = duration_of_ms(
            self.latency_ewma_ms
                .unwrap_or(latency_ms)
                .max(s.latency_floor_ms),
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
    pub(super) fn succeeded(&mut self) {
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

    pub(super) fn record_latency(&mut self, latency: LatencyMs, s: &BudgetSettings) {
        let sample = latency.ms().max(s.latency_floor_ms);
        self.latency_ewma_ms = Some(match self.latency_ewma_ms {
            Some(prev) => prev + s.latency_alpha * (sample - prev),
            None => sample,
        });
    }
}
