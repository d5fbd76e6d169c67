//! Each server kind's own API, as calls: the health check (vLLM and OpenAI-compatible servers'
//! `/v1/models`, Ollama's `/api/tags`, llama.cpp's and TEI's `/health`, with TEI's `/info`),
//! embeddings (TEI's `/embed`, Ollama's `/api/embed`, `/v1/embeddings` elsewhere) and chat
//! (`/v1/chat/completions` everywhere, streamed as server-sent events when asked); reranking is
//! in [`super::rerank`]. Answers are
//! checked as a cloud answer is (count, width, finite numbers); failures are classified for
//! the hub ([`ServerError::failure`]).

use std::time::Duration;

use reqwest::header::HeaderMap;
use serde_json::{Value, json};

use crate::agent::provider::ProviderFailure;
use crate::cloud::chat_stream::read_events;
use crate::cloud::openrouter::read_capped;
use crate::cloud::wire::{parse_embeddings, parse_tokens};
use crate::config::local_server::{LocalServerConfig, ServerKind};
use crate::protocol::FailureClass;
use crate::secret::Secret;

/// One health check's wait.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a streamed chat from a fronted server may stay silent: such servers send nothing
/// while they read a long prompt, which on a busy GPU can take minutes.
const STREAM_IDLE: Duration = Duration::from_secs(300);
/// The most characters of a server's error message passed on.
const MAX_MESSAGE_CHARS: usize = 300;

/// Why a call to a server failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServerError {
    /// Nothing listens (connection refused): the server is down, not slow.
    #[error("nothing answers at {url}: {message}")]
    Refused { url: String, message: String },
    /// Timed out, reset, or cut.
    #[error("{url}: {message}")]
    Transport { url: String, message: String },
    /// An HTTP error status, with the server's message.
    #[error("{url} answered {status}: {message}")]
    Status {
        url: String,
        status: u16,
        message: String,
        retry_after_ms: Option<u64>,
    },
    /// A 2xx whose body is not what the API promises.
    #[error("{url}: {message}")]
    BadAnswer { url: String, message: String },
}

impl ServerError {
    /// What the hub does with the item: an input no server can take fails the request (400,
    /// 413, 422); a missing model or a busy server is someone else's turn (refused, rate
    /// limited); the rest is transient (requeued, counted against the provider).
    pub fn failure(&self) -> ProviderFailure {
        let (class, retry_after_ms) = match self {
            ServerError::Status {
                status: 400 | 413 | 422,
                ..
            } => (FailureClass::Fatal, None),
            ServerError::Status { status: 404, .. } => (FailureClass::Refused, None),
            ServerError::Status {
                status: 429,
                retry_after_ms,
                ..
            } => (FailureClass::RateLimited, *retry_after_ms),
            _ => (FailureClass::Transient, None),
        };
        let mut f = ProviderFailure::new(class, self.to_string());
        f.retry_after_ms = retry_after_ms;
        f
    }

    /// Whether the server is plainly not there (the health check is asked again at once).
    pub fn is_refused(&self) -> bool {
        matches!(self, ServerError::Refused { .. })
    }
}

/// What a health check learned.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    /// The models the server lists (empty where its API lists none).
    pub models: Vec<String>,
    /// The served model's revision, where the server tells it (Ollama's digest, TEI's
    /// `model_sha`): changed weights are a new provider identity the gate checks again.
    pub revision: Option<String>,
}

/// A server's HTTP client: its base URL, key, and the kind's paths.
pub struct ServerApi {
    http: reqwest::Client,
    base: String,
    kind: ServerKind,
    model: String,
    key: Option<Secret>,
    /// Set once the server answered 404 on Cohere's `/v1/rerank`: vLLM's `/v1/score` from then on.
    pub(super) score_route: std::sync::atomic::AtomicBool,
}

fn truncate(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// The message of an error body: OpenAI's `{error:{message}}`, Ollama's and TEI's
/// `{error:"…"}`, vLLM's `{message}` or `{detail}`, else the text itself.
fn error_message(body: &str) -> String {
    let value: Option<Value> = serde_json::from_str(body).ok();
    let found = value.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("error").filter(|e| e.is_string()))
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    truncate(&found.unwrap_or_else(|| body.to_string()))
}

fn retry_after_ms(headers: &HeaderMap) -> Option<u64> {
    let wait = crate::cloud::retry_after::from_headers(headers)?;
    Some(wait.as_millis().min(600_000) as u64)
}

impl ServerApi {
    /// A client for one declared server; `timeout` bounds every work call.
    pub fn new(
        cfg: &LocalServerConfig,
        key: Option<Secret>,
        timeout: Duration,
    ) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .timeout(timeout)
            .user_agent(concat!("fantom-sidecar/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            http,
            base: cfg.base_url().to_string(),
            kind: cfg.kind,
            model: cfg.model.clone(),
            key,
            score_route: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// A server's words as we pass them on: a server that quotes the key it was sent (in an
    /// error body, an error chunk) never gets it into a log or a client's answer.
    fn withhold_key(&self, message: String) -> String {
        match &self.key {
            Some(key) if !key.is_empty() && message.contains(key.expose()) => {
                message.replace(key.expose(), "[withheld]")
            }
            _ => message,
        }
    }

    /// The server's base URL (no key in it: `check` refuses one).
    pub(super) fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub(super) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let rb = self.http.request(method, self.url(path));
        match &self.key {
            Some(key) => rb.bearer_auth(key.expose()),
            None => rb,
        }
    }

    fn transport(&self, path: &str, e: &reqwest::Error) -> ServerError {
        let url = self.url(path);
        // The connection error's cause chain says "Connection refused"; reqwest's own text
        // names the URL only.
        let mut message = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            message = s.to_string();
            source = s.source();
        }
        if e.is_connect() {
            ServerError::Refused { url, message }
        } else if e.is_timeout() {
            ServerError::Transport {
                url,
                message: "no answer in time".into(),
            }
        } else {
            ServerError::Transport { url, message }
        }
    }

    /// Sends; an error status is the server's message.
    async fn open(
        &self,
        path: &str,
        rb: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ServerError> {
        let response = rb.send().await.map_err(|e| self.transport(path, &e))?;
        let status = response.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(response);
        }
        let headers = response.headers().clone();
        let body = read_capped(response).await.unwrap_or_default();
        Err(ServerError::Status {
            url: self.url(path),
            status,
            message: self.withhold_key(error_message(&body)),
            retry_after_ms: retry_after_ms(&headers),
        })
    }

    /// Sends and reads a JSON answer.
    pub(super) async fn send(
        &self,
        path: &str,
        rb: reqwest::RequestBuilder,
    ) -> Result<Value, ServerError> {
        let response = self.open(path, rb).await?;
        let body = read_capped(response)
            .await
            .map_err(|e| self.bad(path, e.to_string()))?;
        serde_json::from_str(&body).map_err(|e| ServerError::BadAnswer {
            url: self.url(path),
            message: format!("the answer is not JSON ({e})"),
        })
    }

    pub(super) fn bad(&self, path: &str, message: impl Into<String>) -> ServerError {
        ServerError::BadAnswer {
            url: self.url(path),
            message: self.withhold_key(truncate(&message.into())),
        }
    }

    /// The health check in the kind's own API, and the declared model among what it serves.
    pub async fn check(&self) -> Result<Checked, ServerError> {
        let get = |path: &str| {
            self.request(reqwest::Method::GET, path)
                .timeout(HEALTH_TIMEOUT)
        };
        match self.kind {
            ServerKind::Vllm | ServerKind::Openai => {
                let path = "/v1/models";
                let v = self.send(path, get(path)).await?;
                let models: Vec<String> = v
                    .get("data")
                    .and_then(Value::as_array)
                    .ok_or_else(|| self.bad(path, "no data array"))?
                    .iter()
                    .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
                    .collect();
                self.listed(path, models, None)
            }
            ServerKind::Ollama => {
                let path = "/api/tags";
                let v = self.send(path, get(path)).await?;
                let rows = v
                    .get("models")
                    .and_then(Value::as_array)
                    .ok_or_else(|| self.bad(path, "no models array"))?;
                let name = |m: &Value| {
                    m.get("name")
                        .or_else(|| m.get("model"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                };
                let models: Vec<String> = rows.iter().filter_map(name).collect();
                let digest = rows
                    .iter()
                    .find(|m| name(m).is_some_and(|n| ollama_same(&n, &self.model)))
                    .and_then(|m| m.get("digest").and_then(Value::as_str))
                    .map(|d| format!("ollama:{d}"));
                self.listed(path, models, digest)
            }
            ServerKind::LlamaCpp => {
                // 200 `{"status":"ok"}` once the model is loaded, 503 while it loads. Its
                // model list names the GGUF file, not a model name: not checked.
                let path = "/health";
                self.open(path, get(path)).await?;
                Ok(Checked {
                    models: Vec::new(),
                    revision: None,
                })
            }
            ServerKind::Tei => {
                // TEI's `/health` is an empty 200 while the backend runs.
                self.open("/health", get("/health")).await?;
                let path = "/info";
                let info = self.send(path, get(path)).await?;
                let id = info
                    .get("model_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                let sha = info
                    .get("model_sha")
                    .and_then(Value::as_str)
                    .map(|s| format!("tei:{s}"));
                self.listed(path, vec![id], sha)
            }
        }
    }

    /// Up only when the declared model is among those listed: a server serving another model
    /// is not this provider.
    fn listed(
        &self,
        path: &str,
        models: Vec<String>,
        revision: Option<String>,
    ) -> Result<Checked, ServerError> {
        if !models.iter().any(|m| ollama_same(m, &self.model)) {
            return Err(self.bad(
                path,
                format!(
                    "it serves {:?}, not the declared model '{}'",
                    models, self.model
                ),
            ));
        }
        Ok(Checked { models, revision })
    }

    /// Embeds `texts` (vectors in input order, each checked finite and as wide as `dims` when
    /// known) and the tokens the server counted.
    pub async fn embed(
        &self,
        texts: &[String],
        dims: Option<usize>,
    ) -> Result<(Vec<Vec<f32>>, u64), ServerError> {
        let post = |path: &'static str, body: Value| {
            let rb = self.request(reqwest::Method::POST, path).json(&body);
            async move { self.send(path, rb).await }
        };
        let n = texts.len();
        let (vectors, tokens) = match self.kind {
            ServerKind::Tei => {
                let path = "/embed";
                let v = post(path, json!({"inputs": texts, "truncate": true})).await?;
                let rows = v
                    .as_array()
                    .ok_or_else(|| self.bad(path, "the answer is not an array of vectors"))?;
                (self.vectors(path, rows, n, dims)?, 0)
            }
            ServerKind::Ollama => {
                let path = "/api/embed";
                let body = json!({"model": self.model, "input": texts, "truncate": true});
                let v = post(path, body).await?;
                let rows = v
                    .get("embeddings")
                    .and_then(Value::as_array)
                    .ok_or_else(|| self.bad(path, "no embeddings array"))?;
                let tokens = v.get("prompt_eval_count").and_then(Value::as_u64);
                (self.vectors(path, rows, n, dims)?, tokens.unwrap_or(0))
            }
            ServerKind::Vllm | ServerKind::LlamaCpp | ServerKind::Openai => {
                let path = "/v1/embeddings";
                let body = json!({"model": self.model, "input": texts, "encoding_format": "float"});
                let v = post(path, body).await?;
                let vectors =
                    parse_embeddings(&v, n, dims).map_err(|e| self.bad(path, e.to_string()))?;
                (vectors, parse_tokens(&v))
            }
        };
        Ok((vectors, tokens))
    }

    /// Rows of number arrays: exactly `n`, one width (`dims` when known), finite.
    fn vectors(
        &self,
        path: &str,
        rows: &[Value],
        n: usize,
        dims: Option<usize>,
    ) -> Result<Vec<Vec<f32>>, ServerError> {
        if rows.len() != n {
            return Err(self.bad(path, format!("{} vectors for {n} inputs", rows.len())));
        }
        let mut width = dims;
        rows.iter()
            .enumerate()
            .map(|(i, row)| {
                let v: Vec<f32> = row
                    .as_array()
                    .and_then(|xs| {
                        xs.iter()
                            .map(|x| x.as_f64().map(|x| x as f32).filter(|x| x.is_finite()))
                            .collect()
                    })
                    .ok_or_else(|| self.bad(path, format!("vector {i} is not finite numbers")))?;
                let w = *width.get_or_insert(v.len());
                if v.len() != w || w == 0 {
                    return Err(self.bad(
                        path,
                        format!("vector {i} has {} dims where {w} are expected", v.len()),
                    ));
                }
                Ok(v)
            })
            .collect()
    }

    /// One chat completion of the client's body on the declared model.
    pub async fn chat(&self, body: Value) -> Result<(Value, u64), ServerError> {
        let path = "/v1/chat/completions";
        let body = self.chat_body(body, false)?;
        let rb = self.request(reqwest::Method::POST, path).json(&body);
        let v = self.send(path, rb).await?;
        if v.get("choices").and_then(Value::as_array).is_none() {
            return Err(self.bad(path, "the chat answer has no choices"));
        }
        let tokens = parse_tokens(&v);
        Ok((v, tokens))
    }

    /// A streamed chat completion: each chunk to `on_chunk` as it arrives; the answer is the
    /// whole completion assembled from them.
    pub async fn chat_stream(
        &self,
        body: Value,
        on_chunk: impl FnMut(Value) + Send,
    ) -> Result<(Value, u64), ServerError> {
        let path = "/v1/chat/completions";
        let body = self.chat_body(body, true)?;
        let rb = self.request(reqwest::Method::POST, path).json(&body);
        let response = self.open(path, rb).await?;
        // An error chunk keeps its status (a 400 for a context too long is the client's).
        let v = read_events(response, STREAM_IDLE, |line| line, on_chunk)
            .await
            .map_err(|e| match e.http_status() {
                status @ 400..=499 => ServerError::Status {
                    url: self.url(path),
                    status,
                    message: self.withhold_key(truncate(&e.to_string())),
                    retry_after_ms: e.retry_after_ms(),
                },
                _ => self.bad(path, e.to_string()),
            })?;
        let tokens = parse_tokens(&v);
        Ok((v, tokens))
    }

    /// The client's body on the declared model (whatever model the client named: the hub
    /// routed it by role), streamed or not as asked.
    fn chat_body(&self, body: Value, stream: bool) -> Result<Value, ServerError> {
        let Value::Object(mut body) = body else {
            return Err(ServerError::Status {
                url: self.url("/v1/chat/completions"),
                status: 400,
                message: "a chat request body must be a JSON object".into(),
                retry_after_ms: None,
            });
        };
        body.insert("model".into(), Value::from(self.model.as_str()));
        body.insert("stream".into(), Value::Bool(stream));
        // OpenRouter's routing fields mean nothing here.
        for field in ["models", "provider", "route", "transforms"] {
            body.remove(field);
        }
        if !stream {
            body.remove("stream_options");
        }
        Ok(Value::Object(body))
    }
}

/// Whether two model names are one (Ollama's `:latest` tag is implied).
pub fn ollama_same(listed: &str, declared: &str) -> bool {
    let strip = |s: &str| {
        s.trim()
            .strip_suffix(":latest")
            .unwrap_or(s.trim())
            .to_string()
    };
    listed.trim() == declared.trim() || strip(listed) == strip(declared)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_classified_for_the_hub_and_messages_are_bounded() {
        let status = |status: u16| ServerError::Status {
            url: "http://h/v1/chat/completions".into(),
            status,
            message: "m".into(),
            retry_after_ms: Some(2000),
        };
        assert_eq!(status(400).failure().class, FailureClass::Fatal);
        assert_eq!(status(404).failure().class, FailureClass::Refused);
        let limited = status(429).failure();
        assert_eq!(limited.class, FailureClass::RateLimited);
        assert_eq!(limited.retry_after_ms, Some(2000));
        assert_eq!(status(503).failure().class, FailureClass::Transient);
        let refused = ServerError::Refused {
            url: "u".into(),
            message: "Connection refused".into(),
        };
        assert!(refused.is_refused());
        assert_eq!(refused.failure().class, FailureClass::Transient);

        assert_eq!(
            error_message(r#"{"error":{"message":"maximum context length is 40960"}}"#),
            "maximum context length is 40960"
        );
        assert_eq!(
            error_message(r#"{"error":"model 'x' not found"}"#),
            "model 'x' not found"
        );
        assert_eq!(error_message(r#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(error_message(&"x".repeat(1000)).chars().count(), 301);
        assert!(ollama_same("qwen3.5:9b", "qwen3.5:9b"));
        assert!(ollama_same("nomic-embed-text:latest", "nomic-embed-text"));
        assert!(!ollama_same("qwen3.5:9b", "qwen3.5:4b"));
    }

    #[test]
    fn a_server_that_quotes_its_key_never_gets_it_passed_on() {
        let cfg: LocalServerConfig = toml::from_str(
            "role = \"rlm\"\nurl = \"http://127.0.0.1:8100\"\nmodel = \"m\"\nkind = \"vllm\"",
        )
        .unwrap();
        let key = "vllm-key-7f3a9c2e41d08b6a";
        let api = ServerApi::new(&cfg, Some(Secret::new(key)), Duration::from_secs(1)).unwrap();
        let shown = api.withhold_key(format!("invalid api key '{key}' for model m"));
        assert_eq!(shown, "invalid api key '[withheld]' for model m");
        let bad = api.bad("/v1/chat/completions", format!("echo: {key}"));
        assert!(!bad.to_string().contains(key), "{bad}");
    }
}
