//! A `fantom-sidecar hub` process for the benches that run the real binary: started from a
//! prepared command with its output piped, ready when it says where it listens.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

/// Runs `cmd` (a `hub` command line with `--log-format json`), quiet but for warnings, and
/// waits for its `listening` line: the process and the hub's address.
pub fn spawn_hub(mut cmd: Command) -> (Child, SocketAddr) {
    let mut child = cmd
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the hub starts");
    let stdout = child.stdout.take().expect("its stdout");
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
            && v["listening"] == "hub"
            && let Some(addr) = v["addr"].as_str().and_then(|a| a.parse().ok())
        {
            return (child, addr);
        }
    }
    let _ = child.kill();
    let status = child.wait();
    panic!("the hub exited before it listened: {status:?}");
}
