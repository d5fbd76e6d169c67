//! Model code, one file per architecture. A loaded model is a trunk ([`Encoder`]: ids in, packed
//! token states out) and a [`Head`] (pooling for embedders; a classifier or the yes/no direction
//! for rerankers); the model thread drives the pair.

pub mod bert;
pub mod qwen3;
pub mod random_weights;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::batch::PreparedBatch;
use super::pooling;
use crate::model_source::ModelFiles;
use crate::model_spec::{Architecture, ModelSpec, Pooling, Task};

/// What one batch produced, one element per row.
#[derive(Debug)]
pub enum ModelOutput {
    /// Pooled vectors (f32, before truncation and normalisation).
    Vectors(Vec<Vec<f32>>),
    /// Raw relevance logits.
    Scores(Vec<f32>),
}

/// A batch's outputs still on its device (f32): read back by the engine's finisher thread while
/// the model thread launches the next batch.
#[derive(Debug)]
pub enum DeviceOutput {
    /// `[rows, h]` pooled vectors.
    Vectors(Tensor),
    /// `[rows]` raw relevance logits.
    Scores(Tensor),
}

impl DeviceOutput {
    /// Copies the outputs to the host.
    pub fn read(&self) -> candle_core::Result<ModelOutput> {
        Ok(match self {
            DeviceOutput::Vectors(t) => ModelOutput::Vectors(t.to_dtype(DType::F32)?.to_vec2()?),
            DeviceOutput::Scores(t) => ModelOutput::Scores(t.to_dtype(DType::F32)?.to_vec1()?),
        })
    }
}

/// The widths that decide how much memory a batch's activations take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// A trunk: token ids in, packed final token states `[tokens, h]` out.
pub trait Encoder: Send {
    /// Its widths, for the boot-time memory estimate ([`crate::inference::warmup`]).
    fn activation_shape(&self) -> ActivationShape;
    fn forward(&self, batch: &PreparedBatch) -> candle_core::Result<Tensor>;
    /// Width of the token states.
    fn hidden_size(&self) -> usize;
    /// Longest sequence the position table allows.
    fn max_positions(&self) -> usize;
    /// Forward FLOPs per token for rows of `seq_len` tokens (matmuls: 2 per multiply-add,
    /// attention included), for throughput reports.
    fn flops_per_token(&self, seq_len: usize) -> f64;
}

/// Attention's softmax over the last dimension, accumulated in f32: candle's CUDA kernel does
/// so for half dtypes; its CPU kernel sums in the input's dtype, so there a half-precision
/// input is widened first (the CPU's half path exists to check the GPU's math).
pub(crate) fn attention_softmax(scores: &Tensor) -> candle_core::Result<Tensor> {
    let dtype = scores.dtype();
    if scores.device().is_cpu() && dtype != DType::F32 {
        let wide = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?;
        return wide.to_dtype(dtype);
    }
    candle_nn::ops::softmax_last_dim(scores)
}

/// What turns token states into one output per row.
pub trait Head: Send {
    fn apply(&self, hidden: &Tensor, batch: &PreparedBatch) -> candle_core::Result<DeviceOutput>;
}

/// Embedders: pooled token states.
pub struct PooledHead {
    pub pooling: Pooling,
    /// Whether the model's vectors are unit length (the host normalises again after any
    /// Matryoshka truncation).
    pub normalize: bool,
    /// Pool (and normalise) from the row offsets with our fused CUDA kernel on CUDA devices: on
    /// by default (checked against its CPU body on an H200); `FANTOM_FUSED_POOLING=0` turns it
    /// off.
    pub fused: bool,
}

impl PooledHead {
    pub fn new(pooling: Pooling, normalize: bool) -> Self {
        let fused = std::env::var("FANTOM_FUSED_POOLING").map_or(true, |v| v != "0");
        PooledHead {
            pooling,
            normalize,
            fused,
        }
    }
}

impl Head for PooledHead {
    fn apply(&self, hidden: &Tensor, batch: &PreparedBatch) -> candle_core::Result<DeviceOutput> {
        let fusable = matches!(hidden.dtype(), DType::F32 | DType::BF16);
        if self.fused && fusable && hidden.device().is_cuda() && !batch.has_prefixes() {
            let lengths: Vec<u32> = batch.lengths.iter().map(|&l| l as u32).collect();
            let lengths = Tensor::new(lengths.as_slice(), hidden.device())?;
            let width = hidden.dim(1)?;
            let pooled = super::kernels::pool_normalize(
                hidden,
                &batch.first_token,
                &lengths,
                self.pooling,
                width,
                self.normalize,
            )?;
            return Ok(DeviceOutput::Vectors(pooled));
        }
        let pooled = pooling::pool(hidden, batch, self.pooling)?;
        Ok(DeviceOutput::Vectors(pooled.to_dtype(DType::F32)?))
    }
}

/// A loaded model: trunk and head. Owned by exactly one thread, which runs one batch at a time.
pub struct LoadedModel {
    pub encoder: Box<dyn Encoder>,
    pub head: Box<dyn Head>,
}

impl LoadedModel {
    /// Runs a batch and reads its outputs back.
    pub fn run(&self, batch: &PreparedBatch) -> candle_core::Result<ModelOutput> {
        self.start(batch)?.read()
    }

    /// Launches a batch; its outputs stay on the device until read. The thread's stream first
    /// waits for the batch's upload.
    pub fn start(&self, batch: &PreparedBatch) -> candle_core::Result<DeviceOutput> {
        batch.wait_uploaded(batch.input_ids.device())?;
        self.head.apply(&self.encoder.forward(batch)?, batch)
    }
}

/// Where a trunk's tensors live: under `prefix.` (`*For*` checkpoints: `bert.`, `model.`) when
/// `prefix.probe` exists, else at the root (`BertModel`, `Qwen3Model` checkpoints).
pub fn under<'a>(vb: &VarBuilder<'a>, prefix: &str, probe: &str) -> VarBuilder<'a> {
    if vb.contains_tensor(&format!("{prefix}.{probe}")) {
        vb.pp(prefix)
    } else {
        vb.clone()
    }
}

/// Loads the model `spec` describes from verified `files`; `token_id` looks up vocabulary ids
/// (Qwen3-Reranker's `yes` and `no`).
pub fn load(
    files: &ModelFiles,
    spec: &ModelSpec,
    device: &Device,
    dtype: DType,
    token_id: &dyn Fn(&str) -> Option<u32>,
) -> candle_core::Result<LoadedModel> {
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
    let parse = |e: serde_json::Error| candle_core::Error::Msg(format!("config.json: {e}"));
    let embed_head =
        || -> Box<dyn Head> { Box::new(PooledHead::new(spec.pooling, spec.normalize)) };
    let model = match spec.architecture {
        Architecture::Bert => {
            let cfg: bert::BertConfig = serde_json::from_str(&config_text).map_err(parse)?;
            let encoder = bert::BertEncoder::load(
                under(&vb, "bert", "embeddings.word_embeddings.weight"),
                &cfg,
            )?;
            let head: Box<dyn Head> = match spec.task {
                Task::Embed => embed_head(),
                Task::Rerank => Box::new(bert::ClassifierHead::load(&vb, &cfg)?),
            };
            LoadedModel {
                encoder: Box::new(encoder),
                head,
            }
        }
        Architecture::Qwen3 => {
            let cfg: qwen3::Qwen3Config = serde_json::from_str(&config_text).map_err(parse)?;
            let encoder =
                qwen3::Qwen3Encoder::load(under(&vb, "model", "embed_tokens.weight"), &cfg)?;
            let head: Box<dyn Head> = match spec.task {
                Task::Embed => embed_head(),
                Task::Rerank => {
                    let id = |t: &str| {
                        token_id(t).ok_or_else(|| {
                            candle_core::Error::Msg(format!(
                                "the tokenizer has no single token `{t}`; a Qwen3 reranker needs `yes` and `no`"
                            ))
                        })
                    };
                    Box::new(qwen3::YesNoHead::load(&vb, &cfg, id("yes")?, id("no")?)?)
                }
            };
            LoadedModel {
                encoder: Box::new(encoder),
                head,
            }
        }
    };
    Ok(model)
}
