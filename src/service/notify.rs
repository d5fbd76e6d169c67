//! The systemd notify protocol (`sd_notify(3)`), written out: one datagram per message to the
//! socket in `$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace).
//!
//! `READY=1` tells a `Type=notify` unit that start-up is done; `STATUS=` is the line
//! `systemctl status` shows; `WATCHDOG=1` must come at least every `WatchdogSec` or systemd
//! restarts the service. The watchdog pings come from a tokio task: the model threads are OS
//! threads of their own and cannot block it, while a wedged runtime stops the pings, which is
//! what the watchdog is for.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// Where notifications go; every method is a no-op when not under systemd.
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    socket: Option<String>,
}

impl Notifier {
    /// The notifier of this process (`$NOTIFY_SOCKET`).
    pub fn from_env() -> Self {
        Notifier {
            socket: std::env::var("NOTIFY_SOCKET")
                .ok()
                .filter(|s| !s.is_empty()),
        }
    }

    /// A notifier that sends to `socket` (tests).
    pub fn to_socket(socket: impl Into<String>) -> Self {
        Notifier {
            socket: Some(socket.into()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.socket.is_some()
    }

    /// Sends `state` (newline-separated `KEY=value` pairs). Failures are logged, not fatal.
    pub fn notify(&self, state: &str) {
        let Some(path) = &self.socket else {
            return;
        };
        if let Err(e) = send(path, state) {
            tracing::debug!(error = %e, "sd_notify failed");
        }
    }

    /// `READY=1` with a status line.
    pub fn ready(&self, status: &str) {
        self.notify(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// A `STATUS=` line.
    pub fn status(&self, status: &str) {
        self.notify(&format!("STATUS={}", one_line(status)));
    }

    pub fn stopping(&self, status: &str) {
        self.notify(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
    }

    /// `RELOADING=1` with `MONOTONIC_USEC` (which `Type=notify-reload` units require: systemd
    /// matches the message to the reload it asked for by that time); a `READY=1` says the
    /// reload is over.
    pub fn reloading(&self) {
        self.notify(&format!("RELOADING=1\nMONOTONIC_USEC={}", monotonic_usec()));
    }

    /// Sends `line()` as `STATUS=` every `every` when it changed, until `stop` turns true; then
    /// `STOPPING=1` with `last_words()`.
    pub fn spawn_status_updates(
        &self,
        every: Duration,
        mut stop: tokio::sync::watch::Receiver<bool>,
        line: impl Fn() -> String + Send + 'static,
        last_words: impl FnOnce() -> String + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let notifier = self.clone();
        tokio::spawn(async move {
            let mut last = String::new();
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
                let now = line();
                if now != last {
                    notifier.status(&now);
                    last = now;
                }
            }
            notifier.stopping(&last_words());
        })
    }

    /// Pings the watchdog every half `WATCHDOG_USEC` while the runtime runs (when systemd asked
    /// for it and `WATCHDOG_PID`, if set, is this process).
    pub fn spawn_watchdog(&self) -> Option<tokio::task::JoinHandle<()>> {
        let every = watchdog_interval(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
            std::process::id(),
        )?;
        self.socket.as_ref()?;
        let notifier = self.clone();
        tracing::info!(
            every_ms = every.as_millis() as u64,
            "systemd watchdog pings on"
        );
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                notifier.notify("WATCHDOG=1");
            }
        }))
    }
}

/// Half the watchdog timeout, when the watchdog is meant for `pid`.
pub fn watchdog_interval(usec: Option<&str>, for_pid: Option<&str>, pid: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    if let Some(p) = for_pid
        && p.trim().parse::<u32>().ok() != Some(pid)
    {
        return None;
    }
    Some(Duration::from_micros(usec / 2))
}

/// Status text on one line (a newline would start another `KEY=`).
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

fn send(path: &str, state: &str) -> io::Result<()> {
    let socket = UnixDatagram::unbound()?;
    if let Some(name) = path.strip_prefix('@') {
        #[cfg(target_os = "linux")]
        {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            socket.send_to_addr(state.as_bytes(), &addr)?;
            return Ok(());
        }
        #[cfg(not(target_os = "linux"))]
        return Err(io::Error::other(format!(
            "abstract socket {name} needs Linux"
        )));
    }
    socket.send_to(state.as_bytes(), path)?;
    Ok(())
}

/// `CLOCK_MONOTONIC` in microseconds, the clock systemd's `MONOTONIC_USEC` is read on.
pub fn monotonic_usec() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    if rc != 0 {
        return 0;
    }
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let micros = u64::try_from(now.tv_nsec / 1_000).unwrap_or(0);
    secs.saturating_mul(1_000_000).saturating_add(micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_reach_the_socket_one_datagram_each() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let notifier = Notifier::to_socket(path.display().to_string());
        notifier.ready("serving:\nhub connected");
        let mut buf = [0u8; 256];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            "READY=1\nSTATUS=serving: hub connected"
        );
        notifier.status("draining: 2 leases in flight");
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STATUS=draining: 2 leases in flight");
        // Outside systemd nothing is sent and nothing fails.
        Notifier::default().ready("x");
    }

    #[test]
    fn the_watchdog_pings_at_half_its_timeout_for_this_process_only() {
        assert_eq!(
            watchdog_interval(Some("30000000"), None, 7),
            Some(Duration::from_secs(15))
        );
        assert_eq!(
            watchdog_interval(Some("30000000"), Some("7"), 7),
            Some(Duration::from_secs(15))
        );
        assert_eq!(watchdog_interval(Some("30000000"), Some("8"), 7), None);
        assert_eq!(watchdog_interval(None, None, 7), None);
        assert_eq!(watchdog_interval(Some("0"), None, 7), None);
    }
}
