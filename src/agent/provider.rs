//! Providers: one thing that serves one role on this agent. The [`Provider`] trait is the seam
//! between the pull loop and what does the work: a local candle engine ([`LocalProvider`]), a
//! cloud route ([`super::cloud_provider`]), a fronted model server
//! ([`super::local_server::provider`]). Benchmarks and tests plug in their own.

use std::future::Future;
use std::pin::Pin;

use crate::inference::{EmbedOptions, Engine, InferenceError, RerankOptions};
use crate::protocol::{
    Backend, Defect, FailureClass, LimitKind, ProviderInfo, Refusal, Score, WorkClass, WorkInput,
    WorkOutput,
};
use crate::roles::Role;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A finished work item.
#[derive(Debug)]
pub struct WorkResult {
    pub output: WorkOutput,
    pub tokens: u64,
    /// What the call cost (US dollars), where the upstream says.
    pub cost_usd: Option<f64>,
}

/// A failed work item and what it means (see [`FailureClass`]).
#[derive(Debug, Clone)]
pub struct ProviderFailure {
    pub class: FailureClass,
    pub message: String,
    pub retry_after_ms: Option<u64>,
    /// The limit that refused a cloud call, when one did.
    pub limit: Option<LimitKind>,
    /// A cloud route's standing refusal (the key was rejected, no endpoint for the pin).
    pub refusal: Option<Refusal>,
    /// The provider's own output was wrong (see [`Defect`]).
    pub defect: Option<Defect>,
}

impl ProviderFailure {
    pub fn new(class: FailureClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
            retry_after_ms: None,
            limit: None,
            refusal: None,
            defect: None,
        }
    }

    /// Provider `id`'s model produced NaN or an infinity: no frame can carry that, and no
    /// retry on this provider helps (fatal; the hub takes the provider out of service).
    pub fn non_finite(id: &str) -> Self {
        Self {
            defect: Some(Defect::NonFinite),
            ..Self::new(
                FailureClass::Fatal,
                format!(
                    "provider '{id}': the model produced non-finite values (NaN or infinity); its weights may be corrupt or its dtype may overflow (try float32)"
                ),
            )
        }
    }
}

/// `result`, or the failure of a provider whose output holds a non-finite number.
pub fn finite(
    id: &str,
    result: Result<WorkResult, ProviderFailure>,
) -> Result<WorkResult, ProviderFailure> {
    match result {
        Ok(r) if !r.output.is_finite() => Err(ProviderFailure::non_finite(id)),
        other => other,
    }
}

/// Something that serves one role.
pub trait Provider: Send + Sync + 'static {
    /// What the hub is told in `hello`.
    fn info(&self) -> ProviderInfo;
    /// Work frames this provider takes at once (the credits of its pull loop).
    fn pipeline_depth(&self) -> u32;
    /// Does one work item.
    fn run(&self, input: WorkInput) -> BoxFuture<Result<WorkResult, ProviderFailure>>;
    /// Does one work item of `class`: a provider with a queue of its own (a local engine)
    /// serves interactive work before batch work it already holds; others run it as is.
    fn run_class(
        &self,
        input: WorkInput,
        class: WorkClass,
    ) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        let _ = class;
        self.run(input)
    }
    /// Does one chat that asked to stream: each chunk goes to `chunks` as it arrives, and the
    /// result is the whole completion. A provider that cannot stream answers whole (no
    /// chunks: the hub cuts them from the completion).
    fn run_streaming(
        &self,
        input: WorkInput,
        chunks: ChunkSink,
    ) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        drop(chunks);
        self.run(input)
    }
}

/// Where a streamed chat's chunks go as they arrive.
pub type ChunkSink = tokio::sync::mpsc::UnboundedSender<serde_json::Value>;

/// A local model serving one role (a model serving two roles is two providers on one engine).
pub struct LocalProvider {
    info: ProviderInfo,
    engine: Engine,
    depth: u32,
}

impl LocalProvider {
    pub fn new(role: Role, engine: Engine, pipeline: crate::config::agent::Pipeline) -> Self {
        let (depth, max_items) = (pipeline.depth, pipeline.max_items);
        let e = engine.info();
        // Pinned: the commit. Unpinned: the digest of the folder's files, so changed bytes are
        // a new provider identity the gate checks again before it serves.
        let revision = Some(e.provenance.revision());
        // An unpinned folder is named by its bytes (the same digest), never by its path: a
        // host path reaches no response, and two hosts with the same bytes in different
        // folders are one model. The folder stays in this agent's own log.
        let model = match &e.provenance {
            crate::model_source::Provenance::Pinned { id, .. } => id.clone(),
            crate::model_source::Provenance::Unpinned { dir, .. }
            | crate::model_source::Provenance::RandomWeights { dir, .. } => {
                let digest = e.provenance.revision();
                tracing::info!(role = %role, dir = %dir.display(), model = %digest, "an unpinned model folder is known to the hub by its digest");
                digest
            }
        };
        let info = ProviderInfo {
            id: role.to_string(),
            role,
            backend: Backend::Local,
            model,
            revision,
            upstream: None,
            dims: role.is_embedding().then_some(e.dims),
            dtype: Some(e.dtype.clone()),
            device: Some(e.device.clone()),
            max_input_tokens: Some(e.max_tokens),
            pooling: e.pooling.clone().filter(|_| role.is_embedding()),
            max_batch_items: max_items,
            max_batch_tokens: e.max_batch_tokens,
            score_activation: (role.op() == crate::roles::Op::Rerank).then_some(e.score_activation),
            server: None,
            attention: Some(e.attention.clone()),
        };
        Self {
            info,
            engine,
            depth,
        }
    }
}

/// Input problems no other provider would solve are fatal; the rest may succeed elsewhere.
fn classify(e: InferenceError) -> ProviderFailure {
    let class = match e {
        InferenceError::Model(_) | InferenceError::Stopped => FailureClass::Transient,
        InferenceError::WrongTask { .. } => FailureClass::Refused,
        _ => FailureClass::Fatal,
    };
    ProviderFailure::new(class, e.to_string())
}

impl Provider for LocalProvider {
    fn info(&self) -> ProviderInfo {
        self.info.clone()
    }

    fn pipeline_depth(&self) -> u32 {
        self.depth
    }

    fn run(&self, input: WorkInput) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        self.run_class(input, WorkClass::Batch)
    }

    fn run_class(
        &self,
        input: WorkInput,
        class: WorkClass,
    ) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        let engine = self.engine.clone();
        let urgent = class == WorkClass::Interactive;
        Box::pin(async move {
            match input {
                WorkInput::Embed(e) => {
                    let opts = EmbedOptions {
                        is_query: e.is_query,
                        task: e.instruction,
                        dimensions: e.dimensions,
                        truncate: e.truncate,
                        urgent,
                    };
                    let out = engine
                        .embed_counted(e.texts, opts)
                        .await
                        .map_err(classify)?;
                    Ok(WorkResult {
                        output: WorkOutput::Embeddings(out.value),
                        tokens: out.tokens as u64,
                        cost_usd: None,
                    })
                }
                WorkInput::Rerank(r) => {
                    let opts = RerankOptions {
                        instruction: r.instruction,
                        urgent,
                    };
                    let out = engine
                        .rerank_counted(r.query, r.documents, opts)
                        .await
                        .map_err(classify)?;
                    let scores = out
                        .value
                        .into_iter()
                        .map(|s| Score {
                            score: s.score,
                            probability: s.probability,
                        })
                        .collect();
                    Ok(WorkResult {
                        output: WorkOutput::Scores(scores),
                        tokens: out.tokens as u64,
                        cost_usd: None,
                    })
                }
                WorkInput::Chat(_) => Err(ProviderFailure::new(
                    FailureClass::Refused,
                    "chat roles are served by cloud routes and fronted model servers, not local models",
                )),
            }
        })
    }
}
