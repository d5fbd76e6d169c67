//! Fused CPU kernels for the elementwise tail of an encoder layer.
//!
//! On the CPU a candle op is a full pass over memory plus a fresh allocation, and profiling the
//! BERT layer showed those passes (bias adds, residual adds, layer norm, an scalar `erf` per
//! GELU element) costing as much as the matrix multiplies. These kernels run **in place** on a
//! matmul's output, one pass each, in parallel over rows:
//! * [`BiasGelu`]: `y = gelu(y + bias)`, exact-GELU with a rational `erf` that vectorises
//!   (max abs error under 5e-7, a few f32 ulps, see the tests);
//! * [`BiasResidualLayerNorm`]: `y = LayerNorm(y + bias + residual)`, two-pass variance;
//! * [`packed_attention`]: the CPU body of [`PackedAttention`] (attention over packed rows, no
//!   padding), reading Q, K and V in place from strided views (e.g. column slices of a fused QKV
//!   matrix): per (head, row) two gemm calls with a vectorised softmax between them;
//!   bidirectional or causal, grouped-query heads, shared-prefix keys. It replaced candle's
//!   variable-length kernel, whose per-score online softmax (two scalar `expf` per score) was 44%
//!   of BERT's CPU time. With [`WeightPrecision`] it rounds the softmax weights as the GPU
//!   kernel does in bf16/f16, so the CPU checks that kernel's numerics.
//!
//! Other devices use candle's ops; the CPU kernels are tested against them.

use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor, bail};
use rayon::prelude::*;

use super::attention::PackedAttention;

/// Defines a row kernel that runs compiled for AVX2+FMA when the CPU has them.
///
/// The crate targets baseline x86-64 (SSE2), so row loops would vectorise 4-wide at best and
/// `mul_add` would be a libm call. The macro keeps the body as an `#[inline(always)]` function
/// and adds a `target_feature(avx2,fma)` twin that inlines it, chosen at run time (the check is
/// cached by std).
macro_rules! simd_kernel {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        #[inline(always)]
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

/// erf for f32 as a rational function of x² on [-4, 4] (the form Eigen and XLA use for
/// vectorised erf): no branches, no exp, so the row loop compiles to SIMD.
#[inline(always)]
pub fn erf_f32(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * -2.726_142_3e-10 + 2.770_681_4e-8;
    p = p * x2 + -2.101_024e-6;
    p = p * x2 + -5.692_506_4e-5;
    p = p * x2 + -7.349_906_3e-4;
    p = p * x2 + -2.954_6e-3;
    p = p * x2 + -1.609_603_4e-2;
    p *= x;
    let mut q = x2 * -1.456_607_2e-5 + -2.133_740_6e-4;
    q = q * x2 + -1.682_827e-3;
    q = q * x2 + -7.373_329_3e-3;
    q = q * x2 + -1.426_474e-2;
    p / q
}

/// e^x for f32 (Cephes' `expf` scheme): x = n·ln2 + r, a degree-6 polynomial for e^r on
/// |r| ≤ ln2/2, 2^n assembled in the exponent bits. Branch-free, so loops over it vectorise.
/// Relative error under 2e-7 on [-87, 88]; inputs below -87 give 0-ish, which softmax wants.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer in the low bits
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + MAGIC;
    let n = shifted - MAGIC;
    let n_int = (shifted.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    // ln2 split in a high and a low part keeps r exact.
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((n_int + 127) as u32) << 23)
}

#[inline(always)]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2))
}

fn rows_mut<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
    width: usize,
    op: &str,
) -> Result<&'a mut [f32]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{op}: the input must be contiguous");
    };
    let CpuStorage::F32(data) = storage else {
        bail!("{op}: f32 only");
    };
    let rows = &mut data[start..end];
    if width == 0 || rows.len() % width != 0 {
        bail!("{op}: {} elements are not rows of {width}", rows.len());
    }
    Ok(rows)
}

simd_kernel! {
    fn bias_gelu_row(row: &mut [f32], bias: &[f32]) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v = gelu(*v + b);
        }
    }
}

simd_kernel! {
    fn layer_norm_row(row: &mut [f32], res: &[f32], op: &BiasResidualLayerNorm) {
        let inv_w = 1.0 / row.len() as f32;
        let mut sum = 0f32;
        for ((v, b), r) in row.iter_mut().zip(&op.bias).zip(res) {
            *v += b + r;
            sum += *v;
        }
        let mean = sum * inv_w;
        let mut var = 0f32;
        for v in row.iter() {
            let d = v - mean;
            var += d * d;
        }
        let inv_std = 1.0 / (var * inv_w + op.eps).sqrt();
        for ((v, g), b) in row.iter_mut().zip(&op.gamma).zip(&op.beta) {
            *v = (*v - mean) * inv_std * g + b;
        }
    }
}

/// `y = gelu(y + bias)` in place on `[rows, width]`.
pub struct BiasGelu {
    pub bias: Vec<f32>,
}

impl InplaceOp1 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let width = self.bias.len();
        let data = rows_mut(storage, layout, width, self.name())?;
        data.par_chunks_mut(width)
            .for_each(|row| bias_gelu_row(row, &self.bias));
        Ok(())
    }
}

/// `y = LayerNorm(y + bias + residual)` in place on `[rows, width]`.
pub struct BiasResidualLayerNorm {
    pub bias: Vec<f32>,
    pub gamma: Vec<f32>,
    pub beta: Vec<f32>,
    pub eps: f32,
}

impl InplaceOp2 for BiasResidualLayerNorm {
    fn name(&self) -> &'static str {
        "bias-residual-layer-norm"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        res_storage: &CpuStorage,
        res_l: &Layout,
    ) -> Result<()> {
        let width = self.bias.len();
        let Some((rs, re)) = res_l.contiguous_offsets() else {
            bail!("{}: the residual must be contiguous", self.name());
        };
        let residual = &res_storage.as_slice::<f32>()?[rs..re];
        let data = rows_mut(dst, dst_l, width, self.name())?;
        if residual.len() != data.len() {
            bail!("{}: residual shape differs", self.name());
        }
        data.par_chunks_mut(width)
            .zip(residual.par_chunks(width))
            .for_each(|(row, res)| layer_norm_row(row, res, self));
        Ok(())
    }
}

/// Q, K and V as f32 slices from their first element, with their row strides, and how the
/// softmax weights are held when they multiply V.
pub(crate) struct AttentionViews<'a> {
    pub q: &'a [f32],
    pub q_stride: usize,
    pub k: &'a [f32],
    pub k_stride: usize,
    pub v: &'a [f32],
    pub v_stride: usize,
    pub weights: WeightPrecision,
}

/// Max of a slice in eight lanes (a plain fold is a serial dependency chain).
#[inline(always)]
fn lanes_max(v: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] = if c[i] > lanes[i] { c[i] } else { lanes[i] };
        }
    }
    rest.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// Sum of a slice in eight lanes.
#[inline(always)]
fn lanes_sum(v: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    lanes.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// A matrix operand for gemm: its first element and its row and column strides.
#[derive(Clone, Copy)]
struct Strided {
    ptr: *const f32,
    row_stride: isize,
    col_stride: isize,
}

impl Strided {
    /// Rows `row_stride` apart, contiguous columns.
    fn rows(ptr: *const f32, row_stride: usize) -> Self {
        Self {
            ptr,
            row_stride: row_stride as isize,
            col_stride: 1,
        }
    }

    /// The transpose of [`Strided::rows`]: matrix column `j` is memory row `j`.
    fn cols(ptr: *const f32, row_stride: usize) -> Self {
        Self {
            ptr,
            row_stride: 1,
            col_stride: row_stride as isize,
        }
    }
}

/// `dst = scale · lhs · rhs` (or `dst += …` when `accumulate`), `(m, n, k)` shaped, `dst` rows
/// `dst_row_stride` apart; single-threaded (callers parallelise over heads and rows).
///
/// # Safety
/// `lhs` must cover `m × k` elements, `rhs` `k × n` and `dst` `m × n` at their strides.
unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_row_stride: usize,
    accumulate: bool,
    lhs: Strided,
    rhs: Strided,
    scale: f32,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_row_stride as isize,
            accumulate,
            lhs.ptr,
            lhs.col_stride,
            lhs.row_stride,
            rhs.ptr,
            rhs.col_stride,
            rhs.row_stride,
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// How the softmax weights are held when they multiply V: f32, or rounded to the half dtype
/// the GPU kernel feeds its second matrix multiply with (the CPU's twin of its precision).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightPrecision {
    F32,
    Bf16,
    F16,
}

/// Query rows scored per block (bounds the score buffer at `QUERY_BLOCK × row length`).
const QUERY_BLOCK: usize = 64;

/// Scratch space one attention task reuses across rows.
struct AttentionScratch {
    /// Scores, then softmax weights, of one block of queries: `[QUERY_BLOCK][row length]`.
    scores: Vec<f32>,
}

simd_kernel! {
    /// One head of one packed row: tokens `start..start + len`, output `out` (contiguous,
    /// `len × head_dim`). The row's keys are those of its shared `prefix` (a packed token
    /// range, all visible) followed by its own. `S = scale · Q Kᵀ` and `O = softmax(S) V` are
    /// single-threaded gemm calls straight on the strided Q, K, V views (no copies), one per key
    /// block; the softmax between them is vectorised.
    fn attention_row(
        op: &PackedAttention,
        x: &AttentionViews,
        head: usize,
        row: (usize, usize),
        prefix: Option<(usize, usize)>,
        scratch: &mut AttentionScratch,
        out: &mut [f32],
    ) {
        let (start, len) = row;
        let d = op.head_dim;
        let kv = (head / (op.q_heads / op.kv_heads)) * d;
        let (p_start, p_len) = prefix.unwrap_or((0, 0));
        let q0 = start * x.q_stride + head * d;
        let mut first = 0;
        while first < len {
            let rows = QUERY_BLOCK.min(len - first);
            // Causal rows see their own keys 0..=i; the block's last row sees the most.
            let own = if op.causal { first + rows } else { len };
            let width = p_len + own;
            let s = &mut scratch.scores[..rows * width];
            // Key blocks: (first key token, keys, first score column).
            let blocks = [(p_start, p_len, 0), (start, own, p_len)];
            for &(k_start, keys, col) in &blocks {
                if keys == 0 {
                    continue;
                }
                // SAFETY: `rows_view` checked that every row of Q, K and V (row stride, `width`
                // columns) lies inside its slice; this head's `d` columns start at `head · d` /
                // `kv` < width; key rows are tokens of this batch. `s` holds rows × width.
                unsafe {
                    let q = Strided::rows(x.q.as_ptr().add(q0 + first * x.q_stride), x.q_stride);
                    // Kᵀ: column j of the product is key row j.
                    let kt = Strided::cols(x.k.as_ptr().add(k_start * x.k_stride + kv), x.k_stride);
                    gemm_into((rows, keys, d), s.as_mut_ptr().add(col), width, false, q, kt, op.scale);
                }
            }
            for (r, scores) in s.chunks_exact_mut(width).enumerate() {
                let visible = p_len + if op.causal { first + r + 1 } else { own };
                let (seen, hidden) = scores.split_at_mut(visible);
                let max = lanes_max(seen);
                for w in seen.iter_mut() {
                    *w = exp_f32(*w - max);
                }
                let inv = 1.0 / lanes_sum(seen);
                match x.weights {
                    WeightPrecision::F32 => seen.iter_mut().for_each(|w| *w *= inv),
                    WeightPrecision::Bf16 => seen
                        .iter_mut()
                        .for_each(|w| *w = half::bf16::from_f32(*w * inv).to_f32()),
                    WeightPrecision::F16 => seen
                        .iter_mut()
                        .for_each(|w| *w = half::f16::from_f32(*w * inv).to_f32()),
                }
                hidden.fill(0.0);
            }
            let mut accumulate = false;
            for &(v_start, keys, col) in &blocks {
                if keys == 0 {
                    continue;
                }
                // SAFETY: as above; the destination is rows × d inside `out`.
                unsafe {
                    let w = Strided::rows(s.as_ptr().add(col), width);
                    let v = Strided::rows(x.v.as_ptr().add(v_start * x.v_stride + kv), x.v_stride);
                    gemm_into((rows, d, keys), out.as_mut_ptr().add(first * d), d, accumulate, w, v, 1.0);
                }
                accumulate = true;
            }
            first += rows;
        }
    }
}

/// A 2-D f32 view: the slice from its first element and its row stride.
pub(crate) fn rows_view<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    width: usize,
    what: &str,
) -> Result<(&'a [f32], usize)> {
    let (rows, cols) = layout.shape().dims2()?;
    let stride = layout.stride();
    if cols != width || (rows > 1 && stride[1] != 1) {
        bail!("packed attention: {what} must be [tokens, {width}] with unit column stride");
    }
    let data = &storage.as_slice::<f32>()?[layout.start_offset()..];
    let row_stride = if rows > 1 { stride[0] } else { width };
    if rows > 0 && data.len() < (rows - 1) * row_stride + width {
        bail!("packed attention: {what} view is out of bounds");
    }
    Ok((data, row_stride))
}

/// The CPU body of [`PackedAttention`] on f32 views: contiguous `[tokens, q_heads × head_dim]`.
/// One task per (head, packed row), so a batch of one long row still keeps every core busy.
pub(crate) fn packed_attention(
    op: &PackedAttention,
    views: &AttentionViews,
    tokens: usize,
) -> Vec<f32> {
    let d = op.head_dim;
    let width = op.q_heads * d;
    // Head-major `[head][token][d]` so every task owns a contiguous slice.
    let mut head_major = vec![0f32; tokens * width];
    let mut starts = Vec::with_capacity(op.lengths.len());
    let mut acc = 0;
    for &len in &op.lengths {
        starts.push(acc);
        acc += len;
    }
    let prefix = |row: usize| -> Option<(usize, usize)> {
        op.prefix_of
            .get(row)
            .copied()
            .flatten()
            .map(|p| (starts[p], op.lengths[p]))
    };
    let widest = (0..op.lengths.len())
        .map(|r| prefix(r).map_or(0, |p| p.1) + op.lengths[r])
        .max()
        .unwrap_or(0);
    let mut tasks = Vec::with_capacity(op.q_heads * op.lengths.len());
    let mut rest: &mut [f32] = &mut head_major;
    for head in 0..op.q_heads {
        for (row, &len) in op.lengths.iter().enumerate() {
            let (mine, tail) = rest.split_at_mut(len * d);
            tasks.push((head, (starts[row], len), prefix(row), mine));
            rest = tail;
        }
    }
    tasks.into_par_iter().for_each_init(
        || AttentionScratch {
            scores: vec![0f32; QUERY_BLOCK * widest],
        },
        |scratch, (head, row, prefix, out)| {
            attention_row(op, views, head, row, prefix, scratch, out)
        },
    );
    // Back to token-major `[token][head × d]`.
    let mut out = vec![0f32; tokens * width];
    out.par_chunks_mut(width.max(1))
        .enumerate()
        .for_each(|(t, row)| {
            for (head, dst) in row.chunks_exact_mut(d).enumerate() {
                dst.copy_from_slice(&head_major[(head * tokens + t) * d..][..d]);
            }
        });
    out
}

/// Copies a small 1-D tensor to a host vector (for the fused kernels' parameters).
pub fn host_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(candle_core::DType::F32)?.to_vec1()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn exp_matches_std() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = x.exp();
            worst = worst.max(((exp_f32(x) - want) / want).abs());
            x += 1e-3;
        }
        assert!(worst < 2e-7, "max relative error {worst}");
    }

    #[test]
    fn erf_matches_libm() {
        let mut worst = 0f64;
        let mut x = -6.0f64;
        while x <= 6.0 {
            let want = libm_erf(x);
            let got = erf_f32(x as f32) as f64;
            worst = worst.max((got - want).abs());
            x += 1e-4;
        }
        assert!(worst < 5e-7, "max abs error {worst}");
    }

    /// erf in f64 by its Taylor series / continued fraction split, as an independent check.
    fn libm_erf(x: f64) -> f64 {
        // Abramowitz–Stegun 7.1.5 series, converges fast for |x| < 3; erfc asymptotics above.
        if x.abs() < 3.0 {
            let mut sum = x;
            let mut term = x;
            let x2 = x * x;
            for n in 1..200 {
                term *= -x2 / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc(x) ≈ exp(-x²)/(x√π) · (1 - 1/(2x²) + 3/(4x⁴)) is < 3e-6 here: erf = ±(1 - erfc).
            let a = x.abs();
            let erfc = (-a * a).exp() / (a * std::f64::consts::PI.sqrt())
                * (1.0 - 1.0 / (2.0 * a * a) + 3.0 / (4.0 * a.powi(4)));
            x.signum() * (1.0 - erfc)
        }
    }

    fn sample(rows: usize, width: usize, seed: u32) -> Vec<f32> {
        (0..rows * width)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0
                    - 0.5)
                    * 8.0
            })
            .collect()
    }

    #[test]
    fn bias_gelu_matches_candle() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, width) = (7, 48);
        let y = Tensor::from_vec(sample(rows, width, 1), (rows, width), &dev)?;
        let bias = Tensor::from_vec(sample(1, width, 2), width, &dev)?;
        let want = y.broadcast_add(&bias)?.gelu_erf()?.to_vec2::<f32>()?;
        let got = y.copy()?;
        got.inplace_op1(&BiasGelu {
            bias: host_vec(&bias)?,
        })?;
        let got = got.to_vec2::<f32>()?;
        for (a, b) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((a - b).abs() < 2e-6, "{a} vs {b}");
        }
        Ok(())
    }

    #[test]
    fn bias_residual_layer_norm_matches_candle() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, width) = (5, 64);
        let y = Tensor::from_vec(sample(rows, width, 3), (rows, width), &dev)?;
        let res = Tensor::from_vec(sample(rows, width, 4), (rows, width), &dev)?;
        let bias = Tensor::from_vec(sample(1, width, 5), width, &dev)?;
        let gamma = Tensor::from_vec(sample(1, width, 6), width, &dev)?;
        let beta = Tensor::from_vec(sample(1, width, 7), width, &dev)?;
        let summed = (y.broadcast_add(&bias)? + &res)?;
        let want = candle_nn::ops::layer_norm(&summed, &gamma, &beta, 1e-12)?.to_vec2::<f32>()?;
        let got = y.copy()?;
        let op = BiasResidualLayerNorm {
            bias: host_vec(&bias)?,
            gamma: host_vec(&gamma)?,
            beta: host_vec(&beta)?,
            eps: 1e-12,
        };
        got.inplace_op2(&res, &op)?;
        for (a, b) in got
            .to_vec2::<f32>()?
            .iter()
            .flatten()
            .zip(want.iter().flatten())
        {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        Ok(())
    }
}
