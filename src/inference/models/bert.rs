//! BERT-class encoders: the embedder (`BertModel` + pooling) and the cross-encoder
//! (`BertForSequenceClassification`: pooler + one-logit classifier).
//!
//! Our own code rather than `candle_transformers::models::bert`, for speed on the padded CPU
//! path, with the same numbers:
//! * Q, K and V are one fused `[3h, h]` projection, and the `1/√d` attention scale is folded into
//!   the Q weights at load, so each layer runs one matmul fewer and no scaling pass.
//! * Tokens are packed (no padding rows, see `inference::batch`): every dense layer is one
//!   2-D GEMM over real tokens only. Attention is packed attention (`inference::attention`: the
//!   CPU body, or the CUDA kernel in bf16/f16 for head dims 32 and 64), reading Q, K and V in
//!   place from the fused projection; masked matmul attention over gathered, right-padded rows
//!   where the kernel does not run.
//! * On the CPU, bias + GELU and bias + residual + LayerNorm run as fused in-place kernels
//!   (`inference::cpu_ops`); elsewhere they are candle's ops.
//!
//! Weights load with or without the `bert.` prefix, so a sentence-transformers `BertModel` and
//! a `BertForSequenceClassification` checkpoint both work.

use candle_core::{D, DType, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};
use serde::Deserialize;

use super::{DeviceOutput, Encoder, Head};
use crate::inference::attention::PackedAttention;
use crate::inference::batch::{PaddedLayout, PreparedBatch};
use crate::inference::cpu_ops::{BiasGelu, BiasResidualLayerNorm, host_vec};

/// The fields of a BERT `config.json` the encoder reads.
#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub position_embedding_type: Option<String>,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}

#[derive(Debug, Clone, Copy)]
enum Activation {
    /// Exact GELU with erf (`gelu` in transformers).
    GeluErf,
    /// Tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    Relu,
}

impl Activation {
    fn parse(name: &str) -> Result<Self> {
        match name {
            "gelu" => Ok(Self::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Self::GeluTanh),
            "relu" => Ok(Self::Relu),
            other => candle_core::bail!("unsupported BERT activation `{other}`"),
        }
    }

    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::GeluErf => x.gelu_erf(),
            Self::GeluTanh => x.gelu(),
            Self::Relu => x.relu(),
        }
    }
}

/// `y = x Wᵀ + b` on a 2-D input. Holds `Wᵀ` contiguous (`[in, out]`): gemm packs its right
/// operand on every call, and packing row-major memory is cheap where gathering the columns of
/// a transposed view was a quarter of small-batch CPU time.
struct Dense {
    weight_t: Tensor,
    bias: Tensor,
}

impl Dense {
    fn load(vb: &VarBuilder, inp: usize, out: usize) -> Result<Self> {
        Self::new(vb.get((out, inp), "weight")?, vb.get(out, "bias")?)
    }

    /// From PyTorch's `[out, in]` weight.
    fn new(weight: Tensor, bias: Tensor) -> Result<Self> {
        Ok(Self {
            weight_t: weight.t()?.contiguous()?,
            bias,
        })
    }

    /// `x Wᵀ` without the bias (fused kernels add it).
    fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.weight_t)
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.matmul(x)?.broadcast_add(&self.bias)
    }
}

struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    fn load(vb: &VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            bias: vb.get(size, "bias")?,
            eps: eps as f32,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// A dense layer followed by `LayerNorm(· + residual)`.
struct DenseResidualNorm {
    dense: Dense,
    norm: LayerNorm,
    /// The fused CPU kernel with host copies of bias, gamma and beta; `None` off the CPU.
    fused: Option<BiasResidualLayerNorm>,
}

impl DenseResidualNorm {
    fn load(vb: &VarBuilder, inp: usize, out: usize, eps: f64, cpu: bool) -> Result<Self> {
        let dense = Dense::load(&vb.pp("dense"), inp, out)?;
        let norm = LayerNorm::load(&vb.pp("LayerNorm"), out, eps)?;
        let fused = if cpu {
            Some(BiasResidualLayerNorm {
                bias: host_vec(&dense.bias)?,
                gamma: host_vec(&norm.weight)?,
                beta: host_vec(&norm.bias)?,
                eps: norm.eps,
            })
        } else {
            None
        };
        Ok(Self { dense, norm, fused })
    }

    fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        match &self.fused {
            Some(op) => {
                let y = self.dense.matmul(x)?;
                y.inplace_op2(residual, op)?;
                Ok(y)
            }
            None => self.norm.forward(&(self.dense.forward(x)? + residual)?),
        }
    }
}

/// The feed-forward input projection and its activation.
struct Intermediate {
    dense: Dense,
    act: Activation,
    /// The fused CPU bias + exact-GELU kernel; `None` off the CPU or for other activations.
    fused: Option<BiasGelu>,
}

impl Intermediate {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.fused {
            Some(op) => {
                let y = self.dense.matmul(x)?;
                y.inplace_op1(op)?;
                Ok(y)
            }
            None => self.act.apply(&self.dense.forward(x)?),
        }
    }
}

struct Layer {
    qkv: Dense,
    attn_out: DenseResidualNorm,
    intermediate: Intermediate,
    output: DenseResidualNorm,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &BertConfig, act: Activation, cpu: bool) -> Result<Self> {
        let h = cfg.hidden_size;
        let att = vb.pp("attention");
        let sa = att.pp("self");
        let head_dim = h / cfg.num_attention_heads;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let q = Dense::load(&sa.pp("query"), h, h)?;
        let k = Dense::load(&sa.pp("key"), h, h)?;
        let v = Dense::load(&sa.pp("value"), h, h)?;
        // Fold the attention scale into Q: (sQ)Kᵀ = s(QKᵀ).
        let qkv = Dense {
            weight_t: Tensor::cat(&[(q.weight_t * scale)?, k.weight_t, v.weight_t], 1)?,
            bias: Tensor::cat(&[(q.bias * scale)?, k.bias, v.bias], 0)?,
        };
        let eps = cfg.layer_norm_eps;
        let dense = Dense::load(&vb.pp("intermediate").pp("dense"), h, cfg.intermediate_size)?;
        let fused_gelu = match (cpu, act) {
            (true, Activation::GeluErf) => Some(BiasGelu {
                bias: host_vec(&dense.bias)?,
            }),
            _ => None,
        };
        Ok(Self {
            qkv,
            attn_out: DenseResidualNorm::load(&att.pp("output"), h, h, eps, cpu)?,
            intermediate: Intermediate {
                dense,
                act,
                fused: fused_gelu,
            },
            output: DenseResidualNorm::load(&vb.pp("output"), cfg.intermediate_size, h, eps, cpu)?,
        })
    }

    /// `x`: packed `[tokens, h]`.
    fn forward(&self, x: &Tensor, attn: &AttentionInputs, heads: usize) -> Result<Tensor> {
        let qkv = self.qkv.forward(x)?; // [tokens, 3h]
        let ctx = attn.attend(&qkv, heads)?; // [tokens, h]
        let x = self.attn_out.forward(&ctx, x)?;
        let inter = self.intermediate.forward(&x)?;
        self.output.forward(&inter, &x)
    }
}

/// What attention needs besides Q, K and V, computed once per batch.
enum AttentionInputs<'a> {
    /// Packed tokens with row lengths: the packed attention op (its row table on CUDA).
    Packed { op: PackedAttention },
    /// Right-padded rows: gather, masked matmul attention, scatter back.
    Padded {
        layout: &'a PaddedLayout,
        rows: usize,
        /// `[rows, 1, 1, longest]`: 0 for tokens, a large negative for padding.
        mask_bias: Tensor,
    },
}

impl AttentionInputs<'_> {
    /// Bidirectional attention over each row; `qkv` is packed `[tokens, 3h]` with the scale
    /// already folded into Q. Returns packed `[tokens, h]`.
    fn attend(&self, qkv: &Tensor, heads: usize) -> Result<Tensor> {
        let (tokens, h3) = qkv.dims2()?;
        let h = h3 / 3;
        let d = h / heads;
        match self {
            Self::Packed { op } => {
                // Column slices of the fused projection, read in place by the kernel.
                let (q, k, v) = (
                    qkv.narrow(1, 0, h)?,
                    qkv.narrow(1, h, h)?,
                    qkv.narrow(1, 2 * h, h)?,
                );
                debug_assert_eq!((op.q_heads, op.head_dim), (heads, d));
                let out = q.apply_op3_no_bwd(&k, &v, op)?;
                debug_assert_eq!(out.dims2()?, (tokens, h));
                Ok(out)
            }
            Self::Padded {
                layout,
                rows,
                mask_bias,
            } => {
                let (b, s) = (*rows, layout.longest);
                let padded = qkv.index_select(&layout.gather, 0)?; // [b·s, 3h]
                let part = |i: usize| -> Result<Tensor> {
                    padded
                        .narrow(1, i * h, h)?
                        .reshape((b, s, heads, d))?
                        .transpose(1, 2)?
                        .contiguous()
                };
                let (q, k, v) = (part(0)?, part(1)?, part(2)?); // [b, heads, s, d]
                let scores = q.matmul(&k.t()?)?.broadcast_add(mask_bias)?;
                let probs = super::attention_softmax(&scores)?;
                let ctx = probs
                    .matmul(&v)?
                    .transpose(1, 2)?
                    .contiguous()?
                    .reshape((b * s, h))?;
                ctx.index_select(&layout.scatter, 0)
            }
        }
    }
}

/// The BERT trunk: embeddings and encoder layers.
pub struct BertEncoder {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
    heads: usize,
    hidden: usize,
    intermediate: usize,
    max_positions: usize,
    dtype: DType,
}

impl BertEncoder {
    /// Loads the trunk from `vb` (rooted where `embeddings.*` lives).
    pub fn load(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        if let Some(kind) = cfg.position_embedding_type.as_deref()
            && kind != "absolute"
        {
            candle_core::bail!("unsupported BERT position_embedding_type `{kind}`");
        }
        if !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
            candle_core::bail!("hidden_size is not a multiple of num_attention_heads");
        }
        let h = cfg.hidden_size;
        let act = Activation::parse(&cfg.hidden_act)?;
        // The fused kernels are f32 CPU code; CUDA runs candle's ops.
        let cpu = vb.device().is_cpu() && vb.dtype() == DType::F32;
        let emb = vb.pp("embeddings");
        let embedding = |name: &str, n: usize| -> Result<Embedding> {
            Ok(Embedding::new(emb.pp(name).get((n, h), "weight")?, h))
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                Layer::load(
                    vb.pp("encoder").pp("layer").pp(i.to_string()),
                    cfg,
                    act,
                    cpu,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            word: embedding("word_embeddings", cfg.vocab_size)?,
            position: embedding("position_embeddings", cfg.max_position_embeddings)?,
            token_type: embedding("token_type_embeddings", cfg.type_vocab_size)?,
            embed_norm: LayerNorm::load(&emb.pp("LayerNorm"), h, cfg.layer_norm_eps)?,
            layers,
            heads: cfg.num_attention_heads,
            hidden: h,
            intermediate: cfg.intermediate_size,
            max_positions: cfg.max_position_embeddings,
            dtype: vb.dtype(),
        })
    }
}

impl Encoder for BertEncoder {
    fn activation_shape(&self) -> super::ActivationShape {
        super::ActivationShape {
            hidden: self.hidden,
            intermediate: self.intermediate,
            heads: self.heads,
            kv_heads: self.heads,
            head_dim: self.hidden / self.heads.max(1),
        }
    }

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Projections and MLP (2·params) plus bidirectional attention over `seq_len`.
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let h = self.hidden as f64;
        let inter = self.intermediate as f64;
        let per_layer = 4.0 * h * h + 2.0 * h * inter;
        let attention = 4.0 * h * seq_len as f64;
        self.layers.len() as f64 * (2.0 * per_layer + attention)
    }

    /// Packed token states `[tokens, h]`.
    fn forward(&self, batch: &PreparedBatch) -> Result<Tensor> {
        if batch.has_prefixes() {
            candle_core::bail!("BERT attends both ways: rows cannot share a prefix");
        }
        let longest = batch.lengths.iter().copied().max().unwrap_or(0);
        if longest > self.max_positions {
            candle_core::bail!(
                "a row of {longest} tokens exceeds {} positions",
                self.max_positions
            );
        }
        let x = (self.word.forward(&batch.input_ids)?
            + self.position.forward(&batch.positions)?
            + self.token_type.forward(&batch.type_ids)?)?;
        let mut x = self.embed_norm.forward(&x)?;
        let attn =
            match &batch.padded {
                // Bidirectional: no shared prefixes (refused above); the scale is in Q.
                None => AttentionInputs::Packed {
                    op: batch.attention(
                        (self.heads, self.heads, self.hidden / self.heads),
                        1.0,
                        false,
                    ),
                },
                Some(layout) => {
                    let mask_bias = ((layout.mask.to_dtype(self.dtype)? - 1.0)? * 1e4)?
                        .reshape((batch.rows(), 1, 1, layout.longest))?;
                    AttentionInputs::Padded {
                        layout,
                        rows: batch.rows(),
                        mask_bias,
                    }
                }
            };
        for layer in &self.layers {
            x = layer.forward(&x, &attn, self.heads)?;
        }
        Ok(x)
    }
}

/// The head of `BertForSequenceClassification`: pooler (`tanh(W·[CLS] + b)`) and a one-logit
/// classifier.
pub struct ClassifierHead {
    pooler: Dense,
    classifier: Dense,
}

impl ClassifierHead {
    /// `vb` is the checkpoint root (the pooler sits in the trunk, the classifier beside it).
    pub fn load(vb: &VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            pooler: Dense::load(
                &super::under(vb, "bert", "embeddings.word_embeddings.weight")
                    .pp("pooler")
                    .pp("dense"),
                h,
                h,
            )?,
            classifier: Dense::load(&vb.pp("classifier"), h, 1)?,
        })
    }
}

impl Head for ClassifierHead {
    fn apply(&self, hidden: &Tensor, batch: &PreparedBatch) -> Result<DeviceOutput> {
        let cls = hidden.index_select(&batch.first_token, 0)?;
        let pooled = self.pooler.forward(&cls)?.tanh()?;
        let logits = self.classifier.forward(&pooled)?.squeeze(D::Minus1)?;
        Ok(DeviceOutput::Scores(logits.to_dtype(DType::F32)?))
    }
}
