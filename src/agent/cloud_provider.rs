//! A cloud route as a provider: one role served through OpenRouter with the pushed key. The
//! hub decides how many of its leases run (the global budget); this turns a work frame into
//! one upstream call and an upstream failure into a failure class the hub acts on (a limit
//! names its kind, so the budget can shrink the right scope).

use std::sync::Arc;

use sha2::Digest;
use tracing::Instrument;

use super::provider::{BoxFuture, ChunkSink, Provider, ProviderFailure, WorkResult};
use crate::cloud::error::CloudError;
use crate::cloud::openrouter::OpenRouterClient;
use crate::cloud::route::CloudRoute;
use crate::protocol::{Backend, ProviderInfo, Score, ScoreActivation, WorkInput, WorkOutput};
use crate::roles::Op;

/// Texts per embeddings call, documents per rerank call.
const MAX_ITEMS_PER_CALL: usize = 64;
/// A generous token budget per call (the upstream enforces its own).
const MAX_TOKENS_PER_CALL: usize = 65_536;

pub struct CloudProvider {
    route: Arc<CloudRoute>,
    client: Arc<OpenRouterClient>,
    depth: u32,
    info: ProviderInfo,
}

impl CloudProvider {
    pub fn new(route: CloudRoute, client: Arc<OpenRouterClient>, depth: u32) -> Self {
        let role = route.role();
        let max_items = match role.op() {
            Op::Chat => 1,
            Op::Embed | Op::Rerank => MAX_ITEMS_PER_CALL,
        };
        // The id names the route, not just the role: work sent for an older route of the role
        // is refused (and requeued), never run on a new model, and credits never cross.
        let digest = sha2::Sha256::digest(route.key().as_bytes());
        let info = ProviderInfo {
            id: format!(
                "cloud:{role}:{:02x}{:02x}{:02x}{:02x}",
                digest[0], digest[1], digest[2], digest[3]
            ),
            role,
            backend: Backend::Cloud,
            model: route.model().to_string(),
            revision: None,
            upstream: route.upstream(),
            dims: route.dims(),
            dtype: route
                .pin()
                .and_then(|p| p.quantization())
                .map(str::to_string),
            device: None,
            max_input_tokens: None,
            pooling: None,
            max_batch_items: max_items,
            max_batch_tokens: MAX_TOKENS_PER_CALL,
            // OpenRouter's rerank answers relevance probabilities (logits are derived from
            // them below), so a cloud reranker's scale is the sigmoid one.
            score_activation: (role.op() == Op::Rerank).then_some(ScoreActivation::Sigmoid),
            server: None,
            attention: None,
        };
        Self {
            route: Arc::new(route),
            client,
            depth: depth.max(1),
            info,
        }
    }
}

fn failure(e: CloudError) -> ProviderFailure {
    ProviderFailure {
        class: e.failure_class(),
        retry_after_ms: e.retry_after_ms(),
        limit: e.limit(),
        refusal: e.refusal(),
        defect: None,
        message: e.to_string(),
    }
}

impl Provider for CloudProvider {
    fn info(&self) -> ProviderInfo {
        self.info.clone()
    }

    fn pipeline_depth(&self) -> u32 {
        self.depth
    }

    fn run(&self, input: WorkInput) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        let (route, client) = (self.route.clone(), self.client.clone());
        Box::pin(
            async move {
                match input {
                    WorkInput::Embed(e) => {
                        let dimensions = e.dimensions;
                        let texts = e.instructed_texts();
                        let out = client
                            .embed(&route, &texts, dimensions, None)
                            .await
                            .map_err(failure)?;
                        Ok(WorkResult {
                            output: WorkOutput::Embeddings(out.vectors),
                            tokens: out.tokens,
                            cost_usd: out.cost_usd,
                        })
                    }
                    WorkInput::Rerank(r) => {
                        let out = client
                            .rerank(&route, &r.query, &r.documents)
                            .await
                            .map_err(failure)?;
                        let scores = out
                            .scores
                            .into_iter()
                            .map(Score::from_probability)
                            .collect();
                        Ok(WorkResult {
                            output: WorkOutput::Scores(scores),
                            tokens: out.tokens,
                            cost_usd: out.cost_usd,
                        })
                    }
                    WorkInput::Chat(body) => {
                        let out = client.chat(&route, body).await.map_err(failure)?;
                        Ok(WorkResult {
                            output: WorkOutput::Chat(out.response),
                            tokens: out.tokens,
                            cost_usd: out.cost_usd,
                        })
                    }
                }
            }
            .instrument(tracing::info_span!("cloud_call")),
        )
    }

    fn run_streaming(
        &self,
        input: WorkInput,
        chunks: ChunkSink,
    ) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        let WorkInput::Chat(body) = input else {
            return self.run(input);
        };
        let (route, client) = (self.route.clone(), self.client.clone());
        Box::pin(
            async move {
                let forward = |chunk| {
                    let _ = chunks.send(chunk);
                };
                let out = client
                    .chat_stream(&route, body, forward)
                    .await
                    .map_err(failure)?;
                Ok(WorkResult {
                    output: WorkOutput::Chat(out.response),
                    tokens: out.tokens,
                    cost_usd: out.cost_usd,
                })
            }
            .instrument(tracing::info_span!("cloud_call", stream = true)),
        )
    }
}
