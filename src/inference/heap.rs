//! Keeping freed tensor memory in the process heap (glibc).
//!
//! Every candle op on the CPU allocates its output. glibc serves large blocks with `mmap` and
//! returns them with `munmap` on free, so each op of each layer faulted fresh zeroed pages in:
//! profiling showed page faults and page clearing at 10–15% of CPU inference time. Raising the
//! mmap threshold to its maximum and never trimming keeps those blocks in the heap for reuse.
//! The cost is that the heap keeps its high-water mark, which is what a long-running inference
//! process wants anyway. Called once when a CPU engine starts; a no-op off glibc.

/// Tunes the allocator for repeated large, short-lived tensors (idempotent).
pub fn keep_tensor_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            const M_TRIM_THRESHOLD: i32 = -1;
            const M_MMAP_THRESHOLD: i32 = -3;
            unsafe extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            // SAFETY: mallopt only changes glibc malloc parameters; both values are in range
            // (32 MiB is glibc's largest mmap threshold on 64-bit).
            let ok = unsafe {
                mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, i32::MAX) == 1
            };
            if !ok {
                tracing::debug!("mallopt refused the heap settings; keeping glibc's defaults");
            }
        });
    }
}
