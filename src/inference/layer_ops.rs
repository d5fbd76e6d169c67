//! The elementwise and row steps of a Qwen3 layer as fused ops, one pass each on every device,
//! where candle's ops need several passes and a contiguous copy before each:
//!
//! * [`QkNormRope`]: the per-head RMSNorm of Q and K, then rotate-half RoPE, in place on the
//!   fused QKV rows (V untouched), so attention reads Q, K and V where the projection wrote them;
//! * [`AddRmsNorm`]: the residual add and the next RMSNorm in one pass (the sum and the normed
//!   sum, or only the normed sum in f32 for the final norm the heads read);
//! * [`SwiGlu`]: `silu(gate) · up` on the fused gate/up rows.
//!
//! Arithmetic is f32 throughout and each result is rounded to the dtype once (candle's chain
//! rounds after every op). The CPU bodies are the reference and the path on the CPU; the CUDA
//! bodies launch `kernels/layer_ops.cu`, and `kernel-check` (on a GPU) and the emulator's tests
//! (in CI) compare the two.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, InplaceOp1, Layout, Result, Shape, Tensor, bail,
};
use rayon::prelude::*;

use super::launch::{self, KernelLaunch, KernelModule};

/// An element the CPU bodies read and write: widened to f32, rounded back once.
trait Elem: Copy + Send + Sync {
    fn widen(self) -> f32;
    fn round(x: f32) -> Self;
    fn storage(v: Vec<Self>) -> CpuStorage;
}

macro_rules! elem {
    ($t:ty, $variant:ident, $widen:expr, $round:expr) => {
        impl Elem for $t {
            fn widen(self) -> f32 {
                $widen(self)
            }
            fn round(x: f32) -> Self {
                $round(x)
            }
            fn storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
        }
    };
}

elem!(f32, F32, |x: f32| x, |x: f32| x);
elem!(half::bf16, BF16, half::bf16::to_f32, half::bf16::from_f32);
elem!(half::f16, F16, half::f16::to_f32, half::f16::from_f32);

/// Checks that a tensor an op holds has the dtype and element count its kernel reads.
fn expect(t: &Tensor, dtype: DType, len: usize, what: &str) -> Result<()> {
    if t.dtype() != dtype || t.elem_count() != len {
        bail!(
            "{what}: {:?} × {} where the kernel reads {dtype:?} × {len}",
            t.dtype(),
            t.elem_count()
        );
    }
    Ok(())
}

/// The contiguous slice `layout` covers.
fn covered<'a, T>(data: &'a [T], layout: &Layout, what: &str) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) if end <= data.len() => Ok(&data[start..end]),
        _ => bail!("{what} must be contiguous"),
    }
}

/// A small tensor's values on the host, widened to f32 (weights, tables: read once per call).
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_device(&candle_core::Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()
}

fn host_u32(t: &Tensor) -> Result<Vec<u32>> {
    t.to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1()
}

/// Per-head RMSNorm (weights `q_weight`, `k_weight`) and RoPE at `positions`, in place on the Q
/// and K heads of contiguous fused QKV rows `[tokens, (q_heads + 2·kv_heads)·head_dim]`.
pub struct QkNormRope {
    /// `[tokens]` u32: each token's position (a row continuing a prefix starts after it).
    pub positions: Tensor,
    pub q_weight: Tensor,
    pub k_weight: Tensor,
    /// `[head_dim / 2]` f32: θ^(−2i/head_dim), computed in f64 on the host.
    pub inv_freq: Tensor,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
}

/// `kernels/layer_ops.cu`'s `QkNormRopeParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QkNormRopeParams {
    pub qkv: u64,
    pub positions: u64,
    pub q_weight: u64,
    pub k_weight: u64,
    pub inv_freq: u64,
    pub tokens: u32,
    pub stride: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub eps: f32,
}

/// `kernels/layer_ops.cu`'s `AddRmsNormParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AddRmsNormParams {
    pub x: u64,
    pub delta: u64,
    pub weight: u64,
    pub out: u64,
    pub tokens: u32,
    pub width: u32,
    pub eps: f32,
    pub mode: u32,
}

/// `kernels/layer_ops.cu`'s `SwigluParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SwigluParams {
    pub gate_up: u64,
    pub out: u64,
    pub tokens: u32,
    pub inter: u32,
}

#[cfg(feature = "cuda")]
mod device_repr {
    use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
    // SAFETY: plain old data with the C layouts the kernels declare.
    unsafe impl DeviceRepr for super::QkNormRopeParams {}
    unsafe impl DeviceRepr for super::AddRmsNormParams {}
    unsafe impl DeviceRepr for super::SwigluParams {}
}

/// The most a head may be: one lane holds at most 4 of its pairs (`ROPE_PAIRS` in the kernel).
pub const MAX_ROPE_HEAD_DIM: usize = 256;

fn dtype_name(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("layer ops run f32, bf16 and f16, not {other:?}"),
    })
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} {x} is past u32")))
}

impl QkNormRope {
    /// `(tokens, row stride)` of the fused rows in `dtype`, checked against the heads, the
    /// positions, the weights and the frequency table (a kernel would read past them).
    fn rows(&self, layout: &Layout, dtype: DType) -> Result<(usize, usize)> {
        let (tokens, stride) = layout.shape().dims2()?;
        let d = self.head_dim;
        if d == 0 || !d.is_multiple_of(2) || d > MAX_ROPE_HEAD_DIM {
            bail!("qk-norm-rope: head_dim {d} must be even and at most {MAX_ROPE_HEAD_DIM}");
        }
        if (self.q_heads + 2 * self.kv_heads) * d > stride {
            bail!("qk-norm-rope: rows of {stride} do not hold the Q, K and V heads");
        }
        expect(
            &self.positions,
            DType::U32,
            tokens,
            "qk-norm-rope positions",
        )?;
        expect(&self.q_weight, dtype, d, "qk-norm-rope q_weight")?;
        expect(&self.k_weight, dtype, d, "qk-norm-rope k_weight")?;
        expect(&self.inv_freq, DType::F32, d / 2, "qk-norm-rope inv_freq")?;
        Ok((tokens, stride))
    }

    pub fn kernel_launch(&self, dtype: DType, tokens: usize) -> Result<KernelLaunch> {
        // One warp per (token, head), four warps a block.
        let jobs = tokens
            .checked_mul(self.q_heads + self.kv_heads)
            .ok_or_else(|| candle_core::Error::Msg("qk-norm-rope: too many heads".into()))?;
        Ok(KernelLaunch {
            module: KernelModule::LayerOps,
            kernel: format!("qk_norm_rope_{}", dtype_name(dtype)?),
            grid: [
                launch::grid_dim(jobs.div_ceil(4), "qk-norm-rope blocks", launch::MAX_GRID_X)?,
                1,
                1,
            ],
            block: 128,
            shared_bytes: 0,
        })
    }

    fn cpu_rows<T: Elem>(&self, rows: &mut [T], stride: usize) -> Result<()> {
        let positions = host_u32(&self.positions)?;
        let (qw, kw, inv_freq) = (
            host_f32(&self.q_weight)?,
            host_f32(&self.k_weight)?,
            host_f32(&self.inv_freq)?,
        );
        let (d, half) = (self.head_dim, self.head_dim / 2);
        if positions.len() * stride != rows.len()
            || qw.len() != d
            || kw.len() != d
            || inv_freq.len() != half
        {
            bail!("qk-norm-rope: positions, weights or the frequency table do not fit the rows");
        }
        rows.par_chunks_mut(stride)
            .zip(positions.par_iter())
            .for_each(|(row, &pos)| {
                for head in 0..self.q_heads + self.kv_heads {
                    let w = if head < self.q_heads { &qw } else { &kw };
                    let x = &mut row[head * d..(head + 1) * d];
                    let ss: f32 = x.iter().map(|v| v.widen() * v.widen()).sum();
                    let inv = 1.0 / (ss / d as f32 + self.eps).sqrt();
                    for i in 0..half {
                        let a = x[i].widen() * inv * w[i];
                        let b = x[i + half].widen() * inv * w[i + half];
                        let (sn, cs) = (pos as f32 * inv_freq[i]).sin_cos();
                        x[i] = T::round(a * cs - b * sn);
                        x[i + half] = T::round(b * cs + a * sn);
                    }
                }
            });
        Ok(())
    }
}

impl InplaceOp1 for QkNormRope {
    fn name(&self) -> &'static str {
        "qk-norm-rope"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let (_, stride) = self.rows(layout, storage.dtype())?;
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("qk-norm-rope: the QKV rows must be contiguous");
        };
        match storage {
            CpuStorage::F32(v) => self.cpu_rows(&mut v[start..end], stride),
            CpuStorage::BF16(v) => self.cpu_rows(&mut v[start..end], stride),
            CpuStorage::F16(v) => self.cpu_rows(&mut v[start..end], stride),
            _ => bail!("qk-norm-rope runs f32, bf16 and f16"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> Result<()> {
        use super::cuda;
        let (tokens, stride) = self.rows(layout, storage.dtype())?;
        let Some((start, _)) = layout.contiguous_offsets() else {
            bail!("qk-norm-rope: the QKV rows must be contiguous");
        };
        let launch = self.kernel_launch(storage.dtype(), tokens)?;
        let params = QkNormRopeParams {
            qkv: cuda::storage_ptr(storage, start)?,
            positions: cuda::tensor_ptr(&self.positions)?,
            q_weight: cuda::tensor_ptr(&self.q_weight)?,
            k_weight: cuda::tensor_ptr(&self.k_weight)?,
            inv_freq: cuda::tensor_ptr(&self.inv_freq)?,
            tokens: u32_of(tokens, "tokens")?,
            stride: u32_of(stride, "row stride")?,
            q_heads: self.q_heads as u32,
            kv_heads: self.kv_heads as u32,
            head_dim: self.head_dim as u32,
            eps: self.eps,
        };
        cuda::launch(storage.device(), &launch, &params)
    }
}

/// What [`AddRmsNorm`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormOutput {
    /// `[2, tokens, width]` in the dtype: the sum (the next residual), then the normed sum.
    SumAndNormed,
    /// `[tokens, width]` f32: the normed sum (the final norm the heads read).
    NormedF32,
    /// `[tokens, width]` in the dtype: the normed sum.
    Normed,
}

impl NormOutput {
    /// The kernel's `mode` for this output.
    pub fn mode(self) -> u32 {
        match self {
            NormOutput::SumAndNormed => 0,
            NormOutput::NormedF32 => 1,
            NormOutput::Normed => 2,
        }
    }
}

/// `s = x + delta` (or `s = x`) and `RMSNorm(s) · weight`, over rows of `width`.
pub struct AddRmsNorm {
    pub weight: Tensor,
    pub eps: f32,
    pub output: NormOutput,
}

impl AddRmsNorm {
    /// The sum and the normed sum of `x + delta`: `(sum, normed)`, both `[tokens, width]`.
    pub fn sum_and_normed(
        weight: &Tensor,
        eps: f32,
        x: &Tensor,
        delta: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let op = AddRmsNorm {
            weight: weight.clone(),
            eps,
            output: NormOutput::SumAndNormed,
        };
        let out = x.apply_op2_no_bwd(delta, &op)?;
        Ok((out.get(0)?, out.get(1)?))
    }

    /// `RMSNorm(x + delta)` (or of `x`) alone, in the dtype or f32 as `output` says.
    pub fn normed(
        weight: &Tensor,
        eps: f32,
        x: &Tensor,
        delta: Option<&Tensor>,
        output: NormOutput,
    ) -> Result<Tensor> {
        let op = AddRmsNorm {
            weight: weight.clone(),
            eps,
            output,
        };
        match delta {
            Some(d) => x.apply_op2_no_bwd(d, &op),
            None => x.apply_op1_no_bwd(&op),
        }
    }

    fn out_shape(&self, tokens: usize, width: usize) -> Shape {
        match self.output {
            NormOutput::SumAndNormed => Shape::from((2, tokens, width)),
            _ => Shape::from((tokens, width)),
        }
    }

    pub fn kernel_launch(&self, dtype: DType, tokens: usize) -> Result<KernelLaunch> {
        Ok(KernelLaunch {
            module: KernelModule::LayerOps,
            kernel: format!("add_rms_norm_{}", dtype_name(dtype)?),
            grid: [
                launch::grid_dim(tokens, "add-rms-norm rows", launch::MAX_GRID_X)?,
                1,
                1,
            ],
            block: 256,
            shared_bytes: 0,
        })
    }

    fn cpu_rows<T: Elem>(&self, x: &[T], delta: Option<&[T]>, width: usize) -> Result<CpuStorage> {
        let w = host_f32(&self.weight)?;
        if w.len() != width || !x.len().is_multiple_of(width.max(1)) {
            bail!("add-rms-norm: the weight does not fit rows of {width}");
        }
        if delta.is_some_and(|d| d.len() != x.len()) {
            bail!("add-rms-norm: x and delta differ in shape");
        }
        let tokens = x.len() / width.max(1);
        // Per row: the sum (rounded to T, as the unfused path holds it) and the normed sum.
        let row = |t: usize| -> (Vec<f32>, Vec<f32>) {
            let xr = &x[t * width..(t + 1) * width];
            let sum: Vec<f32> = match delta {
                Some(d) => xr
                    .iter()
                    .zip(&d[t * width..(t + 1) * width])
                    .map(|(a, b)| T::round(a.widen() + b.widen()).widen())
                    .collect(),
                None => xr.iter().map(|a| a.widen()).collect(),
            };
            let ss: f32 = sum.iter().map(|s| s * s).sum();
            let inv = 1.0 / (ss / width as f32 + self.eps).sqrt();
            let normed = sum.iter().zip(&w).map(|(s, g)| s * inv * g).collect();
            (sum, normed)
        };
        let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..tokens).into_par_iter().map(row).collect();
        Ok(match self.output {
            NormOutput::SumAndNormed => {
                let mut out: Vec<T> = Vec::with_capacity(2 * x.len());
                out.extend(
                    rows.iter()
                        .flat_map(|(s, _)| s.iter().map(|&v| T::round(v))),
                );
                out.extend(
                    rows.iter()
                        .flat_map(|(_, n)| n.iter().map(|&v| T::round(v))),
                );
                T::storage(out)
            }
            NormOutput::NormedF32 => {
                CpuStorage::F32(rows.into_iter().flat_map(|(_, n)| n).collect())
            }
            NormOutput::Normed => T::storage(
                rows.iter()
                    .flat_map(|(_, n)| n.iter().map(|&v| T::round(v)))
                    .collect(),
            ),
        })
    }

    fn cpu(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        delta: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, width) = xl.shape().dims2()?;
        if let Some((_, dl)) = delta
            && dl.shape().dims() != xl.shape().dims()
        {
            bail!("add-rms-norm: x and delta differ in shape");
        }
        let out = match (x, delta) {
            (CpuStorage::F32(v), None) => self.cpu_rows(covered(v, xl, "x")?, None, width)?,
            (CpuStorage::BF16(v), None) => self.cpu_rows(covered(v, xl, "x")?, None, width)?,
            (CpuStorage::F16(v), None) => self.cpu_rows(covered(v, xl, "x")?, None, width)?,
            (CpuStorage::F32(v), Some((CpuStorage::F32(d), dl))) => {
                self.cpu_rows(covered(v, xl, "x")?, Some(covered(d, dl, "delta")?), width)?
            }
            (CpuStorage::BF16(v), Some((CpuStorage::BF16(d), dl))) => {
                self.cpu_rows(covered(v, xl, "x")?, Some(covered(d, dl, "delta")?), width)?
            }
            (CpuStorage::F16(v), Some((CpuStorage::F16(d), dl))) => {
                self.cpu_rows(covered(v, xl, "x")?, Some(covered(d, dl, "delta")?), width)?
            }
            _ => bail!("add-rms-norm: x and delta must share one of f32, bf16, f16"),
        };
        Ok((out, self.out_shape(tokens, width)))
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        delta: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda;
        let (tokens, width) = xl.shape().dims2()?;
        expect(&self.weight, x.dtype(), width, "add-rms-norm weight")?;
        if let Some((d, dl)) = delta
            && (d.dtype() != x.dtype() || dl.shape().dims() != xl.shape().dims())
        {
            bail!("add-rms-norm: x and delta differ in dtype or shape");
        }
        let launch = self.kernel_launch(x.dtype(), tokens)?;
        let out_dtype = if self.output == NormOutput::NormedF32 {
            DType::F32
        } else {
            x.dtype()
        };
        let shape = self.out_shape(tokens, width);
        let (out, out_ptr) = cuda::alloc(x.device(), out_dtype, shape.elem_count())?;
        let params = AddRmsNormParams {
            x: cuda::storage_ptr(x, contiguous_start(xl, "x")?)?,
            delta: match delta {
                Some((d, dl)) => cuda::storage_ptr(d, contiguous_start(dl, "delta")?)?,
                None => 0,
            },
            weight: cuda::tensor_ptr(&self.weight)?,
            out: out_ptr,
            tokens: u32_of(tokens, "tokens")?,
            width: u32_of(width, "width")?,
            eps: self.eps,
            mode: self.output.mode(),
        };
        cuda::launch(x.device(), &launch, &params)?;
        Ok((out, shape))
    }
}

impl CustomOp1 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu(s, l, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda(s, l, None)
    }
}

impl CustomOp2 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(s1, l1, Some((s2, l2)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if l2.shape().dims() != l1.shape().dims() {
            bail!("add-rms-norm: x and delta differ in shape");
        }
        self.cuda(s1, l1, Some((s2, l2)))
    }
}

/// `silu(gate) · up` on contiguous fused rows `[tokens, 2·inter]` (gate first): `[tokens, inter]`.
pub struct SwiGlu;

impl SwiGlu {
    /// `(tokens, intermediate width)` of fused gate/up rows.
    fn halves(l: &Layout) -> Result<(usize, usize)> {
        let (tokens, w2) = l.shape().dims2()?;
        if !w2.is_multiple_of(2) {
            bail!("swiglu: rows of {w2} are not gate and up halves");
        }
        Ok((tokens, w2 / 2))
    }

    /// Columns of the intermediate width across grid x (256 a block), tokens across grid y.
    pub fn kernel_launch(dtype: DType, tokens: usize, inter: usize) -> Result<KernelLaunch> {
        Ok(KernelLaunch {
            module: KernelModule::LayerOps,
            kernel: format!("swiglu_{}", dtype_name(dtype)?),
            grid: [
                launch::grid_dim(inter.div_ceil(256), "swiglu blocks", launch::MAX_GRID_X)?,
                tokens.clamp(1, launch::MAX_GRID_YZ as usize) as u32,
                1,
            ],
            block: 256,
            shared_bytes: 0,
        })
    }

    fn cpu_rows<T: Elem>(gu: &[T], inter: usize) -> Vec<T> {
        let mut out = vec![T::round(0.0); gu.len() / 2];
        out.par_chunks_mut(inter.max(1))
            .zip(gu.par_chunks(2 * inter.max(1)))
            .for_each(|(o, row)| {
                let (gate, up) = row.split_at(inter);
                for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
                    let g = g.widen();
                    *o = T::round(g / (1.0 + (-g).exp()) * u.widen());
                }
            });
        out
    }
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (tokens, inter) = Self::halves(l)?;
        let out = match s {
            CpuStorage::F32(v) => Elem::storage(Self::cpu_rows(covered(v, l, "gate_up")?, inter)),
            CpuStorage::BF16(v) => Elem::storage(Self::cpu_rows(covered(v, l, "gate_up")?, inter)),
            CpuStorage::F16(v) => Elem::storage(Self::cpu_rows(covered(v, l, "gate_up")?, inter)),
            _ => bail!("swiglu runs f32, bf16 and f16"),
        };
        Ok((out, Shape::from((tokens, inter))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda;
        let (tokens, inter) = Self::halves(l)?;
        let launch = Self::kernel_launch(s.dtype(), tokens, inter)?;
        let (out, out_ptr) = cuda::alloc(s.device(), s.dtype(), tokens * inter)?;
        let params = SwigluParams {
            gate_up: cuda::storage_ptr(s, contiguous_start(l, "gate_up")?)?,
            out: out_ptr,
            tokens: u32_of(tokens, "tokens")?,
            inter: u32_of(inter, "intermediate width")?,
        };
        cuda::launch(s.device(), &launch, &params)?;
        Ok((out, Shape::from((tokens, inter))))
    }
}

/// Where a contiguous view starts (elements).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn contiguous_start(layout: &Layout, what: &str) -> Result<usize> {
    match layout.contiguous_offsets() {
        Some((start, _)) => Ok(start),
        None => bail!("{what} must be contiguous"),
    }
}
