//! Running under systemd, with real processes: the agent and the hub speak the notify protocol
//! to a datagram socket the test binds as `NOTIFY_SOCKET` (`STATUS=` while starting, `READY=1`
//! once started, `WATCHDOG=1` pings, `RELOADING=1` and a `reloaded: …` line on SIGHUP,
//! `STOPPING=1` on SIGTERM), and take their tokens from `$CREDENTIALS_DIRECTORY`.

use std::path::{Path, PathBuf};

use tokio::net::UnixDatagram;

use crate::fantom_master::TestMaster;
use crate::relay::{AGENT_URL, opts, relay_toml};
use crate::support::*;

/// The test's end of `NOTIFY_SOCKET`: every datagram received, in order.
struct NotifySocket {
    socket: UnixDatagram,
    path: PathBuf,
    seen: Vec<String>,
}

impl NotifySocket {
    fn bind(dir: &Path) -> NotifySocket {
        let path = dir.join("notify.sock");
        NotifySocket {
            socket: UnixDatagram::bind(&path).expect("bind the notify socket"),
            path,
            seen: Vec::new(),
        }
    }

    fn env(&self) -> String {
        self.path.display().to_string()
    }

    /// Receives until a message satisfies `pred` (bounded by [`PATIENCE`]); returns it.
    async fn until(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tokio::time::timeout(PATIENCE, self.socket.recv(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("no notify message for: {what}; seen {:?}", self.seen))
                .expect("recv");
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            self.seen.push(msg.clone());
            if pred(&msg) {
                return msg;
            }
        }
    }

    /// Sends SIGHUP to `proc` and returns the reload's outcome: the `READY=1` message that
    /// follows its `RELOADING=1` (with the `reloaded: …` or `reload failed …` line).
    async fn reload(&mut self, proc: &Proc) -> String {
        let before = fantom_sidecar::service::notify::monotonic_usec();
        proc.signal("HUP");
        let reloading = self
            .until("RELOADING=1", |m| m.starts_with("RELOADING=1"))
            .await;
        // Type=notify-reload needs MONOTONIC_USEC: the time the reload began, on the clock
        // this process reads too.
        let usec: u64 = reloading
            .lines()
            .find_map(|l| l.strip_prefix("MONOTONIC_USEC="))
            .unwrap_or_else(|| panic!("no MONOTONIC_USEC in {reloading:?}"))
            .parse()
            .unwrap();
        let after = fantom_sidecar::service::notify::monotonic_usec();
        assert!((before..=after).contains(&usec), "{before} {usec} {after}");
        self.until("the reload's outcome", |m| m.starts_with("READY=1"))
            .await
    }

    /// SIGTERM to `proc`: it exits cleanly, and `STOPPING=1` came.
    async fn stop(&mut self, mut proc: Proc) {
        let exit = tokio::task::spawn_blocking(move || proc.terminate())
            .await
            .unwrap();
        assert!(exit.success(), "{exit:?}");
        self.until("STOPPING=1", |m| m.starts_with("STOPPING=1"))
            .await;
    }

    /// The position of the first message containing `needle`.
    fn position(&self, needle: &str) -> Option<usize> {
        self.seen.iter().position(|m| m.contains(needle))
    }
}

fn credentials(dir: &Path, entries: &[(&str, &str)]) -> PathBuf {
    let creds = dir.join("credentials");
    std::fs::create_dir_all(&creds).unwrap();
    for (name, value) in entries {
        std::fs::write(creds.join(name), format!("{value}\n")).unwrap();
    }
    creds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_notifies_systemd_reloads_on_sighup_and_drains_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut notify = NotifySocket::bind(dir.path());
    let token = format!("http-token-{}", std::process::id());
    let creds = credentials(dir.path(), &[("http-token", &token)]);
    let first = TestMaster::start(opts()).await;
    let config = dir.path().join("svc.toml");
    let write_config = |masters: &[(&str, u16)], top: &str| {
        let body = format!(
            "agent_id = \"svc\"\ndrain_timeout_s = 60\n{}",
            relay_toml(masters, top)
        );
        std::fs::write(&config, body).unwrap();
    };
    write_config(&[(first.http_url.as_str(), first.ws_port)], "");
    let (notify_env, creds_env) = (notify.env(), creds.display().to_string());
    let args = agent_args(&config);
    let envs = [
        ("NOTIFY_SOCKET", notify_env.as_str()),
        ("CREDENTIALS_DIRECTORY", creds_env.as_str()),
        ("WATCHDOG_USEC", "1000000"),
    ];
    let agent = Proc::start(&args, &envs, &dir.path().join("svc.log"), "agent");

    // Started: models first, READY after the first dial, then watchdog pings.
    let ready = notify.until("READY=1", |m| m.contains("READY=1")).await;
    assert!(ready.contains("masters registered"), "{ready}");
    let loading = notify
        .position("STATUS=loading models")
        .expect("a loading status");
    assert!(loading < notify.position("READY=1").unwrap());
    notify.until("a watchdog ping", |m| m == "WATCHDOG=1").await;
    first.wait_registered(AGENT_URL).await;

    // The credential is the bearer token of the HTTP port.
    let http = reqwest::Client::new();
    let status = |token: Option<&str>| {
        let mut request = http.get(agent.url("/api/status"));
        if let Some(t) = token {
            request = request.bearer_auth(t);
        }
        request.send()
    };
    assert_eq!(status(None).await.unwrap().status(), 401);
    assert_eq!(status(Some(&token)).await.unwrap().status(), 200);

    // SIGHUP with a second master: it is dialled, and the reload says what it applied.
    let second = TestMaster::start(opts()).await;
    let both = [
        (first.http_url.as_str(), first.ws_port),
        (second.http_url.as_str(), second.ws_port),
    ];
    write_config(&both, "");
    let reloaded = notify.reload(&agent).await;
    assert!(
        reloaded.contains("STATUS=reloaded: masters +1 -0 ~0"),
        "{reloaded}"
    );
    second.wait_registered(AGENT_URL).await;

    // What cannot change under a running agent is named, and the rest keeps running.
    write_config(&both, "cloud_pipeline_depth = 3");
    let line = notify.reload(&agent).await;
    assert!(
        line.contains("needs restart: cloud_pipeline_depth"),
        "{line}"
    );
    assert_eq!(status(Some(&token)).await.unwrap().status(), 200);

    // SIGTERM: STOPPING, then a clean exit.
    notify.stop(agent).await;
    let log = std::fs::read_to_string(dir.path().join("svc.log")).unwrap();
    assert!(!log.contains(&token), "the token reached the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_notifies_ready_and_takes_its_tokens_from_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let mut notify = NotifySocket::bind(dir.path());
    let admin = format!("admin-credential-{}", std::process::id());
    let creds = credentials(
        dir.path(),
        &[("admin-token", &admin), ("fleet-token", "fleet-credential")],
    );
    let state = dir.path().join("state");
    let config = dir.path().join("hub.toml");
    std::fs::write(&config, "listen = \"127.0.0.1:0\"\nlease_s = 120\n").unwrap();
    let args: Vec<String> = vec![
        "hub".into(),
        "--config".into(),
        config.display().to_string(),
        "--state-dir".into(),
        state.display().to_string(),
    ];
    let (notify_env, creds_env) = (notify.env(), creds.display().to_string());
    let envs = [
        ("NOTIFY_SOCKET", notify_env.as_str()),
        ("CREDENTIALS_DIRECTORY", creds_env.as_str()),
    ];
    let hub = Proc::start(&args, &envs, &dir.path().join("hub.log"), "hub");
    let ready = notify.until("READY=1", |m| m.contains("READY=1")).await;
    assert!(
        ready.contains("STATUS=serving: 0 agents, 0 items queued"),
        "{ready}"
    );
    assert!(notify.position("STATUS=starting").unwrap() < notify.position("READY=1").unwrap());

    let admin_status = || {
        reqwest::Client::new()
            .get(hub.url("/admin/status"))
            .bearer_auth(&admin)
            .send()
    };
    let r = admin_status().await.unwrap();
    assert_eq!(r.status(), 200, "the admin credential is the admin token");
    assert!(
        !state.join("admin.token").exists(),
        "no token is generated when systemd passes one"
    );

    // SIGHUP: the lease applies at once, a new listen address needs a restart.
    std::fs::write(&config, "listen = \"127.0.0.1:1\"\nlease_s = 30\n").unwrap();
    let line = notify.reload(&hub).await;
    assert!(
        line.contains("reloaded: role timings; needs restart: listen"),
        "{line}"
    );
    std::fs::write(&config, "lease_s = [").unwrap();
    let line = notify.reload(&hub).await;
    assert!(line.contains("the running config stays"), "{line}");
    let r = admin_status().await.unwrap();
    assert_eq!(r.status(), 200, "the hub still serves after a bad reload");
    notify.stop(hub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_notifies_too_and_reloads_its_hub_settings() {
    let dir = tempfile::tempdir().unwrap();
    let mut notify = NotifySocket::bind(dir.path());
    let config = dir.path().join("hub.toml");
    std::fs::write(&config, "request_timeout_s = 600\n").unwrap();
    let state = dir.path().join("state");
    let args: Vec<String> = vec![
        "serve".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--config".into(),
        config.display().to_string(),
        "--state-dir".into(),
        state.display().to_string(),
    ];
    let notify_env = notify.env();
    let envs = [("NOTIFY_SOCKET", notify_env.as_str())];
    let serve = Proc::start(&args, &envs, &dir.path().join("serve.log"), "hub");
    let ready = notify.until("READY=1", |m| m.contains("READY=1")).await;
    assert!(ready.contains("STATUS=serving:"), "{ready}");
    std::fs::write(&config, "request_timeout_s = 60\n").unwrap();
    let line = notify.reload(&serve).await;
    assert!(line.contains("reloaded: role timings"), "{line}");
    notify.stop(serve).await;
}
