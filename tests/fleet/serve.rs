//! `serve` (hub + one agent in one process) answers the client API with what the one-shot
//! tools compute locally.

use base64::Engine as _;
use serde_json::{Value, json};

use crate::local_support::{json_lines, run_cli};
use crate::support::*;

/// The one-shot tool's JSON lines for `texts`.
pub fn cli_lines(args: &[&str], texts: &[String]) -> Vec<Value> {
    let out = run_cli(args, &json_lines(texts), &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_embeddings_and_rerank_like_the_local_tools() {
    let dir = tempfile::tempdir().unwrap();
    let minilm = minilm_dir().display().to_string();
    let reranker = crate::local_support::fixtures()
        .join("qwen3/tiny-qwen3-reranker")
        .display()
        .to_string();
    let hub = start_serve(dir.path(), &["--reranker-model-dir", &reranker]);
    hub.wait_for_agent("solo").await;

    let texts = many_texts(40);
    let (status, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "code-embedding", "input": texts}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let want = cli_lines(
        &[
            "embed",
            "--model",
            "all-minilm-l6-v2",
            "--model-dir",
            &minilm,
        ],
        &texts,
    );
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), texts.len());
    for (i, (got, want)) in data.iter().zip(&want).enumerate() {
        assert_eq!(got["index"], i);
        let (g, w) = (vector(&got["embedding"]), vector(&want["embedding"]));
        assert_eq!(g.len(), 384);
        let max_diff = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max_diff < 1e-5, "text {i}: max diff {max_diff}");
        assert_eq!(got["provenance"]["provider"], "solo/code-embedding");
        assert_eq!(got["provenance"]["model"], "all-minilm-l6-v2");
        assert_eq!(
            got["provenance"]["revision"],
            "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"
        );
    }
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > texts.len() as u64);

    // One string, base64, and Matryoshka dimensions, on the other embedding role.
    let (status, b64) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": texts[3], "encoding_format": "base64", "dimensions": 128}),
        )
        .await;
    assert_eq!(status, 200, "{b64}");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(v.len(), 128);
    let full = vector(&want[3]["embedding"]);
    assert!(
        cosine(&v, &full[..128]) > 0.99999,
        "truncated then renormalised"
    );

    // Rerank: scores as the local rerank tool computes them, sorted, top_n, documents back.
    let docs: Vec<String> = texts[..6].to_vec();
    let query = "how does the hub lease work to agents?";
    let (status, body) = hub
        .post(
            "/v1/rerank",
            &json!({"query": query, "documents": docs, "top_n": 4, "return_documents": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let want = cli_lines(
        &["rerank", "--model-dir", &reranker, "--query", query],
        &docs,
    );
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 4);
    let mut last = f64::INFINITY;
    for r in results {
        let i = r["index"].as_u64().unwrap() as usize;
        let score = r["relevance_score"].as_f64().unwrap();
        let expected = want[i]["probability"].as_f64().unwrap();
        assert!(
            (score - expected).abs() < 1e-5,
            "doc {i}: {score} vs {expected}"
        );
        assert!(score <= last, "sorted by relevance");
        last = score;
        assert_eq!(r["document"]["text"], docs[i]);
        assert_eq!(r["provenance"]["provider"], "solo/reranker");
    }
}
