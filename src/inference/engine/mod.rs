//! The engine: request → tokenization → batch queue → the one thread that owns the model.
//!
//! The shape is TEI's router → queue → backend split:
//! * **Tokenization** runs on the caller's blocking pool (`spawn_blocking`), never on the model
//!   thread.
//! * The **batcher thread** owns the [`BatchQueue`], forms the next batch by token budget with
//!   length bucketing, pads it and uploads it. It hands batches over a rendezvous channel, so
//!   exactly one batch is prepared while the model runs the current one.
//! * The **model thread** owns the model: nothing else touches it, so no locks sit on the hot
//!   path. It launches a batch and hands its outputs, still on the device, to the **finisher
//!   thread**, which reads them back and answers each entry while the model thread launches
//!   the next batch (on a GPU the copy-back then never stalls the next batch; see
//!   `inference::cuda` for the streams and events between the three threads).
//! * Each input is one queue entry with its own reply channel; a caller that goes away has its
//!   entries dropped before they cost a batch slot.
//!
//! This file is the engine's API (start, embed, rerank, their options and errors); `threads`
//! holds the three threads, the hand-offs between them, and sizing and warming up at start.

mod threads;

use threads::{
    Job, Launched, Ready, Refused, batcher_loop, finisher_loop, model_loop, size_and_warm_up,
};

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc;
use std::time::Instant;

use serde::Serialize;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::batch::AttentionMode;
use super::batcher::BatchBudget;
use super::device::{self, DTypeSpec, DeviceError, DeviceSpec};
use super::models;
use super::models::qwen3;
use super::pooling;
use super::tokenize::{InputTokenizer, TokenizeError, TokenizedInput, Truncation};
use super::warmup::Warmup;
use crate::model_source::{Provenance, ResolvedModel};
use crate::model_spec::{Architecture, ModelSpec, QWEN3_DEFAULT_TASK, ScoreActivation, Task};

/// How the engine runs.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub device: DeviceSpec,
    pub dtype: DTypeSpec,
    /// Padded tokens per batch (longest row × rows); `None`: sized from free memory on a GPU,
    /// [`warmup::DEFAULT_MAX_BATCH_TOKENS`] on the CPU.
    pub max_batch_tokens: Option<usize>,
    /// Rows per batch.
    pub max_batch_rows: usize,
    pub truncation: Truncation,
    /// Packed attention wherever its kernel runs, padded elsewhere (`Auto`); `Padded` forces
    /// the masked-matmul path (the fallback on cards the kernel does not run on), so the CPU
    /// can check it.
    pub attention: AttentionMode,
    /// How much of the worst-case batch runs once at start.
    pub warmup: Warmup,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            device: DeviceSpec::Auto,
            dtype: DTypeSpec::Auto,
            max_batch_tokens: None,
            max_batch_rows: 256,
            truncation: Truncation::Truncate,
            attention: AttentionMode::Auto,
            warmup: Warmup::Auto,
        }
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizeError),
    #[error("cannot load the model: {0}")]
    Load(String),
    #[error("invalid engine settings: {0}")]
    Config(String),
}

/// Why a request failed. Cloneable: one model failure fails every row of its batch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InferenceError {
    #[error("no inputs: send at least one text")]
    EmptyInput,
    #[error("input {index} is an empty string")]
    EmptyText { index: usize },
    #[error("the query is an empty string")]
    EmptyQuery,
    #[error("dimensions {requested} is outside 1..={max}")]
    BadDimensions { requested: usize, max: usize },
    #[error("this is {} model; it cannot {wanted}", model.with_article())]
    WrongTask { model: Task, wanted: Task },
    #[error("input {index} is longer than the model's {max} tokens (truncation is off)")]
    TooLong { index: usize, max: usize },
    #[error("{0}")]
    Tokenize(String),
    #[error("the model failed on a batch: {0}")]
    Model(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// Options of one embedding request.
#[derive(Clone, Debug, Default)]
pub struct EmbedOptions {
    /// Apply the model's query template (instruction-aware models).
    pub is_query: bool,
    /// The instruction for the query template; the manifest's default when `None`.
    pub task: Option<String>,
    /// Matryoshka truncation to this many dimensions (renormalised).
    pub dimensions: Option<usize>,
    /// Cut inputs past the model's limit even where the engine refuses them (the gate's probe
    /// texts, which every provider of a space reads the way a truncating one does).
    pub truncate: bool,
    /// Interactive work (a query): it starts the next batch ahead of batch work queued before
    /// it.
    pub urgent: bool,
}

/// Options of one rerank request.
#[derive(Clone, Debug, Default)]
pub struct RerankOptions {
    /// The instruction of instruction-aware rerankers (Qwen3); the model's default when `None`.
    pub instruction: Option<String>,
    /// Interactive work: ahead of batch work queued before it.
    pub urgent: bool,
}

/// How a reranker's inputs are built from (query, document).
enum RerankInputs {
    /// Cross-encoders: the pair as two segments, truncated longest-first.
    Pairs,
    /// Qwen3-Reranker: the chat template framing an instruction/query/document body; only the
    /// body is truncated.
    ChatTemplate {
        prefix: Vec<u32>,
        suffix: Vec<u32>,
        default_instruction: String,
    },
}

/// One reranked document.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RerankScore {
    /// The model's raw relevance logit.
    pub score: f32,
    /// `sigmoid(score)` when the model defines a probability.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probability: Option<f32>,
}

/// A result with the number of tokens the model read to make it (usage reports).
#[derive(Clone, Debug)]
pub struct Counted<T> {
    pub value: T,
    pub tokens: usize,
}

/// What the engine runs, for logs and status endpoints.
#[derive(Clone, Debug, Serialize)]
pub struct EngineInfo {
    pub provenance: Provenance,
    pub architecture: String,
    pub task: Task,
    pub pooling: Option<String>,
    pub normalize: bool,
    pub max_tokens: usize,
    /// Output width: vector dims for embedders, 1 for rerankers.
    pub dims: usize,
    /// How a reranker's probability comes from its logit (part of its scorer identity).
    pub score_activation: ScoreActivation,
    pub device: String,
    pub dtype: String,
    /// The batch budget in force, and where it came from (configured, the default, or sized
    /// from the device's free memory).
    pub max_batch_tokens: usize,
    pub max_batch_tokens_source: &'static str,
    /// Rows of the warm-up batch that ran at start.
    pub warmup_rows: usize,
    pub max_batch_rows: usize,
    /// How attention runs: `packed` (`inference::attention`) or `padded`.
    pub attention: String,
    /// Forward FLOPs per token at sequence length `s`: `flops_per_token[0] + flops_per_token[1]·s`.
    pub flops_per_token: [f64; 2],
}

/// Counters since start (relaxed atomics; read for metrics and benchmarks).
#[derive(Debug, Default)]
pub struct EngineStats {
    pub batches: AtomicU64,
    pub rows: AtomicU64,
    pub tokens: AtomicU64,
    /// Tokens attention paid for: equal to `tokens` when packed, more when padded.
    pub attended_tokens: AtomicU64,
    pub model_busy_us: AtomicU64,
}

enum RowOutput {
    Vector(Vec<f32>),
    Score(f32),
}

type Reply = oneshot::Sender<Result<RowOutput, InferenceError>>;

struct Entry {
    input: TokenizedInput,
    /// Interactive work: it starts the next batch.
    urgent: bool,
    /// The shared prefix this input continues (its `input` is then only the tail).
    prefix: Option<Arc<Vec<u32>>>,
    reply: Reply,
}

struct Inner {
    info: EngineInfo,
    spec: ModelSpec,
    rerank_inputs: RerankInputs,
    tokenizer: Arc<InputTokenizer>,
    queue: mpsc::Sender<Entry>,
    stats: Arc<EngineStats>,
}

/// A handle to a running engine; clones share it. Dropping the last handle drains the queue
/// and stops the threads.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// Loads the model on its own thread and starts the batcher. Blocks until the model is
    /// loaded (or failed to).
    pub fn start(model: ResolvedModel, cfg: EngineConfig) -> Result<Self, EngineError> {
        let ResolvedModel {
            files,
            spec,
            provenance,
        } = model;
        if cfg.max_batch_rows == 0 {
            return Err(EngineError::Config(
                "max_batch_rows must be at least 1".into(),
            ));
        }
        let (dev, dtype) = device::open(cfg.device, cfg.dtype)?;
        let tokenizer = Arc::new(InputTokenizer::load(
            &files.tokenizer,
            spec.max_tokens,
            cfg.truncation,
        )?);
        if dev.is_cpu() {
            super::heap::keep_tensor_memory();
        }

        let stats = Arc::new(EngineStats::default());
        let (job_tx, job_rx) = mpsc::sync_channel::<Job>(0);
        // One launched batch waits for the finisher while the model thread runs the next.
        let (done_tx, done_rx) = mpsc::sync_channel::<Launched>(1);
        let (ready_tx, ready_rx) = mpsc::channel();
        {
            let (spec, dev, cfg) = (spec.clone(), dev.clone(), cfg.clone());
            let model_tokenizer = tokenizer.clone();
            std::thread::Builder::new()
                .name("fantom-model".into())
                .spawn(move || {
                    let t0 = Instant::now();
                    let token_id = |t: &str| model_tokenizer.token_id(t);
                    let model = match models::load(&files, &spec, &dev, dtype, &token_id) {
                        Ok(m) => m,
                        Err(e) => {
                            let _ = ready_tx.send(Err(Refused::Load(e.to_string())));
                            return;
                        }
                    };
                    let load_time = t0.elapsed();
                    let head_dim = model.encoder.activation_shape().head_dim;
                    let (attention, fallback) = match cfg.attention.resolve(&dev, dtype, head_dim) {
                        Ok(resolved) => resolved,
                        Err(e) => {
                            let _ = ready_tx.send(Err(Refused::Config(e)));
                            return;
                        }
                    };
                    let sized = size_and_warm_up(
                        &model,
                        &spec,
                        &cfg,
                        attention,
                        dtype,
                        &dev,
                        &model_tokenizer,
                    );
                    let (max_batch_tokens, source, warmup_rows) = match sized {
                        Ok(sized) => sized,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    // FLOPs per token as a line in the sequence length: f(s) = a + b·s.
                    let a = model.encoder.flops_per_token(0);
                    let b = model.encoder.flops_per_token(1) - a;
                    let _ = ready_tx.send(Ok(Ready {
                        hidden: model.encoder.hidden_size(),
                        load_time,
                        flops_line: (a, b),
                        max_batch_tokens,
                        source,
                        warmup_rows,
                        attention,
                        fallback,
                    }));
                    model_loop(&model, job_rx, done_tx, &dev);
                })
                .map_err(|e| EngineError::Load(format!("cannot spawn the model thread: {e}")))?;
        }
        let ready = ready_rx
            .recv()
            .map_err(|_| EngineError::Load("the model thread died while loading".into()))?
            .map_err(|e| match e {
                Refused::Config(m) => EngineError::Config(m),
                Refused::Load(m) => EngineError::Load(m),
            })?;
        let (hidden, load_time, flops_line) = (ready.hidden, ready.load_time, ready.flops_line);
        let attention = ready.attention;
        {
            let (stats, dev) = (stats.clone(), dev.clone());
            std::thread::Builder::new()
                .name("fantom-finisher".into())
                .spawn(move || finisher_loop(done_rx, &stats, &dev))
                .map_err(|e| EngineError::Load(format!("cannot spawn the finisher thread: {e}")))?;
        }
        let dims = match spec.task {
            Task::Embed => {
                let dims = spec.dims.unwrap_or(hidden);
                if dims != hidden {
                    return Err(EngineError::Config(format!(
                        "the manifest says {dims} dims but the model outputs {hidden}"
                    )));
                }
                dims
            }
            Task::Rerank => 1,
        };

        let (queue_tx, queue_rx) = mpsc::channel::<Entry>();
        let budget = BatchBudget {
            max_tokens: ready.max_batch_tokens,
            max_rows: cfg.max_batch_rows,
            padded: attention == AttentionMode::Padded,
        };
        {
            let dev = dev.clone();
            std::thread::Builder::new()
                .name("fantom-batcher".into())
                .spawn(move || batcher_loop(queue_rx, job_tx, budget, attention, &dev))
                .map_err(|e| EngineError::Load(format!("cannot spawn the batcher thread: {e}")))?;
        }

        let info = EngineInfo {
            provenance,
            architecture: spec.architecture.to_string(),
            task: spec.task,
            pooling: (spec.task == Task::Embed).then(|| spec.pooling.to_string()),
            normalize: spec.normalize,
            max_tokens: spec.max_tokens,
            dims,
            score_activation: spec.score,
            device: device::describe(&dev),
            dtype: format!("{dtype:?}").to_lowercase(),
            max_batch_tokens: ready.max_batch_tokens,
            max_batch_tokens_source: ready.source.as_str(),
            warmup_rows: ready.warmup_rows,
            max_batch_rows: cfg.max_batch_rows,
            attention: attention.name().to_string(),
            flops_per_token: [flops_line.0, flops_line.1],
        };
        let files_from = info
            .provenance
            .origin()
            .map_or_else(|| "an unpinned folder".to_string(), ToString::to_string);
        tracing::info!(
            model = %info.provenance,
            pinned = info.provenance.is_pinned(),
            files_from = %files_from,
            device = %info.device,
            dtype = %info.dtype,
            dims = info.dims,
            load_ms = load_time.as_millis() as u64,
            max_batch_tokens = info.max_batch_tokens,
            max_batch_tokens_from = info.max_batch_tokens_source,
            warmup_rows = info.warmup_rows,
            attention = %info.attention,
            attention_fallback = ready.fallback.as_deref().unwrap_or(""),
            "model loaded"
        );
        for f in info.provenance.files() {
            tracing::debug!(file = %f.name, sha256 = %f.sha256, check = ?f.check, "model file");
        }
        let rerank_inputs = match spec.architecture {
            Architecture::Qwen3 => RerankInputs::ChatTemplate {
                prefix: tokenizer.encode_raw(qwen3::RERANK_PREFIX)?,
                suffix: tokenizer.encode_raw(qwen3::RERANK_SUFFIX)?,
                default_instruction: spec
                    .prompts
                    .default_task
                    .clone()
                    .unwrap_or_else(|| QWEN3_DEFAULT_TASK.to_string()),
            },
            Architecture::Bert => RerankInputs::Pairs,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                info,
                spec,
                rerank_inputs,
                tokenizer,
                queue: queue_tx,
                stats,
            }),
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.inner.info
    }

    pub fn stats(&self) -> &EngineStats {
        &self.inner.stats
    }

    /// Embeds `texts`; one vector per text, in order.
    pub async fn embed(
        &self,
        texts: Vec<String>,
        opts: EmbedOptions,
    ) -> Result<Vec<Vec<f32>>, InferenceError> {
        Ok(self.embed_counted(texts, opts).await?.value)
    }

    /// [`Engine::embed`], with the number of tokens the model read (templates included).
    pub async fn embed_counted(
        &self,
        texts: Vec<String>,
        opts: EmbedOptions,
    ) -> Result<Counted<Vec<Vec<f32>>>, InferenceError> {
        self.require(Task::Embed)?;
        check_texts(&texts)?;
        self.check_dimensions(opts.dimensions)?;
        let prompts = &self.inner.spec.prompts;
        let texts: Vec<String> = texts
            .iter()
            .map(|t| prompts.apply(t, opts.is_query, opts.task.as_deref()))
            .collect();
        let tokenizer = self.inner.tokenizer.clone();
        let truncate = opts.truncate;
        let inputs = run_blocking(move || {
            if truncate {
                tokenizer.encode_texts_truncated(texts)
            } else {
                tokenizer.encode_texts(texts)
            }
        })
        .instrument(tracing::info_span!("tokenize"))
        .await?;
        let tokens = inputs.iter().map(TokenizedInput::len).sum();
        // Waiting for the engine's batch and the model's forward pass in it.
        let value = self
            .vectors(inputs, opts.dimensions, opts.urgent)
            .instrument(tracing::info_span!("batch", tokens))
            .await?;
        Ok(Counted { value, tokens })
    }

    /// Embeds inputs that are already token ids (benchmarks; no template, no tokenizer).
    pub async fn embed_tokens(
        &self,
        inputs: Vec<TokenizedInput>,
        opts: EmbedOptions,
    ) -> Result<Vec<Vec<f32>>, InferenceError> {
        self.require(Task::Embed)?;
        self.check_dimensions(opts.dimensions)?;
        if inputs.is_empty() {
            return Err(InferenceError::EmptyInput);
        }
        let max = self.inner.spec.max_tokens;
        for (index, input) in inputs.iter().enumerate() {
            if input.is_empty() {
                return Err(InferenceError::EmptyText { index });
            }
            if input.len() > max {
                return Err(InferenceError::TooLong { index, max });
            }
        }
        self.vectors(inputs, opts.dimensions, opts.urgent).await
    }

    /// Matryoshka truncation must keep at least one dimension and at most all of them.
    fn check_dimensions(&self, dimensions: Option<usize>) -> Result<(), InferenceError> {
        let full = self.inner.info.dims;
        match dimensions {
            Some(d) if d == 0 || d > full => Err(InferenceError::BadDimensions {
                requested: d,
                max: full,
            }),
            _ => Ok(()),
        }
    }

    /// Runs tokenized inputs and finishes each vector (truncation, normalisation).
    async fn vectors(
        &self,
        inputs: Vec<TokenizedInput>,
        dimensions: Option<usize>,
        urgent: bool,
    ) -> Result<Vec<Vec<f32>>, InferenceError> {
        let normalize = self.inner.spec.normalize;
        self.submit(inputs, urgent)
            .await?
            .into_iter()
            .map(|row| match row {
                RowOutput::Vector(v) => Ok(pooling::finish(v, dimensions, normalize)),
                RowOutput::Score(_) => Err(InferenceError::Model("expected a vector".into())),
            })
            .collect()
    }

    /// The tokenizer the engine uses (vocabulary lookups, benchmarks).
    pub fn tokenizer(&self) -> &InputTokenizer {
        &self.inner.tokenizer
    }

    /// Scores each document against `query`; one score per document, in order.
    pub async fn rerank(
        &self,
        query: String,
        documents: Vec<String>,
        opts: RerankOptions,
    ) -> Result<Vec<RerankScore>, InferenceError> {
        Ok(self.rerank_counted(query, documents, opts).await?.value)
    }

    /// [`Engine::rerank`], with the number of tokens the model read (a shared prefix once).
    pub async fn rerank_counted(
        &self,
        query: String,
        documents: Vec<String>,
        opts: RerankOptions,
    ) -> Result<Counted<Vec<RerankScore>>, InferenceError> {
        self.require(Task::Rerank)?;
        if query.is_empty() {
            return Err(InferenceError::EmptyQuery);
        }
        check_texts(&documents)?;
        let tokenizer = self.inner.tokenizer.clone();
        let tokenize = tracing::info_span!("tokenize");
        let inputs = match &self.inner.rerank_inputs {
            RerankInputs::Pairs => {
                run_blocking(move || tokenizer.encode_pairs(&query, documents))
                    .instrument(tokenize)
                    .await?
            }
            RerankInputs::ChatTemplate {
                prefix,
                suffix,
                default_instruction,
            } => {
                let instruction = opts
                    .instruction
                    .unwrap_or_else(|| default_instruction.clone());
                let bodies = documents
                    .iter()
                    .map(|d| qwen3::rerank_body(&instruction, &query, d))
                    .collect();
                let (prefix, suffix) = (prefix.clone(), suffix.clone());
                run_blocking(move || tokenizer.encode_framed(&prefix, bodies, &suffix))
                    .instrument(tokenize)
                    .await?
            }
        };
        let sigmoid = self.inner.spec.score == ScoreActivation::Sigmoid;
        let (inputs, prefix) = match self.inner.rerank_inputs {
            // Causal models: rows that start with the same tokens have the same states there.
            RerankInputs::ChatTemplate { .. } => split_shared_prefix(inputs),
            RerankInputs::Pairs => (inputs, None),
        };
        let tokens = inputs.iter().map(TokenizedInput::len).sum::<usize>()
            + prefix.as_ref().map_or(0, |p| p.len());
        let value = self
            .submit_shared(inputs, prefix, opts.urgent)
            .instrument(tracing::info_span!("batch", tokens))
            .await?
            .into_iter()
            .map(|row| match row {
                RowOutput::Score(score) => Ok(RerankScore {
                    score,
                    probability: sigmoid.then(|| 1.0 / (1.0 + (-score).exp())),
                }),
                RowOutput::Vector(_) => Err(InferenceError::Model("expected a score".into())),
            })
            .collect::<Result<_, _>>()?;
        Ok(Counted { value, tokens })
    }

    fn require(&self, wanted: Task) -> Result<(), InferenceError> {
        let model = self.inner.spec.task;
        if model == wanted {
            Ok(())
        } else {
            Err(InferenceError::WrongTask { model, wanted })
        }
    }

    /// Queues tokenized inputs and waits for every row.
    async fn submit(
        &self,
        inputs: Vec<TokenizedInput>,
        urgent: bool,
    ) -> Result<Vec<RowOutput>, InferenceError> {
        self.submit_shared(inputs, None, urgent).await
    }

    /// Queues inputs that all continue `prefix` (their ids are the tails), or whole inputs.
    async fn submit_shared(
        &self,
        inputs: Vec<TokenizedInput>,
        prefix: Option<Arc<Vec<u32>>>,
        urgent: bool,
    ) -> Result<Vec<RowOutput>, InferenceError> {
        let mut receivers = Vec::with_capacity(inputs.len());
        for input in inputs {
            let (reply, rx) = oneshot::channel();
            self.inner
                .queue
                .send(Entry {
                    input,
                    urgent,
                    prefix: prefix.clone(),
                    reply,
                })
                .map_err(|_| InferenceError::Stopped)?;
            receivers.push(rx);
        }
        let mut out = Vec::with_capacity(receivers.len());
        for rx in receivers {
            out.push(rx.await.map_err(|_| InferenceError::Stopped)??);
        }
        Ok(out)
    }
}

/// Shortest common prefix worth computing once (below it, the extra row costs more than it saves).
const MIN_SHARED_PREFIX: usize = 16;

/// Splits rows that start with the same tokens into that shared prefix and their tails, when the
/// prefix is long enough to pay and every row keeps at least its last token (the one scored).
/// Only valid for causal models: a token's state then depends on earlier tokens alone.
fn split_shared_prefix(
    inputs: Vec<TokenizedInput>,
) -> (Vec<TokenizedInput>, Option<Arc<Vec<u32>>>) {
    if inputs.len() < 2 {
        return (inputs, None);
    }
    let first = &inputs[0].ids;
    let mut common = inputs.iter().map(|i| i.len() - 1).min().unwrap_or(0);
    for input in &inputs[1..] {
        common = common.min(
            first
                .iter()
                .zip(&input.ids)
                .take_while(|(a, b)| a == b)
                .count(),
        );
    }
    if common < MIN_SHARED_PREFIX {
        return (inputs, None);
    }
    let prefix = Arc::new(first[..common].to_vec());
    let tails = inputs
        .into_iter()
        .map(|i| TokenizedInput {
            ids: i.ids[common..].to_vec(),
            type_ids: i.type_ids[common..].to_vec(),
        })
        .collect();
    (tails, Some(prefix))
}

fn check_texts(texts: &[String]) -> Result<(), InferenceError> {
    if texts.is_empty() {
        return Err(InferenceError::EmptyInput);
    }
    if let Some(index) = texts.iter().position(String::is_empty) {
        return Err(InferenceError::EmptyText { index });
    }
    Ok(())
}

async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TokenizeError> + Send + 'static,
) -> Result<T, InferenceError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| InferenceError::Tokenize(format!("tokenizer task failed: {e}")))?
        .map_err(|e| match e {
            TokenizeError::TooLong { index, max } => InferenceError::TooLong { index, max },
            other => InferenceError::Tokenize(other.to_string()),
        })
}
