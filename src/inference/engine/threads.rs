//! The engine's three threads and what passes between them: the batcher (forms and uploads
//! the next batch), the model thread (sizes the budget and warms up at start, then launches
//! batches) and the finisher (reads a batch back and answers its entries while the next one
//! runs); see the parent module for the shape and `inference::cuda` for the streams.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Instant;

use candle_core::{DType, Device};

use super::{EngineConfig, EngineStats, Entry, InferenceError, Reply, RowOutput};
use crate::inference::batch::{AttentionMode, PreparedBatch, RowInput};
use crate::inference::batcher::{BatchBudget, BatchQueue};
use crate::inference::device;
use crate::inference::models::{self, ModelOutput};
use crate::inference::tokenize::{InputTokenizer, TokenizedInput};
use crate::inference::warmup;
use crate::model_spec::ModelSpec;

pub(super) struct Job {
    pub(super) batch: PreparedBatch,
    pub(super) replies: Vec<Reply>,
}

/// What the model thread reports once the model is loaded, sized and warmed up.
pub(super) struct Ready {
    pub(super) hidden: usize,
    pub(super) load_time: std::time::Duration,
    pub(super) flops_line: (f64, f64),
    pub(super) max_batch_tokens: usize,
    pub(super) source: warmup::BudgetSource,
    pub(super) warmup_rows: usize,
    pub(super) attention: AttentionMode,
    /// Why attention runs padded where packed was wanted (a dtype, head dim or card the kernel
    /// does not run).
    pub(super) fallback: Option<String>,
}

/// Why the model thread did not start serving.
pub(super) enum Refused {
    /// A setting that cannot work (an impossible budget, too many positions).
    Config(String),
    Load(String),
}

/// The batch budget (configured, or sized from free memory), checked against memory, and the
/// warm-up batch run once: `(max_batch_tokens, where it came from, warm-up rows)`.
pub(super) fn size_and_warm_up(
    model: &models::LoadedModel,
    spec: &ModelSpec,
    cfg: &EngineConfig,
    attention: AttentionMode,
    dtype: DType,
    dev: &Device,
    tokenizer: &InputTokenizer,
) -> Result<(usize, warmup::BudgetSource, usize), Refused> {
    let max_positions = model.encoder.max_positions();
    if spec.max_tokens > max_positions {
        return Err(Refused::Config(format!(
            "max_tokens {} exceeds the model's {max_positions} positions",
            spec.max_tokens
        )));
    }
    let (max_batch_tokens, source) = warmup::budget(
        cfg.max_batch_tokens,
        cfg.max_batch_rows,
        spec.max_tokens,
        &model.encoder.activation_shape(),
        attention,
        dtype,
        dev,
        warmup::free_bytes(dev),
    )
    .map_err(Refused::Config)?;
    // A row of exactly max_tokens real token ids.
    let seed = tokenizer
        .encode_texts(vec![
            "the warm-up row: fn main() { println!(\"hello\"); }".into(),
        ])
        .map_err(|e| Refused::Load(format!("the warm-up row: {e}")))?;
    let ids: Vec<u32> = seed
        .first()
        .map(|t| t.ids.clone())
        .filter(|ids| !ids.is_empty())
        .unwrap_or_else(|| vec![0]);
    let row = TokenizedInput {
        ids: ids.iter().copied().cycle().take(spec.max_tokens).collect(),
        type_ids: vec![0; spec.max_tokens],
    };
    match warmup::run(
        model,
        cfg.warmup,
        dev,
        attention,
        &row,
        max_batch_tokens,
        cfg.max_batch_rows,
    ) {
        Ok(rows) => Ok((max_batch_tokens, source, rows)),
        Err(failed) => {
            let checked = warmup::largest_that_runs(model, dev, attention, &row, failed.rows);
            let what = format!(
                "the warm-up batch ({} rows of {} tokens, max_batch_tokens {max_batch_tokens}) failed on {}: {}",
                failed.rows,
                failed.row_tokens,
                device::describe(dev),
                failed.error
            );
            match (source, checked) {
                // A budget the sizer picked: start with the largest smaller one that ran.
                (warmup::BudgetSource::FreeMemory | warmup::BudgetSource::Default, Some(t)) => {
                    tracing::warn!(
                        max_batch_tokens = t,
                        "{what}; running with {t}, whose warm-up passed"
                    );
                    Ok((
                        t,
                        source,
                        warmup::worst_rows(t, cfg.max_batch_rows, spec.max_tokens),
                    ))
                }
                (_, Some(t)) => Err(Refused::Config(format!(
                    "{what}; a warm-up of max_batch_tokens {t} ran on it: set max_batch_tokens to at most {t}"
                ))),
                (_, None) => Err(Refused::Config(format!(
                    "{what}; not even one row of max_tokens ran: lower max_tokens or use a smaller dtype"
                ))),
            }
        }
    }
}

/// A batch launched on the model thread, on its way to the finisher.
pub(super) struct Launched {
    output: Result<models::DeviceOutput, String>,
    replies: Vec<Reply>,
    started: Instant,
    rows: u64,
    tokens: u64,
    attended_tokens: u64,
    /// Where the batch ends on the model thread's stream (CUDA).
    #[cfg(feature = "cuda")]
    done: Option<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaEvent>>,
}

pub(super) fn batcher_loop(
    rx: mpsc::Receiver<Entry>,
    jobs: mpsc::SyncSender<Job>,
    budget: BatchBudget,
    attention: AttentionMode,
    device: &Device,
) {
    let mut queue: BatchQueue<Entry> = BatchQueue::default();
    loop {
        if queue.is_empty() {
            match rx.recv() {
                Ok(e) => push(&mut queue, e),
                Err(_) => return, // every handle dropped and nothing left to do
            }
        }
        while let Ok(e) = rx.try_recv() {
            push(&mut queue, e);
        }
        queue.retain(|e| !e.reply.is_closed());
        let entries: Vec<Entry> = queue
            .next_batch(budget)
            .into_iter()
            .map(|(_, e)| e)
            .collect();
        if entries.is_empty() {
            continue;
        }
        let rows = entries.iter().map(|e| RowInput {
            input: &e.input,
            prefix: e.prefix.as_ref(),
        });
        match PreparedBatch::build(rows, device, attention) {
            Ok(batch) => {
                let replies = entries.into_iter().map(|e| e.reply).collect();
                // Blocks until the model thread takes it: the one prepared batch.
                if jobs.send(Job { batch, replies }).is_err() {
                    return;
                }
            }
            Err(e) => {
                for entry in entries {
                    let _ = entry.reply.send(Err(InferenceError::Model(e.to_string())));
                }
            }
        }
    }
}

fn push(queue: &mut BatchQueue<Entry>, e: Entry) {
    if e.urgent {
        queue.push_urgent(e.input.len(), e);
    } else {
        queue.push(e.input.len(), e);
    }
}

pub(super) fn model_loop(
    model: &models::LoadedModel,
    jobs: mpsc::Receiver<Job>,
    done: mpsc::SyncSender<Launched>,
    device: &Device,
) {
    while let Ok(Job { batch, replies }) = jobs.recv() {
        let started = Instant::now();
        let output = model.start(&batch).map_err(|e| e.to_string());
        #[cfg(feature = "cuda")]
        let done_at = match device {
            Device::Cuda(dev) => crate::inference::cuda::record(dev).ok(),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        let launched = Launched {
            output,
            replies,
            started,
            rows: batch.outputs as u64,
            tokens: batch.tokens() as u64,
            attended_tokens: batch.attended_tokens() as u64,
            #[cfg(feature = "cuda")]
            done: done_at,
        };
        // Blocks while the finisher still reads the batch before this one.
        if done.send(launched).is_err() {
            return;
        }
    }
}

/// Reads each launched batch back and answers its entries. `model_busy_us` counts from a
/// batch's launch (or the previous batch's end, if later) to its outputs being read.
pub(super) fn finisher_loop(done: mpsc::Receiver<Launched>, stats: &EngineStats, device: &Device) {
    let mut previous_end: Option<Instant> = None;
    while let Ok(batch) = done.recv() {
        // This thread's stream copies the outputs back only once the batch has run; a wait that
        // cannot be set up fails the batch rather than read what may not be written yet.
        #[cfg(feature = "cuda")]
        let ordered = match (device, &batch.done) {
            (Device::Cuda(dev), Some(event)) => {
                crate::inference::cuda::wait(dev, event).map_err(|e| e.to_string())
            }
            (Device::Cuda(_), None) => Err("no event marks the batch's end on the GPU".to_string()),
            _ => Ok(()),
        };
        #[cfg(not(feature = "cuda"))]
        let ordered: Result<(), String> = {
            let _ = device;
            Ok(())
        };
        let result = ordered
            .and(batch.output)
            .and_then(|o| o.read().map_err(|e| e.to_string()));
        let end = Instant::now();
        let from = previous_end.map_or(batch.started, |p| p.max(batch.started));
        previous_end = Some(end);
        stats.model_busy_us.fetch_add(
            end.duration_since(from).as_micros() as u64,
            Ordering::Relaxed,
        );
        stats.batches.fetch_add(1, Ordering::Relaxed);
        stats.rows.fetch_add(batch.rows, Ordering::Relaxed);
        stats.tokens.fetch_add(batch.tokens, Ordering::Relaxed);
        stats
            .attended_tokens
            .fetch_add(batch.attended_tokens, Ordering::Relaxed);
        match result {
            Ok(ModelOutput::Vectors(rows)) => {
                for (reply, v) in batch.replies.into_iter().zip(rows) {
                    let _ = reply.send(Ok(RowOutput::Vector(v)));
                }
            }
            Ok(ModelOutput::Scores(scores)) => {
                for (reply, s) in batch.replies.into_iter().zip(scores) {
                    let _ = reply.send(Ok(RowOutput::Score(s)));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, rows = batch.rows, "model failed on a batch");
                let err = InferenceError::Model(e);
                for reply in batch.replies {
                    let _ = reply.send(Err(err.clone()));
                }
            }
        }
    }
}
