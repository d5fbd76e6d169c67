//! Qwen3 as an encoder: the embedder (Qwen3-Embedding, last-token pooling) and the reranker
//! (Qwen3-Reranker, `sigmoid(logit_yes − logit_no)` at the last position).
//!
//! Our own code rather than `candle_transformers::models::qwen3`, which has no padding mask and
//! an always-on KV cache, so its batched embeddings are wrong (see
//! `../shared/reference/inference-notes.md` §0.1). Here:
//! * no KV cache: one forward per batch, nothing carried between calls;
//! * tokens are packed (`inference::batch`), positions restart at 0 for each row, so padding
//!   side never matters; attention is causal within each row: packed attention
//!   (`inference::attention`: the CPU body, or the CUDA kernel in bf16/f16), or masked matmul
//!   attention over right-padded rows where the kernel does not run (with right padding a
//!   causal mask already keeps real tokens from seeing padding);
//! * RMSNorm before attention and MLP, plus per-head RMSNorm on Q and K before RoPE
//!   (rotate-half RoPE, θ from the config), grouped-query attention, SiLU-gated MLP;
//! * the layer runs without copies around its four GEMMs (`inference::layer_ops`): Q and K are
//!   normed and rotated in place in the fused QKV rows and attention reads Q, K and V there;
//!   the residual add and the next RMSNorm are one pass; SwiGLU reads the fused gate/up rows;
//! * the reranker's head is one vector, `W_lm[yes] − W_lm[no]`, dotted with the last hidden
//!   state: the full-vocabulary matmul (151k rows) is never computed.
//!
//! bf16/f16/f32: weights load in the engine's dtype. The steps a half dtype would spoil run in
//! f32: every norm, RoPE and SwiGLU (rounded once), attention's softmax (the packed kernel's
//! accumulators; [`super::attention_softmax`] on the padded path), the final norm (its output is
//! f32, what pooling reads), and the reranker's yes/no dot product.

use candle_core::{D, DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};
use serde::Deserialize;

use super::{DeviceOutput, Encoder, Head};
use crate::inference::attention::PackedAttention;
use crate::inference::batch::{PaddedLayout, PreparedBatch, SharedKeys};
use crate::inference::layer_ops::{AddRmsNorm, NormOutput, QkNormRope, SwiGlu};

/// Qwen3-Reranker's frozen chat template, before the body (the Hugging Face model card's).
pub const RERANK_PREFIX: &str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n";
/// The template after the body: the assistant turn with an empty thinking block.
pub const RERANK_SUFFIX: &str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

/// The user turn of one (query, document) pair.
pub fn rerank_body(instruction: &str, query: &str, document: &str) -> String {
    format!("<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}")
}

/// The fields of a Qwen3 `config.json` the encoder reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Top level in the published checkpoints; transformers 5 writes it under
    /// `rope_parameters` instead (see [`Qwen3Config::rope_theta`]).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub use_sliding_window: bool,
}

/// transformers 5's `rope_parameters`.
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_type: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

impl Qwen3Config {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// RoPE θ from either config layout (Qwen3's published default 1e6).
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta
            .or_else(|| self.rope_parameters.as_ref().and_then(|p| p.rope_theta))
            .unwrap_or(1_000_000.0)
    }

    fn validate(&self) -> Result<()> {
        if let Some(kind) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.as_deref())
            && kind != "default"
        {
            candle_core::bail!("Qwen3 with rope_type `{kind}` is not supported");
        }
        if self.hidden_act != "silu" {
            candle_core::bail!("unsupported Qwen3 activation `{}`", self.hidden_act);
        }
        if self.attention_bias {
            candle_core::bail!("Qwen3 with attention_bias is not supported");
        }
        if self.use_sliding_window {
            candle_core::bail!("Qwen3 with a sliding window is not supported");
        }
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            candle_core::bail!("num_attention_heads must be a multiple of num_key_value_heads");
        }
        if !self.head_dim().is_multiple_of(2) {
            candle_core::bail!("head_dim must be even for RoPE");
        }
        Ok(())
    }
}

/// `x Wᵀ`, with `Wᵀ` stored contiguous (`[in, out]`) as in the BERT file.
struct Linear {
    weight_t: Tensor,
}

impl Linear {
    fn load(vb: &VarBuilder, inp: usize, out: usize) -> Result<Self> {
        Self::from_weight(vb.get((out, inp), "weight")?)
    }

    fn from_weight(weight: Tensor) -> Result<Self> {
        Ok(Self {
            weight_t: weight.t()?.contiguous()?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.weight_t)
    }
}

/// An RMSNorm's weight and epsilon (applied by `layer_ops`, fused with what comes before).
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn load(vb: &VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            eps: eps as f32,
        })
    }

    /// `RMSNorm(x + delta)`, and the sum: the next residual and the next layer's input.
    fn add(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor)> {
        AddRmsNorm::sum_and_normed(&self.weight, self.eps, x, delta)
    }
}

/// RoPE's inverse frequencies θ^(−2i/d), `[head_dim / 2]` f32, computed in f64.
fn inv_freq(cfg: &Qwen3Config, device: &Device) -> Result<Tensor> {
    let d = cfg.head_dim();
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta().powf(2.0 * i as f64 / d as f64) as f32)
        .collect();
    Tensor::from_vec(inv, d / 2, device)
}

struct Layer {
    input_norm: RmsNorm,
    /// Q, K and V projections fused: `[h, (heads + 2·kv_heads)·head_dim]`.
    qkv: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    o_proj: Linear,
    post_norm: RmsNorm,
    /// Gate and up projections fused: `[h, 2·intermediate]`.
    gate_up: Linear,
    down: Linear,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &Qwen3Config) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let att = vb.pp("self_attn");
        let get = |vb: &VarBuilder, name: &str, out: usize, inp: usize| {
            vb.pp(name).get((out, inp), "weight")
        };
        let qkv = Tensor::cat(
            &[
                get(&att, "q_proj", heads * d, h)?,
                get(&att, "k_proj", kv * d, h)?,
                get(&att, "v_proj", kv * d, h)?,
            ],
            0,
        )?;
        let mlp = vb.pp("mlp");
        let gate_up = Tensor::cat(
            &[
                get(&mlp, "gate_proj", cfg.intermediate_size, h)?,
                get(&mlp, "up_proj", cfg.intermediate_size, h)?,
            ],
            0,
        )?;
        Ok(Self {
            input_norm: RmsNorm::load(&vb.pp("input_layernorm"), h, cfg.rms_norm_eps)?,
            qkv: Linear::from_weight(qkv)?,
            q_norm: RmsNorm::load(&att.pp("q_norm"), d, cfg.rms_norm_eps)?,
            k_norm: RmsNorm::load(&att.pp("k_norm"), d, cfg.rms_norm_eps)?,
            o_proj: Linear::load(&att.pp("o_proj"), heads * d, h)?,
            post_norm: RmsNorm::load(&vb.pp("post_attention_layernorm"), h, cfg.rms_norm_eps)?,
            gate_up: Linear::from_weight(gate_up)?,
            down: Linear::load(&mlp.pp("down_proj"), cfg.intermediate_size, h)?,
        })
    }

    /// Attention and the MLP on the residual `x` and its normed copy `normed`: `(x after
    /// attention, the MLP's output)`; the caller adds the latter with the next norm.
    fn forward(
        &self,
        x: &Tensor,
        normed: &Tensor,
        ctx: &ForwardContext,
    ) -> Result<(Tensor, Tensor)> {
        let (heads, kv, d) = (ctx.heads, ctx.kv_heads, ctx.head_dim);
        let qkv = self.qkv.forward(normed)?;
        // Per-head RMSNorm and RoPE on Q and K, in place in the fused rows.
        qkv.inplace_op1(&QkNormRope {
            positions: ctx.positions.clone(),
            q_weight: self.q_norm.weight.clone(),
            k_weight: self.k_norm.weight.clone(),
            inv_freq: ctx.inv_freq.clone(),
            q_heads: heads,
            kv_heads: kv,
            head_dim: d,
            eps: self.q_norm.eps,
        })?;
        let q = qkv.narrow(1, 0, heads * d)?;
        let k = qkv.narrow(1, heads * d, kv * d)?;
        let v = qkv.narrow(1, (heads + kv) * d, kv * d)?;
        let attn = ctx.attend(&q, &k, &v)?;
        let (x, normed) = self.post_norm.add(x, &self.o_proj.forward(&attn)?)?;
        let act = self.gate_up.forward(&normed)?.apply_op1_no_bwd(&SwiGlu)?;
        Ok((x, self.down.forward(&act)?))
    }
}

/// Per-batch inputs shared by every layer.
struct ForwardContext<'a> {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// `[tokens]` u32 positions and RoPE's inverse frequencies.
    positions: Tensor,
    inv_freq: Tensor,
    /// The packed attention op of this batch (its row table on CUDA), or
    padded: Option<(&'a PaddedLayout, Tensor)>,
    packed: Option<PackedAttention>,
}

impl ForwardContext<'_> {
    /// Causal attention within each row. `q`: `[tokens, heads·d]`, `k`/`v`: `[tokens, kv·d]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (heads, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let scale = 1.0 / (d as f32).sqrt();
        match (&self.packed, &self.padded) {
            (Some(op), _) => q.apply_op3_no_bwd(k, v, op),
            (None, None) => candle_core::bail!("a batch with neither packed nor padded attention"),
            (None, Some((layout, mask))) => {
                let b = layout.gather.dim(0)? / layout.longest.max(1);
                let s = layout.longest;
                let rows = |t: &Tensor, n: usize| -> Result<Tensor> {
                    t.contiguous()?
                        .index_select(&layout.gather, 0)?
                        .reshape((b, s, n, d))?
                        .transpose(1, 2)?
                        .contiguous()
                };
                let q = (rows(q, heads)? * scale as f64)?;
                // Keys: the row's own (as Q), or its shared prefix's followed by its own.
                let (kv_index, sk) = match &layout.shared {
                    Some(shared) => (&shared.kv_gather, shared.kv_longest),
                    None => (&layout.gather, s),
                };
                let key_rows = |t: &Tensor| -> Result<Tensor> {
                    t.contiguous()?
                        .index_select(kv_index, 0)?
                        .reshape((b, sk, kv, d))?
                        .transpose(1, 2)?
                        .contiguous()
                };
                // Grouped-query: each K/V head serves `heads / kv` query heads.
                let repeat = |t: Tensor| -> Result<Tensor> {
                    let group = heads / kv;
                    if group == 1 {
                        return Ok(t);
                    }
                    t.unsqueeze(2)?
                        .expand((b, kv, group, sk, d))?
                        .reshape((b, heads, sk, d))
                };
                let k = repeat(key_rows(k)?)?;
                let v = repeat(key_rows(v)?)?;
                let scores = q.matmul(&k.t()?)?.broadcast_add(mask)?;
                let probs = super::attention_softmax(&scores)?;
                probs
                    .matmul(&v)?
                    .transpose(1, 2)?
                    .contiguous()?
                    .reshape((b * s, heads * d))?
                    .index_select(&layout.scatter, 0)
            }
        }
    }
}

/// The Qwen3 trunk: embeddings, decoder layers (no cache), final norm.
pub struct Qwen3Encoder {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    inv_freq: Tensor,
    cfg: Qwen3Config,
    dtype: DType,
}

impl Qwen3Encoder {
    /// Loads from `vb` rooted where `embed_tokens` lives (`model.` for `*ForCausalLM` files).
    pub fn load(vb: VarBuilder, cfg: &Qwen3Config) -> Result<Self> {
        cfg.validate()?;
        let h = cfg.hidden_size;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(vb.pp("layers").pp(i.to_string()), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed: Embedding::new(vb.pp("embed_tokens").get((cfg.vocab_size, h), "weight")?, h),
            layers,
            norm: RmsNorm::load(&vb.pp("norm"), h, cfg.rms_norm_eps)?,
            inv_freq: inv_freq(cfg, vb.device())?,
            cfg: cfg.clone(),
            dtype: vb.dtype(),
        })
    }
}

impl Encoder for Qwen3Encoder {
    fn activation_shape(&self) -> super::ActivationShape {
        super::ActivationShape {
            hidden: self.cfg.hidden_size,
            intermediate: self.cfg.intermediate_size,
            heads: self.cfg.num_attention_heads,
            kv_heads: self.cfg.num_key_value_heads,
            head_dim: self.cfg.head_dim(),
        }
    }

    /// Final-normed packed token states `[tokens, h]`, in f32.
    fn forward(&self, batch: &PreparedBatch) -> Result<Tensor> {
        let longest = batch.lengths.iter().copied().max().unwrap_or(0);
        if longest > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "a row of {longest} tokens exceeds {} positions",
                self.cfg.max_position_embeddings
            );
        }
        let padded = match &batch.padded {
            None => None,
            Some(layout) => {
                let device = self.embed.embeddings().device();
                let mask = match &layout.shared {
                    // Causal mask over right-padded rows: padding sits after every real token,
                    // so causality alone keeps real tokens from seeing it.
                    None => {
                        let s = layout.longest;
                        let mask: Vec<f32> = (0..s * s)
                            .map(|i| {
                                if i % s > i / s {
                                    f32::NEG_INFINITY
                                } else {
                                    0.0
                                }
                            })
                            .collect();
                        Tensor::from_vec(mask, (1, 1, s, s), device)?
                    }
                    Some(shared) => shared_prefix_mask(layout.longest, shared, device)?,
                };
                Some((layout, mask.to_dtype(self.dtype)?))
            }
        };
        let (heads, kv_heads, head_dim) = (
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim(),
        );
        let ctx = ForwardContext {
            heads,
            kv_heads,
            head_dim,
            positions: batch.positions.clone(),
            inv_freq: self.inv_freq.clone(),
            packed: padded.is_none().then(|| {
                batch.attention(
                    (heads, kv_heads, head_dim),
                    1.0 / (head_dim as f32).sqrt(),
                    true,
                )
            }),
            padded,
        };
        let mut x = self.embed.forward(&batch.input_ids)?;
        // Each layer's input norm runs fused with the previous layer's residual add.
        let mut mlp: Option<Tensor> = None;
        for layer in &self.layers {
            let norm = &layer.input_norm;
            let normed = match mlp.take() {
                None => AddRmsNorm::normed(&norm.weight, norm.eps, &x, None, NormOutput::Normed)?,
                Some(delta) => {
                    let (sum, normed) = norm.add(&x, &delta)?;
                    x = sum;
                    normed
                }
            };
            let (after_attention, out) = layer.forward(&x, &normed, &ctx)?;
            x = after_attention;
            mlp = Some(out);
        }
        // The final norm, in f32: what the heads read.
        AddRmsNorm::normed(
            &self.norm.weight,
            self.norm.eps,
            &x,
            mlp.as_ref(),
            NormOutput::NormedF32,
        )
    }

    fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
    }

    fn max_positions(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    /// Projections and MLP (2·params) plus causal attention (`QKᵀ` and `PV`, half the
    /// full square on average).
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let c = &self.cfg;
        let (h, d) = (c.hidden_size as f64, c.head_dim() as f64);
        let (heads, kv) = (c.num_attention_heads as f64, c.num_key_value_heads as f64);
        let per_layer =
            h * (heads + 2.0 * kv) * d + heads * d * h + 3.0 * h * c.intermediate_size as f64;
        let attention = 2.0 * heads * d * seq_len as f64;
        c.num_hidden_layers as f64 * (2.0 * per_layer + attention)
    }
}

/// `[rows, 1, queries, keys]` additive mask for rows whose keys are a shared prefix followed by
/// their own tokens: query `i` sees every prefix key and own keys `0..=i`. Built on the device
/// from per-row lengths (a host-built mask would be as large as the attention scores).
fn shared_prefix_mask(queries: usize, shared: &SharedKeys, device: &Device) -> Result<Tensor> {
    let q = Tensor::arange(0f32, queries as f32, device)?.reshape((1, 1, queries, 1))?;
    let k = Tensor::arange(0f32, shared.kv_longest as f32, device)?.reshape((
        1,
        1,
        1,
        shared.kv_longest,
    ))?;
    let prefix_len = shared.prefix_len.to_dtype(DType::F32)?;
    let own_len = shared.own_len.to_dtype(DType::F32)?;
    let in_prefix = k.broadcast_lt(&prefix_len)?.to_dtype(DType::F32)?;
    let own = k.broadcast_sub(&prefix_len)?; // position among the row's own keys
    let own_seen = own
        .broadcast_ge(&Tensor::zeros((1, 1, 1, 1), DType::F32, device)?)?
        .to_dtype(DType::F32)?
        .broadcast_mul(&own.broadcast_le(&q)?.to_dtype(DType::F32)?)?
        .broadcast_mul(&own.broadcast_lt(&own_len)?.to_dtype(DType::F32)?)?;
    let visible = in_prefix.broadcast_add(&own_seen)?; // 0 or 1
    // 0 where visible, a huge negative (−inf in f16) elsewhere.
    visible.affine(1e30, -1e30)
}

/// Qwen3-Reranker's head: the `yes − no` direction of the LM head, dotted with the last token's
/// state. Only two rows of the head are read; the 151k-row vocabulary matmul never runs.
pub struct YesNoHead {
    /// `W_lm[yes] − W_lm[no]`, `[h, 1]`, in f32 (a half-precision logit would cost the
    /// probability a percent).
    direction: Tensor,
}

impl YesNoHead {
    /// `vb` is the checkpoint root; `yes`/`no` are the tokenizer's ids for the two answers.
    pub fn load(vb: &VarBuilder, cfg: &Qwen3Config, yes: u32, no: u32) -> Result<Self> {
        let h = cfg.hidden_size;
        let head = if vb.contains_tensor("lm_head.weight") {
            vb.pp("lm_head").get((cfg.vocab_size, h), "weight")?
        } else if cfg.tie_word_embeddings {
            super::under(vb, "model", "embed_tokens.weight")
                .pp("embed_tokens")
                .get((cfg.vocab_size, h), "weight")?
        } else {
            candle_core::bail!("no lm_head.weight and tie_word_embeddings is false");
        };
        for id in [yes, no] {
            if id as usize >= cfg.vocab_size {
                candle_core::bail!("token id {id} is outside the vocabulary");
            }
        }
        // The difference is taken, and kept, in f32.
        let row = |id: u32| head.i(id as usize)?.to_dtype(DType::F32);
        let direction = (row(yes)? - row(no)?)?.reshape((h, 1))?;
        Ok(Self { direction })
    }
}

impl Head for YesNoHead {
    fn apply(&self, hidden: &Tensor, batch: &PreparedBatch) -> Result<DeviceOutput> {
        let last = hidden
            .index_select(&batch.last_token, 0)?
            .to_dtype(DType::F32)?;
        let logits = last.matmul(&self.direction)?.squeeze(D::Minus1)?;
        Ok(DeviceOutput::Scores(logits))
    }
}
