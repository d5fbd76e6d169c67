//! Local inference on candle: embedders and rerankers from verified model files.
//!
//! [`Engine`] is the entry point: start it from a [`crate::model_source::ResolvedModel`], then
//! `embed` or `rerank` from any task. Inside, requests are tokenized off the model thread,
//! queued, batched by a token budget with length bucketing ([`batcher`]), run by the one thread
//! that owns the model and read back by a finisher thread ([`engine`]). At start the batch
//! budget is sized within memory and the kernels' limits and the worst-case batch run once
//! ([`warmup`]). Attention runs over packed rows ([`attention`]), on CUDA with our kernel; the
//! rest of a Qwen3 layer runs as fused ops ([`layer_ops`]); the kernels' own source is checked
//! on the CPU under an emulator (tests) and on a device by [`kernel_check`].

pub mod attention;
pub mod batch;
pub mod batcher;
pub mod cpu_ops;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
#[cfg(test)]
mod emulator;
pub mod engine;
pub mod heap;
pub mod kernel_check;
pub mod kernels;
pub mod launch;
pub mod layer_ops;
pub mod models;
pub mod pooling;
pub mod tokenize;
pub mod warmup;

pub use batch::AttentionMode;
pub use device::{DTypeSpec, DeviceSpec};
pub use engine::{
    Counted, EmbedOptions, Engine, EngineConfig, EngineError, EngineInfo, EngineStats,
    InferenceError, RerankOptions, RerankScore,
};
pub use tokenize::Truncation;
pub use warmup::Warmup;
