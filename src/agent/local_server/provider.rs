//! A declared server as a hub provider: a local provider (policy `local` admits it, nothing
//! leaves the host) whose `server` field says it is fronted. Chat runs on the server's
//! `/v1/chat/completions`, streamed when the client asked; embeddings are truncated to the
//! requested width and L2-normalised here, as our own models' are, and the gate judges them
//! like any other provider's before they serve a text. A reranker's scores come as logit and
//! probability ([`super::rerank`]); its scorer identity is its model, revision (the server's,
//! else the operator's) and quantization, checked by the hub on probe pairs.

use std::sync::Arc;

use tokio::sync::Notify;
use tracing::Instrument;

use super::api::ServerApi;
use crate::agent::provider::{BoxFuture, ChunkSink, Provider, ProviderFailure, WorkResult};
use crate::config::local_server::{LocalServerConfig, ServerKind};
use crate::protocol::{Backend, FailureClass, ProviderInfo, WorkInput, WorkOutput};
use crate::roles::{Op, Role};

/// A generous token budget per embedding call (the server enforces its own).
const MAX_TOKENS_PER_CALL: usize = 65_536;

pub struct ServerProvider {
    info: ProviderInfo,
    api: Arc<ServerApi>,
    depth: u32,
    kind: ServerKind,
    /// Wakes the server's health loop when a call finds nothing listening.
    check_now: Arc<Notify>,
}

impl ServerProvider {
    pub fn new(
        role: Role,
        cfg: &LocalServerConfig,
        revision: Option<String>,
        api: Arc<ServerApi>,
        check_now: Arc<Notify>,
    ) -> Self {
        let embeds = role.op() == Op::Embed;
        let reranks = role.op() == Op::Rerank;
        let info = ProviderInfo {
            id: format!("server:{role}"),
            role,
            backend: Backend::Local,
            model: cfg.model.clone(),
            revision: served_revision(cfg, revision),
            upstream: None,
            dims: cfg.dims.filter(|_| embeds),
            dtype: cfg.quantization.clone(),
            device: None,
            max_input_tokens: None,
            pooling: None,
            max_batch_items: if embeds || reranks {
                cfg.max_items_per_work
            } else {
                1
            },
            max_batch_tokens: MAX_TOKENS_PER_CALL,
            score_activation: reranks.then_some(super::rerank::ACTIVATION),
            server: Some(cfg.kind.as_str().to_string()),
            attention: None,
        };
        Self {
            info,
            api,
            depth: cfg.pipeline_depth,
            kind: cfg.kind,
            check_now,
        }
    }

    pub fn info_ref(&self) -> &ProviderInfo {
        &self.info
    }
}

impl Provider for ServerProvider {
    fn info(&self) -> ProviderInfo {
        self.info.clone()
    }

    fn pipeline_depth(&self) -> u32 {
        self.depth
    }

    fn run(&self, input: WorkInput) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        let api = self.api.clone();
        let dims = self.info.dims;
        let (kind, model) = (self.kind, self.info.model.clone());
        let bell = self.check_now.clone();
        Box::pin(async move {
            match input {
                WorkInput::Embed(e) => {
                    let dimensions = e.dimensions;
                    let texts = e.instructed_texts();
                    let (vectors, tokens) = api
                        .embed(&texts, dims)
                        .await
                        .map_err(|e| failure(&bell, &e))?;
                    let width = vectors.first().map_or(0, Vec::len);
                    if let Some(d) = dimensions.filter(|d| *d > width) {
                        return Err(ProviderFailure::new(
                            FailureClass::Fatal,
                            format!("dimensions {d} is wider than the server's {width}"),
                        ));
                    }
                    let vectors = vectors
                        .into_iter()
                        .map(|v| crate::inference::pooling::finish(v, dimensions, true))
                        .collect();
                    Ok(WorkResult {
                        output: WorkOutput::Embeddings(vectors),
                        tokens,
                        cost_usd: None,
                    })
                }
                WorkInput::Chat(body) => {
                    let (response, tokens) =
                        api.chat(body).await.map_err(|e| failure(&bell, &e))?;
                    Ok(WorkResult {
                        output: WorkOutput::Chat(response),
                        tokens,
                        cost_usd: None,
                    })
                }
                WorkInput::Rerank(r) if r.instruction.is_some() => Err(ProviderFailure::new(
                    FailureClass::Refused,
                    "a fronted reranker takes no instruction (an instructed reranker like Qwen3 runs as a [[models]] table)",
                )),
                WorkInput::Rerank(r) => {
                    let (scores, tokens) = api
                        .rerank(kind, &model, &r.query, &r.documents)
                        .await
                        .map_err(|e| failure(&bell, &e))?;
                    Ok(WorkResult {
                        output: WorkOutput::Scores(scores),
                        tokens,
                        cost_usd: None,
                    })
                }
            }
        }
        .instrument(tracing::info_span!("server_call", kind = kind.as_str())))
    }

    fn run_streaming(
        &self,
        input: WorkInput,
        chunks: ChunkSink,
    ) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        let WorkInput::Chat(body) = input else {
            return self.run(input);
        };
        let api = self.api.clone();
        let bell = self.check_now.clone();
        Box::pin(
            async move {
                let forward = |chunk| {
                    let _ = chunks.send(chunk);
                };
                let (response, tokens) = api
                    .chat_stream(body, forward)
                    .await
                    .map_err(|e| failure(&bell, &e))?;
                Ok(WorkResult {
                    output: WorkOutput::Chat(response),
                    tokens,
                    cost_usd: None,
                })
            }
            .instrument(tracing::info_span!("server_call", stream = true)),
        )
    }
}

/// The revision a provider of `cfg` names: what the server tells of its weights, else what the
/// operator declared. A reranker's is the bare commit (TEI's `model_sha` without the `tei:` the
/// embedding gate reads it with), so a TEI and a vLLM of one commit claim one scorer.
pub fn served_revision(cfg: &LocalServerConfig, told: Option<String>) -> Option<String> {
    let told = match cfg.role.op() {
        Op::Rerank => told.map(|r| r.strip_prefix("tei:").map_or(r.clone(), str::to_string)),
        _ => told,
    };
    told.or_else(|| cfg.revision.clone())
}

/// The hub's failure for a server error; nothing listening wakes the health loop (`bell`).
fn failure(bell: &Notify, e: &super::api::ServerError) -> ProviderFailure {
    if e.is_refused() {
        bell.notify_one();
    }
    e.failure()
}
