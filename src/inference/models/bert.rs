//! BERT-class encoders: the embedder (`BertModel` + pooling) and the cross-encoder
//! (`BertForSequenceClassification`: pooler + one-logit classifier).
//!
//! Our own code rather than `candle_transformers::models::bert`, for speed on the padded CPU
//! path, with the same numbers:
//! * Q, K and V are one fused `[3h, h]` projection, and the `1/√d` attention scale is folded into
//!   the Q weights at load, so each layer runs one matmul fewer and no scaling pass.
//! * Dense layers run on `[rows × seq, h]` 2-D matrices (one large GEMM, not a batched one).
//! * Softmax and layer norm are candle's fused last-dimension kernels.
//!
//! Weights load with or without the `bert.` prefix, so a sentence-transformers `BertModel` and
//! a `BertForSequenceClassification` checkpoint both work.

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};
use serde::Deserialize;

use super::{LocalModel, ModelOutput};
use crate::inference::batch::PreparedBatch;
use crate::inference::pooling;
use crate::model_spec::Pooling;

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

/// `y = x Wᵀ + b` on a 2-D input.
struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    fn load(vb: &VarBuilder, inp: usize, out: usize) -> Result<Self> {
        Ok(Self {
            weight: vb.get((out, inp), "weight")?,
            bias: vb.get(out, "bias")?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.weight.t()?)?.broadcast_add(&self.bias)
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

struct Layer {
    qkv: Dense,
    attn_out: Dense,
    attn_norm: LayerNorm,
    intermediate: Dense,
    output: Dense,
    out_norm: LayerNorm,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
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
            weight: Tensor::cat(&[(q.weight * scale)?, k.weight, v.weight], 0)?,
            bias: Tensor::cat(&[(q.bias * scale)?, k.bias, v.bias], 0)?,
        };
        Ok(Self {
            qkv,
            attn_out: Dense::load(&att.pp("output").pp("dense"), h, h)?,
            attn_norm: LayerNorm::load(&att.pp("output").pp("LayerNorm"), h, cfg.layer_norm_eps)?,
            intermediate: Dense::load(
                &vb.pp("intermediate").pp("dense"),
                h,
                cfg.intermediate_size,
            )?,
            output: Dense::load(&vb.pp("output").pp("dense"), cfg.intermediate_size, h)?,
            out_norm: LayerNorm::load(&vb.pp("output").pp("LayerNorm"), h, cfg.layer_norm_eps)?,
        })
    }

    /// `x`: `[b·s, h]`; `mask_bias`: `[b, 1, 1, s]` (0 for tokens, a large negative for padding).
    fn forward(
        &self,
        x: &Tensor,
        mask_bias: &Tensor,
        (b, s): (usize, usize),
        heads: usize,
        act: Activation,
    ) -> Result<Tensor> {
        let h = x.dim(1)?;
        let d = h / heads;
        let qkv = self.qkv.forward(x)?; // [b·s, 3h]
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(1, i * h, h)?
                .reshape((b, s, heads, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?); // [b, heads, s, d]
        let scores = q.matmul(&k.t()?)?.broadcast_add(mask_bias)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let ctx = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * s, h))?;
        let x = self
            .attn_norm
            .forward(&(self.attn_out.forward(&ctx)? + x)?)?;
        let inter = act.apply(&self.intermediate.forward(&x)?)?;
        self.out_norm.forward(&(self.output.forward(&inter)? + x)?)
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
    act: Activation,
    max_positions: usize,
    dtype: DType,
    device: Device,
}

impl BertEncoder {
    /// Loads the trunk from `vb` (rooted where `embeddings.*` lives).
    pub fn load(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        if let Some(kind) = cfg.position_embedding_type.as_deref()
            && kind != "absolute"
        {
            candle_core::bail!("unsupported BERT position_embedding_type `{kind}`");
        }
        if cfg.hidden_size % cfg.num_attention_heads != 0 {
            candle_core::bail!("hidden_size is not a multiple of num_attention_heads");
        }
        let h = cfg.hidden_size;
        let emb = vb.pp("embeddings");
        let embedding = |name: &str, n: usize| -> Result<Embedding> {
            Ok(Embedding::new(emb.pp(name).get((n, h), "weight")?, h))
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(vb.pp("encoder").pp("layer").pp(i.to_string()), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            word: embedding("word_embeddings", cfg.vocab_size)?,
            position: embedding("position_embeddings", cfg.max_position_embeddings)?,
            token_type: embedding("token_type_embeddings", cfg.type_vocab_size)?,
            embed_norm: LayerNorm::load(&emb.pp("LayerNorm"), h, cfg.layer_norm_eps)?,
            layers,
            heads: cfg.num_attention_heads,
            hidden: h,
            act: Activation::parse(&cfg.hidden_act)?,
            max_positions: cfg.max_position_embeddings,
            dtype: vb.dtype(),
            device: vb.device().clone(),
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Token states `[b, s, h]` for a right-padded batch.
    pub fn forward(&self, batch: &PreparedBatch) -> Result<Tensor> {
        let (b, s) = batch.input_ids.dims2()?;
        if s > self.max_positions {
            candle_core::bail!(
                "sequence of {s} tokens exceeds {} positions",
                self.max_positions
            );
        }
        let positions = Tensor::arange(0u32, s as u32, &self.device)?;
        let x = self
            .word
            .forward(&batch.input_ids)?
            .broadcast_add(&self.position.forward(&positions)?)?
            .add(&self.token_type.forward(&batch.type_ids)?)?;
        let mut x = self.embed_norm.forward(&x)?.reshape((b * s, self.hidden))?;
        // 0 where a token is, a large negative where padding is, broadcast over heads and rows.
        let mask_bias = ((batch.mask.to_dtype(self.dtype)? - 1.0)? * 1e4)?.reshape((b, 1, 1, s))?;
        for layer in &self.layers {
            x = layer.forward(&x, &mask_bias, (b, s), self.heads, self.act)?;
        }
        x.reshape((b, s, self.hidden))
    }
}

/// Finds where the trunk's tensors live: at the root (`BertModel` files) or under `bert.`
/// (`BertFor*` files).
fn trunk<'a>(vb: &VarBuilder<'a>) -> VarBuilder<'a> {
    if vb.contains_tensor("bert.embeddings.word_embeddings.weight") {
        vb.pp("bert")
    } else {
        vb.clone()
    }
}

/// A BERT sentence embedder: trunk + pooling.
pub struct BertEmbedder {
    encoder: BertEncoder,
    pooling: Pooling,
}

impl BertEmbedder {
    pub fn load(vb: VarBuilder, cfg: &BertConfig, pooling: Pooling) -> Result<Self> {
        Ok(Self {
            encoder: BertEncoder::load(trunk(&vb), cfg)?,
            pooling,
        })
    }
}

impl LocalModel for BertEmbedder {
    fn run(&self, batch: &PreparedBatch) -> Result<ModelOutput> {
        let hidden = self.encoder.forward(batch)?;
        let pooled = pooling::pool(&hidden, &batch.mask, &batch.lengths, self.pooling)?;
        Ok(ModelOutput::Vectors(
            pooled.to_dtype(DType::F32)?.to_vec2()?,
        ))
    }

    fn hidden_size(&self) -> usize {
        self.encoder.hidden_size()
    }

    fn max_positions(&self) -> usize {
        self.encoder.max_positions()
    }
}

/// A BERT cross-encoder: trunk, pooler (`tanh(W·[CLS] + b)`) and a one-logit classifier.
pub struct BertCrossEncoder {
    encoder: BertEncoder,
    pooler: Dense,
    classifier: Dense,
}

impl BertCrossEncoder {
    pub fn load(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let trunk_vb = trunk(&vb);
        let h = cfg.hidden_size;
        let pooler = Dense::load(&trunk_vb.pp("pooler").pp("dense"), h, h)?;
        let classifier = Dense::load(&vb.pp("classifier"), h, 1)?;
        Ok(Self {
            encoder: BertEncoder::load(trunk_vb, cfg)?,
            pooler,
            classifier,
        })
    }
}

impl LocalModel for BertCrossEncoder {
    fn run(&self, batch: &PreparedBatch) -> Result<ModelOutput> {
        let hidden = self.encoder.forward(batch)?;
        let cls = hidden.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
        let pooled = self.pooler.forward(&cls)?.tanh()?;
        let logits = self.classifier.forward(&pooled)?.squeeze(D::Minus1)?;
        Ok(ModelOutput::Scores(logits.to_dtype(DType::F32)?.to_vec1()?))
    }

    fn hidden_size(&self) -> usize {
        self.encoder.hidden_size()
    }

    fn max_positions(&self) -> usize {
        self.encoder.max_positions()
    }
}
