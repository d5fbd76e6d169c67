//! Compiles our CUDA kernels (`kernels/*.cu`) to PTX with `nvcc`, only for the `cuda` feature.
//! The PTX is embedded in the binary (`include_str!` from `OUT_DIR`) and loaded through cudarc
//! by `inference::kernels`. The target is `compute_$CUDA_COMPUTE_CAP` (default 80); the driver
//! JITs the PTX for the card it runs on. A CPU build needs nothing from here.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 2] = ["pool_normalize", "cosine_matrix"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|c| c.trim().replace('.', ""))
        .filter(|c| !c.is_empty() && c.chars().all(|ch| ch.is_ascii_digit()))
        .unwrap_or_else(|| "80".into());
    for k in KERNELS {
        let ptx = out.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(&ptx)
            .arg(format!("kernels/{k}.cu"))
            .status()
            .unwrap_or_else(|e| {
                panic!("the cuda feature needs nvcc ({nvcc}): {e}; see docs/cuda-build.md")
            });
        assert!(status.success(), "nvcc failed on kernels/{k}.cu");
    }
}
