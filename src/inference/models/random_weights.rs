//! Random weights of the right shapes, for benchmarks of an architecture without its download.
//!
//! `--random-weights` loads `config.json` and the tokenizer from a folder and draws every tensor
//! the model code asks for from N(0, 0.02) (norm weights: 1), on the target device. The FLOPs,
//! memory traffic and kernels are those of the real model; the outputs mean nothing, so such an
//! engine is never pinned and says so.

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

/// A backend that has every tensor.
pub struct RandomWeights;

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = if name.ends_with("norm.weight") || name.ends_with("LayerNorm.weight") {
            Tensor::ones(s, DType::F32, dev)?
        } else {
            Tensor::randn(0f32, 0.02, s, dev)?
        };
        t.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("random weights need a shape for `{name}`")
    }

    /// Answers every prefix probe with "yes": models load their `*For*` layout (`model.`,
    /// `bert.`, an untied `lm_head`).
    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}
