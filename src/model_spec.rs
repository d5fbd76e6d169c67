//! What a model is, as the engine needs to know it: architecture, task, pooling, limits and
//! prompt templates.
//!
//! A [`ModelSpec`] comes from a pinned manifest (`models/*.toml`) or from inspecting a Hugging
//! Face folder (`model_source::folder`); either way the engine sees the same plain struct.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Qwen3-Embedding's query template (no space after `Query:`; documents get none).
pub const QWEN3_QUERY_TEMPLATE: &str = "Instruct: {task}\nQuery:{text}";
/// The instruction Qwen3-Embedding and Qwen3-Reranker use when none is given (the model cards').
pub const QWEN3_DEFAULT_TASK: &str =
    "Given a web search query, retrieve relevant passages that answer the query";
/// Longest Qwen3 input unless a folder or manifest says less (the official recipes' limit).
pub const QWEN3_MAX_TOKENS: usize = 8192;

/// Model code the engine has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// BERT-class encoder (`BertModel`, `BertForSequenceClassification`).
    Bert,
    /// Qwen3 decoder used as an encoder: last-token embedder, yes/no reranker.
    Qwen3,
}

impl Architecture {
    /// Every architecture the engine can load, for error messages.
    pub const ALL: &'static [Architecture] = &[Architecture::Bert, Architecture::Qwen3];

    pub fn as_str(self) -> &'static str {
        match self {
            Architecture::Bert => "bert",
            Architecture::Qwen3 => "qwen3",
        }
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a loaded model is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    /// Texts in, one vector per text out.
    Embed,
    /// (query, document) pairs in, one relevance score per pair out.
    Rerank,
}

impl Task {
    /// "an embedding" / "a reranking", for messages.
    pub fn with_article(self) -> &'static str {
        match self {
            Task::Embed => "an embedding",
            Task::Rerank => "a reranking",
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Task::Embed => "embed",
            Task::Rerank => "rerank",
        })
    }
}

/// How token states become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// Mean over the real (unpadded) tokens.
    Mean,
    /// The first token (`[CLS]`).
    Cls,
    /// The last real token (decoder embedders such as Qwen3).
    Last,
}

impl FromStr for Pooling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "cls" => Ok(Pooling::Cls),
            "last" | "last-token" | "lasttoken" => Ok(Pooling::Last),
            other => Err(format!(
                "unknown pooling `{other}` (expected mean, cls or last)"
            )),
        }
    }
}

impl fmt::Display for Pooling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        })
    }
}

/// How a reranker's raw logit becomes a probability, when the model defines one.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ScoreActivation {
    /// The model defines no probability; only the raw logit is reported.
    #[default]
    None,
    /// `probability = sigmoid(logit)` (single-logit cross-encoders, Qwen3 yes/no).
    Sigmoid,
}

/// Text templates applied before tokenization. `{text}` is the input; `{task}` the instruction.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTemplates {
    /// Template for queries (`embed --query`), e.g. `Instruct: {task}\nQuery:{text}`.
    #[serde(default)]
    pub query: Option<String>,
    /// Template for documents; none means the text as is.
    #[serde(default)]
    pub document: Option<String>,
    /// The instruction substituted for `{task}` when the request names none.
    #[serde(default)]
    pub default_task: Option<String>,
}

impl PromptTemplates {
    /// Applies the query or document template to `text`.
    pub fn apply(&self, text: &str, is_query: bool, task: Option<&str>) -> String {
        let template = if is_query {
            self.query.as_deref()
        } else {
            self.document.as_deref()
        };
        match template {
            None => text.to_string(),
            Some(t) => {
                let task = task.or(self.default_task.as_deref()).unwrap_or("");
                t.replace("{task}", task).replace("{text}", text)
            }
        }
    }
}

/// The settings the engine runs a model with.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub architecture: Architecture,
    pub task: Task,
    /// Pooling for embedders (ignored by rerankers).
    pub pooling: Pooling,
    /// L2-normalise output vectors.
    pub normalize: bool,
    /// Longest input in tokens, special tokens included.
    pub max_tokens: usize,
    /// Output width of an embedder; `None` until the model config is read.
    pub dims: Option<usize>,
    pub prompts: PromptTemplates,
    pub score: ScoreActivation,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_templates() {
        let p = PromptTemplates {
            query: Some("Instruct: {task}\nQuery:{text}".into()),
            document: None,
            default_task: Some("find code".into()),
        };
        assert_eq!(p.apply("x", true, None), "Instruct: find code\nQuery:x");
        assert_eq!(p.apply("x", true, Some("t")), "Instruct: t\nQuery:x");
        assert_eq!(p.apply("x", false, None), "x");
    }

    #[test]
    fn pooling_parse() {
        assert_eq!("mean".parse::<Pooling>().unwrap(), Pooling::Mean);
        assert_eq!("last".parse::<Pooling>().unwrap(), Pooling::Last);
        assert!("max".parse::<Pooling>().is_err());
    }
}
