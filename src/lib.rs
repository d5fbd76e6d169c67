//! fantom-sidecar: the GPU inference sidecar of Fantom MCP Server.
//!
//! Module map (one concern each; see `docs/architecture.md`):
//! * [`model_spec`]: what a model is (architecture, task, pooling, limits, prompts).
//! * [`manifest`]: pinned model manifests (`models/*.toml`), digests and `models.lock`.
//! * [`model_source`]: where model files come from (HF cache, hub download, a folder) and
//!   proof that they are the pinned bytes.
//! * [`inference`]: the local engine: tokenization, batching, the model thread, model code.
//! * [`cli`]: the `fantom-sidecar` command line.

pub mod cli;
pub mod inference;
pub mod manifest;
pub mod model_source;
pub mod model_spec;
