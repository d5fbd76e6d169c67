//! The Hugging Face cache and hub downloads, always at a pinned commit.
//!
//! A cached file is found by resolving `models--{org}--{name}/snapshots/{sha}/{file}` directly:
//! the Python client writes no `refs/{sha}` for a commit pin, so hf-hub's own lookup would miss
//! it. Only files missing there are downloaded (hf-hub, into the same cache). `HF_HUB_OFFLINE=1`
//! turns the download into a clear error, as does a network that cannot reach the hub.

use std::collections::BTreeMap;
use std::path::PathBuf;

use hf_hub::api::tokio::ApiBuilder;
use hf_hub::{Repo, RepoType};

use crate::manifest::ModelManifest;

/// Where the cache is and how to reach the hub. Read from the same variables as the Python
/// client: `HF_HUB_CACHE`, `HF_HOME`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`.
#[derive(Clone, Debug)]
pub struct HubOptions {
    pub cache_dir: PathBuf,
    pub endpoint: String,
    pub offline: bool,
}

impl HubOptions {
    pub fn from_env() -> Self {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let cache_dir = env("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| env("HF_HOME").map(|h| PathBuf::from(h).join("hub")))
            .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub")))
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let endpoint = env("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".to_string());
        let offline = env("HF_HUB_OFFLINE")
            .is_some_and(|v| matches!(v.as_str(), "1" | "true" | "TRUE" | "yes"));
        Self {
            cache_dir,
            endpoint: endpoint.trim_end_matches('/').to_string(),
            offline,
        }
    }

    /// `…/models--org--name/snapshots/<revision>`.
    pub fn snapshot_dir(&self, manifest: &ModelManifest) -> PathBuf {
        self.cache_dir
            .join(format!("models--{}", manifest.repo.replace('/', "--")))
            .join("snapshots")
            .join(manifest.revision.as_str())
    }
}

/// A file the cache lacks and the hub could not provide.
#[derive(Debug)]
pub struct FetchFailure {
    pub file: String,
    pub reason: String,
}

/// Paths of `names` (files of the manifest's repo at its pin): from the cache snapshot,
/// downloading what is missing.
pub async fn fetch(
    manifest: &ModelManifest,
    names: &[String],
    hub: &HubOptions,
) -> Result<BTreeMap<String, PathBuf>, FetchFailure> {
    let snapshot = hub.snapshot_dir(manifest);
    let mut paths = BTreeMap::new();
    let mut missing = Vec::new();
    for name in names {
        let p = snapshot.join(name);
        if p.is_file() {
            paths.insert(name.clone(), p);
        } else {
            missing.push(name.clone());
        }
    }
    if missing.is_empty() {
        return Ok(paths);
    }
    if hub.offline {
        return Err(FetchFailure {
            file: missing[0].clone(),
            reason: "HF_HUB_OFFLINE is set, so nothing is downloaded".to_string(),
        });
    }
    let api = ApiBuilder::new()
        .with_cache_dir(hub.cache_dir.clone())
        .with_endpoint(hub.endpoint.clone())
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .build()
        .map_err(|e| FetchFailure {
            file: missing[0].clone(),
            reason: format!("cannot set up the hub client: {e}"),
        })?;
    let repo = api.repo(Repo::with_revision(
        manifest.repo.clone(),
        RepoType::Model,
        manifest.revision.to_string(),
    ));
    for name in missing {
        tracing::info!(model = %manifest.id, file = %name, endpoint = %hub.endpoint, "downloading model file");
        match repo.download(&name).await {
            Ok(p) => {
                paths.insert(name, p);
            }
            Err(e) => {
                return Err(FetchFailure {
                    file: name,
                    reason: error_chain(&e),
                });
            }
        }
    }
    Ok(paths)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        // reqwest repeats its message one level down: say each cause once.
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = inner.source();
    }
    s
}
