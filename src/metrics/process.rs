//! The standard `process_*` series (the names every Prometheus client uses: CPU seconds, resident
//! and virtual memory, open and maximum file descriptors, threads, start time), read from
//! `/proc/self` at scrape time, since the Rust client library has no process collector. Outside
//! Linux there is no `/proc` and the family list is empty.

use std::fmt;

use super::{Families, Labels};

/// Writes the process families (Linux); a file that cannot be read leaves its series out.
pub fn encode(families: &mut Families) -> fmt::Result {
    #[cfg(target_os = "linux")]
    if let Some(p) = linux::read() {
        let one = |v: f64| [(Labels::new(), v)];
        families.counter(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            one(p.cpu_seconds),
        )?;
        families.gauge(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            one(p.resident_bytes),
        )?;
        families.gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            one(p.virtual_bytes),
        )?;
        families.gauge(
            "process_open_fds",
            "Number of open file descriptors.",
            one(p.open_fds),
        )?;
        if let Some(max) = p.max_fds {
            families.gauge(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                one(max),
            )?;
        }
        families.gauge("process_threads", "Number of OS threads.", one(p.threads))?;
        if let Some(start) = p.start_time_seconds {
            families.gauge(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                one(start),
            )?;
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = families;
    Ok(())
}

#[cfg(target_os = "linux")]
mod linux {
    pub struct Process {
        pub cpu_seconds: f64,
        pub resident_bytes: f64,
        pub virtual_bytes: f64,
        pub open_fds: f64,
        pub max_fds: Option<f64>,
        pub threads: f64,
        pub start_time_seconds: Option<f64>,
    }

    pub fn read() -> Option<Process> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        parse(&stat, system_boot_seconds(), clock_ticks(), page_bytes())
    }

    /// `/proc/self/stat`'s fields after the command name (which may hold spaces and parens).
    fn parse(stat: &str, boot_s: Option<f64>, ticks: f64, page: f64) -> Option<Process> {
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // Field n of proc(5) is at n - 3 here: the pid and the name are gone.
        let num = |n: usize| fields.get(n - 3)?.parse::<f64>().ok();
        let (utime, stime) = (num(14)?, num(15)?);
        let open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()) as f64;
        Some(Process {
            cpu_seconds: (utime + stime) / ticks,
            resident_bytes: num(24)? * page,
            virtual_bytes: num(23)?,
            open_fds,
            max_fds: max_fds(),
            threads: num(20)?,
            start_time_seconds: boot_s.zip(num(22)).map(|(b, t)| b + t / ticks),
        })
    }

    fn clock_ticks() -> f64 {
        // SAFETY: sysconf reads a constant of the running system.
        let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if t > 0 { t as f64 } else { 100.0 }
    }

    fn page_bytes() -> f64 {
        // SAFETY: as above.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 { p as f64 } else { 4096.0 }
    }

    fn max_fds() -> Option<f64> {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct we own.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
        (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as f64)
    }

    /// The boot time (`btime` of `/proc/stat`), seconds since the epoch.
    fn system_boot_seconds() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        stat.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse().ok())
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_name_with_spaces_and_parens_does_not_shift_the_fields() {
            let stat = "42 (a b) c) S 1 2 3 4 5 6 7 8 9 10 300 200 0 0 20 0 7 0 5000 8192000 250 0";
            let p = super::parse(stat, Some(1_000.0), 100.0, 4096.0).unwrap();
            assert_eq!(p.cpu_seconds, 5.0);
            assert_eq!(p.threads, 7.0);
            assert_eq!(p.virtual_bytes, 8_192_000.0);
            assert_eq!(p.resident_bytes, 250.0 * 4096.0);
            assert_eq!(p.start_time_seconds, Some(1_050.0));
        }
    }
}
