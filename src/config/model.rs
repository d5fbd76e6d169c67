//! One local model to load: which files, on which device, with which batch limits. The CLI's
//! model flags and the agent's `[[models]]` tables both become a [`ModelChoice`], so there is
//! one way from configuration to a running [`Engine`].

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Deserialize;

use crate::inference::{
    AttentionMode, DTypeSpec, DeviceSpec, Engine, EngineConfig, Truncation, Warmup,
};
use crate::manifest::ManifestRegistry;
use crate::manifest::lock::ModelsLock;
use crate::model_source::{self, HubOptions, ModelSelector, SourceOptions, SpecOverrides};
use crate::model_spec::{Pooling, Task};

/// A local model and how to run it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelChoice {
    /// A pinned model id (`fantom-sidecar models list`).
    #[serde(default)]
    pub model: Option<String>,
    /// The model's files: with `model`, verified against the pin; alone, any HF folder.
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
    /// Config and tokenizer from `model_dir`, weights random (benchmarks only); with `model`,
    /// that pinned manifest's settings.
    #[serde(default)]
    pub random_weights: bool,
    #[serde(default = "default_device", with = "from_str")]
    pub device: DeviceSpec,
    #[serde(default = "default_dtype", with = "from_str")]
    pub dtype: DTypeSpec,
    /// Pooling of an unpinned folder.
    #[serde(default, with = "from_str_opt")]
    pub pooling: Option<Pooling>,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Refuse over-long inputs instead of truncating them.
    #[serde(default)]
    pub no_truncate: bool,
    /// `None`: sized from free memory on a GPU, 16384 on the CPU.
    #[serde(default)]
    pub max_batch_tokens: Option<usize>,
    #[serde(default = "default_batch_rows")]
    pub max_batch_rows: usize,
    /// How much of the worst-case batch runs at start: `auto` (all of it on a GPU, one row on
    /// the CPU), `full`, `one-row`.
    #[serde(default, with = "from_str")]
    pub warmup: Warmup,
    /// The lock file for digests the manifests leave empty.
    #[serde(default)]
    pub lock_file: Option<PathBuf>,
    /// Extra manifests (*.toml).
    #[serde(default)]
    pub manifests: Option<PathBuf>,
}

fn default_device() -> DeviceSpec {
    DeviceSpec::Auto
}
fn default_dtype() -> DTypeSpec {
    DTypeSpec::Auto
}
fn default_batch_rows() -> usize {
    EngineConfig::default().max_batch_rows
}

impl ModelChoice {
    pub fn selector(&self) -> anyhow::Result<ModelSelector> {
        if self.random_weights
            && let Some(dir) = &self.model_dir
        {
            return Ok(ModelSelector::RandomWeights {
                dir: dir.clone(),
                like: self.model.clone(),
            });
        }
        Ok(ModelSelector::from_flags(
            self.model.clone(),
            self.model_dir.clone(),
        )?)
    }

    pub fn source_options(&self) -> anyhow::Result<SourceOptions> {
        source_options(self.manifests.as_deref(), self.lock_file.as_deref())
    }

    pub fn overrides(&self) -> SpecOverrides {
        SpecOverrides {
            pooling: self.pooling,
            max_tokens: self.max_tokens,
        }
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            device: self.device,
            dtype: self.dtype,
            max_batch_tokens: self.max_batch_tokens,
            max_batch_rows: self.max_batch_rows,
            warmup: self.warmup,
            truncation: if self.no_truncate {
                Truncation::Refuse
            } else {
                Truncation::Truncate
            },
            attention: AttentionMode::Auto,
        }
    }

    /// Resolves, verifies and loads the model for `task`.
    pub async fn load(&self, task: Task) -> anyhow::Result<Engine> {
        self.load_with(task, self.engine_config()).await
    }

    /// [`ModelChoice::load`] with engine settings of the caller's.
    pub async fn load_with(&self, task: Task, cfg: EngineConfig) -> anyhow::Result<Engine> {
        let selector = self.selector()?;
        let opts = self.source_options()?;
        let resolved = model_source::resolve(&selector, task, &self.overrides(), &opts).await?;
        let engine = tokio::task::spawn_blocking(move || Engine::start(resolved, cfg))
            .await
            .context("the model loader panicked")??;
        Ok(engine)
    }
}

/// Built-in manifests plus those in `manifests`, the lock file (default path unless given) and
/// the hub and mirror settings from the environment.
pub fn source_options(
    manifests: Option<&Path>,
    lock_file: Option<&Path>,
) -> anyhow::Result<SourceOptions> {
    let mut registry = ManifestRegistry::built_in();
    if let Some(dir) = manifests {
        registry.add_dir(dir)?;
    }
    Ok(SourceOptions {
        registry,
        lock_path: lock_file.map_or_else(ModelsLock::default_path, Path::to_path_buf),
        hub: HubOptions::from_env(),
        mirror: crate::model_source::MirrorOptions::from_env(),
    })
}

/// Fields read from their `FromStr` text (devices, dtypes).
mod from_str {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, de::Error};

    pub fn deserialize<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr<Err: Display>,
    {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

mod from_str_opt {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, de::Error};

    pub fn deserialize<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr<Err: Display>,
    {
        Option::<String>::deserialize(d)?
            .map(|s| s.parse().map_err(D::Error::custom))
            .transpose()
    }
}
