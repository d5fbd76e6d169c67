//! The host this process runs on: its name, as the kernel knows it (an agent's `hello`, the
//! holder a locked state dir names).

/// The host's name, from the kernel (`HOSTNAME` if that cannot be read).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".into())
}
