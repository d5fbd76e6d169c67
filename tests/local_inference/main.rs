//! Local inference on real weights, against committed reference outputs, through the library
//! and through the real binary. One test binary (link time is the cost of a test binary here).

mod cli;
mod cross_encoder;
mod embeddings;
mod half;
mod hub;
mod mirror;
mod pinning;
mod pypi_index;
mod qwen3;
mod support;
