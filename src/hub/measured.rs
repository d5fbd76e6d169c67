//! Numbers an agent measured (a call's latency, the tokens it read, what it cost), bounded where
//! they enter the hub.
//!
//! A frame's numbers are only as trustworthy as the agent that sent them, and one absurd value
//! folded into an average outlives the frame: the budget turns its latency average into
//! durations, checkpoints it, and a hub that takes over restores it. So no such number reaches
//! the core's state unbounded: a latency is a [`LatencyMs`] (finite, never negative, never past
//! the role's call timeout: the agent fails a call that runs longer), tokens are bounded per
//! item, a cost per call. The same bounds apply again where a checkpoint is restored
//! ([`LatencyMs::restored`]), and [`duration_of_ms`] turns any millisecond figure into a
//! [`Duration`] without the panic `Duration::from_secs_f64` has for huge or NaN input.

use std::time::Duration;

use crate::protocol::{AccountLimits, ProviderInfo, ProviderStats};

/// The longest latency any call can have measured: the longest call timeout a role may have
/// (its request timeout's bound, a day).
pub const MAX_LATENCY_MS: f64 = crate::config::timings::MAX_REQUEST_TIMEOUT.as_millis() as f64;

/// The most tokens one item (a text, a document, a chat) can have read: more than any model's
/// context. A frame's count is bounded by this per item.
pub const MAX_TOKENS_PER_ITEM: u64 = 1 << 21;

/// The most one call can have cost (US dollars): far above any model's price for a whole
/// context, far below what would exhaust a project's day at once.
pub const MAX_COST_USD_PER_CALL: f64 = 1_000.0;

/// A call's latency in milliseconds as an agent measured it: finite, in
/// [0, [`MAX_LATENCY_MS`]], so every average of them is too, and every duration made from one
/// exists.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct LatencyMs(f64);

impl LatencyMs {
    /// A measurement from the wire, bounded by the call timeout it ran under (a call that runs
    /// longer fails at the agent, so a larger figure is not what it measured); `None` for what
    /// is not a measurement at all (NaN, infinite, negative).
    pub fn measured(raw: f64, call_timeout: Duration) -> Option<LatencyMs> {
        if !raw.is_finite() || raw < 0.0 {
            return None;
        }
        let most = (call_timeout.as_secs_f64() * 1000.0).min(MAX_LATENCY_MS);
        Some(LatencyMs(raw.min(most)))
    }

    /// A value read back from stored state (a checkpoint another hub wrote): the same bounds,
    /// with no call timeout to tighten them.
    pub fn restored(raw: f64) -> Option<LatencyMs> {
        (raw.is_finite() && raw >= 0.0).then(|| LatencyMs(raw.min(MAX_LATENCY_MS)))
    }

    pub fn ms(self) -> f64 {
        self.0
    }
}

/// `ms` milliseconds as a [`Duration`], for figures the hub computed from bounded ones: NaN and
/// negatives are zero, anything past [`MAX_LATENCY_MS`] is that bound. Never panics.
pub fn duration_of_ms(ms: f64) -> Duration {
    let bounded = if ms.is_nan() {
        0.0
    } else {
        ms.clamp(0.0, MAX_LATENCY_MS)
    };
    Duration::from_secs_f64(bounded / 1000.0)
}

/// The tokens a frame of `items` items reports, bounded by [`MAX_TOKENS_PER_ITEM`] each.
pub fn tokens(raw: u64, items: usize) -> u64 {
    let items = u64::try_from(items.max(1)).unwrap_or(u64::MAX);
    raw.min(items.saturating_mul(MAX_TOKENS_PER_ITEM))
}

/// What a call cost, as the agent reported it: finite, non-negative, at most
/// [`MAX_COST_USD_PER_CALL`]; `None` when the figure is no cost at all.
pub fn cost_usd(raw: Option<f64>) -> Option<f64> {
    raw.filter(|c| c.is_finite() && *c >= 0.0)
        .map(|c| c.min(MAX_COST_USD_PER_CALL))
}

/// A figure that is only shown (an agent's own latency quantiles, an account's remaining
/// credit): finite and within `[0, most]`, or absent.
pub fn shown(raw: Option<f64>, most: f64) -> Option<f64> {
    raw.filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v.min(most))
}

/// The most requests a minute an account can be believed to allow.
pub const MAX_ACCOUNT_RPM: f64 = 1e9;
/// The most money an account's figures can be believed to hold (US dollars).
pub const MAX_ACCOUNT_USD: f64 = 1e12;

/// An account's limits as an agent discovered them (or a checkpoint kept them), each figure
/// finite and within what an account can hold; an absurd one is absent, as if unsaid.
pub fn account(limits: AccountLimits) -> AccountLimits {
    AccountLimits {
        rpm: shown(limits.rpm, MAX_ACCOUNT_RPM),
        credits_remaining_usd: usd(limits.credits_remaining_usd),
        limit_remaining_usd: usd(limits.limit_remaining_usd),
        ..limits
    }
}

/// A provider's counters as its agent reports them in heartbeats (shown in status and
/// metrics): each latency finite and within [`MAX_LATENCY_MS`], or absent.
pub fn provider_stats(stats: ProviderStats) -> ProviderStats {
    ProviderStats {
        latency_ewma_ms: shown(stats.latency_ewma_ms, MAX_LATENCY_MS),
        latency_p50_ms: shown(stats.latency_p50_ms, MAX_LATENCY_MS),
        latency_p95_ms: shown(stats.latency_p95_ms, MAX_LATENCY_MS),
        ..stats
    }
}

/// The most items one work frame may carry, whatever a provider offers.
pub const MAX_FRAME_ITEMS: usize = 16_384;
/// The most tokens one work frame may carry, whatever a provider offers.
pub const MAX_FRAME_TOKENS: usize = 1 << 24;
/// The widest vector a provider can claim.
pub const MAX_DIMS: usize = 1 << 16;

/// A provider as its agent describes it, with its frame limits bounded (an offer past them
/// is taken at the bound); a width no table can have is refused.
pub fn provider_info(info: ProviderInfo) -> Result<ProviderInfo, String> {
    if let Some(dims) = info.dims.filter(|d| *d == 0 || *d > MAX_DIMS) {
        return Err(format!(
            "provider '{}' claims {dims} dimensions; a vector has 1 to {MAX_DIMS}",
            info.id
        ));
    }
    let per_item = usize::try_from(MAX_TOKENS_PER_ITEM).unwrap_or(usize::MAX);
    Ok(ProviderInfo {
        max_batch_items: info.max_batch_items.clamp(1, MAX_FRAME_ITEMS),
        max_batch_tokens: info.max_batch_tokens.clamp(1, MAX_FRAME_TOKENS),
        max_input_tokens: info.max_input_tokens.map(|t| t.clamp(1, per_item)),
        ..info
    })
}

/// A balance (an overdrawn one is negative): finite and within [`MAX_ACCOUNT_USD`] either way.
fn usd(raw: Option<f64>) -> Option<f64> {
    raw.filter(|v| v.is_finite())
        .map(|v| v.clamp(-MAX_ACCOUNT_USD, MAX_ACCOUNT_USD))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latency_is_bounded_by_its_call_timeout_and_what_is_no_measurement_is_none() {
        let call = Duration::from_secs(120);
        assert_eq!(LatencyMs::measured(1e300, call).unwrap().ms(), 120_000.0);
        assert_eq!(LatencyMs::measured(f64::MAX, call).unwrap().ms(), 120_000.0);
        assert_eq!(LatencyMs::measured(0.0, call).unwrap().ms(), 0.0);
        assert_eq!(LatencyMs::measured(250.5, call).unwrap().ms(), 250.5);
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0, -1e300] {
            assert_eq!(LatencyMs::measured(bad, call), None, "{bad}");
            assert_eq!(LatencyMs::restored(bad), None, "{bad}");
        }
        // A call timeout past the bound (it cannot be configured, but the type holds anyway).
        let huge = Duration::from_secs(u64::MAX / 4);
        assert_eq!(
            LatencyMs::measured(1e300, huge).unwrap().ms(),
            MAX_LATENCY_MS
        );
        assert_eq!(LatencyMs::restored(1e300).unwrap().ms(), MAX_LATENCY_MS);
    }

    #[test]
    fn every_millisecond_figure_is_a_duration() {
        assert_eq!(duration_of_ms(1500.0), Duration::from_millis(1500));
        assert_eq!(duration_of_ms(f64::NAN), Duration::ZERO);
        assert_eq!(duration_of_ms(-5.0), Duration::ZERO);
        assert_eq!(
            duration_of_ms(1e300),
            Duration::from_secs_f64(MAX_LATENCY_MS / 1000.0)
        );
        assert_eq!(
            duration_of_ms(f64::INFINITY),
            Duration::from_secs_f64(MAX_LATENCY_MS / 1000.0)
        );
    }

    #[test]
    fn tokens_and_costs_are_bounded_per_item_and_per_call() {
        assert_eq!(tokens(u64::MAX, 3), 3 * MAX_TOKENS_PER_ITEM);
        assert_eq!(tokens(u64::MAX, 0), MAX_TOKENS_PER_ITEM);
        assert_eq!(tokens(1234, 3), 1234);
        assert_eq!(cost_usd(Some(1e300)), Some(MAX_COST_USD_PER_CALL));
        assert_eq!(cost_usd(Some(0.002)), Some(0.002));
        assert_eq!(cost_usd(Some(0.0)), Some(0.0));
        for bad in [f64::NAN, f64::INFINITY, -0.5] {
            assert_eq!(cost_usd(Some(bad)), None, "{bad}");
        }
        assert_eq!(shown(Some(1e300), 10.0), Some(10.0));
        assert_eq!(shown(Some(-1.0), 10.0), None);
    }
}
