//! What benchmarks of the hub measure against: a provider that does no inference (every item
//! answered at once with the same 8 floats), the reference server that answers the same
//! embedding straight from an axum handler (call inside a Tokio runtime), and the client call
//! both are measured with.

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
