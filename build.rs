//! Compiles our CUDA kernels (`kernels/*.cu`) with `nvcc`, only for the `cuda` feature, into one
//! fatbin each: SASS for sm_80 (A100) and sm_90 (H100/H200), and for `CUDA_COMPUTE_CAP` when it
//! names another card, plus PTX the driver can JIT for newer ones (compute_80 for the attention
//! kernel, which needs bf16 tensor cores and cp.async; compute_75 for the rest). The fatbins are
//! embedded in the binary and loaded by `inference::cuda`. A CPU build needs nothing from here.

use std::path::PathBuf;
use std::process::Command;

/// (source stem, the oldest architecture it runs on).
const KERNELS: [(&str, u32); 4] = [
    ("packed_attention", 80),
    ("layer_ops", 75),
    ("pool_normalize", 75),
    ("cosine_matrix", 75),
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels/fantom.cuh");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    for (k, _) in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap: Option<u32> = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|c| c.trim().replace('.', ""))
        .and_then(|c| c.parse().ok());
    for (k, oldest) in KERNELS {
        let mut sass = vec![80u32, 90];
        if let Some(c) = cap.filter(|c| *c >= oldest && !sass.contains(c)) {
            sass.push(c);
        }
        let mut cmd = Command::new(&nvcc);
        cmd.args(["--fatbin", "-O3", "-std=c++17"]);
        for arch in &sass {
            cmd.arg(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
        }
        cmd.arg(format!(
            "-gencode=arch=compute_{oldest},code=compute_{oldest}"
        ));
        let fatbin = out.join(format!("{k}.fatbin"));
        let status = cmd
            .arg("-o")
            .arg(&fatbin)
            .arg(format!("kernels/{k}.cu"))
            .status()
            .unwrap_or_else(|e| {
                panic!("the cuda feature needs nvcc ({nvcc}): {e}; see docs/cuda-build.md")
            });
        assert!(status.success(), "nvcc failed on kernels/{k}.cu");
    }
}
