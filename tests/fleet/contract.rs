//! The API contract, published and held. A real `serve` (all-MiniLM-L6-v2, the MiniLM
//! cross-encoder, chat through the OpenRouter stand-in) is run through schemathesis, from PyPI
//! in the client SDKs' venv (tests/clients/requirements.txt), twice:
//!
//! - with our own `/openapi.json`: no server error, every status code documented, every
//!   response's content type, headers and body as documented, on every route (the client
//!   routes without a key, the admin routes with the admin token);
//! - with TEI's own `openapi.json` (tests/fixtures/tei/, v1.9.3), restricted to the TEI routes we
//!   serve, with every check schemathesis has: a request TEI's schema allows that we refuse, or
//!   one it forbids that we take, must be one of the deliberate differences listed in
//!   [`TEI_DIFFERENCES`], and anything else fails.
//!
//! Examples per operation, the seed and the generation are fixed, so a run is bounded (well
//! under a minute here) and repeatable. Also: `/docs` is served from the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use serde_json::{Value, json};

use crate::clients::clients_python;
use crate::cloud::{upstream, wait_for_cloud};
use crate::liveness::push_chat;
use crate::local_support::assemble_cross_encoder;
use crate::support::*;

/// One failed check of a schemathesis run, with the exchange that failed it.
#[derive(Debug)]
struct Failure {
    check: String,
    /// What schemathesis says was wrong.
    message: String,
    operation: String,
    status: Option<u64>,
    request: String,
    response: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} on {}: {}\n    answer {:?}: {}\n    request: {}",
            self.check, self.operation, self.message, self.status, self.response, self.request
        )
    }
}

/// A body recorded by schemathesis (`{"$base64": ...}` or a string), as text.
fn recorded(body: &Value) -> String {
    match body.get("$base64").and_then(Value::as_str) {
        Some(b64) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default(),
        None => body.as_str().map(str::to_string).unwrap_or_default(),
    }
}

/// The failed checks in a schemathesis NDJSON events report.
fn failures_in(report: &Path) -> Vec<Failure> {
    let text = std::fs::read_to_string(report)
        .unwrap_or_else(|e| panic!("schemathesis wrote no report {}: {e}", report.display()));
    let mut out = Vec::new();
    for line in text.lines() {
        let event: Value = serde_json::from_str(line).expect("an NDJSON event");
        let Some(recorder) = event.pointer("/ScenarioFinished/recorder") else {
            continue;
        };
        let Some(checks) = recorder["checks"].as_object() else {
            continue;
        };
        for (case, results) in checks {
            for result in results.as_array().into_iter().flatten() {
                if result["status"] == "success" || result["status"] == "skip" {
                    continue;
                }
                let exchange = &recorder["interactions"][case];
                out.push(Failure {
                    check: result["name"].as_str().unwrap_or("?").to_string(),
                    message: result
                        .pointer("/failure_info/failure/message")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    operation: result
                        .pointer("/failure_info/failure/operation")
                        .and_then(Value::as_str)
                        .unwrap_or(recorder["label"].as_str().unwrap_or("?"))
                        .to_string(),
                    status: exchange
                        .pointer("/response/status_code")
                        .and_then(Value::as_u64),
                    request: exchange
                        .pointer("/request/body")
                        .map(recorded)
                        .unwrap_or_default(),
                    response: exchange
                        .pointer("/response/content")
                        .map(recorded)
                        .unwrap_or_default(),
                });
            }
        }
    }
    out
}

/// Runs `schemathesis run LOCATION ARGS` (seeded, bounded, one worker) and returns its failed
/// checks; a run that could not test (an error, a crash) fails the test.
fn schemathesis(dir: &Path, name: &str, location: &str, args: &[&str]) -> Vec<Failure> {
    let python = clients_python();
    let report = dir.join(format!("{name}.ndjson"));
    let out = Command::new(python.with_file_name("schemathesis"))
        .arg("run")
        .arg(location)
        .args([
            "--seed",
            "7",
            "--generation-deterministic",
            "--no-shrink",
            "--workers",
            "1",
            "--max-examples",
            "25",
            "--suppress-health-check",
            "all",
            "--request-timeout",
            "30",
            "--report",
            "ndjson",
            "--report-ndjson-path",
        ])
        .arg(&report)
        .args(args)
        .env("NO_COLOR", "1")
        .current_dir(dir)
        .output()
        .expect("schemathesis runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if let Some(line) = stdout.lines().find(|l| {
        l.trim_start().starts_with(|c: char| c.is_ascii_digit()) && l.contains(" generated")
    }) {
        eprintln!("schemathesis {name}: {}", line.trim());
    }
    std::fs::write(dir.join(format!("{name}.log")), stdout.as_bytes()).unwrap();
    assert!(
        report.exists(),
        "schemathesis ({name}) did not run: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let failures = failures_in(&report);
    let tested = stdout.contains("Tested:");
    assert!(
        tested && (out.status.success() || !failures.is_empty()),
        "schemathesis ({name}) did not run its tests: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        stdout
    );
    failures
}

/// The checks our own document is held to.
const OWN_CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,\
response_headers_conformance,response_schema_conformance";

/// Where we differ from TEI on purpose. Each entry: the check that notices, what in the
/// exchange shows it (a piece of our answer, or of the request), and why.
const TEI_DIFFERENCES: &[(&str, &str, &str)] = &[
    (
        "positive_data_acceptance",
        "holds token ids",
        "token ids are refused: they belong to the client's tokenizer, not the model's",
    ),
    (
        "positive_data_acceptance",
        "normalize=false is not served",
        "a space's vectors are as its pinned model makes them",
    ),
    (
        "positive_data_acceptance",
        "truncate=false is not served",
        "a long input is cut at the model's limit; refusing it per request is not served",
    ),
    (
        "positive_data_acceptance",
        "truncation_direction: only right is served",
        "a long input loses its end, as the engine cuts it",
    ),
    (
        "positive_data_acceptance",
        "is not served; use query, document",
        "prompt names are query, document and passage (TEI refuses a name its model lacks too)",
    ),
    (
        "positive_data_acceptance",
        "is an empty string",
        "an empty text is refused: it has no meaning to embed or rank",
    ),
    (
        "positive_data_acceptance",
        "is empty",
        "an empty list is refused (TEI refuses it too, as `Empty`)",
    ),
    (
        "positive_data_acceptance",
        "dimensions must be at least 1",
        "dimensions 0 (TEI refuses it too: `dimensions` should be positive)",
    ),
    (
        "positive_data_acceptance",
        "dimensions_too_large",
        "more dimensions than the space has (TEI refuses it too)",
    ),
    (
        "negative_data_rejection",
        ": null",
        "null for an optional field is taken as absent",
    ),
];

/// Why `failure` is one of [`TEI_DIFFERENCES`], if it is.
fn deliberate(failure: &Failure) -> Option<&'static str> {
    TEI_DIFFERENCES
        .iter()
        .find(|(check, shows, _)| {
            failure.check == *check
                && (failure.response.contains(shows) || failure.request.contains(shows))
        })
        .map(|(_, _, why)| *why)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_holds_to_its_own_contract_and_to_teis() {
    let dir = tempfile::tempdir().unwrap();
    let up = upstream(|_| {}).await;
    let cross = assemble_cross_encoder(dir.path()).display().to_string();
    let hub = start_serve(
        dir.path(),
        &[
            "--reranker-model-dir",
            &cross,
            "--openrouter-url",
            &up.base_url,
        ],
    );
    eventually("serve is ready", || async {
        let (status, _) = hub.get("/ready").await;
        (status == 200).then_some(())
    })
    .await;
    push_chat(&hub).await;
    wait_for_cloud(&hub, "solo", 1).await;
    let base = hub.url("");

    // The document describes what the router serves, and /docs shows it from the binary.
    let (code, doc) = hub.get("/openapi.json").await;
    assert_eq!(code, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    let ui = hub.http.get(hub.url("/docs/")).send().await.unwrap();
    assert_eq!(ui.status(), 200);
    assert!(ui.text().await.unwrap().contains("swagger-ui"));
    let script = hub
        .http
        .get(hub.url("/docs/swagger-ui-bundle.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        script.status(),
        200,
        "Swagger UI's assets are in the binary"
    );

    // Our own contract: the client routes without a key (the project `default`); the admin
    // routes (with the admin token) come last, since their pushes may change what serves.
    let schema = hub.url("/openapi.json");
    let failures = schemathesis(
        dir.path(),
        "own-clients",
        &schema,
        &["--checks", OWN_CHECKS, "--exclude-tag", "admin"],
    );
    assert_held(&failures, "client routes");

    // TEI's contract, on the TEI routes we serve (its /v1/embeddings is OpenAI's, whose error
    // shape we follow instead; /embed_all, /embed_sparse, /predict, /tokenize and /decode are
    // not served).
    let tei = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tei/openapi.json");
    let failures = schemathesis(
        dir.path(),
        "tei",
        tei.to_str().unwrap(),
        &[
            "--url",
            &base,
            "--checks",
            "all",
            "--include-path-regex",
            "^/(embed|rerank|similarity|info|health|metrics)$",
        ],
    );
    let mut seen = std::collections::BTreeSet::new();
    let mut unexpected = Vec::new();
    for failure in &failures {
        match deliberate(failure) {
            Some(why) => {
                seen.insert(why);
            }
            None => unexpected.push(failure.to_string()),
        }
    }
    eprintln!("TEI contract: deliberate differences seen: {seen:#?}");
    assert!(
        unexpected.is_empty(),
        "differences from TEI's contract that are not deliberate ({}):\n{}",
        unexpected.len(),
        unexpected.join("\n")
    );
    tei_and_openai_points(&hub).await;

    let admin_header = format!("Authorization: Bearer {}", hub.admin);
    let failures = schemathesis(
        dir.path(),
        "own-admin",
        &schema,
        &[
            "--checks",
            OWN_CHECKS,
            "--include-tag",
            "admin",
            "--header",
            &admin_header,
        ],
    );
    assert_held(&failures, "admin routes");
}

/// No check failed on our own document.
fn assert_held(failures: &[Failure], routes: &str) {
    let listed: Vec<String> = failures.iter().map(ToString::to_string).collect();
    assert!(
        failures.is_empty(),
        "the hub broke its own contract on its {routes} ({} failures):\n{}",
        failures.len(),
        listed.join("\n")
    );
}

/// The points where a client generated from TEI's or OpenAI's contract used to trip.
async fn tei_and_openai_points(hub: &HubProc) {
    // /similarity applies `parameters` as /embed does, refusing what it cannot honour with
    // /embed's messages.
    let inputs = json!({"source_sentence": "a parser", "sentences": ["a tokenizer", "tea"]});
    let (code, plain) = hub.post("/similarity", &json!({"inputs": inputs})).await;
    assert_eq!(code, 200, "{plain}");
    let (code, query) = hub
        .post(
            "/similarity",
            &json!({"inputs": inputs, "parameters": {"prompt_name": "query", "truncate": true,
                    "truncation_direction": "Right"}}),
        )
        .await;
    assert_eq!(code, 200, "{query}");
    assert_eq!(query.as_array().unwrap().len(), 2);
    for (parameters, embed_field) in [
        (
            json!({"prompt_name": "nonsense"}),
            json!({"prompt_name": "nonsense"}),
        ),
        (json!({"truncate": false}), json!({"truncate": false})),
        (
            json!({"truncation_direction": "Left"}),
            json!({"truncation_direction": "Left"}),
        ),
    ] {
        let (code, similarity) = hub
            .post(
                "/similarity",
                &json!({"inputs": inputs, "parameters": parameters}),
            )
            .await;
        let mut embed = json!({"inputs": "a parser"});
        embed
            .as_object_mut()
            .unwrap()
            .extend(embed_field.as_object().unwrap().clone());
        let (embed_code, embedded) = hub.post("/embed", &embed).await;
        assert_eq!((code, embed_code), (400, 400), "{similarity} {embedded}");
        assert_eq!(similarity["error"], embedded["error"], "the same message");
        assert_eq!(similarity["error_type"], "Validation");
    }

    // Integral floats are integers; a fraction is refused naming the field.
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": "x", "dimensions": 8.0}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["data"][0]["embedding"].as_array().unwrap().len(), 8);
    let (code, body) = hub
        .post("/embed", &json!({"inputs": "x", "dimensions": 8.5}))
        .await;
    assert_eq!(code, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("not a whole number"),
        "{body}"
    );

    // An unknown model is OpenAI's 404 model_not_found.
    let (code, body) = hub
        .post("/v1/embeddings", &json!({"model": "nope", "input": "x"}))
        .await;
    assert_eq!(code, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");

    // Gzip when the client asks (the openai SDK does); not otherwise.
    let raw = reqwest::Client::builder().no_gzip().build().unwrap();
    let texts: Vec<String> = (0..32).map(|i| format!("text number {i}")).collect();
    let request = json!({"model": "embedding", "input": texts});
    let r = raw
        .post(hub.url("/v1/embeddings"))
        .header("accept-encoding", "gzip")
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-encoding"], "gzip");
    let packed = r.bytes().await.unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&packed[..]), &mut text)
        .unwrap();
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["data"].as_array().unwrap().len(), 32);
    assert!(
        packed.len() * 2 < text.len(),
        "{} of {}",
        packed.len(),
        text.len()
    );
    let r = raw
        .post(hub.url("/v1/embeddings"))
        .json(&request)
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("content-encoding").is_none());
}
