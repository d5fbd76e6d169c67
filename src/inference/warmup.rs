//! Boot-time sizing and warm-up: how much memory a batch needs, what the device has free, the
//! default batch budget on a GPU, and the worst-case batch run once at start, so an
//! out-of-memory surfaces at boot with a suggested `max_batch_tokens`, never on the first
//! production batch (what text-embeddings-inference's warm-up does).
//!
//! The estimate is an upper bound of the activations at a layer's peak (weights are loaded
//! already and not counted): the residual stream, Q/K/V, and the larger of attention (padded:
//! per-row copies and the `rows × heads × longest²` scores) and the MLP, with a quarter more for
//! the allocator and temporaries.

use candle_core::{DType, Device};

use super::batch::{AttentionMode, PreparedBatch, RowInput};
use super::device;
use super::models::{ActivationShape, LoadedModel};
use super::tokenize::TokenizedInput;

/// The budget when none is configured and the device cannot be measured (the CPU).
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 16384;
/// The most a budget sized from free device memory may be.
pub const MAX_AUTO_BATCH_TOKENS: usize = 1 << 18;
/// Of the memory free after loading, what activations may take (the rest: cuBLAS workspaces,
/// the allocator's slack, another process on the card).
const USABLE_FRACTION: f64 = 0.8;

/// How much of a warm-up runs at boot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Warmup {
    /// The worst-case batch on a GPU; one row of `max_tokens` on the CPU (where memory is the
    /// host's and the estimate guards it).
    #[default]
    Auto,
    /// The worst-case batch: as many rows of `max_tokens` as the budget holds.
    Full,
    /// One row of `max_tokens`.
    OneRow,
}

impl std::str::FromStr for Warmup {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Warmup::Auto),
            "full" => Ok(Warmup::Full),
            "one-row" => Ok(Warmup::OneRow),
            _ => Err(format!(
                "unknown warm-up `{s}` (expected auto, full or one-row)"
            )),
        }
    }
}

/// Where the batch budget came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetSource {
    Configured,
    Default,
    /// Sized from the device's free memory after the weights loaded.
    FreeMemory,
}

impl BudgetSource {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetSource::Configured => "configured",
            BudgetSource::Default => "default",
            BudgetSource::FreeMemory => "free device memory",
        }
    }
}

/// The largest batch a budget allows: rows of `max_tokens`, as many as fit both limits.
pub fn worst_rows(max_batch_tokens: usize, max_batch_rows: usize, max_tokens: usize) -> usize {
    (max_batch_tokens / max_tokens.max(1)).clamp(1, max_batch_rows.max(1))
}

/// An upper estimate of the activation bytes of `rows` right-padded rows of `longest` tokens.
pub fn activation_bytes(
    shape: &ActivationShape,
    rows: usize,
    longest: usize,
    attention: AttentionMode,
    dtype: DType,
    device: &Device,
) -> u64 {
    let b = dtype.size_in_bytes() as f64;
    let (rows, longest) = (rows as f64, longest as f64);
    let t = rows * longest;
    let (h, i) = (shape.hidden as f64, shape.intermediate as f64);
    let (heads, kv, d) = (
        shape.heads as f64,
        shape.kv_heads as f64,
        shape.head_dim as f64,
    );
    // The layer's input, output and normed copy, and the f32 final norm with its input.
    let residual = 3.0 * t * h * b + 2.0 * t * h * 4.0;
    let qkv = t * (heads + 2.0 * kv) * d * b;
    let attention = match attention {
        AttentionMode::Padded => {
            // Softmax is widened to f32 on the CPU's half path (`attention_softmax`).
            let widened = if device.is_cpu() && dtype != DType::F32 {
                8.0
            } else {
                0.0
            };
            let rows_heads = rows * heads;
            4.0 * rows_heads * longest * d * b
                + rows_heads * longest * longest * (2.0 * b + widened)
        }
        // Packed: one (head, row) at a time; the scores are never the batch's.
        _ => t * heads * d * b,
    };
    let mlp = 3.0 * t * i * b;
    ((residual + qkv + attention.max(mlp)) * 1.25) as u64
}

/// Memory on `device` free for activations now, in bytes (`None`: it cannot tell).
pub fn free_bytes(device: &Device) -> Option<u64> {
    device::memory(device).map(|m| m.free_bytes)
}

/// The budget to run with: the configured one, else sized from free device memory on a GPU,
/// else the default; checked against free memory (an impossible one is refused with the
/// largest that fits).
#[allow(clippy::too_many_arguments)]
pub fn budget(
    configured: Option<usize>,
    max_batch_rows: usize,
    max_tokens: usize,
    shape: &ActivationShape,
    attention: AttentionMode,
    dtype: DType,
    device: &Device,
    free: Option<u64>,
) -> Result<(usize, BudgetSource), String> {
    let gpu = !device.is_cpu();
    sized(
        configured,
        max_batch_rows,
        max_tokens,
        gpu,
        free,
        &device::describe(device),
        |rows| activation_bytes(shape, rows, max_tokens, attention, dtype, device),
    )
}

/// [`budget`] with the estimate as `needs(rows)`; `gpu`: an unconfigured budget is sized from
/// free memory.
fn sized(
    configured: Option<usize>,
    max_batch_rows: usize,
    max_tokens: usize,
    gpu: bool,
    free: Option<u64>,
    device: &str,
    needs_rows: impl Fn(usize) -> u64,
) -> Result<(usize, BudgetSource), String> {
    let needs = |tokens: usize| needs_rows(worst_rows(tokens, max_batch_rows, max_tokens));
    let usable = free.map(|f| (f as f64 * USABLE_FRACTION) as u64);
    // The largest multiple of `max_tokens` (up to `cap`) whose worst batch fits `usable`.
    let largest_fitting = |usable: u64, cap: usize| -> Option<usize> {
        let most = (cap / max_tokens.max(1)).max(1);
        let (mut lo, mut hi) = (0usize, most);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if needs(mid * max_tokens) <= usable {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        (lo > 0).then_some(lo * max_tokens)
    };
    let (tokens, source) = match (configured, usable) {
        (Some(t), _) => (t, BudgetSource::Configured),
        (None, Some(usable)) if gpu => {
            let cap = MAX_AUTO_BATCH_TOKENS.min(max_batch_rows.saturating_mul(max_tokens));
            match largest_fitting(usable, cap) {
                Some(t) => (t.max(max_tokens), BudgetSource::FreeMemory),
                None => (max_tokens, BudgetSource::FreeMemory),
            }
        }
        // The CPU's default, or less when even that does not fit the host's memory.
        (None, usable) => {
            let default = DEFAULT_MAX_BATCH_TOKENS.max(max_tokens);
            match usable.filter(|u| needs(default) > *u) {
                Some(u) => (
                    largest_fitting(u, default).unwrap_or(max_tokens),
                    BudgetSource::FreeMemory,
                ),
                None => (default, BudgetSource::Default),
            }
        }
    };
    if tokens < max_tokens {
        return Err(format!(
            "max_batch_tokens ({tokens}) must hold one input of max_tokens ({max_tokens})"
        ));
    }
    if let Some(usable) = usable {
        let need = needs(tokens);
        if need > usable {
            let rows = worst_rows(tokens, max_batch_rows, max_tokens);
            let fix = match largest_fitting(usable, tokens) {
                Some(t) => format!("set max_batch_tokens to at most {t}"),
                None => "even one input of max_tokens does not fit: lower max_tokens, use a smaller dtype, or free memory".to_string(),
            };
            return Err(format!(
                "max_batch_tokens {tokens} ({rows} rows of {max_tokens} tokens at most) needs about {} of activations on {device}, and {} is free for them: {fix}",
                gib(need),
                gib(usable)
            ));
        }
    }
    Ok((tokens, source))
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Runs the worst-case batch (or one row of it) once; the error says what to change.
pub fn run(
    model: &LoadedModel,
    mode: Warmup,
    device: &Device,
    attention: AttentionMode,
    row: TokenizedInput,
    max_batch_tokens: usize,
    max_batch_rows: usize,
) -> Result<usize, String> {
    let full = match mode {
        Warmup::Full => true,
        Warmup::OneRow => false,
        Warmup::Auto => !device.is_cpu(),
    };
    let rows = if full {
        worst_rows(max_batch_tokens, max_batch_rows, row.len())
    } else {
        1
    };
    let inputs = vec![row; rows];
    let batch = PreparedBatch::build(
        inputs.iter().map(|input| RowInput {
            input,
            prefix: None,
        }),
        device,
        attention,
    )
    .and_then(|batch| model.run(&batch).map(|_| ()));
    match batch {
        Ok(()) => Ok(rows),
        Err(e) => Err(format!(
            "the warm-up batch ({rows} rows of {} tokens, max_batch_tokens {max_batch_tokens}) failed on {}: {e}; set max_batch_tokens to at most {} (or leave it unset on a GPU to size it from free memory)",
            inputs.first().map_or(0, TokenizedInput::len),
            device::describe(device),
            (max_batch_tokens / 2).max(inputs.first().map_or(1, TokenizedInput::len))
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_4b() -> ActivationShape {
        ActivationShape {
            hidden: 2560,
            intermediate: 9728,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
        }
    }

    #[test]
    fn the_estimate_grows_with_the_batch_and_the_square_of_padded_rows() {
        let s = qwen3_4b();
        let one = activation_bytes(&s, 1, 512, AttentionMode::Padded, DType::BF16, &Device::Cpu);
        let many = activation_bytes(
            &s,
            32,
            512,
            AttentionMode::Padded,
            DType::BF16,
            &Device::Cpu,
        );
        assert!(many > 30 * one / 2 && many < 33 * one, "{one} {many}");
        let long = activation_bytes(&s, 1, 4096, AttentionMode::Padded, DType::F32, &Device::Cpu);
        let short = activation_bytes(&s, 8, 512, AttentionMode::Padded, DType::F32, &Device::Cpu);
        assert!(long > short, "scores grow with the square of the row");
        // 32 × 512 tokens of Qwen3-4B in bf16: a couple of GiB.
        let gb = many as f64 / (1u64 << 30) as f64;
        assert!((1.0..8.0).contains(&gb), "{gb}");
    }

    #[test]
    fn an_impossible_budget_is_refused_with_the_largest_that_fits() {
        let s = qwen3_4b();
        let free = Some(4u64 << 30);
        // Qwen3-4B on the CPU, 512-token rows: `configured` tokens in up to `rows` rows.
        let on_cpu = |configured, rows, attention, free| {
            budget(
                configured,
                rows,
                512,
                &s,
                attention,
                DType::F32,
                &Device::Cpu,
                free,
            )
        };
        let err = on_cpu(Some(1 << 20), 1 << 20, AttentionMode::Padded, free).unwrap_err();
        assert!(err.contains("set max_batch_tokens to at most"), "{err}");
        let at_most: usize = err.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(at_most.is_multiple_of(512) && at_most >= 512, "{at_most}");
        let ok = on_cpu(Some(at_most), 1 << 20, AttentionMode::Padded, free);
        assert_eq!(ok, Ok((at_most, BudgetSource::Configured)));
        // Unconfigured on the CPU: the default, or what fits when the default does not.
        let plenty = Some(64u64 << 30);
        let cpu = |free| on_cpu(None, 256, AttentionMode::Packed, free);
        assert_eq!(
            cpu(plenty),
            Ok((DEFAULT_MAX_BATCH_TOKENS, BudgetSource::Default))
        );
        let (t, source) = cpu(free).unwrap();
        assert!(t < DEFAULT_MAX_BATCH_TOKENS && t % 512 == 0, "{t}");
        assert_eq!(source, BudgetSource::FreeMemory);
        let tiny = on_cpu(Some(512), 1, AttentionMode::Padded, Some(1 << 20));
        assert!(tiny.unwrap_err().contains("even one input"));
    }

    #[test]
    fn an_unconfigured_gpu_budget_is_the_largest_that_fits_free_memory() {
        // 1 MiB a row of 512 tokens; 100 MiB free: 80 usable, so 80 rows.
        let needs = |rows: usize| rows as u64 * (1 << 20);
        let free = Some(100u64 << 20);
        let (t, source) = sized(None, 256, 512, true, free, "cuda:0", needs).unwrap();
        assert_eq!((t, source), (80 * 512, BudgetSource::FreeMemory));
        // Capped by the rows a batch may have, and by the ceiling.
        let (t, _) = sized(None, 16, 512, true, Some(1 << 40), "cuda:0", needs).unwrap();
        assert_eq!(t, 16 * 512);
        let (t, _) = sized(None, 1 << 20, 512, true, Some(1 << 50), "cuda:0", needs).unwrap();
        assert_eq!(t, MAX_AUTO_BATCH_TOKENS);
        // The CPU keeps the default.
        let (t, source) = sized(None, 256, 512, false, free, "cpu", needs).unwrap();
        assert_eq!(
            (t, source),
            (DEFAULT_MAX_BATCH_TOKENS, BudgetSource::Default)
        );
    }
}
