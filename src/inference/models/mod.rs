//! Model code, one file per architecture, behind one trait the model thread drives.

pub mod bert;
pub mod qwen3;
pub mod random_weights;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use super::batch::PreparedBatch;
use crate::model_source::ModelFiles;
use crate::model_spec::{Architecture, ModelSpec, Task};

/// What one batch produced, one element per row.
#[derive(Debug)]
pub enum ModelOutput {
    /// Pooled vectors (f32, before truncation and normalisation).
    Vectors(Vec<Vec<f32>>),
    /// Raw relevance logits.
    Scores(Vec<f32>),
}

/// A loaded model. Owned by exactly one thread, which calls `run` for one batch at a time.
pub trait LocalModel: Send {
    fn run(&self, batch: &PreparedBatch) -> candle_core::Result<ModelOutput>;
    /// Width of the token states (the embedder's full output width).
    fn hidden_size(&self) -> usize;
    /// Longest sequence the position table allows.
    fn max_positions(&self) -> usize;
    /// Forward FLOPs per token for rows of `seq_len` tokens (matmuls: 2 per multiply-add,
    /// attention included), for throughput reports.
    fn flops_per_token(&self, seq_len: usize) -> f64;
}

/// Loads the model `spec` describes from verified `files`; `token_id` looks up vocabulary ids
/// (Qwen3-Reranker's `yes` and `no`).
pub fn load(
    files: &ModelFiles,
    spec: &ModelSpec,
    device: &Device,
    dtype: DType,
    token_id: &dyn Fn(&str) -> Option<u32>,
) -> candle_core::Result<Box<dyn LocalModel>> {
    let config_text = std::fs::read_to_string(&files.config)?;
    let vb = if files.weights.is_empty() {
        // `--random-weights`: benchmarks of an architecture without its weights.
        VarBuilder::from_backend(
            Box::new(random_weights::RandomWeights),
            dtype,
            device.clone(),
        )
    } else {
        // SAFETY: the files were hashed against their pins just before this; memory-mapping them
        // is how candle avoids a second copy of multi-gigabyte weights. Model files must not be
        // rewritten while a process maps them (the cache and model dirs are ours).
        unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, device)? }
    };
    let model: Box<dyn LocalModel> = match spec.architecture {
        Architecture::Bert => {
            let cfg: bert::BertConfig = serde_json::from_str(&config_text)
                .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
            match spec.task {
                Task::Embed => Box::new(bert::BertEmbedder::load(vb, &cfg, spec.pooling)?),
                Task::Rerank => Box::new(bert::BertCrossEncoder::load(vb, &cfg)?),
            }
        }
        Architecture::Qwen3 => {
            let cfg: qwen3::Qwen3Config = serde_json::from_str(&config_text)
                .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
            match spec.task {
                Task::Embed => Box::new(qwen3::Qwen3Embedder::load(vb, &cfg, spec.pooling)?),
                Task::Rerank => {
                    let id = |t: &str| {
                        token_id(t).ok_or_else(|| {
                            candle_core::Error::Msg(format!(
                                "the tokenizer has no single token `{t}`; a Qwen3 reranker needs `yes` and `no`"
                            ))
                        })
                    };
                    Box::new(qwen3::Qwen3Reranker::load(vb, &cfg, id("yes")?, id("no")?)?)
                }
            }
        }
    };
    Ok(model)
}
