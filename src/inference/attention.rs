//! Attention over packed rows: the one op every device runs for Qwen3 (causal, grouped-query
//! heads, shared-prefix keys) and BERT-class models (bidirectional), on Q, K and V read in place
//! through their row strides (column slices of one fused QKV projection). No padding token is
//! computed anywhere.
//!
//! * [`PackedAttention`] is a candle custom op. Its CPU body is `cpu_ops::packed_attention` (a
//!   gemm per (head, row)): the path on the CPU, and the reference every other body is checked
//!   against; bf16 and f16 are widened to f32 there, with the softmax weights rounded to the
//!   half dtype as the GPU kernel rounds them. Its CUDA body launches
//!   `kernels/packed_attention.cu`: FlashAttention-2's algorithm on tensor cores, the scores
//!   never stored, K and V never copied per query head.
//! * [`RowTable`]: what the CUDA kernel reads about a batch (each row's tokens and prefix; the
//!   tiles of 64 queries, the most work first), built and uploaded once per batch by
//!   `PreparedBatch` and held by every layer's op.
//! * [`kernel_launch`]: the kernel, grid and shared memory for a batch (the CUDA body and the
//!   emulator's tests launch the same).

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, bail};

use super::cpu_ops::{self, AttentionViews, WeightPrecision};
use super::launch::{self, KernelLaunch, KernelModule};

/// Queries per CUDA block.
pub const QUERY_TILE: usize = 64;
/// Keys per tile streamed through shared memory.
pub const KEY_TILE: usize = 64;
/// Threads per CUDA block (4 warps of 16 query rows).
const THREADS: u32 = 128;
/// The head dims the CUDA kernel is built for (MiniLM and BGE-small 32, BGE-base/large 64,
/// Qwen3 128).
pub const CUDA_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Attention over packed rows. Inputs are 2-D views `[tokens, heads × head_dim]` whose rows may
/// be strided: Q with `q_heads`, K and V with `kv_heads` (grouped-query when fewer). Output:
/// contiguous `[tokens, q_heads × head_dim]` in the inputs' dtype.
#[derive(Clone)]
pub struct PackedAttention {
    /// Length of each packed row (sequence), in order.
    pub lengths: Vec<usize>,
    /// For each row, the row whose tokens are its shared prefix (causal models only): their
    /// keys come before the row's own, all visible. Empty means no prefixes.
    pub prefix_of: Vec<Option<usize>>,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies Q·K (1.0 when the scale is folded into Q's weights).
    pub scale: f32,
    /// Each token sees only itself and earlier tokens of its row.
    pub causal: bool,
    /// The batch's row table on its device (CUDA); built from `lengths` when absent.
    pub table: Option<RowTable>,
}

/// A batch's rows and query tiles as the CUDA kernel reads them (u32 tensors on the device).
#[derive(Clone)]
pub struct RowTable {
    /// 4 per row: first token, tokens, the prefix's first token, the prefix's tokens (0 without
    /// one).
    pub rows: Tensor,
    /// 2 per tile: row, first query; the most work first.
    pub tiles: Tensor,
    pub n_tiles: usize,
}

impl RowTable {
    /// The table's two arrays on the host: `(rows, tiles)`.
    pub fn host(lengths: &[usize], prefix_of: &[Option<usize>]) -> Result<(Vec<u32>, Vec<u32>)> {
        let n = lengths.len();
        let u = |x: usize, what: &str| -> Result<u32> {
            u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} {x} past u32")))
        };
        let mut starts = Vec::with_capacity(n);
        let mut acc = 0usize;
        for &len in lengths {
            starts.push(acc);
            acc = acc
                .checked_add(len)
                .ok_or_else(|| candle_core::Error::Msg("token count overflows".into()))?;
        }
        u(acc, "tokens")?;
        let mut rows = Vec::with_capacity(4 * n);
        // (cost, row, first query) of every tile: keys a tile's queries read at most.
        let mut tiles: Vec<(usize, u32, u32)> = Vec::new();
        for r in 0..n {
            let len = lengths[r];
            if len == 0 {
                bail!("row {r} has no tokens");
            }
            let (p_start, p_len) = match prefix_of.get(r).copied().flatten() {
                Some(p) if p < n && prefix_of.get(p).copied().flatten().is_none() => {
                    (starts[p], lengths[p])
                }
                Some(p) => bail!("row {r}: prefix row {p} is not a row without a prefix"),
                None => (0, 0),
            };
            rows.extend([
                u(starts[r], "start")?,
                u(len, "len")?,
                u(p_start, "prefix")?,
                u(p_len, "prefix len")?,
            ]);
            for m0 in (0..len).step_by(QUERY_TILE) {
                tiles.push((p_len + len.min(m0 + QUERY_TILE), r as u32, m0 as u32));
            }
        }
        // Longest first: the last blocks to start are the shortest, so the tail is short.
        tiles.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let tiles = tiles.into_iter().flat_map(|(_, r, m0)| [r, m0]).collect();
        Ok((rows, tiles))
    }

    /// Builds the table and puts it on `device`.
    pub fn upload(lengths: &[usize], prefix_of: &[Option<usize>], device: &Device) -> Result<Self> {
        let (rows, tiles) = Self::host(lengths, prefix_of)?;
        let n_tiles = tiles.len() / 2;
        Ok(Self {
            rows: Tensor::from_vec(rows, 4 * lengths.len(), device)?,
            tiles: Tensor::from_vec(tiles, 2 * n_tiles, device)?,
            n_tiles,
        })
    }
}

/// The kernel's one parameter (`PackedAttentionParams` in `kernels/packed_attention.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub rows: u64,
    pub tiles: u64,
    pub q_stride: u32,
    pub k_stride: u32,
    pub v_stride: u32,
    pub out_stride: u32,
    pub group: u32,
    pub causal: u32,
    pub scale_log2: f32,
    pub q_heads: u32,
}

#[cfg(feature = "cuda")]
// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for KernelParams {}

/// Whether the CUDA kernel is built for this dtype and head dim (else the padded path runs).
pub fn cuda_supports(dtype: DType, head_dim: usize) -> std::result::Result<(), String> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Err(format!(
            "the packed attention kernel runs bf16 and f16, not {dtype:?}"
        ));
    }
    if !CUDA_HEAD_DIMS.contains(&head_dim) {
        return Err(format!(
            "the packed attention kernel is built for head dims {CUDA_HEAD_DIMS:?}, not {head_dim}"
        ));
    }
    Ok(())
}

/// The launch for a batch of `n_tiles` query tiles and `q_heads` heads.
pub fn kernel_launch(
    dtype: DType,
    head_dim: usize,
    n_tiles: usize,
    q_heads: usize,
) -> Result<KernelLaunch> {
    cuda_supports(dtype, head_dim).map_err(candle_core::Error::Msg)?;
    let name = if dtype == DType::BF16 { "bf16" } else { "f16" };
    // The Q (then output) tile and two buffers each of K and V, rows padded by 8 elements.
    let shared = (QUERY_TILE + 4 * KEY_TILE) * (head_dim + 8) * dtype.size_in_bytes();
    // One flat grid, tile-major: the longest tiles of every head start first, and the query
    // heads of one kv head run side by side (they read the same K/V).
    let blocks = n_tiles
        .checked_mul(q_heads)
        .ok_or_else(|| candle_core::Error::Msg("attention: too many blocks".into()))?;
    Ok(KernelLaunch {
        module: KernelModule::Attention,
        kernel: format!("packed_attention_{name}_d{head_dim}"),
        grid: [
            launch::grid_dim(blocks, "attention blocks", launch::MAX_GRID_X)?,
            1,
            1,
        ],
        block: THREADS,
        shared_bytes: shared as u32,
    })
}

/// One input as the kernel reads it: its first element and its row stride (elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowView {
    pub offset: usize,
    pub row_stride: usize,
}

/// A `[tokens, width]` view with unit column stride: where it starts and its row stride.
pub fn row_view(layout: &Layout, tokens: usize, width: usize, what: &str) -> Result<RowView> {
    let (rows, cols) = layout.shape().dims2()?;
    let stride = layout.stride();
    if rows != tokens || cols != width || (cols > 1 && stride[1] != 1) {
        bail!("packed attention: {what} must be [{tokens}, {width}] with unit column stride");
    }
    Ok(RowView {
        offset: layout.start_offset(),
        row_stride: if rows > 1 { stride[0] } else { width },
    })
}

impl PackedAttention {
    /// The kernel's parameters for views of Q, K, V and the addresses of Q, K, V, the output,
    /// the row table and the tile list.
    pub fn kernel_params(
        &self,
        views: &[RowView; 3],
        [q, k, v, out, rows, tiles]: [u64; 6],
    ) -> KernelParams {
        KernelParams {
            q,
            k,
            v,
            out,
            rows,
            tiles,
            q_stride: views[0].row_stride as u32,
            k_stride: views[1].row_stride as u32,
            v_stride: views[2].row_stride as u32,
            out_stride: (self.q_heads * self.head_dim) as u32,
            group: (self.q_heads / self.kv_heads.max(1)) as u32,
            causal: u32::from(self.causal),
            scale_log2: self.scale * std::f32::consts::LOG2_E,
            q_heads: self.q_heads as u32,
        }
    }

    /// Tokens of the batch, after checking the heads and the three views' shapes.
    pub(crate) fn tokens(
        &self,
        ql: &Layout,
        kl: &Layout,
        vl: &Layout,
    ) -> Result<(usize, [RowView; 3])> {
        if self.kv_heads == 0 || !self.q_heads.is_multiple_of(self.kv_heads) {
            bail!(
                "packed attention: {} query heads over {} kv heads",
                self.q_heads,
                self.kv_heads
            );
        }
        let tokens: usize = self.lengths.iter().sum();
        let (d, q, kv) = (self.head_dim, self.q_heads, self.kv_heads);
        Ok((
            tokens,
            [
                row_view(ql, tokens, q * d, "Q")?,
                row_view(kl, tokens, kv * d, "K")?,
                row_view(vl, tokens, kv * d, "V")?,
            ],
        ))
    }
}

impl PackedAttention {
    /// The CPU body on half-precision Q, K, V: widened to contiguous f32, the softmax weights
    /// rounded to `weights` (as the CUDA kernel holds them); f32 out, for the caller to round.
    fn widened_body<T: Copy>(
        &self,
        [q, k, v]: [&[T]; 3],
        [qv, kv, vv]: [RowView; 3],
        tokens: usize,
        weights: WeightPrecision,
        f: impl Fn(T) -> f32 + Copy,
    ) -> Result<Vec<f32>> {
        let width = self.q_heads * self.head_dim;
        let kv_width = self.kv_heads * self.head_dim;
        let (q, k, v) = (
            widened(q, qv, tokens, width, f)?,
            widened(k, kv, tokens, kv_width, f)?,
            widened(v, vv, tokens, kv_width, f)?,
        );
        let views = AttentionViews {
            q: &q,
            q_stride: width,
            k: &k,
            k_stride: kv_width,
            v: &v,
            v_stride: kv_width,
            weights,
        };
        Ok(cpu_ops::packed_attention(self, &views, tokens))
    }
}

/// A strided `[rows, width]` half-precision view widened to contiguous f32.
fn widened<T: Copy>(
    data: &[T],
    view: RowView,
    rows: usize,
    width: usize,
    f: impl Fn(T) -> f32,
) -> Result<Vec<f32>> {
    if rows > 0 && data.len() < view.offset + (rows - 1) * view.row_stride + width {
        bail!("packed attention: a view runs past its storage");
    }
    let mut out = Vec::with_capacity(rows * width);
    for r in 0..rows {
        let at = view.offset + r * view.row_stride;
        out.extend(data[at..at + width].iter().map(|&x| f(x)));
    }
    Ok(out)
}

impl CustomOp3 for PackedAttention {
    fn name(&self) -> &'static str {
        "packed-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, [qv, kv, vv]) = self.tokens(ql, kl, vl)?;
        let (d, width) = (self.head_dim, self.q_heads * self.head_dim);
        let kv_width = self.kv_heads * d;
        let shape = Shape::from((tokens, width));
        match (qs, ks, vs) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                let (q, q_stride) = cpu_ops::rows_view(qs, ql, width, "Q")?;
                let (k, k_stride) = cpu_ops::rows_view(ks, kl, kv_width, "K")?;
                let (v, v_stride) = cpu_ops::rows_view(vs, vl, kv_width, "V")?;
                let views = AttentionViews {
                    q,
                    q_stride,
                    k,
                    k_stride,
                    v,
                    v_stride,
                    weights: WeightPrecision::F32,
                };
                let out = cpu_ops::packed_attention(self, &views, tokens);
                Ok((CpuStorage::F32(out), shape))
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let out = self.widened_body(
                    [q, k, v],
                    [qv, kv, vv],
                    tokens,
                    WeightPrecision::Bf16,
                    |x| x.to_f32(),
                )?;
                Ok((
                    CpuStorage::BF16(out.into_iter().map(half::bf16::from_f32).collect()),
                    shape,
                ))
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                let out = self.widened_body(
                    [q, k, v],
                    [qv, kv, vv],
                    tokens,
                    WeightPrecision::F16,
                    |x| x.to_f32(),
                )?;
                Ok((
                    CpuStorage::F16(out.into_iter().map(half::f16::from_f32).collect()),
                    shape,
                ))
            }
            _ => bail!("packed attention: Q, K and V must share one of f32, bf16, f16"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda;
        use candle_core::backend::BackendStorage;
        let (tokens, views) = self.tokens(ql, kl, vl)?;
        if ks.dtype() != qs.dtype() || vs.dtype() != qs.dtype() {
            bail!("packed attention: Q, K and V differ in dtype");
        }
        // Row strides and element offsets travel as u32 (and tokens × stride must not wrap).
        for view in &views {
            if u32::try_from(view.row_stride).is_err() {
                bail!(
                    "packed attention: a row stride of {} is past u32",
                    view.row_stride
                );
            }
        }
        let dev = qs.device().clone();
        let table = match &self.table {
            Some(t) => t.clone(),
            None => RowTable::upload(&self.lengths, &self.prefix_of, &Device::Cuda(dev.clone()))?,
        };
        let launch = kernel_launch(qs.dtype(), self.head_dim, table.n_tiles, self.q_heads)?;
        let width = self.q_heads * self.head_dim;
        // cp.async reads 16-byte chunks: every row must start 16-byte aligned.
        for (view, what) in views.iter().zip(["Q", "K", "V"]) {
            if view.offset % 8 != 0 || view.row_stride % 8 != 0 {
                bail!(
                    "packed attention: {what} starts at element {} with row stride {}: the kernel needs both a multiple of 8",
                    view.offset,
                    view.row_stride
                );
            }
        }
        let (out, out_ptr) = cuda::alloc(&dev, qs.dtype(), tokens * width)?;
        let params = self.kernel_params(
            &views,
            [
                cuda::storage_ptr(qs, views[0].offset)?,
                cuda::storage_ptr(ks, views[1].offset)?,
                cuda::storage_ptr(vs, views[2].offset)?,
                out_ptr,
                cuda::tensor_ptr(&table.rows)?,
                cuda::tensor_ptr(&table.tiles)?,
            ],
        );
        cuda::launch(&dev, &launch, &params)?;
        Ok((out, Shape::from((tokens, width))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn sample(rows: usize, width: usize, seed: u64) -> Vec<f32> {
        super::super::kernel_check::test_data(rows * width, seed)
            .into_iter()
            .map(|x| x * 4.0)
            .collect()
    }

    /// Attention the plain way, per row and head, in f64; `prefix_of` as the op takes it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn naive_attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        lengths: &[usize],
        prefix_of: &[Option<usize>],
        (hq, hk, d): (usize, usize, usize),
        scale: f32,
        causal: bool,
    ) -> Vec<f32> {
        let mut out = vec![0f32; q.len()];
        let starts: Vec<usize> = lengths
            .iter()
            .scan(0, |a, &l| {
                let s = *a;
                *a += l;
                Some(s)
            })
            .collect();
        for (r, &len) in lengths.iter().enumerate() {
            let prefix: Vec<usize> = prefix_of
                .get(r)
                .copied()
                .flatten()
                .map(|p| (starts[p]..starts[p] + lengths[p]).collect())
                .unwrap_or_default();
            for i in 0..len {
                for h in 0..hq {
                    let kh = h / (hq / hk);
                    let own = if causal { i + 1 } else { len };
                    let keys: Vec<usize> = prefix
                        .iter()
                        .copied()
                        .chain(starts[r]..starts[r] + own)
                        .collect();
                    let t = starts[r] + i;
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            (0..d)
                                .map(|c| {
                                    q[t * hq * d + h * d + c] as f64
                                        * k[j * hk * d + kh * d + c] as f64
                                })
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for c in 0..d {
                        let acc: f64 = keys
                            .iter()
                            .zip(&e)
                            .map(|(&j, w)| w * v[j * hk * d + kh * d + c] as f64)
                            .sum();
                        out[t * hq * d + h * d + c] = (acc / z) as f32;
                    }
                }
            }
        }
        out
    }

    /// Q, K and V as column slices of one fused `[tokens, (hq + 2hk)·d]` matrix.
    fn fused(
        tokens: usize,
        (hq, hk, d): (usize, usize, usize),
        seed: u64,
        dtype: DType,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let width = (hq + 2 * hk) * d;
        let t = Tensor::from_vec(sample(tokens, width, seed), (tokens, width), &Device::Cpu)?
            .to_dtype(dtype)?;
        Ok((
            t.narrow(1, 0, hq * d)?,
            t.narrow(1, hq * d, hk * d)?,
            t.narrow(1, (hq + hk) * d, hk * d)?,
        ))
    }

    fn flat(t: &Tensor) -> Result<Vec<f32>> {
        t.to_dtype(DType::F32)?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()
    }

    #[test]
    fn packed_attention_matches_naive() -> Result<()> {
        let lengths = vec![5, 1, 12, 3];
        let tokens: usize = lengths.iter().sum();
        for (hq, hk, causal) in [(4, 4, false), (4, 2, true), (6, 1, false)] {
            let d = 12;
            let (q, k, v) = fused(tokens, (hq, hk, d), 9, DType::F32)?;
            let op = PackedAttention {
                lengths: lengths.clone(),
                prefix_of: Vec::new(),
                q_heads: hq,
                kv_heads: hk,
                head_dim: d,
                scale: 0.25,
                causal,
                table: None,
            };
            let got = flat(&q.apply_op3_no_bwd(&k, &v, &op)?)?;
            let want = naive_attention(
                &flat(&q)?,
                &flat(&k)?,
                &flat(&v)?,
                &lengths,
                &[],
                (hq, hk, d),
                0.25,
                causal,
            );
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() < 1e-5,
                    "{a} vs {b} (hq {hq}, hk {hk}, causal {causal})"
                );
            }
        }
        Ok(())
    }

    /// bf16 and f16 are widened: the same numbers as f32 on the rounded inputs, within what
    /// rounding the weights and the output to the half dtype costs.
    #[test]
    fn half_inputs_are_widened_and_rounded_once() -> Result<()> {
        let lengths = vec![7, 1, 20];
        let prefix_of = vec![Some(2), Some(2), None];
        let tokens: usize = lengths.iter().sum();
        let shape = (4, 2, 16);
        for dtype in [DType::BF16, DType::F16] {
            let (q, k, v) = fused(tokens, shape, 3, dtype)?;
            let op = PackedAttention {
                lengths: lengths.clone(),
                prefix_of: prefix_of.clone(),
                q_heads: 4,
                kv_heads: 2,
                head_dim: 16,
                scale: 0.25,
                causal: true,
                table: None,
            };
            let out = q.apply_op3_no_bwd(&k, &v, &op)?;
            assert_eq!(out.dtype(), dtype);
            let want = naive_attention(
                &flat(&q)?,
                &flat(&k)?,
                &flat(&v)?,
                &lengths,
                &prefix_of,
                shape,
                0.25,
                true,
            );
            let worst = flat(&out)?
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let bound = if dtype == DType::BF16 { 0.05 } else { 0.01 };
            assert!(worst < bound && worst > 0.0, "{dtype:?}: {worst}");
        }
        Ok(())
    }

    /// A row continuing a shared prefix attends exactly as the whole sequence would (causal).
    #[test]
    fn shared_prefix_equals_the_whole_row() -> Result<()> {
        let dev = Device::Cpu;
        let (hq, hk, d) = (4, 2, 8);
        let (p, a, b) = (5, 3, 4); // prefix, tail A, tail B
        let width = (hq + 2 * hk) * d;
        let pre = sample(p, width, 21);
        let ta = sample(a, width, 22);
        let tb = sample(b, width, 23);
        // Packed: tail A, tail B, prefix (the batch layout). Whole rows for the reference.
        let packed: Vec<f32> = [ta.clone(), tb.clone(), pre.clone()].concat();
        let fused = Tensor::from_vec(packed, (a + b + p, width), &dev)?;
        let split = |t: &Tensor| -> Result<(Tensor, Tensor, Tensor)> {
            Ok((
                t.narrow(1, 0, hq * d)?,
                t.narrow(1, hq * d, hk * d)?,
                t.narrow(1, (hq + hk) * d, hk * d)?,
            ))
        };
        let (q, k, v) = split(&fused)?;
        let op = |lengths: Vec<usize>, prefix_of: Vec<Option<usize>>| PackedAttention {
            lengths,
            prefix_of,
            q_heads: hq,
            kv_heads: hk,
            head_dim: d,
            scale: 0.3,
            causal: true,
            table: None,
        };
        let got = q
            .apply_op3_no_bwd(&k, &v, &op(vec![a, b, p], vec![Some(2), Some(2), None]))?
            .to_vec2::<f32>()?;
        for (tail, offset) in [(&ta, 0), (&tb, a)] {
            let n = p + tail.len() / width;
            let whole = Tensor::from_vec([pre.clone(), tail.clone()].concat(), (n, width), &dev)?;
            let (q, k, v) = split(&whole)?;
            let want = q
                .apply_op3_no_bwd(&k, &v, &op(vec![n], Vec::new()))?
                .to_vec2::<f32>()?;
            for i in 0..n - p {
                for (x, y) in got[offset + i].iter().zip(&want[p + i]) {
                    assert!((x - y).abs() < 1e-5, "{x} vs {y}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn the_row_table_puts_the_most_work_first() -> Result<()> {
        // Rows of 130 (three tiles), 1, and 10 continuing the 130-token row as a prefix.
        let (rows, tiles) = RowTable::host(&[130, 1, 10], &[None, None, Some(0)])?;
        assert_eq!(rows, [0, 130, 0, 0, 130, 1, 0, 0, 131, 10, 0, 130]);
        // Costs: row 2 (130 + 10), row 0's tiles (130, 128, 64), row 1 (1).
        assert_eq!(tiles, [2, 0, 0, 128, 0, 64, 0, 0, 1, 0]);
        assert!(
            RowTable::host(&[3, 0], &[]).is_err(),
            "an empty row is refused"
        );
        assert!(
            RowTable::host(&[3, 4], &[Some(1), Some(0)]).is_err(),
            "prefixes do not chain"
        );
        Ok(())
    }

    #[test]
    fn the_launch_fits_the_kernel() -> Result<()> {
        let l = kernel_launch(DType::BF16, 128, 10, 32)?;
        assert_eq!(l.kernel, "packed_attention_bf16_d128");
        assert_eq!((l.grid, l.block), ([320, 1, 1], 128));
        // Q tile + 2 × (K, V) tiles of 64 rows of 136 bf16: 87 040 bytes (under the 227 KiB a
        // block may have on sm_90, and two blocks fit an SM).
        assert_eq!(l.shared_bytes, 87_040);
        assert!(kernel_launch(DType::F32, 128, 1, 1).is_err());
        assert!(kernel_launch(DType::F16, 80, 1, 1).is_err());
        assert!(
            kernel_launch(DType::F16, 64, 0, 8).is_err(),
            "no block is no launch"
        );
        Ok(())
    }
}
