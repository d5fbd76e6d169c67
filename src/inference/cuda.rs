//! Our kernels on a CUDA device, and the hand-offs between the engine's threads there.
//!
//! * **Modules**: `build.rs` compiles each `kernels/*.cu` to a fatbin (SASS for sm_80 and sm_90,
//!   and the card `CUDA_COMPUTE_CAP` names, with PTX for newer cards), embedded here and loaded
//!   once per device, each function looked up once ([`function`]). No JIT on the cards we build
//!   for.
//! * **Launches**: [`launch`] runs a [`KernelLaunch`] with one `#[repr(C)]` parameter block;
//!   [`storage_ptr`], [`tensor_ptr`] and [`alloc`] give the raw addresses it holds.
//! * **Streams**: candle runs each thread on its own per-thread default stream. The batcher
//!   thread uploads a batch through a reused pinned buffer ([`upload_u32`]) on its stream and
//!   records an event; the model thread's stream waits on it ([`wait`]) instead of the upload
//!   queueing behind the batch that is running. The model thread records an event after a batch
//!   and hands the outputs to the finisher thread, whose stream waits on it before copying them
//!   back, so the next batch is launched before this one's results are read.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaFunction, CudaModule, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice,
    PushKernelArg, sys,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Result, Storage, Tensor, bail};

use super::launch::{KernelLaunch, KernelModule};

fn image(module: KernelModule) -> &'static [u8] {
    match module {
        KernelModule::Attention => {
            include_bytes!(concat!(env!("OUT_DIR"), "/packed_attention.fatbin"))
        }
        KernelModule::LayerOps => include_bytes!(concat!(env!("OUT_DIR"), "/layer_ops.fatbin")),
        KernelModule::Pooling => include_bytes!(concat!(env!("OUT_DIR"), "/pool_normalize.fatbin")),
        KernelModule::Cosine => include_bytes!(concat!(env!("OUT_DIR"), "/cosine_matrix.fatbin")),
    }
}

/// Modules loaded per (device, module), and functions looked up per (device, kernel) with the
/// dynamic shared memory each was granted: a launch costs no lookup after the first.
#[derive(Default)]
struct Loaded {
    modules: HashMap<(usize, KernelModule), Arc<CudaModule>>,
    functions: HashMap<(usize, String), (CudaFunction, u32)>,
}

fn loaded() -> std::sync::MutexGuard<'static, Loaded> {
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Kernel `name` of `module` on `dev`, its module loaded on first use; granted at least
/// `shared_bytes` of dynamic shared memory (past 48 KiB a block must ask for it).
fn function_with(
    dev: &CudaDevice,
    module: KernelModule,
    name: &str,
    shared_bytes: u32,
) -> Result<CudaFunction> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let ordinal = ctx.ordinal();
    let mut cache = loaded();
    if let Some((f, granted)) = cache.functions.get(&(ordinal, name.to_string()))
        && (*granted >= shared_bytes || shared_bytes <= 48 * 1024)
    {
        return Ok(f.clone());
    }
    let m = match cache.modules.get(&(ordinal, module)) {
        Some(m) => m.clone(),
        None => {
            let m = ctx
                .load_module(Ptx::from_binary(image(module).to_vec()))
                .w()?;
            cache.modules.insert((ordinal, module), m.clone());
            m
        }
    };
    let f = m.load_function(name).w()?;
    if shared_bytes > 48 * 1024 {
        f.set_attribute(
            sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared_bytes as i32,
        )
        .w()?;
    }
    cache
        .functions
        .insert((ordinal, name.to_string()), (f.clone(), shared_bytes));
    Ok(f)
}

/// Kernel `name` of `module` on `dev`, its module loaded on first use.
pub fn function(dev: &CudaDevice, module: KernelModule, name: &str) -> Result<CudaFunction> {
    function_with(dev, module, name, 0)
}

/// The device's compute capability `(major, minor)`.
pub fn compute_capability(dev: &CudaDevice) -> Result<(i32, i32)> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let major = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .w()?;
    let minor = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .w()?;
    Ok((major, minor))
}

/// Launches `l` on this thread's stream with its one parameter block.
pub fn launch<P: DeviceRepr>(dev: &CudaDevice, l: &KernelLaunch, params: &P) -> Result<()> {
    let func = function_with(dev, l.module, &l.kernel, l.shared_bytes)?;
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(params);
    let cfg = LaunchConfig {
        grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
        block_dim: (l.block, 1, 1),
        shared_mem_bytes: l.shared_bytes,
    };
    // SAFETY: every kernel of ours takes exactly one parameter block, the `#[repr(C)]` twin of
    // its C struct, whose pointers the caller took from live storages of the right sizes.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// The address of element `offset` of a storage.
pub fn storage_ptr(s: &CudaStorage, offset: usize) -> Result<u64> {
    fn at<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
        s: &CudaStorage,
        offset: usize,
    ) -> Result<u64> {
        let slice = s.as_cuda_slice::<T>()?;
        if offset > slice.len() {
            bail!("element {offset} is past a storage of {}", slice.len());
        }
        let stream = s.device().cuda_stream();
        let (ptr, _sync) = slice.device_ptr(&stream);
        Ok(ptr + (offset * std::mem::size_of::<T>()) as u64)
    }
    match s.dtype() {
        DType::F32 => at::<f32>(s, offset),
        DType::BF16 => at::<half::bf16>(s, offset),
        DType::F16 => at::<half::f16>(s, offset),
        DType::U32 => at::<u32>(s, offset),
        other => bail!("our kernels take f32, bf16, f16 and u32, not {other:?}"),
    }
}

/// The address of a contiguous tensor's first element.
pub fn tensor_ptr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Some((start, _)) = layout.contiguous_offsets() else {
        bail!("a kernel input must be contiguous");
    };
    match &*storage {
        Storage::Cuda(s) => storage_ptr(s, start),
        _ => bail!("a kernel input is not on the CUDA device"),
    }
}

/// An uninitialised output of `elems` elements (the kernel writes every one) and its address.
pub fn alloc(dev: &CudaDevice, dtype: DType, elems: usize) -> Result<(CudaStorage, u64)> {
    fn make<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
        dev: &CudaDevice,
        elems: usize,
    ) -> Result<(CudaStorage, u64)> {
        // SAFETY: the launch that follows writes every element before anything reads one.
        let slice = unsafe { dev.alloc::<T>(elems.max(1)) }?;
        let ptr = {
            let stream = dev.cuda_stream();
            let (ptr, _sync) = slice.device_ptr(&stream);
            ptr
        };
        Ok((CudaStorage::wrap_cuda_slice(slice, dev.clone()), ptr))
    }
    match dtype {
        DType::F32 => make::<f32>(dev, elems),
        DType::BF16 => make::<half::bf16>(dev, elems),
        DType::F16 => make::<half::f16>(dev, elems),
        other => bail!("our kernels write f32, bf16 and f16, not {other:?}"),
    }
}

/// A point in this thread's stream (work enqueued so far).
pub fn record(dev: &CudaDevice) -> Result<Arc<CudaEvent>> {
    Ok(Arc::new(dev.cuda_stream().record_event(None).w()?))
}

/// This thread's stream waits for `event` (recorded on another thread's stream).
pub fn wait(dev: &CudaDevice, event: &CudaEvent) -> Result<()> {
    dev.cuda_stream().wait(event).w()
}

/// One thread's staging buffer for uploads: pinned, reused, grown when a batch needs more.
#[derive(Default)]
struct Staging {
    buffer: Option<PinnedHostSlice<u32>>,
    /// The last copy out of `buffer`: it must land before the buffer is written again.
    copied: Option<Arc<CudaEvent>>,
}

thread_local! {
    static STAGING: RefCell<Staging> = RefCell::new(Staging::default());
}

/// Uploads `parts` as one copy from this thread's pinned buffer into one device allocation;
/// returns a tensor per part (views of it) and the event the copy completes at.
pub fn upload_u32(dev: &CudaDevice, parts: &[&[u32]]) -> Result<(Vec<Tensor>, Arc<CudaEvent>)> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    STAGING.with(|cell| {
        let mut staging = cell.borrow_mut();
        if let Some(copied) = staging.copied.take() {
            copied.synchronize().w()?;
        }
        if staging.buffer.as_ref().is_none_or(|b| b.len() < total) {
            let ctx = dev.cuda_stream().context().clone();
            let len = total.max(1).next_power_of_two().max(1 << 16);
            // SAFETY: written below before any copy reads it.
            staging.buffer = Some(unsafe { ctx.alloc_pinned::<u32>(len) }.w()?);
        }
        let Some(buffer) = staging.buffer.as_mut() else {
            bail!("no staging buffer");
        };
        let host = buffer.as_mut_slice().w()?;
        let mut at = 0;
        for p in parts {
            host[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        let stream = dev.cuda_stream();
        // SAFETY: every element is written by the copy just below.
        let mut device = unsafe { stream.alloc::<u32>(total.max(1)) }.w()?;
        stream.memcpy_htod(&host[..total], &mut device).w()?;
        let copied = record(dev)?;
        staging.copied = Some(copied.clone());
        let whole = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(device, dev.clone())),
            total.max(1),
            BackpropOp::none(),
            false,
        );
        let mut tensors = Vec::with_capacity(parts.len());
        let mut at = 0;
        for p in parts {
            tensors.push(whole.narrow(0, at, p.len())?);
            at += p.len();
        }
        Ok((tensors, copied))
    })
}
