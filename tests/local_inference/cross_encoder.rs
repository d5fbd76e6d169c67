//! The BERT cross-encoder (MiniLM trunk + seeded classifier head) against transformers'
//! `AutoModelForSequenceClassification`.

use fantom_sidecar::inference::EngineConfig;
use fantom_sidecar::model_source::{ModelSelector, SpecOverrides};
use fantom_sidecar::model_spec::Task;

use crate::support::*;

#[tokio::test]
async fn cross_encoder_matches_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = assemble_cross_encoder(tmp.path());
    let opts = source_options(tmp.path());
    let resolved = resolve(
        ModelSelector::Folder(dir),
        Task::Rerank,
        SpecOverrides::default(),
        &opts,
    )
    .await
    .unwrap();
    let reference = cross_encoder_reference();
    assert_eq!(resolved.spec.max_tokens, reference.max_length);
    assert_eq!(resolved.files.weights.len(), 2, "sharded: trunk + head");
    let engine = start(resolved, cpu()).await;
    let mut checked = 0;
    for case in &reference.cases {
        let got = engine
            .rerank(
                case.query.clone(),
                case.documents.clone(),
                Default::default(),
            )
            .await
            .unwrap();
        assert_eq!(got.len(), case.logits.len());
        for (i, (g, want)) in got.iter().zip(&case.logits).enumerate() {
            assert!(
                (g.score - want).abs() <= 1e-4,
                "doc {i}: {} vs {want}",
                g.score
            );
            let p = g
                .probability
                .expect("single-logit cross-encoders define a probability");
            assert!((p - 1.0 / (1.0 + (-want).exp())).abs() <= 1e-4);
            checked += 1;
        }
    }
    assert!(checked >= 24);
}

#[tokio::test]
async fn cross_encoder_batched_equals_single() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = assemble_cross_encoder(tmp.path());
    let opts = source_options(tmp.path());
    let case = &cross_encoder_reference().cases[0];
    let mut scores = Vec::new();
    for rows in [1, 64] {
        let resolved = resolve(
            ModelSelector::Folder(dir.clone()),
            Task::Rerank,
            SpecOverrides::default(),
            &opts,
        )
        .await
        .unwrap();
        let engine = start(
            resolved,
            EngineConfig {
                max_batch_rows: rows,
                ..cpu()
            },
        )
        .await;
        scores.push(
            engine
                .rerank(
                    case.query.clone(),
                    case.documents.clone(),
                    Default::default(),
                )
                .await
                .unwrap(),
        );
    }
    for (a, b) in scores[0].iter().zip(&scores[1]) {
        assert!(
            (a.score - b.score).abs() <= 1e-5,
            "{} vs {}",
            a.score,
            b.score
        );
    }
}

#[tokio::test]
async fn an_embedding_folder_is_not_a_reranker() {
    let tmp = tempfile::tempdir().unwrap();
    let err = resolve(
        ModelSelector::Folder(minilm_dir()),
        Task::Rerank,
        SpecOverrides::default(),
        &source_options(tmp.path()),
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("not a sequence-classification model"),
        "{err}"
    );
}
