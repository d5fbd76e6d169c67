//! Qwen3 embedder and reranker against transformers, on the tiny random-weight fixtures of
//! `tests/fixtures/qwen3/` (made by `make_qwen3_fixtures.py`; real BPE tokenizer, GQA,
//! head_dim ≠ hidden/heads, truncation exercised).

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use fantom_sidecar::inference::tokenize::InputTokenizer;
use fantom_sidecar::inference::{
    AttentionMode, EmbedOptions, Engine, EngineConfig, RerankOptions, Truncation,
};
use fantom_sidecar::model_source::{ModelSelector, SpecOverrides};
use fantom_sidecar::model_spec::{Pooling, Task};
use serde::Deserialize;

use crate::support::*;

fn qwen3_dir(name: &str) -> PathBuf {
    fixtures().join("qwen3").join(name)
}

#[derive(Deserialize)]
struct EmbeddingReference {
    max_length: usize,
    task: String,
    documents: Vec<String>,
    queries: Vec<String>,
    document_ids: Vec<Vec<u32>>,
    documents_embeddings: Vec<Vec<f32>>,
    queries_embeddings: Vec<Vec<f32>>,
    mrl_dims: usize,
    documents_embeddings_mrl: Vec<Vec<f32>>,
}

#[derive(Deserialize)]
struct RerankerReference {
    max_length: usize,
    instruction: String,
    cases: Vec<RerankCase>,
}

#[derive(Deserialize)]
struct RerankCase {
    query: String,
    documents: Vec<String>,
    scores: Vec<f32>,
    logit_yes: Vec<f32>,
    logit_no: Vec<f32>,
    input_ids: Vec<Vec<u32>>,
}

fn read<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = fixtures().join("qwen3").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn assert_vectors(got: &[Vec<f32>], want: &[Vec<f32>], min_cos: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let cos = cosine(g, w);
        assert!(cos >= min_cos, "{what} {i}: cosine {cos}");
    }
}

#[tokio::test]
async fn the_folder_is_read_as_a_qwen3_embedder() {
    let tmp = tempfile::tempdir().unwrap();
    let resolved = resolve(
        ModelSelector::Folder(qwen3_dir("tiny-qwen3-embedding")),
        Task::Embed,
        SpecOverrides::default(),
        &source_options(tmp.path()),
    )
    .await
    .unwrap();
    let reference: EmbeddingReference = read("embedding_reference.json");
    assert_eq!(resolved.spec.pooling, Pooling::Last);
    assert_eq!(resolved.spec.max_tokens, reference.max_length);
    assert_eq!(
        resolved.spec.prompts.apply("q", true, None),
        format!("Instruct: {}\nQuery:q", reference.task)
    );
    // The tokenizer truncates inside, keeping the appended <|endoftext|>: the ids match.
    let tok = InputTokenizer::load(
        &resolved.files.tokenizer,
        resolved.spec.max_tokens,
        Truncation::Truncate,
    )
    .unwrap();
    let ids: Vec<Vec<u32>> = tok
        .encode_texts(reference.documents.clone())
        .unwrap()
        .into_iter()
        .map(|t| t.ids)
        .collect();
    assert_eq!(ids, reference.document_ids);
}

#[tokio::test]
async fn qwen3_embeddings_match_transformers() {
    let reference: EmbeddingReference = read("embedding_reference.json");
    let engine = qwen3_engine("tiny-qwen3-embedding", Task::Embed, cpu()).await;
    let docs = engine
        .embed(reference.documents.clone(), EmbedOptions::default())
        .await
        .unwrap();
    assert_vectors(&docs, &reference.documents_embeddings, 0.9999, "document");
    for (g, w) in docs.iter().zip(&reference.documents_embeddings) {
        assert!(max_abs_diff(g, w) <= 1e-4);
    }
    let query = EmbedOptions {
        is_query: true,
        ..EmbedOptions::default()
    };
    let queries = engine
        .embed(reference.queries.clone(), query)
        .await
        .unwrap();
    assert_vectors(&queries, &reference.queries_embeddings, 0.9999, "query");
    let mrl = EmbedOptions {
        dimensions: Some(reference.mrl_dims),
        ..EmbedOptions::default()
    };
    let truncated = engine
        .embed(reference.documents.clone(), mrl)
        .await
        .unwrap();
    assert_vectors(
        &truncated,
        &reference.documents_embeddings_mrl,
        0.9999,
        "MRL",
    );
}

#[tokio::test]
async fn qwen3_batched_equals_one_at_a_time_and_padded_path_agrees() {
    let reference: EmbeddingReference = read("embedding_reference.json");
    let texts = reference.documents.clone();
    let batched = qwen3_engine("tiny-qwen3-embedding", Task::Embed, cpu()).await;
    let single = qwen3_engine(
        "tiny-qwen3-embedding",
        Task::Embed,
        EngineConfig {
            max_batch_rows: 1,
            ..cpu()
        },
    )
    .await;
    let padded = qwen3_engine(
        "tiny-qwen3-embedding",
        Task::Embed,
        EngineConfig {
            attention: AttentionMode::Padded,
            ..cpu()
        },
    )
    .await;
    let a = batched
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();
    let b = single
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();
    let c = padded
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();
    assert!(batched.stats().batches.load(Ordering::Relaxed) < texts.len() as u64);
    assert!(
        padded.stats().attended_tokens.load(Ordering::Relaxed)
            > padded.stats().tokens.load(Ordering::Relaxed),
        "mixed lengths were really padded"
    );
    assert_vectors(&a, &b, 0.99999, "batched vs single");
    assert_vectors(&c, &reference.documents_embeddings, 0.9999, "padded path");
}

#[tokio::test]
async fn qwen3_reranker_matches_transformers() {
    let reference: RerankerReference = read("reranker_reference.json");
    let engine = qwen3_engine("tiny-qwen3-reranker", Task::Rerank, cpu()).await;
    assert_eq!(engine.info().max_tokens, reference.max_length);
    for case in &reference.cases {
        let got = engine
            .rerank(
                case.query.clone(),
                case.documents.clone(),
                RerankOptions::default(),
            )
            .await
            .unwrap();
        for (i, g) in got.iter().enumerate() {
            let diff = case.logit_yes[i] - case.logit_no[i];
            assert!(
                (g.score - diff).abs() <= 1e-4,
                "doc {i}: {} vs {diff}",
                g.score
            );
            let p = g.probability.expect("sigmoid(yes - no)");
            assert!(
                (p - case.scores[i]).abs() <= 1e-4,
                "doc {i}: {p} vs {}",
                case.scores[i]
            );
        }
    }
}

#[tokio::test]
async fn qwen3_reranker_template_ids_match_and_paths_agree() {
    let reference: RerankerReference = read("reranker_reference.json");
    let overrides = SpecOverrides {
        pooling: None,
        max_tokens: Some(reference.max_length),
    };
    let tmp = tempfile::tempdir().unwrap();
    let opts = source_options(tmp.path());
    let resolve_ce = || {
        resolve(
            ModelSelector::Folder(qwen3_dir("tiny-qwen3-reranker")),
            Task::Rerank,
            overrides.clone(),
            &opts,
        )
    };
    // The framed ids are transformers' ids, truncation of the body included.
    let resolved = resolve_ce().await.unwrap();
    let tok = InputTokenizer::load(
        &resolved.files.tokenizer,
        reference.max_length,
        Truncation::Truncate,
    )
    .unwrap();
    let prefix = tok
        .encode_raw(fantom_sidecar::inference::models::qwen3::RERANK_PREFIX)
        .unwrap();
    let suffix = tok
        .encode_raw(fantom_sidecar::inference::models::qwen3::RERANK_SUFFIX)
        .unwrap();
    for case in &reference.cases {
        let bodies = case
            .documents
            .iter()
            .map(|d| {
                fantom_sidecar::inference::models::qwen3::rerank_body(
                    &reference.instruction,
                    &case.query,
                    d,
                )
            })
            .collect();
        let ids: Vec<Vec<u32>> = tok
            .encode_framed(&prefix, bodies, &suffix)
            .unwrap()
            .into_iter()
            .map(|t| t.ids)
            .collect();
        assert_eq!(ids, case.input_ids);
    }
    // One at a time and padded attention agree with the packed batch.
    let case = &reference.cases[0];
    let mut runs = Vec::new();
    for cfg in [
        cpu(),
        EngineConfig {
            max_batch_rows: 1,
            ..cpu()
        },
        EngineConfig {
            attention: AttentionMode::Padded,
            ..cpu()
        },
    ] {
        let engine = start(resolve_ce().await.unwrap(), cfg).await;
        runs.push(
            engine
                .rerank(
                    case.query.clone(),
                    case.documents.clone(),
                    RerankOptions::default(),
                )
                .await
                .unwrap(),
        );
    }
    for run in &runs[1..] {
        for (a, b) in runs[0].iter().zip(run) {
            assert!(
                (a.score - b.score).abs() <= 1e-4,
                "{} vs {}",
                a.score,
                b.score
            );
        }
    }
}

#[test]
fn cli_embeds_queries_and_reranks_with_qwen3_folders() {
    let tmp = tempfile::tempdir().unwrap();
    let reference: EmbeddingReference = read("embedding_reference.json");
    let dir = qwen3_dir("tiny-qwen3-embedding");
    let out = run_cli(
        &["embed", "--model-dir", dir.to_str().unwrap(), "--query"],
        &json_lines(&reference.queries),
        &[("FANTOM_MODELS_LOCK", tmp.path().join("l").to_str().unwrap())],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (i, line) in lines.iter().enumerate() {
        let v: Vec<f32> = serde_json::from_value(line["embedding"].clone()).unwrap();
        assert!(
            cosine(&v, &reference.queries_embeddings[i]) >= 0.9999,
            "query {i}"
        );
    }
    let rr: RerankerReference = read("reranker_reference.json");
    let case = &rr.cases[1];
    let dir = qwen3_dir("tiny-qwen3-reranker");
    let out = run_cli(
        &[
            "rerank",
            "--model-dir",
            dir.to_str().unwrap(),
            "--max-tokens",
            "160",
            "--query",
            &case.query,
        ],
        &json_lines(&case.documents),
        &[("FANTOM_MODELS_LOCK", tmp.path().join("l").to_str().unwrap())],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (i, line) in String::from_utf8_lossy(&out.stdout).lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let p = v["probability"].as_f64().unwrap() as f32;
        assert!((p - case.scores[i]).abs() <= 1e-4, "doc {i}");
    }
}

#[test]
fn bench_runs_an_architecture_from_its_config_with_random_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let dir = qwen3_dir("tiny-qwen3-reranker");
    let out = run_cli(
        &[
            "bench",
            "--model-dir",
            dir.to_str().unwrap(),
            "--random-weights",
            "--device",
            "cpu",
            "--batch-sizes",
            "1,4",
            "--tokens",
            "64",
            "--seconds",
            "0.05",
            "--peak-tflops",
            "1",
            "--json",
            json.to_str().unwrap(),
        ],
        "",
        &[("FANTOM_MODELS_LOCK", tmp.path().join("l").to_str().unwrap())],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("random weights"), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(
        report["model"]
            .as_str()
            .unwrap()
            .contains("random weights, benchmark only")
    );
    let rows = report["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert!(r["batches"].as_u64().unwrap() >= 3);
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["peak_fraction"].as_f64().unwrap() > 0.0);
    }
    // FLOPs per token of the tiny config: 3 layers × (2·(64·(4+4)·32 + 4·32·64 + 3·64·160)
    // + 2·4·32·64) = 3 × (2·(16384 + 8192 + 30720) + 16384) = 380,928.
    let gflop = report["gflop_per_token"].as_f64().unwrap();
    assert!((gflop - 380_928e-9).abs() < 1e-12, "{gflop}");
}

/// Candidates of one request share the template prefix, the instruction and the query: the
/// engine runs those tokens once per batch and the scores do not change.
#[tokio::test]
async fn rerank_candidates_share_their_common_prefix() {
    let reference: RerankerReference = read("reranker_reference.json");
    let case = &reference.cases[0];
    let engine = qwen3_engine("tiny-qwen3-reranker", Task::Rerank, cpu()).await;
    let got = engine
        .rerank(
            case.query.clone(),
            case.documents.clone(),
            RerankOptions::default(),
        )
        .await
        .unwrap();
    let stats = engine.stats();
    let full: usize = case.input_ids.iter().map(Vec::len).sum();
    let computed = stats.tokens.load(Ordering::Relaxed) as usize;
    let shared = {
        let first = &case.input_ids[0];
        case.input_ids[1..]
            .iter()
            .map(|ids| first.iter().zip(ids).take_while(|(a, b)| a == b).count())
            .min()
            .unwrap()
    };
    let batches = stats.batches.load(Ordering::Relaxed) as usize;
    assert!(
        shared >= 53,
        "the system prompt alone is 53 tokens; shared {shared}"
    );
    assert_eq!(
        computed,
        full - (case.documents.len() - batches) * shared,
        "each batch runs the {shared}-token prefix once instead of once per candidate"
    );
    assert_eq!(
        stats.rows.load(Ordering::Relaxed) as usize,
        case.documents.len()
    );
    // A single candidate has nothing to share and scores the same.
    let alone = engine
        .rerank(
            case.query.clone(),
            case.documents[..1].to_vec(),
            RerankOptions::default(),
        )
        .await
        .unwrap();
    assert!((alone[0].score - got[0].score).abs() <= 1e-4);
}

#[tokio::test]
async fn a_full_warm_up_runs_the_worst_batch_once_at_start() {
    let cfg = EngineConfig {
        max_batch_tokens: Some(48 * 8),
        warmup: fantom_sidecar::inference::Warmup::Full,
        ..cpu()
    };
    let engine = qwen3_engine("tiny-qwen3-embedding", Task::Embed, cfg).await;
    let info = engine.info();
    assert_eq!(info.max_tokens, 48);
    assert_eq!(
        (
            info.warmup_rows,
            info.max_batch_tokens,
            info.max_batch_tokens_source
        ),
        (8, 384, "configured")
    );
    assert_eq!(
        engine.stats().batches.load(Ordering::Relaxed),
        0,
        "the warm-up is not a batch served"
    );
    let v = engine
        .embed(vec!["after the warm-up".into()], EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(v.len(), 1);
    // Unconfigured on the CPU: the default budget, one warm-up row.
    let engine = engine_default().await;
    assert_eq!(
        (
            engine.info().warmup_rows,
            engine.info().max_batch_tokens_source
        ),
        (1, "default")
    );
}

async fn engine_default() -> Engine {
    qwen3_engine("tiny-qwen3-embedding", Task::Embed, cpu()).await
}

/// `--model ID --model-dir DIR --random-weights`: a pinned manifest's settings (its dims, max
/// tokens, task) on random weights of the folder's config, as the GPU check starts each pinned
/// Qwen3 model without its download; a manifest of another task or a config narrower than its
/// dims is refused.
#[test]
fn a_pinned_manifest_starts_on_random_weights_of_its_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    // One layer of Qwen3-Embedding-0.6B's widths (1024 dims) with the fixture tokenizer.
    let dir = tmp.path().join("qwen3-0.6b-shapes");
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(qwen3_dir("tiny-qwen3-embedding").join("config.json")).unwrap(),
    )
    .unwrap();
    for (k, v) in [
        ("hidden_size", 1024),
        ("intermediate_size", 256),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("head_dim", 128),
        ("num_hidden_layers", 1),
        ("max_position_embeddings", 32768),
    ] {
        cfg[k] = v.into();
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        fixtures().join("qwen3/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let lock = tmp.path().join("models.lock");
    let env = [("FANTOM_MODELS_LOCK", lock.to_str().unwrap())];
    let flags = |id: &str, verb: &str| -> Vec<String> {
        [verb, "--model", id, "--model-dir", dir.to_str().unwrap()]
            .into_iter()
            .chain(["--random-weights", "--device", "cpu", "--max-tokens", "64"])
            .chain(["--log-format", "json"])
            .map(String::from)
            .collect()
    };
    let args = flags("qwen3-embedding-0.6b", "embed");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_cli(&args, "\"fn lease()\"\n\"bananas\"\n", &env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["embedding"].as_array().unwrap().len(), 1024);
    assert!(stderr.contains("random weights"), "{stderr}");
    assert!(stderr.contains("\"attention\":\"packed\""), "{stderr}");
    assert!(!lock.exists(), "random weights are never pinned");
    // The reranker's manifest is not an embedder.
    let args = flags("qwen3-reranker-0.6b", "embed");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_cli(&args, "\"x\"\n", &env);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("qwen3-reranker-0.6b"));
    // Qwen3-Embedding-4B's 2560 dims are not this config's 1024.
    let args = flags("qwen3-embedding-4b", "embed");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_cli(&args, "\"x\"\n", &env);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("2560"));
}
