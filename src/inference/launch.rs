//! A launch of one of our CUDA kernels as plain data: which module and kernel, the grid, the
//! block and the dynamic shared memory. Each op computes its launch once (`kernel_launch` beside
//! the op); the CUDA body hands it to the driver (`inference::cuda`) and, in CI, the emulator
//! runs the same launch over the kernel's own source (`inference::emulator`), so the host side
//! of every launch is checked without a GPU.

/// Our kernel sources, one PTX/SASS module each (`kernels/*.cu`, built by `build.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelModule {
    /// `kernels/packed_attention.cu`.
    Attention,
    /// `kernels/layer_ops.cu`.
    LayerOps,
    /// `kernels/pool_normalize.cu`.
    Pooling,
    /// `kernels/cosine_matrix.cu`.
    Cosine,
}

impl KernelModule {
    /// The source file's stem under `kernels/`.
    pub fn source(self) -> &'static str {
        match self {
            KernelModule::Attention => "packed_attention",
            KernelModule::LayerOps => "layer_ops",
            KernelModule::Pooling => "pool_normalize",
            KernelModule::Cosine => "cosine_matrix",
        }
    }
}

/// One launch: `grid` blocks of `block` threads with `shared_bytes` of dynamic shared memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelLaunch {
    pub module: KernelModule,
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: u32,
    pub shared_bytes: u32,
}

/// A grid dimension from a count, checked against the driver's limit for that dimension.
pub fn grid_dim(count: usize, what: &str, max: u32) -> candle_core::Result<u32> {
    match u32::try_from(count) {
        Ok(n) if n >= 1 && n <= max => Ok(n),
        _ => candle_core::bail!("{what}: {count} is outside 1..={max} for a kernel grid"),
    }
}

/// The most blocks along grid x.
pub const MAX_GRID_X: u32 = i32::MAX as u32;
/// The most blocks along grid y or z.
pub const MAX_GRID_YZ: u32 = 65_535;
