//! `embed` and `rerank`: local inference from the command line, JSON Lines in and out.

use std::io::Write;

use clap::Args;
use serde::Serialize;

use super::ModelArgs;
use super::input::read_json_lines;
use super::progress::{Meter, Progress};
use super::stream::{self, run_in_order, write_json_line};
use crate::inference::{EmbedOptions, Engine, EngineConfig, RerankOptions};
use crate::model_spec::Task;

#[derive(Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Truncate vectors to N dimensions (Matryoshka) and renormalise.
    #[arg(long)]
    dimensions: Option<usize>,
    /// Embed the inputs as queries (applies the model's query template).
    #[arg(long)]
    query: bool,
    /// The instruction for the query template (instruction-aware models).
    #[arg(long, requires = "query")]
    task: Option<String>,
}

#[derive(Args)]
pub struct RerankArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The query the documents are scored against.
    #[arg(long)]
    query: String,
    /// The instruction of instruction-aware rerankers (Qwen3); the model's default otherwise.
    #[arg(long)]
    instruction: Option<String>,
}

/// One output line of `embed` (field order is part of the format: `index` first).
#[derive(Serialize)]
struct EmbeddingLine {
    index: usize,
    embedding: Vec<f32>,
}

/// One output line of `rerank`.
#[derive(Serialize)]
struct ScoreLine {
    index: usize,
    score: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    probability: Option<f32>,
}

/// Resolves, verifies and loads the model for `task`.
pub(super) async fn load_engine(args: &ModelArgs, task: Task) -> anyhow::Result<Engine> {
    args.choice().load(task).await
}

/// [`load_engine`] with engine settings of the caller's.
pub(super) async fn load_engine_with(
    args: &ModelArgs,
    task: Task,
    cfg: EngineConfig,
) -> anyhow::Result<Engine> {
    args.choice().load_with(task, cfg).await
}

/// The engine's rows and tokens so far (what the progress bar follows).
fn meter(engine: &Engine) -> Meter {
    let engine = engine.clone();
    std::sync::Arc::new(move || {
        let s = engine.stats();
        (
            s.rows.load(std::sync::atomic::Ordering::Relaxed),
            s.tokens.load(std::sync::atomic::Ordering::Relaxed),
        )
    })
}

fn read_stdin() -> anyhow::Result<Vec<String>> {
    Ok(read_json_lines(std::io::stdin().lock())?)
}

pub async fn embed(args: EmbedArgs) -> anyhow::Result<()> {
    let texts = read_stdin()?;
    let engine = load_engine(&args.model, Task::Embed).await?;
    let opts = EmbedOptions {
        is_query: args.query,
        task: args.task,
        dimensions: args.dimensions,
        truncate: false,
        urgent: false,
    };
    let mut out = stream::stdout();
    let progress = Progress::start(texts.len(), "texts", meter(&engine));
    run_in_order(
        texts,
        |chunk| {
            let (engine, opts) = (engine.clone(), opts.clone());
            async move { engine.embed(chunk, opts).await }
        },
        |index, embedding| write_json_line(&mut out, &EmbeddingLine { index, embedding }),
    )
    .await?;
    out.flush()?;
    progress.finish("embedded").await;
    Ok(())
}

pub async fn rerank(args: RerankArgs) -> anyhow::Result<()> {
    let documents = read_stdin()?;
    let engine = load_engine(&args.model, Task::Rerank).await?;
    let query = args.query;
    let opts = RerankOptions {
        instruction: args.instruction,
        urgent: false,
    };
    let mut out = stream::stdout();
    let progress = Progress::start(documents.len(), "documents", meter(&engine));
    run_in_order(
        documents,
        |chunk| {
            let (engine, query, opts) = (engine.clone(), query.clone(), opts.clone());
            async move { engine.rerank(query, chunk, opts).await }
        },
        |index, s| {
            let line = ScoreLine {
                index,
                score: s.score,
                probability: s.probability,
            };
            write_json_line(&mut out, &line)
        },
    )
    .await?;
    out.flush()?;
    progress.finish("reranked").await;
    Ok(())
}
