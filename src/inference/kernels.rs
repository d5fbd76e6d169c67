//! Our own kernels, where candle has none and they pay, as candle custom ops: each has a CPU
//! body (the reference the CUDA body is checked against, and the path on CPU devices) and,
//! with the `cuda` feature, a CUDA body from `kernels/*.cu` (compiled to PTX by `build.rs`,
//! loaded through cudarc into candle's device).
//!
//! * [`pool_normalize`]: token states → one vector per row: first/last token or mean, the
//!   first `dims` features (Matryoshka), L2-normalised. One pass on the device instead of an
//!   index_select or index_add, a division, a host copy and a host loop.
//! * [`cosine_matrix`]: the gate's `n × m` cosines between probe vectors and a fingerprint.
//!
//! `kernel_check` runs them, with the attention and layer kernels, on a device against their
//! CPU bodies (`fantom-sidecar kernel-check`, the GPU script).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::launch::KernelModule;
use crate::model_spec::Pooling;

/// Threads per block of both kernels (a power of two).
#[cfg(feature = "cuda")]
const BLOCK: u32 = 256;

/// Pools packed token states `[tokens, h]` (f32 or bf16) into `[rows, dims]` f32 unit vectors.
/// Row `r` is tokens `starts[r] .. starts[r] + lengths[r]` (`u32` tensors of `rows`).
pub fn pool_normalize(
    hidden: &Tensor,
    starts: &Tensor,
    lengths: &Tensor,
    pooling: Pooling,
    dims: usize,
    normalize: bool,
) -> Result<Tensor> {
    let h = hidden.dim(1)?;
    if dims == 0 || dims > h {
        candle_core::bail!("pool_normalize: dims {dims} outside 1..={h}");
    }
    let op = PoolNormalize {
        mode: match pooling {
            Pooling::Cls => 0,
            Pooling::Last => 1,
            Pooling::Mean => 2,
        },
        dims,
        normalize,
    };
    hidden
        .contiguous()?
        .apply_op3_no_bwd(&starts.contiguous()?, &lengths.contiguous()?, &op)
}

/// Cosines between every row of `a` `[n, d]` and every row of `b` `[m, d]` (f32): `[n, m]`.
pub fn cosine_matrix(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dim(1)? != b.dim(1)? {
        candle_core::bail!("cosine_matrix: widths {} and {}", a.dim(1)?, b.dim(1)?);
    }
    a.to_dtype(DType::F32)?
        .contiguous()?
        .apply_op2_no_bwd(&b.to_dtype(DType::F32)?.contiguous()?, &CosineMatrix)
}

struct PoolNormalize {
    /// 0 first token, 1 last token, 2 mean (as the kernel reads it).
    mode: u32,
    dims: usize,
    normalize: bool,
}

struct CosineMatrix;

/// The contiguous slice a layout covers.
fn slice<'a, T>(data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("kernels take contiguous inputs"),
    }
}

fn u32s<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    match s {
        CpuStorage::U32(v) => slice(v, l),
        _ => candle_core::bail!("starts and lengths are u32"),
    }
}

/// The CPU body: the same arithmetic as the kernel, in f32 (the norm too).
fn pool_rows(
    hidden: &[f32],
    h: usize,
    starts: &[u32],
    lengths: &[u32],
    op: &PoolNormalize,
) -> Result<Vec<f32>> {
    let tokens = hidden.len() / h.max(1);
    let mut out = Vec::with_capacity(starts.len() * op.dims);
    for (&start, &len) in starts.iter().zip(lengths) {
        let (start, len) = (start as usize, len as usize);
        if len > 0 && start + len > tokens {
            candle_core::bail!("a row runs past the token states ({start}+{len} > {tokens})");
        }
        let row = &mut vec![0f32; op.dims];
        if len > 0 {
            match op.mode {
                2 => {
                    for t in start..start + len {
                        for (d, v) in row.iter_mut().enumerate() {
                            *v += hidden[t * h + d];
                        }
                    }
                    for v in row.iter_mut() {
                        *v /= len as f32;
                    }
                }
                mode => {
                    let t = if mode == 0 { start } else { start + len - 1 };
                    row.copy_from_slice(&hidden[t * h..t * h + op.dims]);
                }
            }
        }
        if op.normalize {
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            let scale = 1.0 / norm.max(1e-12);
            row.iter_mut().for_each(|v| *v *= scale);
        }
        out.extend_from_slice(row);
    }
    Ok(out)
}

impl CustomOp3 for PoolNormalize {
    fn name(&self) -> &'static str {
        "pool-normalize"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, h) = l1.shape().dims2()?;
        let widened;
        let hidden = match s1 {
            CpuStorage::F32(v) => slice(v, l1)?,
            CpuStorage::BF16(v) => {
                widened = slice(v, l1)?.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
                &widened
            }
            _ => candle_core::bail!("pool_normalize takes f32 or bf16 states"),
        };
        let (starts, lengths) = (u32s(s2, l2)?, u32s(s3, l3)?);
        if starts.len() != lengths.len() {
            candle_core::bail!("starts and lengths differ in length");
        }
        let out = pool_rows(hidden, h, starts, lengths, self)?;
        Ok((CpuStorage::F32(out), Shape::from((starts.len(), self.dims))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

        let dev = s1.device().clone();
        let (_, h) = l1.shape().dims2()?;
        let rows = l2.shape().elem_count();
        if l3.shape().elem_count() != rows {
            candle_core::bail!("starts and lengths differ in length");
        }
        let (o1, o2, o3) = (offset(l1)?, offset(l2)?, offset(l3)?);
        let starts = s2.as_cuda_slice::<u32>()?.slice(o2..);
        let lengths = s3.as_cuda_slice::<u32>()?.slice(o3..);
        let out = dev.alloc_zeros::<f32>(rows * self.dims)?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: BLOCK * 4,
        };
        let (h, dims, mode, normalize) = (
            h as u32,
            self.dims as u32,
            self.mode,
            u32::from(self.normalize),
        );
        let name = match s1.dtype() {
            DType::F32 => "pool_normalize_f32",
            DType::BF16 => "pool_normalize_bf16",
            other => candle_core::bail!("pool_normalize takes f32 or bf16 states, not {other:?}"),
        };
        let func = super::cuda::function(&dev, KernelModule::Pooling, name)?;
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&func);
        let hidden_f32;
        let hidden_bf16;
        match s1.dtype() {
            DType::F32 => {
                hidden_f32 = s1.as_cuda_slice::<f32>()?.slice(o1..);
                launch.arg(&hidden_f32);
            }
            _ => {
                hidden_bf16 = s1.as_cuda_slice::<half::bf16>()?.slice(o1..);
                launch.arg(&hidden_bf16);
            }
        }
        launch.arg(&starts);
        launch.arg(&lengths);
        launch.arg(&h);
        launch.arg(&dims);
        launch.arg(&mode);
        launch.arg(&normalize);
        launch.arg(&out);
        // SAFETY: the arguments match the kernel's signature; `out` holds rows × dims.
        unsafe { launch.launch(cfg) }.w()?;
        let storage = candle_core::CudaStorage::wrap_cuda_slice(out, dev);
        Ok((storage, Shape::from((rows, self.dims))))
    }
}

impl CustomOp2 for CosineMatrix {
    fn name(&self) -> &'static str {
        "cosine-matrix"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (s1, s2) else {
            candle_core::bail!("cosine_matrix takes f32");
        };
        let (n, d) = l1.shape().dims2()?;
        let (m, _) = l2.shape().dims2()?;
        let (a, b) = (slice(a, l1)?, slice(b, l2)?);
        let mut out = Vec::with_capacity(n * m);
        for i in 0..n {
            for j in 0..m {
                let (x, y) = (&a[i * d..(i + 1) * d], &b[j * d..(j + 1) * d]);
                let (mut dot, mut aa, mut bb) = (0f32, 0f32, 0f32);
                for (u, v) in x.iter().zip(y) {
                    dot += u * v;
                    aa += u * u;
                    bb += v * v;
                }
                let c = if aa == 0.0 || bb == 0.0 {
                    0.0
                } else {
                    dot / (aa.sqrt() * bb.sqrt())
                };
                out.push(c);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((n, m))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

        let dev = s1.device().clone();
        let (n, d) = l1.shape().dims2()?;
        let (m, _) = l2.shape().dims2()?;
        let a = s1.as_cuda_slice::<f32>()?.slice(offset(l1)?..);
        let b = s2.as_cuda_slice::<f32>()?.slice(offset(l2)?..);
        let out = dev.alloc_zeros::<f32>(n * m)?;
        let cfg = LaunchConfig {
            grid_dim: ((n * m) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 3 * BLOCK * 4,
        };
        let (nu, mu, du) = (n as u32, m as u32, d as u32);
        let func = super::cuda::function(&dev, KernelModule::Cosine, "cosine_matrix_f32")?;
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&func);
        launch.arg(&a);
        launch.arg(&b);
        launch.arg(&nu);
        launch.arg(&mu);
        launch.arg(&du);
        launch.arg(&out);
        // SAFETY: the arguments match the kernel's signature; `out` holds n × m.
        unsafe { launch.launch(cfg) }.w()?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, m)),
        ))
    }
}

#[cfg(feature = "cuda")]
fn offset(layout: &Layout) -> Result<usize> {
    match layout.contiguous_offsets() {
        Some((start, _)) => Ok(start),
        None => candle_core::bail!("kernels take contiguous inputs"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::kernel_check::test_data;
    use crate::inference::pooling::finish;
    use candle_core::Device;

    fn rows_of(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2::<f32>().unwrap()
    }

    #[test]
    fn the_cpu_body_pools_truncates_and_normalises_like_the_engine() {
        let (h, lengths) = (8usize, [3u32, 1, 4]);
        let states = test_data(8 * h, 3);
        let hidden = Tensor::from_vec(states.clone(), (8, h), &Device::Cpu).unwrap();
        let starts = Tensor::new(&[0u32, 3, 4], &Device::Cpu).unwrap();
        let lens = Tensor::new(&lengths, &Device::Cpu).unwrap();
        let token = |t: usize| states[t * h..(t + 1) * h].to_vec();
        // The engine's path: pool, then `finish` (truncate, renormalise in f64).
        let mean_row0: Vec<f32> = (0..h)
            .map(|d| (0..3).map(|t| states[t * h + d]).sum::<f32>() / 3.0)
            .collect();
        let cases = [
            (Pooling::Cls, vec![token(0), token(3), token(4)]),
            (Pooling::Last, vec![token(2), token(3), token(7)]),
        ];
        for (pooling, want) in cases {
            for dims in [h, 5] {
                let got = pool_normalize(&hidden, &starts, &lens, pooling, dims, true).unwrap();
                for (g, w) in rows_of(&got).iter().zip(&want) {
                    let w = finish(w.clone(), Some(dims), true);
                    for (x, y) in g.iter().zip(&w) {
                        assert!((x - y).abs() < 1e-6, "{pooling:?} {dims}: {g:?} vs {w:?}");
                    }
                }
            }
        }
        let mean = pool_normalize(&hidden, &starts, &lens, Pooling::Mean, h, false).unwrap();
        for (x, y) in rows_of(&mean)[0].iter().zip(&mean_row0) {
            assert!((x - y).abs() < 1e-6);
        }
        // bf16 states are widened first; an empty row pools to zeros; bad widths are refused.
        let empty = Tensor::new(&[0u32], &Device::Cpu).unwrap();
        let zero = pool_normalize(
            &hidden.to_dtype(DType::BF16).unwrap(),
            &empty,
            &empty,
            Pooling::Mean,
            h,
            true,
        )
        .unwrap();
        assert!(rows_of(&zero)[0].iter().all(|v| *v == 0.0));
        assert!(pool_normalize(&hidden, &starts, &lens, Pooling::Cls, h + 1, true).is_err());
    }

    #[test]
    fn the_cpu_cosine_matrix_matches_the_cosine_in_f64() {
        let (n, m, d) = (3, 4, 64);
        let (a, b) = (test_data(n * d, 5), test_data(m * d, 6));
        let ta = Tensor::from_vec(a.clone(), (n, d), &Device::Cpu).unwrap();
        let tb = Tensor::from_vec(b.clone(), (m, d), &Device::Cpu).unwrap();
        let got = rows_of(&cosine_matrix(&ta, &tb).unwrap());
        for i in 0..n {
            for j in 0..m {
                let (x, y) = (&a[i * d..(i + 1) * d], &b[j * d..(j + 1) * d]);
                let dot = |u: &[f32], v: &[f32]| -> f64 {
                    u.iter()
                        .zip(v)
                        .map(|(p, q)| f64::from(*p) * f64::from(*q))
                        .sum()
                };
                let want = dot(x, y) / (dot(x, x).sqrt() * dot(y, y).sqrt());
                assert!((f64::from(got[i][j]) - want).abs() < 1e-5, "{i},{j}");
            }
        }
        assert!(
            cosine_matrix(
                &ta,
                &Tensor::zeros((1, 3), DType::F32, &Device::Cpu).unwrap()
            )
            .is_err()
        );
    }
}
