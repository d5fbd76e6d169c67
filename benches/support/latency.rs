//! Latency summaries for the benches' summaries of record: the nearest-rank percentile of
//! sorted milliseconds, and a run's runtime (two workers, as the machine's two cores).

/// The `q` quantile (0..=1) of `sorted` (ascending), nearest rank.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// The multi-threaded runtime a bench runs on.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}
