//! Choosing the device and the dtype a model runs in.
//!
//! `auto` takes the first CUDA device when the binary was built with the `cuda` feature and a
//! GPU answers, else the CPU. The CPU runs f32 by default (candle's CPU kernels are fastest and
//! exact there; our fused CPU kernels are f32); bf16 and f16 on the CPU run the GPU's code path
//! (padded attention, candle's generic ops) so CI can check the math a GPU runs, slowly. CUDA
//! defaults to bf16, the dtype Qwen3 is trained in (f16 overflows on some Qwen3 inputs), with
//! f16 and f32 on request.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};

/// `--device auto|cpu|cuda[:N]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(format!(
                    "unknown device `{s}` (expected auto, cpu, cuda or cuda:N)"
                )),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// `--dtype auto|f32|f16|bf16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DTypeSpec {
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
}

impl FromStr for DTypeSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "f32" | "float32" => Ok(Self::F32),
            "f16" | "float16" => Ok(Self::F16),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            _ => Err(format!(
                "unknown dtype `{s}` (expected auto, f32, f16 or bf16)"
            )),
        }
    }
}

/// Why no device could be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "this binary was built without the `cuda` feature; rebuild with `cargo build --release --features cuda` (docs/cuda-build.md) or use --device cpu"
    )]
    NoCudaBuild,
    #[error("cannot open CUDA device {index}: {message}")]
    Cuda { index: usize, message: String },
}

/// Opens the device and picks the dtype.
pub fn open(device: DeviceSpec, dtype: DTypeSpec) -> Result<(Device, DType), DeviceError> {
    let dev = match device {
        DeviceSpec::Cpu => Device::Cpu,
        DeviceSpec::Auto => {
            if candle_core::utils::cuda_is_available() {
                match Device::new_cuda(0) {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::warn!(error = %e, "no usable CUDA device; running on the CPU");
                        Device::Cpu
                    }
                }
            } else {
                Device::Cpu
            }
        }
        DeviceSpec::Cuda(index) => {
            if !candle_core::utils::cuda_is_available() {
                return Err(DeviceError::NoCudaBuild);
            }
            Device::new_cuda(index).map_err(|e| DeviceError::Cuda {
                index,
                message: e.to_string(),
            })?
        }
    };
    let dt = match (dev.is_cpu(), dtype) {
        (true, DTypeSpec::Auto) | (_, DTypeSpec::F32) => DType::F32,
        (false, DTypeSpec::Auto) | (_, DTypeSpec::Bf16) => DType::BF16,
        (_, DTypeSpec::F16) => DType::F16,
    };
    if dev.is_cpu() && dt != DType::F32 {
        tracing::warn!(dtype = ?dt, "a half-precision dtype on the CPU runs the GPU's code path, slowly: for checking it, not for serving");
    }
    Ok((dev, dt))
}

/// A device's memory now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memory {
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// The device's memory now: the host's available and total memory for the CPU
/// (`/proc/meminfo`), the card's free and total for a CUDA device; `None` where it cannot tell.
pub fn memory(dev: &Device) -> Option<Memory> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = dev {
        let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
        return Some(Memory {
            free_bytes: free as u64,
            total_bytes: total as u64,
        });
    }
    if !dev.is_cpu() {
        return None;
    }
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
    };
    Some(Memory {
        free_bytes: kib("MemAvailable:")? * 1024,
        total_bytes: kib("MemTotal:")? * 1024,
    })
}

/// A short name for reports: `cpu`, `cuda:0`.
pub fn describe(dev: &Device) -> String {
    match dev.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_devices() {
        assert_eq!("auto".parse::<DeviceSpec>().unwrap(), DeviceSpec::Auto);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        assert!("cuda:x".parse::<DeviceSpec>().is_err());
        assert!("gpu".parse::<DeviceSpec>().is_err());
    }

    #[test]
    fn cpu_is_f32_unless_a_half_dtype_is_asked() {
        let (dev, dt) = open(DeviceSpec::Cpu, DTypeSpec::Auto).unwrap();
        assert!(dev.is_cpu());
        assert_eq!(dt, DType::F32);
        assert_eq!(
            open(DeviceSpec::Cpu, DTypeSpec::Bf16).unwrap().1,
            DType::BF16
        );
        assert_eq!(open(DeviceSpec::Cpu, DTypeSpec::F16).unwrap().1, DType::F16);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_says_how_to_build() {
        let err = open(DeviceSpec::Cuda(0), DTypeSpec::Auto).unwrap_err();
        assert!(err.to_string().contains("--features cuda"), "{err}");
        let (dev, _) = open(DeviceSpec::Auto, DTypeSpec::Auto).unwrap();
        assert!(dev.is_cpu());
    }
}
