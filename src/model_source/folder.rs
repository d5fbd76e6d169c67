//! Reading a Hugging Face model folder: `config.json`, the sentence-transformers files
//! (`modules.json`, `1_Pooling/config.json`, `sentence_bert_config.json`) and the weight layout
//! (`model.safetensors` or a sharded `model.safetensors.index.json`).
//!
//! Pinned loads use this only for the weight layout; unpinned loads (`--model-dir` alone) take
//! their whole [`ModelSpec`] from here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::model_spec::{
    Architecture, ModelSpec, Pooling, PromptTemplates, QWEN3_DEFAULT_TASK, QWEN3_MAX_TOKENS,
    QWEN3_QUERY_TEMPLATE, ScoreActivation, Task,
};

/// The parts of `config.json` the loader reads to decide what the model is.
#[derive(Deserialize, Debug, Default)]
pub struct ConfigSummary {
    #[serde(default)]
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub hidden_size: Option<usize>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub num_labels: Option<usize>,
    #[serde(default)]
    pub id2label: Option<serde_json::Map<String, serde_json::Value>>,
}

impl ConfigSummary {
    pub fn read(dir: &Path) -> Result<Self, String> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{} is not valid: {e}", path.display()))
    }

    /// The architecture, from `model_type` first and `architectures` second.
    pub fn architecture(&self) -> Result<Architecture, String> {
        let from_type = match self.model_type.as_deref() {
            Some("bert") => Some(Architecture::Bert),
            Some("qwen3") => Some(Architecture::Qwen3),
            _ => None,
        };
        let from_arch = self.architectures.iter().find_map(|a| {
            if a.starts_with("Bert") {
                Some(Architecture::Bert)
            } else if a.starts_with("Qwen3") && !a.starts_with("Qwen3Moe") {
                Some(Architecture::Qwen3)
            } else {
                None
            }
        });
        from_type.or(from_arch).ok_or_else(|| {
            format!(
                "unsupported model (model_type {:?}, architectures {:?}); this build runs: {}",
                self.model_type,
                self.architectures,
                Architecture::ALL
                    .iter()
                    .map(|a| a.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    /// Number of classifier outputs (1 for a relevance cross-encoder).
    pub fn labels(&self) -> usize {
        self.num_labels
            .or_else(|| self.id2label.as_ref().map(|m| m.len()))
            .unwrap_or(2)
    }

    pub fn is_classifier(&self) -> bool {
        self.architectures
            .iter()
            .any(|a| a.ends_with("ForSequenceClassification"))
    }
}

/// The safetensors files of a folder: `model.safetensors`, or the shards an index names.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        return shards_of_index(&index);
    }
    let hint = if dir.join("pytorch_model.bin").exists() {
        " (pytorch_model.bin is not loaded: pickle files can run code; convert it to safetensors)"
    } else {
        ""
    };
    Err(format!(
        "{} holds no model.safetensors or model.safetensors.index.json{hint}",
        dir.display()
    ))
}

/// The shard file names a `model.safetensors.index.json` maps tensors to, in name order.
pub fn shard_names(index: &Path) -> Result<Vec<String>, String> {
    #[derive(Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(index)
        .map_err(|e| format!("cannot read {}: {e}", index.display()))?;
    let parsed: Index = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a safetensors index: {e}", index.display()))?;
    let shards: BTreeSet<String> = parsed.weight_map.into_values().collect();
    if shards.is_empty() {
        return Err(format!("{} maps no tensors", index.display()));
    }
    for shard in &shards {
        if shard.contains("..") || shard.contains('/') || !shard.ends_with(".safetensors") {
            return Err(format!(
                "{} names a shard that is not a safetensors file beside it: {shard}",
                index.display()
            ));
        }
    }
    Ok(shards.into_iter().collect())
}

/// The shard files of an index, which must all exist beside it.
pub fn shards_of_index(index: &Path) -> Result<Vec<PathBuf>, String> {
    let dir = index.parent().unwrap_or(Path::new("."));
    shard_names(index)?
        .into_iter()
        .map(|shard| {
            let p = dir.join(&shard);
            if p.is_file() {
                Ok(p)
            } else {
                Err(format!(
                    "{} names {shard}, which is missing",
                    index.display()
                ))
            }
        })
        .collect()
}

#[derive(Deserialize)]
struct StModule {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: String,
}

#[derive(Deserialize)]
struct StPooling {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

/// Pooling and normalisation declared by the sentence-transformers files, if there are any.
fn sentence_transformers_pooling(dir: &Path) -> Result<Option<(Pooling, bool)>, String> {
    let modules_path = dir.join("modules.json");
    let Ok(text) = std::fs::read_to_string(&modules_path) else {
        return Ok(None);
    };
    let modules: Vec<StModule> = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not valid: {e}", modules_path.display()))?;
    let normalize = modules.iter().any(|m| m.kind.ends_with(".Normalize"));
    let Some(pool) = modules.iter().find(|m| m.kind.ends_with(".Pooling")) else {
        return Ok(None);
    };
    let cfg_path = dir.join(&pool.path).join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .map_err(|e| format!("cannot read {}: {e}", cfg_path.display()))?;
    let cfg: StPooling = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not valid: {e}", cfg_path.display()))?;
    let pooling = if cfg.pooling_mode_mean_tokens {
        Pooling::Mean
    } else if cfg.pooling_mode_cls_token {
        Pooling::Cls
    } else if cfg.pooling_mode_lasttoken {
        Pooling::Last
    } else if cfg.pooling_mode_max_tokens || cfg.pooling_mode_mean_sqrt_len_tokens {
        return Err(format!(
            "{} asks for a pooling this engine does not run (max / mean-sqrt-len); pass --pooling to override",
            cfg_path.display()
        ));
    } else {
        return Err(format!("{} enables no pooling mode", cfg_path.display()));
    };
    Ok(Some((pooling, normalize)))
}

/// The max input length a folder declares: sentence-transformers' `max_seq_length`, else the
/// tokenizer's `model_max_length`, never above the position table.
fn declared_max_tokens(dir: &Path, config: &ConfigSummary) -> usize {
    #[derive(Deserialize)]
    struct St {
        max_seq_length: Option<usize>,
    }
    #[derive(Deserialize)]
    struct Tok {
        model_max_length: Option<f64>,
    }
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let st = read("sentence_bert_config.json")
        .and_then(|t| serde_json::from_str::<St>(&t).ok())
        .and_then(|s| s.max_seq_length);
    let tok = read("tokenizer_config.json")
        .and_then(|t| serde_json::from_str::<Tok>(&t).ok())
        .and_then(|t| t.model_max_length)
        .filter(|n| (2.0..1e7).contains(n))
        .map(|n| n as usize);
    let positions = config.max_position_embeddings.unwrap_or(512);
    st.or(tok).unwrap_or(positions).min(positions)
}

/// Settings for an unpinned folder: everything read from its files, the task from the caller.
pub fn inspect(dir: &Path, task: Task) -> Result<ModelSpec, String> {
    let config = ConfigSummary::read(dir)?;
    let architecture = config.architecture()?;
    let max_tokens = declared_max_tokens(dir, &config);
    let (pooling, normalize, score) = match task {
        Task::Embed => {
            let (pooling, normalize) = match sentence_transformers_pooling(dir)? {
                Some(p) => p,
                // No sentence-transformers files: BERT's own convention is the [CLS] state.
                None => (
                    match architecture {
                        Architecture::Bert => Pooling::Cls,
                        // Decoders see the whole text only at the last token.
                        Architecture::Qwen3 => Pooling::Last,
                    },
                    true,
                ),
            };
            (pooling, normalize, ScoreActivation::None)
        }
        Task::Rerank => match architecture {
            Architecture::Bert => {
                if !config.is_classifier() {
                    return Err(format!(
                        "{} holds {:?}, not a sequence-classification model: rerank needs a cross-encoder",
                        dir.display(),
                        config.architectures
                    ));
                }
                if config.labels() != 1 {
                    return Err(format!(
                        "{} classifies into {} labels; a reranker has exactly one relevance logit",
                        dir.display(),
                        config.labels()
                    ));
                }
                // sentence-transformers' CrossEncoder applies a sigmoid to single-logit models.
                (Pooling::Cls, false, ScoreActivation::Sigmoid)
            }
            Architecture::Qwen3 => {
                // Qwen3-Reranker is a causal LM judged by its "yes" and "no" logits.
                if !config
                    .architectures
                    .iter()
                    .any(|a| a.ends_with("ForCausalLM"))
                {
                    return Err(format!(
                        "{} holds {:?}: a Qwen3 reranker is a Qwen3ForCausalLM (yes/no logits)",
                        dir.display(),
                        config.architectures
                    ));
                }
                (Pooling::Last, false, ScoreActivation::Sigmoid)
            }
        },
    };
    let (max_tokens, prompts) = match architecture {
        Architecture::Bert => (max_tokens, PromptTemplates::default()),
        Architecture::Qwen3 => (
            // The official recipes cap inputs at 8192 tokens unless the folder says less.
            max_tokens.min(QWEN3_MAX_TOKENS),
            PromptTemplates {
                query: (task == Task::Embed).then(|| QWEN3_QUERY_TEMPLATE.to_string()),
                document: None,
                default_task: Some(QWEN3_DEFAULT_TASK.to_string()),
            },
        ),
    };
    Ok(ModelSpec {
        architecture,
        task,
        pooling,
        normalize,
        max_tokens,
        dims: config.hidden_size.filter(|_| task == Task::Embed),
        prompts,
        score,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn sentence_transformers_folder() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "config.json",
            r#"{"model_type":"bert","architectures":["BertModel"],"hidden_size":384,"max_position_embeddings":512}"#,
        );
        write(
            d.path(),
            "modules.json",
            r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
                {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
        );
        write(
            d.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens":true}"#,
        );
        write(
            d.path(),
            "sentence_bert_config.json",
            r#"{"max_seq_length":256}"#,
        );
        let spec = inspect(d.path(), Task::Embed).unwrap();
        assert_eq!(spec.pooling, Pooling::Mean);
        assert!(spec.normalize);
        assert_eq!(spec.max_tokens, 256);
        assert_eq!(spec.dims, Some(384));
        let err = inspect(d.path(), Task::Rerank).unwrap_err();
        assert!(err.contains("not a sequence-classification model"), "{err}");
    }

    #[test]
    fn plain_bert_defaults_to_cls_and_position_limit() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "config.json",
            r#"{"architectures":["BertModel"],"hidden_size":8,"max_position_embeddings":128}"#,
        );
        write(
            d.path(),
            "tokenizer_config.json",
            r#"{"model_max_length":1000000000000000019884624838656}"#,
        );
        let spec = inspect(d.path(), Task::Embed).unwrap();
        assert_eq!(spec.pooling, Pooling::Cls);
        assert_eq!(spec.max_tokens, 128);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "config.json",
            r#"{"model_type":"t5","architectures":["T5Model"]}"#,
        );
        let err = inspect(d.path(), Task::Embed).unwrap_err();
        assert!(err.contains("t5") && err.contains("bert"), "{err}");
    }

    #[test]
    fn sharded_weights_and_pickles() {
        let d = tempfile::tempdir().unwrap();
        assert!(weight_files(d.path()).is_err());
        write(d.path(), "pytorch_model.bin", "x");
        assert!(weight_files(d.path()).unwrap_err().contains("pickle"));
        write(
            d.path(),
            "model.safetensors.index.json",
            r#"{"metadata":{},"weight_map":{"a":"b.safetensors","c":"a.safetensors","d":"b.safetensors"}}"#,
        );
        assert!(weight_files(d.path()).unwrap_err().contains("missing"));
        write(d.path(), "a.safetensors", "");
        write(d.path(), "b.safetensors", "");
        let files = weight_files(d.path()).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(names, ["a.safetensors", "b.safetensors"]);
    }
}
