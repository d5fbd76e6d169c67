//! all-MiniLM-L6-v2 on candle against sentence-transformers (torch, CPU).

use std::sync::atomic::Ordering;

use fantom_sidecar::inference::{EmbedOptions, EngineConfig, InferenceError};
use fantom_sidecar::model_source::{ModelSelector, Provenance, SpecOverrides};
use fantom_sidecar::model_spec::{Pooling, Task};

use crate::support::*;

#[tokio::test]
async fn minilm_reproduces_sentence_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = minilm_engine(tmp.path(), cpu()).await;
    let texts = texts();
    let reference = minilm_reference();
    assert!(texts.len() >= 50, "the reference covers at least 50 texts");
    assert!(
        reference.token_counts.contains(&reference.max_seq_length),
        "some texts run past the 256-token limit, so truncation is exercised"
    );
    let got = engine
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(got.len(), texts.len());
    for (i, (g, r)) in got.iter().zip(&reference.mean).enumerate() {
        assert_eq!(g.len(), reference.dims);
        let cos = cosine(g, r);
        let diff = max_abs_diff(g, r);
        assert!(cos >= 0.9999, "text {i}: cosine {cos}");
        assert!(diff <= 1e-4, "text {i}: max abs diff {diff}");
    }
    // One request of mixed lengths was batched (several rows per batch, with padding).
    let stats = engine.stats();
    let batches = stats.batches.load(Ordering::Relaxed);
    assert!(
        batches < texts.len() as u64,
        "{batches} batches for {} texts",
        texts.len()
    );
    assert_eq!(
        stats.attended_tokens.load(Ordering::Relaxed),
        stats.tokens.load(Ordering::Relaxed),
        "packed attention on the CPU pays for no padding"
    );
    match &engine.info().provenance {
        Provenance::Pinned {
            revision, files, ..
        } => {
            assert_eq!(
                revision.as_str(),
                "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"
            );
            assert_eq!(files.len(), 3);
        }
        other => panic!("expected a pinned model, got {other:?}"),
    }
}

#[tokio::test]
async fn batched_and_one_at_a_time_agree() {
    let tmp = tempfile::tempdir().unwrap();
    let batched = minilm_engine(tmp.path(), cpu()).await;
    let single = minilm_engine(
        tmp.path(),
        EngineConfig {
            max_batch_rows: 1,
            ..cpu()
        },
    )
    .await;
    let texts = texts();
    let a = batched
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();
    let b = single
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(
        single.stats().batches.load(Ordering::Relaxed),
        texts.len() as u64
    );
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let cos = cosine(x, y);
        assert!(cos >= 0.99999, "text {i}: batched vs single cosine {cos}");
    }
}

#[tokio::test]
async fn cls_pooling_on_an_unpinned_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = source_options(tmp.path());
    let overrides = SpecOverrides {
        pooling: Some(Pooling::Cls),
        max_tokens: None,
    };
    let resolved = resolve(
        ModelSelector::Folder(minilm_dir()),
        Task::Embed,
        overrides,
        &opts,
    )
    .await
    .unwrap();
    assert!(!resolved.provenance.is_pinned());
    assert_eq!(
        resolved.spec.max_tokens, 256,
        "from sentence_bert_config.json"
    );
    let engine = start(resolved, cpu()).await;
    assert!(matches!(
        engine.info().provenance,
        Provenance::Unpinned { .. }
    ));
    let reference = minilm_reference();
    let texts: Vec<String> = texts().into_iter().take(reference.cls.len()).collect();
    let got = engine.embed(texts, EmbedOptions::default()).await.unwrap();
    for (i, (g, r)) in got.iter().zip(&reference.cls).enumerate() {
        assert!(cosine(g, r) >= 0.9999, "text {i}: {}", cosine(g, r));
        assert!(max_abs_diff(g, r) <= 1e-4, "text {i}");
    }
}

#[tokio::test]
async fn unpinned_folder_takes_mean_pooling_from_sentence_transformers_files() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = source_options(tmp.path());
    let resolved = resolve(
        ModelSelector::Folder(minilm_dir()),
        Task::Embed,
        SpecOverrides::default(),
        &opts,
    )
    .await
    .unwrap();
    assert_eq!(resolved.spec.pooling, Pooling::Mean);
    assert!(resolved.spec.normalize);
    let engine = start(resolved, cpu()).await;
    let got = engine
        .embed(texts()[..3].to_vec(), EmbedOptions::default())
        .await
        .unwrap();
    let reference = minilm_reference();
    for (g, r) in got.iter().zip(&reference.mean) {
        assert!(cosine(g, r) >= 0.9999);
    }
}

#[tokio::test]
async fn dimensions_truncate_and_renormalise() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = minilm_engine(tmp.path(), cpu()).await;
    let reference = minilm_reference();
    let opts = EmbedOptions {
        dimensions: Some(64),
        ..EmbedOptions::default()
    };
    let got = engine.embed(texts()[..4].to_vec(), opts).await.unwrap();
    for (g, r) in got.iter().zip(&reference.mean) {
        assert_eq!(g.len(), 64);
        let norm: f32 = g.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
        assert!(cosine(g, &r[..64]) >= 0.9999);
    }
    for bad in [0, 385] {
        let opts = EmbedOptions {
            dimensions: Some(bad),
            ..EmbedOptions::default()
        };
        let err = engine.embed(vec!["x".into()], opts).await.unwrap_err();
        assert_eq!(
            err,
            InferenceError::BadDimensions {
                requested: bad,
                max: 384
            }
        );
    }
}

#[tokio::test]
async fn bad_requests_get_clear_errors_and_the_engine_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = minilm_engine(
        tmp.path(),
        EngineConfig {
            truncation: fantom_sidecar::inference::Truncation::Refuse,
            ..cpu()
        },
    )
    .await;
    let opts = EmbedOptions::default;
    assert_eq!(
        engine.embed(vec![], opts()).await.unwrap_err(),
        InferenceError::EmptyInput
    );
    assert_eq!(
        engine
            .embed(vec!["a".into(), String::new()], opts())
            .await
            .unwrap_err(),
        InferenceError::EmptyText { index: 1 }
    );
    let long = "word ".repeat(400);
    assert_eq!(
        engine
            .embed(vec!["short".into(), long], opts())
            .await
            .unwrap_err(),
        InferenceError::TooLong { index: 1, max: 256 }
    );
    let err = engine
        .rerank("q".into(), vec!["d".into()], Default::default())
        .await
        .unwrap_err();
    assert!(matches!(err, InferenceError::WrongTask { .. }), "{err}");
    assert!(err.to_string().contains("an embedding model"), "{err}");
    // Still serving after every refusal.
    let ok = engine
        .embed(vec!["still here".into()], opts())
        .await
        .unwrap();
    assert_eq!(ok[0].len(), 384);
}

#[tokio::test]
async fn concurrent_requests_each_get_their_own_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = minilm_engine(tmp.path(), cpu()).await;
    let texts = texts();
    let reference = minilm_reference();
    let mut tasks = Vec::new();
    for (i, t) in texts.iter().enumerate().take(24) {
        let (engine, t) = (engine.clone(), t.clone());
        tasks.push(tokio::spawn(async move {
            (
                i,
                engine
                    .embed(vec![t], EmbedOptions::default())
                    .await
                    .unwrap(),
            )
        }));
    }
    for task in tasks {
        let (i, v) = task.await.unwrap();
        assert!(
            cosine(&v[0], &reference.mean[i]) >= 0.9999,
            "request {i} got another row"
        );
    }
}

/// The GPU-shaped path (gathered right-padded rows, masked matmul attention, candle's unfused
/// ops) checked on the CPU: CI has no GPU, so this is what keeps the CUDA path's math honest.
#[tokio::test]
async fn padded_attention_path_matches_the_reference_too() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = minilm_engine(
        tmp.path(),
        EngineConfig {
            attention: fantom_sidecar::inference::AttentionMode::Padded,
            ..cpu()
        },
    )
    .await;
    assert_eq!(engine.info().attention, "padded");
    let texts = texts();
    let reference = minilm_reference();
    let got = engine
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();
    for (i, (g, r)) in got.iter().zip(&reference.mean).enumerate() {
        assert!(cosine(g, r) >= 0.9999, "text {i}: cosine {}", cosine(g, r));
        assert!(max_abs_diff(g, r) <= 1e-4, "text {i}");
    }
    let stats = engine.stats();
    assert!(
        stats.attended_tokens.load(Ordering::Relaxed) > stats.tokens.load(Ordering::Relaxed),
        "mixed lengths were padded"
    );
}

/// Our encoder (packed tokens, fused kernels, own attention) against candle-transformers' plain
/// BERT on the same weights: two implementations, one answer.
#[test]
fn our_bert_matches_candle_transformers_bert() {
    use candle_core::{DType, Device, Tensor};
    use candle_nn::VarBuilder;
    use candle_transformers::models::bert::{BertModel, Config};

    let dir = minilm_dir();
    let dev = Device::Cpu;
    let cfg: Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &dev)
    }
    .unwrap();
    let theirs = BertModel::load(vb, &cfg).unwrap();
    let tok = fantom_sidecar::inference::tokenize::InputTokenizer::load(
        &dir.join("tokenizer.json"),
        256,
        fantom_sidecar::inference::Truncation::Truncate,
    )
    .unwrap();
    let texts: Vec<String> = texts().into_iter().take(16).collect();
    let inputs = tok.encode_texts(texts.clone()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let ours = rt.block_on(async {
        let engine = minilm_engine(tmp.path(), cpu()).await;
        engine.embed(texts, EmbedOptions::default()).await.unwrap()
    });
    for (i, input) in inputs.iter().enumerate() {
        let n = input.ids.len();
        let ids = Tensor::from_vec(input.ids.clone(), (1, n), &dev).unwrap();
        let types = ids.zeros_like().unwrap();
        let hidden = theirs.forward(&ids, &types, None).unwrap(); // [1, n, 384]
        let mean: Vec<f32> = (hidden.sum(1).unwrap() / n as f64)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        let norm = mean.iter().map(|x| x * x).sum::<f32>().sqrt();
        let mean: Vec<f32> = mean.iter().map(|x| x / norm).collect();
        assert!(cosine(&ours[i], &mean) >= 0.99999, "text {i}");
        assert!(max_abs_diff(&ours[i], &mean) <= 1e-5, "text {i}");
    }
}
