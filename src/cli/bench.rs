//! `bench`: throughput of the local engine on synthetic rows of an exact token length.
//!
//! Rows are random token ids (no tokenizer, no templates), `--tokens` long; each batch size
//! sends requests of exactly that many rows, one at a time, so each request is one batch. With
//! `--random-weights` this measures an architecture without its download (the GPU check runs
//! the Qwen3-4B config this way). Reports rows/s, tokens/s, batch latency, achieved TFLOP/s
//! (from the model's FLOPs per token) and, with `--peak-tflops`, the fraction of that peak.

use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;

use super::ModelArgs;
use super::oneshot::load_engine_with;
use crate::inference::tokenize::TokenizedInput;
use crate::inference::{EmbedOptions, EngineConfig};
use crate::model_spec::Task;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Rows per batch to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,32,256")]
    batch_sizes: Vec<usize>,
    /// Tokens per row.
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// Measuring time per batch size (after one warm-up batch).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// The device's peak in TFLOP/s for the dtype (e.g. 790 for bf16 on an H200).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct BenchRow {
    batch_size: usize,
    tokens_per_row: usize,
    batches: usize,
    seconds: f64,
    rows_per_s: f64,
    tokens_per_s: f64,
    batch_ms: f64,
    tflops: f64,
    peak_fraction: Option<f64>,
}

#[derive(Serialize)]
struct BenchReport {
    model: String,
    device: String,
    dtype: String,
    gflop_per_token: f64,
    results: Vec<BenchRow>,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let largest = args.batch_sizes.iter().copied().max().unwrap_or(1);
    anyhow::ensure!(
        largest > 0 && args.tokens > 1,
        "batch sizes and --tokens must be positive"
    );
    let cfg = EngineConfig {
        max_batch_rows: largest,
        max_batch_tokens: Some(largest * args.tokens),
        ..args.model.choice().engine_config()
    };
    let mut model = args.model.clone();
    model.max_tokens = Some(model.max_tokens.unwrap_or(args.tokens).max(args.tokens));
    let engine = load_engine_with(&model, Task::Embed, cfg).await?;
    let info = engine.info().clone();
    let vocab = engine.tokenizer().vocab_size().max(2) as u64;
    let flops = info.flops_per_token[0] + info.flops_per_token[1] * args.tokens as f64;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rows = |n: usize| -> Vec<TokenizedInput> {
        (0..n)
            .map(|_| {
                let ids = (0..args.tokens)
                    .map(|_| {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        ((seed >> 33) % vocab) as u32
                    })
                    .collect();
                TokenizedInput {
                    ids,
                    type_ids: vec![0; args.tokens],
                }
            })
            .collect()
    };
    let mut results = Vec::new();
    for &bs in &args.batch_sizes {
        engine
            .embed_tokens(rows(bs), EmbedOptions::default())
            .await?; // warm-up
        let budget = Duration::from_secs_f64(args.seconds);
        let start = Instant::now();
        let mut batches = 0;
        while batches < 3 || start.elapsed() < budget {
            engine
                .embed_tokens(rows(bs), EmbedOptions::default())
                .await?;
            batches += 1;
        }
        let seconds = start.elapsed().as_secs_f64();
        let rows_per_s = (batches * bs) as f64 / seconds;
        let tokens_per_s = rows_per_s * args.tokens as f64;
        let tflops = tokens_per_s * flops / 1e12;
        results.push(BenchRow {
            batch_size: bs,
            tokens_per_row: args.tokens,
            batches,
            seconds,
            rows_per_s,
            tokens_per_s,
            batch_ms: seconds * 1e3 / batches as f64,
            tflops,
            peak_fraction: args.peak_tflops.map(|p| tflops / p),
        });
    }
    println!(
        "{} on {} ({}), {:.2} GFLOP/token at {} tokens",
        info.provenance,
        info.device,
        info.dtype,
        flops / 1e9,
        args.tokens
    );
    println!(
        "{:>6} {:>12} {:>14} {:>11} {:>9} {:>8}",
        "batch", "rows/s", "tokens/s", "batch ms", "TFLOP/s", "of peak"
    );
    for r in &results {
        let peak = r
            .peak_fraction
            .map(|f| format!("{:.1}%", f * 100.0))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:>6} {:>12.1} {:>14.0} {:>11.2} {:>9.2} {:>8}",
            r.batch_size, r.rows_per_s, r.tokens_per_s, r.batch_ms, r.tflops, peak
        );
    }
    if let Some(path) = &args.json {
        let report = BenchReport {
            model: info.provenance.to_string(),
            device: info.device.clone(),
            dtype: info.dtype.clone(),
            gflop_per_token: flops / 1e9,
            results,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
