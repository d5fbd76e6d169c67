//! The clients people already use, against the fleet: the official `openai` Python SDK
//! streaming a chat through the hub (chunk by chunk as the upstream sends them), and raising
//! when the stream is cut. The SDK (PyPI `openai`) lives in `.cache/pypi-clients`, where
//! `.ci/run` (or the first test run) installs it; `FANTOM_TEST_PY_CLIENTS` points elsewhere.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::liveness::chat_fleet;
use crate::support::*;

/// The version of the SDK tested (`.ci/run` installs the same).
const OPENAI_SDK: &str = "openai==3.57.0";

/// Where the SDK is: `FANTOM_TEST_PY_CLIENTS`, else `.cache/pypi-clients` in the checkout,
/// where `.ci/run` installs it. When missing there, it is installed once with pip (PyPI is
/// reachable wherever the tests run); failing that, the test fails saying what to do.
fn py_clients() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::var_os("FANTOM_TEST_PY_CLIENTS").map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/pypi-clients"),
            PathBuf::from,
        );
        if !dir.join("openai").is_dir() {
            let status = Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
                .args(["--no-warn-conflicts", "--target"])
                .arg(&dir)
                .arg(OPENAI_SDK)
                .status();
            assert!(
                matches!(status, Ok(s) if s.success()) && dir.join("openai").is_dir(),
                "the openai SDK is missing: run `python3 -m pip install --target {} {OPENAI_SDK}` or set FANTOM_TEST_PY_CLIENTS (pip said: {status:?})",
                dir.display()
            );
        }
        dir
    })
    .clone()
}

/// The SDK's script on a thread: its JSON lines arrive on the receiver as it prints them.
fn stream_with_sdk(base_url: &str, text: &str) -> std::sync::mpsc::Receiver<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_stream.py");
    let mut child = Command::new("python3")
        .arg(script)
        .args([base_url, text])
        .env("PYTHONPATH", py_clients())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let stdout = child.stdout.take().expect("its stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
        let _ = child.wait();
    });
    rx
}

fn next(rx: &std::sync::mpsc::Receiver<Value>) -> Value {
    rx.recv_timeout(PATIENCE)
        .expect("the SDK said something in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_streams_a_chat_and_raises_when_the_stream_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (up, hub, mut agent) = chat_fleet(dir.path(), "sdk").await;
    let base = hub.url("/v1");

    // Chunk by chunk: the SDK has the first piece while the upstream holds the rest.
    up.state.set_stream_hold(true);
    let rx = stream_with_sdk(&base, "one two three");
    assert_eq!(next(&rx)["piece"], "echo:");
    up.state.set_stream_hold(false);
    let mut pieces = vec!["echo:".to_string()];
    loop {
        let line = next(&rx);
        if line["done"] == true {
            break;
        }
        pieces.push(line["piece"].as_str().expect("a piece").to_string());
    }
    assert_eq!(pieces.concat(), "echo: one two three");

    // Cut: the agent dies after the first piece; the SDK raises with the hub's code.
    up.state.set_stream_hold(true);
    let rx = stream_with_sdk(&base, "cut short");
    assert_eq!(next(&rx)["piece"], "echo:");
    agent.kill();
    let end = next(&rx);
    up.state.set_stream_hold(false);
    assert_eq!(end["code"], "stream_cut", "{end}");
}
