//! Local inference on candle: embedders and rerankers from verified model files.
//!
//! [`Engine`] is the entry point: start it from a [`crate::model_source::ResolvedModel`], then
//! `embed` or `rerank` from any task. Inside, requests are tokenized off the model thread,
//! queued, batched by a padded-token budget with length bucketing ([`batcher`]), and run by the
//! one thread that owns the model ([`engine`]). At start the batch budget is sized and the
//! worst-case batch run once ([`warmup`]).

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
