//! A declared server as a hub provider: a local provider (policy `local` admits it, nothing
//! leaves the host) whose `server` field says it is fronted. Chat runs on the server's
//! `/v1/chat/completions`, streamed when the client asked; embeddings are truncated to the
//! requested width and L2-normalised here, as our own models' are, and the gate judges them
//! like any other provider's before they serve a text.

use std::sync::Arc;

use tokio::sync::Notify;

use super::api::ServerApi;
use crate::agent::provider::{BoxFuture, ChunkSink, Provider, ProviderFailure, WorkResult};
use crate::config::local_server::LocalServerConfig;
use crate::protocol::{Backend, FailureClass, ProviderInfo, WorkInput, WorkOutput};
use crate::roles::{Op, Role};

/// A generous token budget per embedding call (the server enforces its own).
const MAX_TOKENS_PER_CALL: usize = 65_536;

pub struct ServerProvider {
    info: ProviderInfo,
    api: Arc<ServerApi>,
    depth: u32,
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
        let info = ProviderInfo {
            id: format!("server:{role}"),
            role,
            backend: Backend::Local,
            model: cfg.model.clone(),
            revision,
            upstream: None,
            dims: cfg.dims.filter(|_| embeds),
            dtype: None,
            device: None,
            max_input_tokens: None,
            pooling: None,
            max_batch_items: if embeds { cfg.max_items_per_work } else { 1 },
            max_batch_tokens: MAX_TOKENS_PER_CALL,
            score_activation: None,
            server: Some(cfg.kind.as_str().to_string()),
        };
        Self {
            info,
            api,
            depth: cfg.pipeline_depth,
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
                WorkInput::Rerank(_) => Err(ProviderFailure::new(
                    FailureClass::Refused,
                    "a fronted server does not rerank here",
                )),
            }
        })
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
        Box::pin(async move {
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
        })
    }
}

/// The hub's failure for a server error; nothing listening wakes the health loop (`bell`).
fn failure(bell: &Notify, e: &super::api::ServerError) -> ProviderFailure {
    if e.is_refused() {
        bell.notify_one();
    }
    e.failure()
}
