//! The GPU's code paths on the CPU: bf16 and f16 through packed attention (what a CUDA device
//! runs by default: the CPU body widens the half inputs and rounds the softmax weights as the
//! CUDA kernel does, with the fused layer ops in the half dtype) and through padded attention
//! (the fallback where the kernel does not run: candle's generic ops, the gather/scatter
//! indexes and masks), against the f32 packed path, for the tiny Qwen3 embedder and reranker
//! and for MiniLM. Embeddings (MRL too) keep a cosine of at least 0.999, reranker probabilities
//! stay within 2e-2, and no number is NaN or infinite, on the gate's probe texts, inputs of
//! exactly the max length, and batches that mix one-token rows with max-length ones.

use fantom_sidecar::hub::gate::measure::probe_texts;
use fantom_sidecar::inference::tokenize::InputTokenizer;
use fantom_sidecar::inference::{
    AttentionMode, EmbedOptions, Engine, EngineConfig, RerankOptions, Truncation,
};
use fantom_sidecar::model_spec::Task;

use crate::support::*;

const HALF: [&str; 2] = ["bf16", "f16"];
const MIN_COSINE: f64 = 0.999;
const MAX_PROBABILITY_DIFF: f32 = 2e-2;

/// A GPU path on the CPU in `dtype`: `Packed` (a CUDA device's default in bf16/f16) or
/// `Padded` (its fallback).
fn gpu_path(dtype: &str, attention: AttentionMode) -> EngineConfig {
    EngineConfig {
        device: "cpu".parse().unwrap(),
        dtype: dtype.parse().unwrap(),
        attention,
        ..EngineConfig::default()
    }
}

/// Each half dtype through each GPU path: `(name, config)`.
fn half_paths() -> Vec<(String, EngineConfig)> {
    HALF.iter()
        .flat_map(|d| {
            [AttentionMode::Packed, AttentionMode::Padded]
                .map(|a| (format!("{d} {}", a.name()), gpu_path(d, a)))
        })
        .collect()
}

/// The gate's probe texts, then one-token rows between texts longer than the model takes
/// (truncated to exactly its max length), so one batch mixes both.
fn inputs() -> Vec<String> {
    let long = probe_texts().last().unwrap().repeat(4);
    let mut texts = probe_texts();
    for _ in 0..3 {
        texts.push("x".into());
        texts.push(long.clone());
    }
    texts
}

/// Asserts the longest input really is cut at the model's max length.
fn assert_max_length(tokenizer: &std::path::Path, max_tokens: usize, texts: &[String]) {
    let tok = InputTokenizer::load(tokenizer, max_tokens, Truncation::Truncate).unwrap();
    let lengths: Vec<usize> = tok
        .encode_texts(texts.to_vec())
        .unwrap()
        .iter()
        .map(|t| t.ids.len())
        .collect();
    assert_eq!(lengths.iter().max(), Some(&max_tokens), "{lengths:?}");
    // One word piece and the model's special tokens (BERT: [CLS] x [SEP]).
    assert!(lengths.iter().min().is_some_and(|m| *m <= 3), "{lengths:?}");
}

fn finite(vectors: &[Vec<f32>], what: &str) {
    for (i, v) in vectors.iter().enumerate() {
        assert!(v.iter().all(|x| x.is_finite()), "{what} {i}: not finite");
    }
}

/// Every vector of `got` at least [`MIN_COSINE`] to its twin in `want`; the lowest cosine.
fn close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) -> f64 {
    finite(got, what);
    assert_eq!(got.len(), want.len(), "{what}");
    let mut lowest = 1.0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let c = cosine(g, w);
        assert!(c >= MIN_COSINE, "{what} {i}: cosine {c}");
        lowest = lowest.min(c);
    }
    lowest
}

/// Embeddings as documents, as queries and truncated (MRL), in f32 packed and in each half dtype.
async fn embedder_holds(
    reference: Engine,
    tokenizer: &std::path::Path,
    make: impl AsyncFn(EngineConfig) -> Engine,
    mrl: usize,
) {
    let texts = inputs();
    assert_max_length(tokenizer, reference.info().max_tokens, &texts);
    let mrl = EmbedOptions {
        dimensions: Some(mrl),
        ..EmbedOptions::default()
    };
    let query = EmbedOptions {
        is_query: true,
        ..EmbedOptions::default()
    };
    let options = [
        ("document", EmbedOptions::default()),
        ("mrl", mrl),
        ("query", query),
    ];
    let mut want = Vec::new();
    for (_, opts) in &options {
        want.push(reference.embed(texts.clone(), opts.clone()).await.unwrap());
    }
    for (path, cfg) in half_paths() {
        let attention = cfg.attention;
        let engine = make(cfg).await;
        assert!(path.starts_with(&engine.info().dtype), "{path}");
        assert_eq!(engine.info().attention, attention.name());
        for ((name, opts), want) in options.iter().zip(&want) {
            let got = engine.embed(texts.clone(), opts.clone()).await.unwrap();
            let lowest = close(&got, want, &format!("{path} {name}"));
            println!("{path} {name}: lowest cosine {lowest:.6}");
        }
    }
}

#[tokio::test]
async fn the_tiny_qwen3_embedder_in_bf16_and_f16_matches_f32() {
    let reference = qwen3_engine("tiny-qwen3-embedding", Task::Embed, cpu()).await;
    embedder_holds(
        reference,
        &fixtures().join("qwen3/tiny-qwen3-embedding/tokenizer.json"),
        async |cfg| qwen3_engine("tiny-qwen3-embedding", Task::Embed, cfg).await,
        32,
    )
    .await;
}

#[tokio::test]
async fn minilm_in_bf16_and_f16_matches_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = minilm_engine(tmp.path(), cpu()).await;
    embedder_holds(
        reference,
        &minilm_dir().join("tokenizer.json"),
        async |cfg| {
            let tmp = tempfile::tempdir().unwrap();
            minilm_engine(tmp.path(), cfg).await
        },
        128,
    )
    .await;
}

#[tokio::test]
async fn the_tiny_qwen3_reranker_in_bf16_and_f16_matches_f32() {
    let reference = qwen3_engine("tiny-qwen3-reranker", Task::Rerank, cpu()).await;
    let docs = inputs();
    let query = "which text is about leases and queues?".to_string();
    let want = reference
        .rerank(query.clone(), docs.clone(), RerankOptions::default())
        .await
        .unwrap();
    for (dtype, cfg) in half_paths() {
        let engine = qwen3_engine("tiny-qwen3-reranker", Task::Rerank, cfg).await;
        let got = engine
            .rerank(query.clone(), docs.clone(), RerankOptions::default())
            .await
            .unwrap();
        assert_eq!(got.len(), want.len());
        let mut worst = 0.0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (pg, pw) = (g.probability.unwrap(), w.probability.unwrap());
            assert!(g.score.is_finite() && pg.is_finite(), "{dtype} {i}");
            let diff = (pg - pw).abs();
            assert!(diff <= MAX_PROBABILITY_DIFF, "{dtype} {i}: {pg} vs {pw}");
            worst = worst.max(diff);
        }
        println!("{dtype} rerank: largest probability difference {worst:.5}");
    }
}

/// The hub's canaries (issue 21): a probe text inside a client's work frame must keep its
/// fingerprint's direction whatever batch it rides in (its neighbours, its position, the
/// padding), or the gate would suspend an honest provider. The fingerprint is the probe set
/// embedded together in f32 (as the gate asks the reference); each probe then rides alone, in a
/// batch of 8 or in one of 32 (every size at every position across the set: first, in the
/// middle, last), beside one-token rows and max-length ones, in f32 (packed and padded) and the
/// GPU's half dtypes.
#[tokio::test]
async fn minilm_canaries_keep_their_fingerprint_in_any_batch_and_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = minilm_engine(tmp.path(), cpu()).await;
    let probes = probe_texts();
    let fingerprint = reference
        .embed(probes.clone(), EmbedOptions::default())
        .await
        .unwrap();
    let long = probes.last().unwrap().repeat(4);
    let filler = |n: usize| -> Vec<String> {
        (0..n)
            .map(|i| match i % 4 {
                0 => "x".to_string(),
                1 => long.clone(),
                _ => format!("client text {i}: how the queue hands out leases"),
            })
            .collect()
    };
    let configs = [
        ("f32 packed".to_string(), cpu()),
        (
            "f32 padded".to_string(),
            gpu_path("f32", AttentionMode::Padded),
        ),
    ]
    .into_iter()
    .chain(half_paths());
    for (name, cfg) in configs {
        let name = name.as_str();
        let tmp = tempfile::tempdir().unwrap();
        let engine = minilm_engine(tmp.path(), cfg).await;
        let mut lowest = 1.0f64;
        // Each probe rides once; across the twelve, every size meets every position.
        for (p, probe) in probes.iter().enumerate() {
            let size = [1usize, 8, 32][p % 3];
            let mut batch = filler(size - 1);
            let at = match (p / 3) % 3 {
                0 => 0,
                1 => batch.len() / 2,
                _ => batch.len(),
            };
            batch.insert(at, probe.clone());
            let out = engine.embed(batch, EmbedOptions::default()).await.unwrap();
            finite(&out, name);
            let c = cosine(&out[at], &fingerprint[p]);
            assert!(
                c >= MIN_COSINE,
                "{name}: probe {p} in a batch of {size} at {at}: {c}"
            );
            lowest = lowest.min(c);
        }
        println!("canaries, {name}: lowest cosine to the fingerprint {lowest:.6}");
    }
}

/// What canaries cost (issue 21), printed for docs/benchmarks.md: at the default 64 texts per
/// work frame (63 of the client's and a canary), canaries per 1 000 client texts and their
/// tokens beside the clients' own, on the code-search mix of benches/texts.jsonl.
#[tokio::test]
async fn minilm_canary_overhead_on_a_realistic_mix() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = minilm_engine(tmp.path(), cpu()).await;
    let mix: Vec<String> = std::fs::read_to_string(repo_root().join("benches/texts.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let client = engine
        .embed_counted(mix.clone(), EmbedOptions::default())
        .await
        .unwrap()
        .tokens as f64
        * 1000.0
        / mix.len() as f64;
    let probes = probe_texts();
    let per_canary = engine
        .embed_counted(probes.clone(), EmbedOptions::default())
        .await
        .unwrap()
        .tokens as f64
        / probes.len() as f64;
    let canaries = (1000.0f64 / 63.0).ceil();
    let overhead = canaries * per_canary;
    assert!(per_canary > 0.0 && client > 0.0);
    println!(
        "canary overhead per 1000 client texts (64 per frame): {canaries} texts, {overhead:.0} tokens \
         ({:.1} % of the clients' {client:.0}); {per_canary:.1} tokens per canary on average",
        100.0 * overhead / client
    );
}

/// Canaries at every width (issue 27): a frame of a Matryoshka width under the space's is
/// judged on the fingerprint's first entries (the gate's `check_canary`), at the space's own
/// minimum cosine. Honest numerics must keep well above that floor (within a fifth of its
/// allowance) at every width that carries a canary (`MIN_CANARY_DIMS` and up): each probe rides
/// in batches of 1, 8 and 32 in f32 (packed and padded) and both half dtypes through both GPU
/// paths (the packed kernel's numerics included), cut to each width, against the f32
/// fingerprint cut the same way. The lowest cosine per width is printed for
/// `docs/operations.md`.
#[tokio::test]
async fn canaries_keep_above_the_floor_at_every_width_that_carries_one() {
    use fantom_sidecar::hub::gate::measure::{HONEST_MARGIN, MIN_CANARY_DIMS, MIN_COSINE_FLOOR};
    // Honest noise uses at most a fifth of what the floor allows.
    let honest = 1.0 - (1.0 - MIN_COSINE_FLOOR) * HONEST_MARGIN;
    let tmp = tempfile::tempdir().unwrap();
    let minilm = minilm_engine(tmp.path(), cpu()).await;
    let qwen3 = qwen3_engine("tiny-qwen3-embedding", Task::Embed, cpu()).await;
    let probes = probe_texts();
    for (model, reference) in [("minilm", minilm), ("tiny-qwen3", qwen3)] {
        let full = reference.info().dims;
        let fingerprint = reference
            .embed(probes.clone(), EmbedOptions::default())
            .await
            .unwrap();
        let widths: Vec<usize> = [4, 8, 16, 32, 64, 128, 256, 384, 1024]
            .into_iter()
            .filter(|w| *w < full)
            .chain([full])
            .collect();
        let mut lowest = vec![1.0f64; widths.len()];
        let configs = [cpu(), gpu_path("f32", AttentionMode::Padded)]
            .into_iter()
            .chain(half_paths().into_iter().map(|(_, c)| c));
        for cfg in configs {
            let engine = match model {
                "minilm" => {
                    let tmp = tempfile::tempdir().unwrap();
                    minilm_engine(tmp.path(), cfg).await
                }
                _ => qwen3_engine("tiny-qwen3-embedding", Task::Embed, cfg).await,
            };
            for (p, probe) in probes.iter().enumerate() {
                let size = [1usize, 8, 32][p % 3];
                let mut batch: Vec<String> = (0..size - 1)
                    .map(|i| format!("client text {i}: how the queue hands out leases"))
                    .collect();
                let at = (p / 3) % batch.len().max(1);
                batch.insert(at.min(batch.len()), probe.clone());
                let at = batch.iter().position(|t| t == probe).unwrap();
                // The engine's Matryoshka cut is the first entries, re-normalised: a cosine on
                // the cut vectors is the same number (checked at one width against the engine).
                let out = engine
                    .embed(batch.clone(), EmbedOptions::default())
                    .await
                    .unwrap();
                finite(&out, model);
                for (k, w) in widths.iter().enumerate() {
                    let c = cosine(&out[at][..*w], &fingerprint[p][..*w]);
                    lowest[k] = lowest[k].min(c);
                }
                if p == 0 {
                    let cut = EmbedOptions {
                        dimensions: Some(widths[1]),
                        ..EmbedOptions::default()
                    };
                    let mrl = engine.embed(batch.clone(), cut).await.unwrap();
                    let direct = cosine(&mrl[at], &out[at][..widths[1]]);
                    assert!(
                        direct > 0.999_999,
                        "{model}: the engine's cut is the first entries"
                    );
                }
            }
        }
        for (w, c) in widths.iter().zip(&lowest) {
            println!("canary width {w} of {full} ({model}): lowest honest cosine {c:.6}");
            if *w >= MIN_CANARY_DIMS {
                assert!(
                    *c >= honest,
                    "{model} at width {w}: honest numerics at {c} leave too little margin over the floor"
                );
            }
        }
    }
}
