//! Pins: manifest digests, the lock file, and refusing a changed file.

use std::path::Path;

use fantom_sidecar::manifest::ManifestRegistry;
use fantom_sidecar::model_source::{
    DigestCheck, ModelSelector, Provenance, SourceError, SpecOverrides,
};
use fantom_sidecar::model_spec::{Pooling, Task};

use crate::support::*;

fn copy_minilm(into: &Path) -> std::path::PathBuf {
    let dir = into.join("minilm-copy");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(minilm_dir().join(f), dir.join(f)).unwrap();
    }
    dir
}

/// Flips one bit in the middle of a file (a weight, not the header).
fn flip_a_bit(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

fn pinned(id: &str, dir: &Path) -> ModelSelector {
    ModelSelector::Pinned {
        id: id.into(),
        dir: Some(dir.to_path_buf()),
    }
}

#[tokio::test]
async fn a_tampered_weight_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_minilm(tmp.path());
    flip_a_bit(&dir.join("model.safetensors"));
    let err = resolve(
        pinned("all-minilm-l6-v2", &dir),
        Task::Embed,
        SpecOverrides::default(),
        &source_options(tmp.path()),
    )
    .await
    .unwrap_err();
    match &err {
        SourceError::DigestMismatch(m) => {
            assert_eq!(m.file, "model.safetensors");
            assert_eq!(
                m.expected.to_string(),
                "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
            );
        }
        other => panic!("expected a digest mismatch, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("does not match its pin") && msg.contains("manifest"),
        "{msg}"
    );
}

const TEST_MANIFEST: &str = r#"
id = "minilm-ce-test"
repo = "fantom-tests/minilm-cross-encoder"
revision = "0000000000000000000000000000000000000001"
architecture = "bert"
task = "rerank"
score = "sigmoid"
max_tokens = 512

[files]
"config.json" = ""
"tokenizer.json" = ""
"model.safetensors.index.json" = ""
"model-00001-of-00002.safetensors" = ""
"model-00002-of-00002.safetensors" = ""
"#;

#[tokio::test]
async fn the_lock_file_pins_on_first_load_and_refuses_a_change() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = assemble_cross_encoder(tmp.path());
    let manifests = tmp.path().join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    std::fs::write(manifests.join("ce.toml"), TEST_MANIFEST).unwrap();
    let mut opts = source_options(tmp.path());
    opts.registry = ManifestRegistry::built_in();
    opts.registry.add_dir(&manifests).unwrap();
    let load = || {
        resolve(
            pinned("minilm-ce-test", &dir),
            Task::Rerank,
            SpecOverrides::default(),
            &opts,
        )
    };

    let first = load().await.unwrap();
    let checks: Vec<_> = first.provenance.files().iter().map(|f| f.check).collect();
    assert!(
        checks.iter().all(|c| *c == Some(DigestCheck::Recorded)),
        "{checks:?}"
    );
    let lock = std::fs::read_to_string(&opts.lock_path).unwrap();
    assert!(
        lock.contains("minilm-ce-test") && lock.contains(HEAD_SHARD),
        "{lock}"
    );

    let second = load().await.unwrap();
    assert!(
        second
            .provenance
            .files()
            .iter()
            .all(|f| f.check == Some(DigestCheck::Lock))
    );
    // The pinned reranker really runs.
    let engine = start(second, cpu()).await;
    let case = &cross_encoder_reference().cases[0];
    let got = engine
        .rerank(
            case.query.clone(),
            case.documents[..2].to_vec(),
            Default::default(),
        )
        .await
        .unwrap();
    assert!((got[0].score - case.logits[0]).abs() <= 1e-4);

    // Replace the head with different bytes: refused, naming the lock file.
    let head = dir.join(HEAD_SHARD);
    flip_a_bit(&head);
    let err = load().await.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, SourceError::DigestMismatch(ref m) if m.file == HEAD_SHARD),
        "{msg}"
    );
    assert!(msg.contains("models.lock"), "{msg}");
}

#[tokio::test]
async fn pinned_loads_refuse_what_would_change_the_space() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = source_options(tmp.path());
    let dir = minilm_dir();
    let load =
        |id: &'static str, task: Task, pooling: Option<Pooling>, max_tokens: Option<usize>| {
            resolve(
                pinned(id, &dir),
                task,
                SpecOverrides {
                    pooling,
                    max_tokens,
                },
                &opts,
            )
        };
    let refused = [
        (
            load("all-minilm-l6-v2", Task::Embed, Some(Pooling::Cls), None).await,
            "--pooling cls applies only to unpinned",
        ),
        (
            load("all-minilm-l6-v2", Task::Rerank, None, None).await,
            "is an embedding model; this command needs a reranking model",
        ),
        (
            load("all-minilm-l6-v2", Task::Embed, None, Some(600)).await,
            "outside 2..=512",
        ),
        (
            load("no-such-model", Task::Embed, None, None).await,
            "unknown model `no-such-model`",
        ),
    ];
    for (result, want) in refused {
        let err = result.unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
    // Lowering max tokens keeps the space (shorter inputs embed the same): allowed.
    let resolved = load("all-minilm-l6-v2", Task::Embed, None, Some(128))
        .await
        .unwrap();
    assert_eq!(resolved.spec.max_tokens, 128);
}

#[tokio::test]
async fn a_model_dir_missing_a_pinned_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("partial");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(minilm_dir().join("config.json"), dir.join("config.json")).unwrap();
    let err = resolve(
        pinned("all-minilm-l6-v2", &dir),
        Task::Embed,
        SpecOverrides::default(),
        &source_options(tmp.path()),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, SourceError::MissingInDir { ref file, .. } if file == "model.safetensors"),
        "{err}"
    );
}

#[tokio::test]
async fn provenance_reports_the_resolved_revision_and_digests() {
    let tmp = tempfile::tempdir().unwrap();
    let resolved = resolve(
        pinned("all-minilm-l6-v2", &minilm_dir()),
        Task::Embed,
        SpecOverrides::default(),
        &source_options(tmp.path()),
    )
    .await
    .unwrap();
    let json = serde_json::to_value(&resolved.provenance).unwrap();
    assert_eq!(json["pin"], "pinned");
    assert_eq!(json["revision"], "c9745ed1d9f207416be6d2e6f8de32d1f16199bf");
    assert_eq!(json["origin"]["kind"], "model_dir");
    let files = json["files"].as_array().unwrap();
    assert!(files.iter().any(|f| f["name"] == "model.safetensors"
        && f["sha256"] == "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
        && f["check"] == "manifest"));
    assert!(matches!(resolved.provenance, Provenance::Pinned { .. }));
}
