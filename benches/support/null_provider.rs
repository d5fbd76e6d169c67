//! What benchmarks of the hub measure against: a provider that does no inference (every item
//! answered at once with the same 8 floats) and an agent of the bench process hosting it, the
//! reference server that answers the same embedding straight from an axum handler (call inside
//! a Tokio runtime), and the client calls both are measured with.

use fantom_sidecar::agent::provider::{BoxFuture, Provider, ProviderFailure, WorkResult};
use fantom_sidecar::protocol::{Backend, ProviderInfo, WorkInput, WorkOutput};
use fantom_sidecar::roles::Role;
use serde_json::json;

/// Answers every item with the same 8 floats, at once.
pub struct NullProvider;

impl Provider for NullProvider {
    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "embedding".into(),
            role: Role::Embedding,
            backend: Backend::Local,
            model: "null".into(),
            revision: Some("bench".into()),
            upstream: None,
            dims: Some(8),
            dtype: None,
            device: None,
            max_input_tokens: None,
            pooling: None,
            max_batch_items: 64,
            max_batch_tokens: 1 << 20,
            score_activation: None,
            server: None,
            attention: None,
        }
    }

    fn pipeline_depth(&self) -> u32 {
        4
    }

    fn run(&self, input: WorkInput) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
        let n = input.items();
        Box::pin(async move {
            Ok(WorkResult {
                output: WorkOutput::Embeddings(vec![vec![0.125; 8]; n]),
                tokens: n as u64,
                cost_usd: None,
            })
        })
    }
}

/// Starts the reference: one embedding answered straight from a handler, on the same HTTP
/// stack as the hub. Returns its address.
pub fn start_direct() -> std::net::SocketAddr {
    let direct = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let addr = direct.local_addr().expect("its address");
    let echo = axum::Router::new().route(
        "/v1/embeddings",
        axum::routing::post(|axum::Json(_): axum::Json<serde_json::Value>| async {
            axum::Json(
                json!({"object":"list","data":[{"object":"embedding","index":0,
                "embedding":vec![0.125f32; 8]}],"model":"embedding"}),
            )
        }),
    );
    tokio::spawn(fantom_sidecar::http::serve(
        direct,
        echo,
        None,
        std::future::pending(),
    ));
    addr
}

/// One `/v1/embeddings` request of `texts` to `addr`, its answer read to the end.
pub async fn embed(client: &reqwest::Client, addr: std::net::SocketAddr, texts: &[String]) {
    let r = client
        .post(format!("http://{addr}/v1/embeddings"))
        .json(&json!({"model": "embedding", "input": texts}))
        .send()
        .await
        .expect("the request is sent");
    assert!(r.status().is_success(), "{}", r.status());
    let _ = r.bytes().await.expect("the answer is read");
}

/// An agent of this process hosting the null provider, dialling `hub_urls`; run it with its
/// stop switch.
pub fn null_agent(
    hub_urls: Vec<String>,
    agent_id: String,
    fleet_token: &fantom_sidecar::secret::Secret,
) -> std::sync::Arc<fantom_sidecar::agent::Agent> {
    fantom_sidecar::agent::Agent::new(fantom_sidecar::agent::AgentOptions {
        hub_urls,
        agent_id,
        fleet_token: fleet_token.clone(),
        ca_file: None,
        drain_timeout: std::time::Duration::from_secs(5),
        max_frame_bytes: fantom_sidecar::protocol::codec::DEFAULT_MAX_FRAME_BYTES,
        providers: vec![std::sync::Arc::new(NullProvider)],
        servers: Default::default(),
        cloud: Default::default(),
    })
}

/// Items/s over `requests` requests of 1 000 texts to `addr`, `in_flight` at a time.
pub async fn items_per_s(
    client: &reqwest::Client,
    addr: std::net::SocketAddr,
    requests: usize,
    in_flight: usize,
) -> f64 {
    let batch: std::sync::Arc<Vec<String>> =
        std::sync::Arc::new((0..1000).map(|i| format!("text number {i}")).collect());
    let started = std::time::Instant::now();
    let mut set = tokio::task::JoinSet::new();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(in_flight));
    for _ in 0..requests {
        let (client, batch, sem) = (client.clone(), batch.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await.expect("the semaphore");
            embed(&client, addr, &batch).await
        });
    }
    while let Some(done) = set.join_next().await {
        done.expect("a request task");
    }
    (requests * 1000) as f64 / started.elapsed().as_secs_f64()
}
