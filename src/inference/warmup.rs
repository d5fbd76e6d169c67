//! Boot-time sizing and warm-up: how much memory a batch needs, what the device has free, the
//! default batch budget on a GPU, and the worst-case batch run once at start, so an
//! out-of-memory surfaces at boot with a suggested `max_batch_tokens`, never on the first
//! production batch (what text-embeddings-inference's warm-up does).
//!
//! The estimate is an upper bound of the activations at a layer's peak (weights are loaded
//! already and not counted): the residual stream, Q/K/V, and the larger of attention (padded:
//! per-row copies and the `rows × heads × longest²` scores) and the MLP, with a quarter more for
//! the allocator and temporaries.
//!
//! Memory is not the only bound on a GPU: candle's CUDA kernels index with u32 and cuBLAS with
//! i32, so no tensor may hold 2³¹ elements or more, and a batched GEMM holds at most 65 535
//! matrices ([`kernel_limit`]). A budget the sizer picks respects both, so it passes its
//! warm-up; a configured one past them is refused with the largest that respects them; and when
//! a warm-up still fails, the advice is a smaller budget whose warm-up was run and passed
//! ([`largest_that_runs`]), never a guess.

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
/// The most elements one tensor may hold on a GPU (candle's kernels and cuBLAS index with 32
/// bits; measured on the H200: padded scores of exactly 2³¹ elements ran, 1.5 × 2³¹ failed in
/// cuBLAS).
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 31;
/// The most matrices one batched cuBLAS GEMM may hold (its grid's z).
pub const MAX_GEMM_BATCH: u64 = 65_535;

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

/// Why a batch of `rows` rows of `longest` tokens cannot run on a GPU whatever its memory (a
/// tensor past [`MAX_TENSOR_ELEMENTS`], a batched GEMM past [`MAX_GEMM_BATCH`]), or `None`.
pub fn kernel_limit(
    shape: &ActivationShape,
    rows: usize,
    longest: usize,
    attention: AttentionMode,
) -> Option<String> {
    let (rows, longest) = (rows as u64, longest as u64);
    let tokens = rows * longest;
    let (h, i) = (shape.hidden as u64, shape.intermediate as u64);
    let (heads, kv, d) = (
        shape.heads as u64,
        shape.kv_heads as u64,
        shape.head_dim as u64,
    );
    // The widest per-token tensor: fused gate/up, fused QKV, the residual with its norm.
    let widest = (2 * i).max((heads + 2 * kv) * d).max(2 * h);
    if tokens.saturating_mul(widest) > MAX_TENSOR_ELEMENTS {
        return Some(format!(
            "{tokens} tokens × {widest} per token is {} elements in one tensor, past 2^31",
            tokens.saturating_mul(widest)
        ));
    }
    if attention == AttentionMode::Padded {
        let scores = (rows * heads).saturating_mul(longest * longest);
        if scores > MAX_TENSOR_ELEMENTS {
            return Some(format!(
                "padded attention's scores ({rows} rows × {heads} heads × {longest}²) are {scores} elements, past 2^31"
            ));
        }
        if rows * heads > MAX_GEMM_BATCH {
            return Some(format!(
                "padded attention batches {} matrices in one GEMM, past {MAX_GEMM_BATCH}",
                rows * heads
            ));
        }
    }
    None
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
        |rows| {
            if gpu {
                kernel_limit(shape, rows, max_tokens, attention)
            } else {
                None
            }
        },
    )
}

/// [`budget`] with the estimate as `needs_rows(rows)` and the kernels' limits as
/// `limit_rows(rows)`; `gpu`: an unconfigured budget is sized from free memory.
#[allow(clippy::too_many_arguments)]
fn sized(
    configured: Option<usize>,
    max_batch_rows: usize,
    max_tokens: usize,
    gpu: bool,
    free: Option<u64>,
    device: &str,
    needs_rows: impl Fn(usize) -> u64,
    limit_rows: impl Fn(usize) -> Option<String>,
) -> Result<(usize, BudgetSource), String> {
    let rows_of = |tokens: usize| worst_rows(tokens, max_batch_rows, max_tokens);
    let usable = free.map(|f| (f as f64 * USABLE_FRACTION) as u64);
    // Whether the worst batch of a budget fits memory and the kernels' limits.
    let runs = |tokens: usize| {
        let rows = rows_of(tokens);
        limit_rows(rows).is_none() && usable.is_none_or(|u| needs_rows(rows) <= u)
    };
    // The largest multiple of `max_tokens` (up to `cap`) whose worst batch runs: both grow with
    // the rows, so a bisection finds it.
    let largest_running = |cap: usize| -> Option<usize> {
        let most = (cap / max_tokens.max(1)).max(1);
        let (mut lo, mut hi) = (0usize, most);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if runs(mid * max_tokens) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        (lo > 0).then_some(lo * max_tokens)
    };
    if let Some(why) = limit_rows(1) {
        return Err(format!(
            "one input of max_tokens ({max_tokens}) is past what the kernels on {device} take: {why}; lower max_tokens"
        ));
    }
    let (tokens, source) = match (configured, usable) {
        (Some(t), _) => (t, BudgetSource::Configured),
        (None, Some(_)) if gpu => {
            let cap = MAX_AUTO_BATCH_TOKENS.min(max_batch_rows.saturating_mul(max_tokens));
            let t = largest_running(cap).unwrap_or(max_tokens);
            (t.max(max_tokens), BudgetSource::FreeMemory)
        }
        // The CPU's default, or less when even that does not fit the host's memory.
        (None, _) => {
            let default = DEFAULT_MAX_BATCH_TOKENS.max(max_tokens);
            if runs(default) {
                (default, BudgetSource::Default)
            } else {
                (
                    largest_running(default).unwrap_or(max_tokens),
                    BudgetSource::FreeMemory,
                )
            }
        }
    };
    if tokens < max_tokens {
        return Err(format!(
            "max_batch_tokens ({tokens}) must hold one input of max_tokens ({max_tokens})"
        ));
    }
    let rows = rows_of(tokens);
    let fix = || {
        match largest_running(tokens) {
        Some(t) => format!("set max_batch_tokens to at most {t}"),
        None => "even one input of max_tokens does not fit: lower max_tokens, use a smaller dtype, or free memory".to_string(),
    }
    };
    if let Some(why) = limit_rows(rows) {
        return Err(format!(
            "max_batch_tokens {tokens} ({rows} rows of {max_tokens} tokens at most) is past what the kernels on {device} take: {why}: {}",
            fix()
        ));
    }
    if let Some(usable) = usable {
        let need = needs_rows(rows);
        if need > usable {
            return Err(format!(
                "max_batch_tokens {tokens} ({rows} rows of {max_tokens} tokens at most) needs about {} of activations on {device}, and {} is free for them: {}",
                gib(need),
                gib(usable),
                fix()
            ));
        }
    }
    Ok((tokens, source))
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// A warm-up that failed: its batch and the device's error.
#[derive(Debug)]
pub struct WarmupFailure {
    pub rows: usize,
    pub row_tokens: usize,
    pub error: String,
}

/// Runs the worst-case batch (or one row of it) once: the rows it ran.
pub fn run(
    model: &LoadedModel,
    mode: Warmup,
    device: &Device,
    attention: AttentionMode,
    row: &TokenizedInput,
    max_batch_tokens: usize,
    max_batch_rows: usize,
) -> Result<usize, WarmupFailure> {
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
    run_rows(model, device, attention, row, rows)
}

fn run_rows(
    model: &LoadedModel,
    device: &Device,
    attention: AttentionMode,
    row: &TokenizedInput,
    rows: usize,
) -> Result<usize, WarmupFailure> {
    let inputs = vec![row; rows];
    PreparedBatch::build(
        inputs.iter().map(|input| RowInput {
            input,
            prefix: None,
        }),
        device,
        attention,
    )
    .and_then(|batch| model.run(&batch).map(|_| ()))
    .map(|()| rows)
    .map_err(|e| WarmupFailure {
        rows,
        row_tokens: row.len(),
        error: e.to_string(),
    })
}

/// After a warm-up of `failed_rows` rows failed: the largest budget of fewer rows (halving)
/// whose warm-up runs, each run for real; `None` when not even one row runs.
pub fn largest_that_runs(
    model: &LoadedModel,
    device: &Device,
    attention: AttentionMode,
    row: &TokenizedInput,
    failed_rows: usize,
) -> Option<usize> {
    let mut rows = failed_rows / 2;
    while rows >= 1 {
        if run_rows(model, device, attention, row, rows).is_ok() {
            return Some(rows * row.len());
        }
        rows /= 2;
    }
    None
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
        let (t, source) = sized(None, 256, 512, true, free, "cuda:0", needs, |_| None).unwrap();
        assert_eq!((t, source), (80 * 512, BudgetSource::FreeMemory));
        // Capped by the rows a batch may have, and by the ceiling.
        let (t, _) = sized(None, 16, 512, true, Some(1 << 40), "cuda:0", needs, |_| {
            None
        })
        .unwrap();
        assert_eq!(t, 16 * 512);
        let (t, _) = sized(
            None,
            1 << 20,
            512,
            true,
            Some(1 << 50),
            "cuda:0",
            needs,
            |_| None,
        )
        .unwrap();
        assert_eq!(t, MAX_AUTO_BATCH_TOKENS);
        // The CPU keeps the default.
        let (t, source) = sized(None, 256, 512, false, free, "cpu", needs, |_| None).unwrap();
        assert_eq!(
            (t, source),
            (DEFAULT_MAX_BATCH_TOKENS, BudgetSource::Default)
        );
    }

    /// The Qwen3 shapes of every pinned manifest (hidden, intermediate, heads, kv heads).
    fn qwen3(size: &str) -> ActivationShape {
        let (hidden, intermediate, heads, kv_heads) = match size {
            "0.6b" => (1024, 3072, 16, 8),
            "4b" => (2560, 9728, 32, 8),
            _ => (4096, 12288, 32, 8),
        };
        ActivationShape {
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim: 128,
        }
    }

    /// What failed on the H200 (0.6B shapes, 8 192-token rows): 3 padded rows are past 2³¹
    /// scores, and the sizer's 20 rows would have been too.
    #[test]
    fn the_kernels_limits_bound_a_batch() {
        let s = qwen3("0.6b");
        assert!(kernel_limit(&s, 2, 8192, AttentionMode::Padded).is_none());
        let why = kernel_limit(&s, 3, 8192, AttentionMode::Padded).unwrap();
        assert!(why.contains("scores"), "{why}");
        assert!(kernel_limit(&s, 20, 8192, AttentionMode::Packed).is_none());
        // Packed: the widest per-token tensor (4B's fused gate/up, 19 456 wide) bounds tokens.
        let s = qwen3("4b");
        assert!(kernel_limit(&s, 13, 8192, AttentionMode::Packed).is_none());
        let why = kernel_limit(&s, 14, 8192, AttentionMode::Packed).unwrap();
        assert!(why.contains("19456"), "{why}");
        // Padded: no GEMM of more than 65 535 matrices.
        assert!(
            kernel_limit(&s, 2049, 8, AttentionMode::Padded)
                .unwrap()
                .contains("matrices")
        );
    }

    /// Every pinned Qwen3 manifest (max_tokens 8192) gets a default budget on an H200 (141 GB,
    /// about 125 GiB free after the weights) that is within the kernels' limits and memory, in
    /// bf16 packed and in f32 padded; a configured budget past the limits is refused with one
    /// that passes.
    #[test]
    fn every_pinned_qwen3_gets_a_budget_that_runs_on_an_h200() {
        let free = Some(125u64 << 30);
        for size in ["0.6b", "4b", "8b"] {
            let s = qwen3(size);
            for (attention, dtype) in [
                (AttentionMode::Packed, DType::BF16),
                (AttentionMode::Padded, DType::F32),
            ] {
                let (tokens, source) = sized(
                    None,
                    256,
                    8192,
                    true,
                    free,
                    "cuda:0",
                    |rows| activation_bytes(&s, rows, 8192, attention, dtype, &Device::Cpu),
                    |rows| kernel_limit(&s, rows, 8192, attention),
                )
                .unwrap();
                assert_eq!(source, BudgetSource::FreeMemory);
                let rows = worst_rows(tokens, 256, 8192);
                assert!(
                    kernel_limit(&s, rows, 8192, attention).is_none(),
                    "{size} {attention:?}: {rows} rows"
                );
                assert!(rows >= 1 && tokens % 8192 == 0, "{size}: {tokens}");
                if attention == AttentionMode::Packed {
                    assert!(
                        rows >= 8,
                        "{size}: packed rows of 8192 should batch: {rows}"
                    );
                }
            }
            let limits = |rows| kernel_limit(&s, rows, 8192, AttentionMode::Padded);
            let needs = |_rows| 1u64;
            let err = sized(
                Some(64 * 8192),
                256,
                8192,
                true,
                free,
                "cuda:0",
                needs,
                limits,
            )
            .unwrap_err();
            assert!(err.contains("past what the kernels"), "{err}");
            let at_most: usize = err.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(
                sized(
                    Some(at_most),
                    256,
                    8192,
                    true,
                    free,
                    "cuda:0",
                    needs,
                    limits
                )
                .is_ok(),
                "{size}: {at_most}"
            );
        }
    }
}
