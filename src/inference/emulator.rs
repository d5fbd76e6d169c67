//! Our CUDA kernels' own source run on the CPU (tests only; CI has no GPU).
//!
//! `kernels/emu/` emulates the CUDA execution model (threads, blocks, shared memory, barriers,
//! warp shuffles, mma.sync, ldmatrix and cp.async with the PTX ISA's fragment layouts; see
//! `kernels/emu/cuda_emu.h`). The first test that needs it compiles `kernels/emu/entry.cc` with
//! the system's C++ compiler (`$CXX`, else `c++`) into a shared library in a temp dir, loads it
//! and removes the dir; each test then runs the launch an op computes for the GPU (its
//! [`KernelLaunch`] and `#[repr(C)]` parameters, over host memory) and compares the result
//! with the op's CPU body. Inputs are registered as the only memory the kernel may read through
//! cp.async, and outputs sit between guard zones that must come back untouched.

use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use super::launch::KernelLaunch;

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const c_uint,
    *const c_uint,
    c_uint,
    *mut *mut c_void,
    *const usize,
    c_uint,
) -> c_int;

struct Library {
    launch: LaunchFn,
}

fn library() -> &'static Library {
    static LIB: OnceLock<Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = std::env::temp_dir().join(format!("fantom-emu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir for the emulator");
        let lib = dir.join("libfantom_emu.so");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let status = std::process::Command::new(&cxx)
            .args([
                "-std=c++20",
                "-O2",
                "-shared",
                "-fPIC",
                "-pthread",
                "-fno-strict-aliasing",
            ])
            .arg("-I")
            .arg(root.join("kernels/emu/include"))
            .arg("-o")
            .arg(&lib)
            .arg(root.join("kernels/emu/entry.cc"))
            .status()
            .unwrap_or_else(|e| panic!("the kernel emulator needs a C++20 compiler ({cxx}): {e}"));
        assert!(status.success(), "{cxx} failed on kernels/emu/entry.cc");
        let path = CString::new(lib.to_string_lossy().as_bytes()).expect("a path without NUL");
        // SAFETY: dlopen/dlsym on the library just built; the symbol has the declared signature
        // (kernels/emu/entry.cc), and the handle is never closed.
        unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            assert!(!handle.is_null(), "cannot load {}", lib.display());
            let sym = libc::dlsym(handle, c"fantom_emu_launch".as_ptr());
            assert!(!sym.is_null(), "no fantom_emu_launch in {}", lib.display());
            // Loaded: the file is no longer needed (nothing is left in the temp dir).
            let _ = std::fs::remove_dir_all(&dir);
            Library {
                launch: std::mem::transmute::<*mut c_void, LaunchFn>(sym),
            }
        }
    })
}

/// Runs `l` with `params` (one pointer per kernel parameter); cp.async may read only the
/// `(begin, end)` address ranges of `readable`.
pub fn launch(l: &KernelLaunch, params: &mut [*mut c_void], readable: &[(usize, usize)]) {
    let lib = library();
    let name = CString::new(l.kernel.as_str()).expect("a kernel name");
    let block = [l.block, 1, 1];
    let ranges: Vec<usize> = readable.iter().flat_map(|&(a, b)| [a, b]).collect();
    // SAFETY: the parameters point at values of the kernel's parameter types, whose pointers
    // address live host buffers of the sizes the launch covers (each test sets them up so).
    let rc = unsafe {
        (lib.launch)(
            name.as_ptr(),
            l.grid.as_ptr(),
            block.as_ptr(),
            l.shared_bytes,
            params.as_mut_ptr(),
            ranges.as_ptr(),
            readable.len() as c_uint,
        )
    };
    assert_eq!(rc, 0, "the emulator has no kernel {}", l.kernel);
}

/// Runs `l` with its one parameter block.
pub fn launch_one<P>(l: &KernelLaunch, params: &P, readable: &[(usize, usize)]) {
    launch(l, &mut [params as *const P as *mut c_void], readable);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::attention::{PackedAttention, RowTable, row_view};
    use crate::inference::kernel_check::test_data;
    use crate::inference::layer_ops::{
        AddRmsNorm, AddRmsNormParams, NormOutput, QkNormRope, QkNormRopeParams, SwiGlu,
        SwigluParams,
    };
    use candle_core::{DType, Device, Result, Storage, Tensor};

    /// The host address of a CPU tensor's first element (its layout's start).
    fn host_ptr(t: &Tensor) -> u64 {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            panic!("a CPU tensor")
        };
        let base = match cpu {
            candle_core::CpuStorage::F32(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::BF16(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::F16(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::U32(v) => v.as_ptr() as usize,
            _ => panic!("a dtype the kernels take"),
        };
        (base + layout.start_offset() * t.dtype().size_in_bytes()) as u64
    }

    /// The address range of a CPU tensor's whole storage.
    fn range(t: &Tensor) -> (usize, usize) {
        let (storage, _) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            panic!("a CPU tensor")
        };
        let (p, n) = match cpu {
            candle_core::CpuStorage::F32(v) => (v.as_ptr() as usize, v.len() * 4),
            candle_core::CpuStorage::BF16(v) => (v.as_ptr() as usize, v.len() * 2),
            candle_core::CpuStorage::F16(v) => (v.as_ptr() as usize, v.len() * 2),
            candle_core::CpuStorage::U32(v) => (v.as_ptr() as usize, v.len() * 4),
            _ => panic!("a dtype the kernels take"),
        };
        (p, p + n)
    }

    const GUARD: usize = 64;

    /// An output buffer of `n` elements of `bytes` each, between guard zones of 0xA5.
    struct Guarded {
        buf: Vec<u8>,
        bytes: usize,
    }

    impl Guarded {
        fn new(n: usize, bytes: usize) -> Self {
            Self {
                buf: vec![0xA5; (n + 2 * GUARD) * bytes],
                bytes,
            }
        }
        fn ptr(&mut self) -> u64 {
            self.buf[GUARD * self.bytes..].as_mut_ptr() as u64
        }
        /// The elements, after checking the guards; as a tensor of `dtype` and `shape`.
        fn tensor(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
            let n: usize = shape.iter().product();
            let (head, rest) = self.buf.split_at(GUARD * self.bytes);
            let (body, tail) = rest.split_at(n * self.bytes);
            assert!(
                head.iter().chain(tail).all(|&b| b == 0xA5),
                "a kernel wrote outside its output"
            );
            let t = match dtype {
                DType::F32 => Tensor::from_vec(
                    body.chunks(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect::<Vec<_>>(),
                    shape,
                    &Device::Cpu,
                )?,
                DType::BF16 => Tensor::from_vec(
                    body.chunks(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                        .collect::<Vec<_>>(),
                    shape,
                    &Device::Cpu,
                )?,
                DType::F16 => Tensor::from_vec(
                    body.chunks(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                        .collect::<Vec<_>>(),
                    shape,
                    &Device::Cpu,
                )?,
                other => panic!("{other:?}"),
            };
            Ok(t)
        }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(a.len(), b.len());
        Ok(a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max))
    }

    fn fused(tokens: usize, width: usize, seed: u64, dtype: DType) -> Result<Tensor> {
        Tensor::from_vec(
            test_data(tokens * width, seed),
            (tokens, width),
            &Device::Cpu,
        )?
        .to_dtype(dtype)
    }

    /// The CUDA kernel against the CPU body on the same bf16/f16 inputs: uneven rows (one-token
    /// ones, rows over several query and key tiles), grouped-query heads, causal and
    /// bidirectional, shared prefixes, every head dim the kernel is built for, Q, K and V read
    /// in place from one fused matrix.
    #[test]
    fn packed_attention_kernel_matches_the_cpu_body() -> Result<()> {
        struct Case {
            lengths: Vec<usize>,
            prefix_of: Vec<Option<usize>>,
            heads: (usize, usize, usize),
            causal: bool,
        }
        let cases = [
            Case {
                lengths: vec![70, 1, 130, 5],
                prefix_of: vec![],
                heads: (4, 2, 32),
                causal: true,
            },
            Case {
                lengths: vec![70, 1, 130, 5],
                prefix_of: vec![],
                heads: (4, 4, 32),
                causal: false,
            },
            Case {
                lengths: vec![3, 64, 20, 80],
                prefix_of: vec![Some(3), Some(3), Some(3), None],
                heads: (2, 1, 64),
                causal: true,
            },
            Case {
                lengths: vec![129, 2],
                prefix_of: vec![],
                heads: (2, 1, 128),
                causal: true,
            },
            Case {
                lengths: vec![1, 66],
                prefix_of: vec![],
                heads: (1, 1, 128),
                causal: false,
            },
        ];
        for case in &cases {
            let (hq, hk, d) = case.heads;
            let tokens: usize = case.lengths.iter().sum();
            for dtype in [DType::BF16, DType::F16] {
                let qkv = fused(tokens, (hq + 2 * hk) * d, 17, dtype)?;
                let (q, k, v) = (
                    qkv.narrow(1, 0, hq * d)?,
                    qkv.narrow(1, hq * d, hk * d)?,
                    qkv.narrow(1, (hq + hk) * d, hk * d)?,
                );
                let op = PackedAttention {
                    lengths: case.lengths.clone(),
                    prefix_of: case.prefix_of.clone(),
                    q_heads: hq,
                    kv_heads: hk,
                    head_dim: d,
                    scale: 1.0 / (d as f32).sqrt(),
                    causal: case.causal,
                    table: None,
                };
                let want = q.apply_op3_no_bwd(&k, &v, &op)?;
                let (rows, tiles) = RowTable::host(&case.lengths, &case.prefix_of)?;
                let (rows_t, tiles_t) = (
                    Tensor::new(rows.as_slice(), &Device::Cpu)?,
                    Tensor::new(tiles.as_slice(), &Device::Cpu)?,
                );
                let views = [
                    row_view(q.layout(), tokens, hq * d, "Q")?,
                    row_view(k.layout(), tokens, hk * d, "K")?,
                    row_view(v.layout(), tokens, hk * d, "V")?,
                ];
                let launch =
                    crate::inference::attention::kernel_launch(dtype, d, tiles.len() / 2, hq)?;
                let mut out = Guarded::new(tokens * hq * d, 2);
                let params = op.kernel_params(
                    &views,
                    [
                        host_ptr(&q),
                        host_ptr(&k),
                        host_ptr(&v),
                        out.ptr(),
                        host_ptr(&rows_t),
                        host_ptr(&tiles_t),
                    ],
                );
                launch_one(&launch, &params, &[range(&qkv)]);
                let got = out.tensor(dtype, &[tokens, hq * d])?;
                let diff = max_diff(&got, &want)?;
                // The inputs are within ±1: a few ulps of the half dtype at 1.
                let tolerance = if dtype == DType::BF16 { 1.6e-2 } else { 2e-3 };
                assert!(
                    diff <= tolerance,
                    "{:?} {dtype:?} causal {}: {diff}",
                    case.heads,
                    case.causal
                );
            }
        }
        Ok(())
    }

    fn rope_op(
        tokens: usize,
        (hq, hk, d): (usize, usize, usize),
        dtype: DType,
    ) -> Result<QkNormRope> {
        let positions: Vec<u32> = (0..tokens as u32).map(|t| (t * 37) % 9000).collect();
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 1e6f64.powf(2.0 * i as f64 / d as f64) as f32)
            .collect();
        Ok(QkNormRope {
            positions: Tensor::new(positions.as_slice(), &Device::Cpu)?,
            q_weight: Tensor::from_vec(test_data(d, 5), d, &Device::Cpu)?.to_dtype(dtype)?,
            k_weight: Tensor::from_vec(test_data(d, 6), d, &Device::Cpu)?.to_dtype(dtype)?,
            inv_freq: Tensor::new(inv.as_slice(), &Device::Cpu)?,
            q_heads: hq,
            kv_heads: hk,
            head_dim: d,
            eps: 1e-6,
        })
    }

    #[test]
    fn layer_op_kernels_match_their_cpu_bodies() -> Result<()> {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let tol = match dtype {
                DType::F32 => 2e-5,
                DType::BF16 => 1.6e-2,
                _ => 2e-3,
            };
            // Per-head RMSNorm and RoPE, in place on Q and K (V untouched).
            for heads in [(4, 2, 32), (2, 1, 128)] {
                let (hq, hk, d) = heads;
                let tokens = 9;
                let width = (hq + 2 * hk) * d;
                let op = rope_op(tokens, heads, dtype)?;
                let qkv = fused(tokens, width, 11, dtype)?;
                let want = qkv.copy()?;
                want.inplace_op1(&op)?;
                let got = qkv.copy()?;
                let params = QkNormRopeParams {
                    qkv: host_ptr(&got),
                    positions: host_ptr(&op.positions),
                    q_weight: host_ptr(&op.q_weight),
                    k_weight: host_ptr(&op.k_weight),
                    inv_freq: host_ptr(&op.inv_freq),
                    tokens: tokens as u32,
                    stride: width as u32,
                    q_heads: hq as u32,
                    kv_heads: hk as u32,
                    head_dim: d as u32,
                    eps: op.eps,
                };
                launch_one(&op.kernel_launch(dtype, tokens)?, &params, &[]);
                let diff = max_diff(&got, &want)?;
                assert!(
                    diff <= tol * 4.0,
                    "qk-norm-rope {heads:?} {dtype:?}: {diff}"
                );
                let untouched = max_diff(
                    &got.narrow(1, (hq + hk) * d, hk * d)?,
                    &qkv.narrow(1, (hq + hk) * d, hk * d)?,
                )?;
                assert_eq!(untouched, 0.0, "V is left alone");
            }
            // The residual add with the next norm, each output form, with and without a delta.
            let (tokens, width) = (5, 96);
            let x = fused(tokens, width, 21, dtype)?;
            let delta = fused(tokens, width, 22, dtype)?;
            let weight =
                Tensor::from_vec(test_data(width, 23), width, &Device::Cpu)?.to_dtype(dtype)?;
            for output in [
                NormOutput::SumAndNormed,
                NormOutput::NormedF32,
                NormOutput::Normed,
            ] {
                for with_delta in [true, false] {
                    let op = AddRmsNorm {
                        weight: weight.clone(),
                        eps: 1e-6,
                        output,
                    };
                    let want = if with_delta {
                        x.apply_op2_no_bwd(&delta, &op)?
                    } else {
                        x.apply_op1_no_bwd(&op)?
                    };
                    let out_dtype = if output == NormOutput::NormedF32 {
                        DType::F32
                    } else {
                        dtype
                    };
                    let mut out = Guarded::new(want.elem_count(), out_dtype.size_in_bytes());
                    let params = AddRmsNormParams {
                        x: host_ptr(&x),
                        delta: if with_delta { host_ptr(&delta) } else { 0 },
                        weight: host_ptr(&weight),
                        out: out.ptr(),
                        tokens: tokens as u32,
                        width: width as u32,
                        eps: 1e-6,
                        mode: output.mode(),
                    };
                    launch_one(&op.kernel_launch(dtype, tokens)?, &params, &[]);
                    let got = out.tensor(out_dtype, want.dims())?;
                    let diff = max_diff(&got, &want)?;
                    let bound = if out_dtype == DType::F32 {
                        1e-4
                    } else {
                        tol * 4.0
                    };
                    assert!(
                        diff <= bound,
                        "add-rms-norm {output:?} delta {with_delta} {dtype:?}: {diff}"
                    );
                }
            }
            // SwiGLU over fused gate/up rows.
            let (tokens, inter) = (7, 40);
            let gu = fused(tokens, 2 * inter, 31, dtype)?;
            let want = gu.apply_op1_no_bwd(&SwiGlu)?;
            let mut out = Guarded::new(tokens * inter, dtype.size_in_bytes());
            let params = SwigluParams {
                gate_up: host_ptr(&gu),
                out: out.ptr(),
                tokens: tokens as u32,
                inter: inter as u32,
            };
            launch_one(&SwiGlu::kernel_launch(dtype, tokens, inter)?, &params, &[]);
            let diff = max_diff(&out.tensor(dtype, &[tokens, inter])?, &want)?;
            assert!(diff <= tol, "swiglu {dtype:?}: {diff}");
        }
        Ok(())
    }
}
