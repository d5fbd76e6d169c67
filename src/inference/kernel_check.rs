//! `fantom-sidecar kernel-check`'s cases: every kernel of ours run on a device and compared with
//! its CPU body, on the shapes that break kernels (uneven rows, one-token rows, rows over several
//! tiles, shared prefixes, grouped-query heads, causal and bidirectional, every dtype the kernel
//! takes). On the CPU both sides are the CPU body (every difference 0); on a GPU it is the check
//! the GPU script runs first. The same kernels run in CI under the emulator
//! (`inference::emulator`).

use candle_core::{DType, Device, Result, Tensor};

use super::attention::PackedAttention;
use super::kernels::{cosine_matrix, pool_normalize};
use super::layer_ops::{AddRmsNorm, NormOutput, QkNormRope, SwiGlu};
use crate::model_spec::Pooling;

/// One comparison of a kernel on a device with its CPU body.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelCheck {
    pub kernel: String,
    pub case: String,
    /// Largest absolute difference from the CPU body.
    pub max_abs_diff: f32,
    pub tolerance: f32,
    pub passed: bool,
}

/// Deterministic test data: `len` values in [-1, 1) from `seed`.
pub(crate) fn test_data(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (
        a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
    );
    if a.len() != b.len() {
        candle_core::bail!("shapes differ: {} and {}", a.len(), b.len());
    }
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max))
}

/// The fused pooling kernel (uneven rows, an empty row, every pooling, truncated and full
/// width, f32 and bf16 states) and the gate's cosine matrix.
fn pooling_and_cosine(device: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    let (h, lengths) = (96usize, [5u32, 1, 17, 0, 9]);
    let tokens: u32 = lengths.iter().sum();
    let starts: Vec<u32> = lengths
        .iter()
        .scan(0u32, |at, &l| {
            let s = *at;
            *at += l;
            Some(s)
        })
        .collect();
    let hidden = Tensor::from_vec(
        test_data(tokens as usize * h, 7),
        (tokens as usize, h),
        &Device::Cpu,
    )?;
    let (s_cpu, l_cpu) = (
        Tensor::new(starts.as_slice(), &Device::Cpu)?,
        Tensor::new(lengths.as_slice(), &Device::Cpu)?,
    );
    for dtype in [DType::F32, DType::BF16] {
        let states = hidden.to_dtype(dtype)?;
        let on_dev = (
            states.to_device(device)?,
            s_cpu.to_device(device)?,
            l_cpu.to_device(device)?,
        );
        for pooling in [Pooling::Cls, Pooling::Last, Pooling::Mean] {
            for (dims, normalize) in [(h, true), (32, true), (h, false)] {
                let want = pool_normalize(&states, &s_cpu, &l_cpu, pooling, dims, normalize)?;
                let got =
                    pool_normalize(&on_dev.0, &on_dev.1, &on_dev.2, pooling, dims, normalize)?;
                let case = format!("{dtype:?} {pooling:?} dims={dims} normalize={normalize}");
                check(checks, "pool_normalize", case, &want, &got, 1e-5)?;
            }
        }
    }
    for (n, m, d) in [(12usize, 12usize, 4096usize), (3, 5, 7), (1, 1, 1024)] {
        let a = Tensor::from_vec(test_data(n * d, 11), (n, d), &Device::Cpu)?;
        let mut b_data = test_data(m * d, 13);
        b_data[..d].iter_mut().for_each(|v| *v = 0.0); // a zero row: cosine 0
        let b = Tensor::from_vec(b_data, (m, d), &Device::Cpu)?;
        let want = cosine_matrix(&a, &b)?;
        let got = cosine_matrix(&a.to_device(device)?, &b.to_device(device)?)?;
        check(
            checks,
            "cosine_matrix",
            format!("{n}x{m} d={d}"),
            &want,
            &got,
            1e-5,
        )?;
    }
    Ok(())
}

/// Runs every kernel on `device` and compares each with its CPU body.
pub fn self_check(device: &Device) -> Result<Vec<KernelCheck>> {
    let mut checks = Vec::new();
    pooling_and_cosine(device, &mut checks)?;
    attention(device, &mut checks)?;
    layer_ops(device, &mut checks)?;
    Ok(checks)
}

/// What a half dtype's rounding allows at values within ±1 (a few ulps at 1); f32 agrees to
/// float noise.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1.6e-2,
        DType::F16 => 2e-3,
        _ => 1e-4,
    }
}

fn check(
    checks: &mut Vec<KernelCheck>,
    kernel: &str,
    case: String,
    want: &Tensor,
    got: &Tensor,
    tolerance: f32,
) -> Result<()> {
    let diff = max_abs_diff(want, &got.to_device(&Device::Cpu)?)?;
    checks.push(KernelCheck {
        kernel: kernel.into(),
        case,
        max_abs_diff: diff,
        tolerance,
        passed: diff <= tolerance,
    });
    Ok(())
}

/// Packed attention on Q, K, V read in place from one fused matrix, in the dtypes and head dims
/// the device runs it in (bf16 and f16 with head dims 32, 64, 128 on CUDA; f32 too on the CPU).
fn attention(device: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    // (row lengths, prefix of each row, (query heads, kv heads, head dim), causal)
    type Case = (Vec<usize>, Vec<Option<usize>>, (usize, usize, usize), bool);
    let cases: [Case; 6] = [
        (vec![70, 1, 130, 5], vec![], (4, 2, 32), true),
        (vec![70, 1, 130, 5], vec![], (4, 4, 32), false),
        (
            vec![3, 64, 20, 80],
            vec![Some(3), Some(3), Some(3), None],
            (8, 2, 64),
            true,
        ),
        (vec![200, 1, 65], vec![], (8, 8, 64), false),
        (vec![129, 2, 300], vec![], (16, 8, 128), true),
        (vec![1, 1, 1], vec![], (2, 1, 128), true),
    ];
    let dtypes: &[DType] = if device.is_cpu() {
        &[DType::F32, DType::BF16, DType::F16]
    } else {
        &[DType::BF16, DType::F16]
    };
    for (lengths, prefix_of, (hq, hk, d), causal) in cases {
        let tokens: usize = lengths.iter().sum();
        let width = (hq + 2 * hk) * d;
        let host = Tensor::from_vec(test_data(tokens * width, 41), (tokens, width), &Device::Cpu)?;
        for &dtype in dtypes {
            let op = PackedAttention {
                lengths: lengths.clone(),
                prefix_of: prefix_of.clone(),
                q_heads: hq,
                kv_heads: hk,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                causal,
                table: None,
            };
            let split = |t: &Tensor| -> Result<Tensor> {
                let (q, k, v) = (
                    t.narrow(1, 0, hq * d)?,
                    t.narrow(1, hq * d, hk * d)?,
                    t.narrow(1, (hq + hk) * d, hk * d)?,
                );
                q.apply_op3_no_bwd(&k, &v, &op)
            };
            let qkv = host.to_dtype(dtype)?;
            let want = split(&qkv)?;
            let got = split(&qkv.to_device(device)?)?;
            let rows = lengths
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let case = format!(
                "{dtype:?} d={d} heads={hq}/{hk} {} rows={rows}{}",
                if causal { "causal" } else { "both-ways" },
                if prefix_of.is_empty() { "" } else { " prefix" }
            );
            check(
                checks,
                "packed_attention",
                case,
                &want,
                &got,
                tolerance(dtype),
            )?;
        }
    }
    Ok(())
}

/// The per-head norm with RoPE (in place), the residual add with the norm (each output), and
/// SwiGLU, in f32, bf16 and f16.
fn layer_ops(device: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    let cpu = Device::Cpu;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // RMSNorm on rows of ±1 divides by about 0.58: a half dtype's error grows with it.
        let tol = tolerance(dtype) * 4.0;
        for (hq, hk, d) in [(4, 2, 32), (16, 8, 128)] {
            let tokens = 33;
            let width = (hq + 2 * hk) * d;
            let positions: Vec<u32> = (0..tokens as u32).map(|t| (t * 251) % 8192).collect();
            let inv: Vec<f32> = (0..d / 2)
                .map(|i| 1.0 / 1e6f64.powf(2.0 * i as f64 / d as f64) as f32)
                .collect();
            let op_on = |dev: &Device| -> Result<QkNormRope> {
                Ok(QkNormRope {
                    positions: Tensor::new(positions.as_slice(), dev)?,
                    q_weight: Tensor::from_vec(test_data(d, 5), d, &cpu)?
                        .to_dtype(dtype)?
                        .to_device(dev)?,
                    k_weight: Tensor::from_vec(test_data(d, 6), d, &cpu)?
                        .to_dtype(dtype)?
                        .to_device(dev)?,
                    inv_freq: Tensor::new(inv.as_slice(), dev)?,
                    q_heads: hq,
                    kv_heads: hk,
                    head_dim: d,
                    eps: 1e-6,
                })
            };
            let qkv = Tensor::from_vec(test_data(tokens * width, 43), (tokens, width), &cpu)?
                .to_dtype(dtype)?;
            let want = qkv.copy()?;
            want.inplace_op1(&op_on(&cpu)?)?;
            let got = qkv.to_device(device)?;
            got.inplace_op1(&op_on(device)?)?;
            check(
                checks,
                "qk_norm_rope",
                format!("{dtype:?} d={d} heads={hq}/{hk} positions<8192"),
                &want,
                &got,
                tol,
            )?;
        }
        let (tokens, width) = (17, 1024);
        let x = Tensor::from_vec(test_data(tokens * width, 51), (tokens, width), &cpu)?
            .to_dtype(dtype)?;
        let delta = Tensor::from_vec(test_data(tokens * width, 52), (tokens, width), &cpu)?
            .to_dtype(dtype)?;
        let weight = Tensor::from_vec(test_data(width, 53), width, &cpu)?.to_dtype(dtype)?;
        for output in [
            NormOutput::SumAndNormed,
            NormOutput::NormedF32,
            NormOutput::Normed,
        ] {
            let run = |dev: &Device| -> Result<Tensor> {
                let op = AddRmsNorm {
                    weight: weight.to_device(dev)?,
                    eps: 1e-6,
                    output,
                };
                x.to_device(dev)?
                    .apply_op2_no_bwd(&delta.to_device(dev)?, &op)
            };
            let bound = if output == NormOutput::NormedF32 {
                1e-4
            } else {
                tol
            };
            check(
                checks,
                "add_rms_norm",
                format!("{dtype:?} {output:?} width={width}"),
                &run(&cpu)?,
                &run(device)?,
                bound,
            )?;
        }
        let gu = Tensor::from_vec(test_data(tokens * 2 * 1536, 61), (tokens, 2 * 1536), &cpu)?
            .to_dtype(dtype)?;
        let want = gu.apply_op1_no_bwd(&SwiGlu)?;
        let got = gu.to_device(device)?.apply_op1_no_bwd(&SwiGlu)?;
        check(
            checks,
            "swiglu",
            format!("{dtype:?} inter=1536"),
            &want,
            &got,
            tolerance(dtype),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_self_check_passes_on_the_cpu() {
        let checks = self_check(&Device::Cpu).unwrap();
        assert!(checks.len() > 40, "{}", checks.len());
        assert!(
            checks.iter().all(|c| c.passed && c.max_abs_diff == 0.0),
            "{checks:?}"
        );
    }

    /// On a CUDA machine: the kernels against their CPU bodies (skipped without a device).
    #[cfg(feature = "cuda")]
    #[test]
    fn the_cuda_kernels_match_their_cpu_bodies() {
        let Ok(device) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: skipped");
            return;
        };
        let checks = self_check(&device).unwrap();
        assert!(checks.iter().all(|c| c.passed), "{checks:?}");
    }
}
