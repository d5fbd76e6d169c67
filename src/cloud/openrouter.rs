//! The OpenRouter HTTP client: embeddings, rerank and chat calls for one [`CloudRoute`], and
//! what the key can tell about its own funding (`/key`, `/credits`).
//!
//! Owns sending (the key only as the bearer token, never logged or put in an error) and
//! turning every failure into a [`CloudError`]. Bodies and response checks are the pure
//! functions of the private `wire` module.

use std::fmt;
use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

use super::error::{CloudError, MAX_MESSAGE_CHARS, truncate_chars};
use super::route::CloudRoute;
use super::wire::{
    bad, chat_body, credit_totals, embed_body, error_in_success, parse_cost, parse_credits,
    parse_embeddings, parse_key, parse_rerank, parse_tokens, rerank_body,
};
use crate::secret::Secret;

pub const DEFAULT_BASE_URL: &str = "https://openrouter.ai/api/v1";

/// One OpenRouter key and base URL, shared by every route that uses that key.
pub struct OpenRouterClient {
    http: reqwest::Client,
    base_url: String,
    key: Secret,
}

impl fmt::Debug for OpenRouterClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenRouterClient")
            .field("base_url", &self.base_url)
            .field("key", &"[redacted]")
            .finish()
    }
}

/// Vectors in input order.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedded {
    pub vectors: Vec<Vec<f32>>,
    pub tokens: u64,
    /// `usage.cost` (US dollars), where the answer carries one.
    pub cost_usd: Option<f64>,
}

/// Relevance scores in document order.
#[derive(Clone, Debug, PartialEq)]
pub struct Reranked {
    pub scores: Vec<f32>,
    pub tokens: u64,
    /// `usage.cost` (US dollars), where the answer carries one.
    pub cost_usd: Option<f64>,
}

/// The chat completion response object, unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct Chatted {
    pub response: Value,
    pub tokens: u64,
    /// `usage.cost` (US dollars), where the answer carries one.
    pub cost_usd: Option<f64>,
}

/// What the key says about its limits and funding (numbers only).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KeyInfo {
    /// Requests per minute from the deprecated `data.rate_limit {requests, interval}`: `None`
    /// when absent, `requests <= 0` (always -1 today), or the interval is unparsable.
    pub rpm: Option<f64>,
    pub limit_usd: Option<f64>,
    pub limit_remaining_usd: Option<f64>,
    pub usage_usd: Option<f64>,
    pub is_free_tier: Option<bool>,
    /// `total_credits - total_usage` from `/credits`; `None` when unknown (401/403/404, 0/0).
    pub credits_remaining_usd: Option<f64>,
    /// `/key`'s `rate_limit` as it stands (for a master that reads it itself).
    pub rate_limit_requests: Option<i64>,
    pub rate_limit_interval: Option<String>,
    /// `/credits` as it stands (the master computes what remains).
    pub total_credits_usd: Option<f64>,
    pub total_usage_usd: Option<f64>,
}

impl KeyInfo {
    /// Funded: credits remain, or the key's cap has room, or the account has paid before.
    /// `None` when nothing says.
    pub fn funded(&self) -> Option<bool> {
        let signals = [
            self.credits_remaining_usd.map(|c| c > 0.0),
            self.limit_remaining_usd.map(|l| l > 0.0),
            self.is_free_tier.map(|free| !free),
        ];
        if signals.contains(&Some(true)) {
            Some(true)
        } else if signals.iter().any(Option::is_some) {
            Some(false)
        } else {
            None
        }
    }
}

/// One HTTP answer, before classification.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The body as JSON on a 2xx; the classified failure otherwise.
    fn into_json(self) -> Result<Value, CloudError> {
        if !self.is_success() {
            return Err(CloudError::from_response(
                self.status,
                &self.headers,
                &self.body,
            ));
        }
        let value: Value = serde_json::from_str(&self.body)
            .map_err(|e| bad(format!("the body is not JSON ({e})")))?;
        match error_in_success(&value, &self.headers, &self.body) {
            Some(err) => Err(err),
            None => Ok(value),
        }
    }
}

impl OpenRouterClient {
    /// A client for `base_url` (`http://` or `https://`; a trailing `/` is dropped). Every
    /// request times out after `timeout`.
    pub fn new(base_url: &str, key: Secret, timeout: Duration) -> Result<Self, CloudError> {
        let base_url = base_url.trim().trim_end_matches('/');
        let host = base_url
            .strip_prefix("https://")
            .or_else(|| base_url.strip_prefix("http://"));
        if host.is_none_or(str::is_empty) {
            return Err(CloudError::NoEndpoints {
                message: format!(
                    "base URL '{}' must start with http:// or https://",
                    truncate_chars(base_url, 100)
                ),
                pin_unmatched: false,
            });
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            HeaderName::from_static("x-title"),
            HeaderValue::from_static("fantom-sidecar"),
        );
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .default_headers(headers)
            .user_agent(concat!("fantom-sidecar/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(transport)?;
        Ok(Self {
            http,
            base_url: base_url.to_string(),
            key,
        })
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Embeds `texts` on an embedding route; vectors come back in input order, each exactly
    /// `dimensions` (when given) or the route's dims wide.
    pub async fn embed(
        &self,
        route: &CloudRoute,
        texts: &[String],
        dimensions: Option<usize>,
        input_type: Option<&str>,
    ) -> Result<Embedded, CloudError> {
        let Some(route_dims) = route.dims() else {
            return Err(wrong_route(route, "embeddings"));
        };
        if texts.is_empty() {
            return Ok(Embedded {
                vectors: Vec::new(),
                tokens: 0,
                cost_usd: None,
            });
        }
        let body = embed_body(route, texts, dimensions, input_type);
        let value = self.post("/embeddings", &body, &route.key()).await?;
        let vectors =
            parse_embeddings(&value, texts.len(), Some(dimensions.unwrap_or(route_dims)))?;
        Ok(Embedded {
            vectors,
            tokens: parse_tokens(&value),
            cost_usd: parse_cost(&value),
        })
    }

    /// Scores every document against `query` on the rerank route, in document order.
    pub async fn rerank(
        &self,
        route: &CloudRoute,
        query: &str,
        documents: &[String],
    ) -> Result<Reranked, CloudError> {
        if !matches!(route, CloudRoute::Rerank { .. }) {
            return Err(wrong_route(route, "rerank"));
        }
        if documents.is_empty() {
            return Ok(Reranked {
                scores: Vec::new(),
                tokens: 0,
                cost_usd: None,
            });
        }
        let body = rerank_body(route, query, documents);
        let value = self.post("/rerank", &body, &route.key()).await?;
        let scores = parse_rerank(&value, documents.len())?;
        Ok(Reranked {
            scores,
            tokens: parse_tokens(&value),
            cost_usd: parse_cost(&value),
        })
    }

    /// A non-streaming chat completion of the client's body on the route's model.
    pub async fn chat(&self, route: &CloudRoute, body: Value) -> Result<Chatted, CloudError> {
        if !matches!(route, CloudRoute::Chat { .. }) {
            return Err(wrong_route(route, "chat"));
        }
        let body = chat_body(route, body)?;
        let response = self.post("/chat/completions", &body, &route.key()).await?;
        if !response.is_object() {
            return Err(bad("the chat response is not a JSON object"));
        }
        let (tokens, cost_usd) = (parse_tokens(&response), parse_cost(&response));
        Ok(Chatted {
            response,
            tokens,
            cost_usd,
        })
    }

    /// What the key says about itself (`/key`, or `/auth/key` on 404) and, when the key may
    /// see it, the account's remaining credits (`/credits`; any failure there is "unknown").
    pub async fn key_info(&self) -> Result<KeyInfo, CloudError> {
        let mut answer = self.get("/key").await?;
        if answer.status == 404 {
            answer = self.get("/auth/key").await?;
        }
        let mut info = parse_key(&answer.into_json()?);
        info.credits_remaining_usd = match self.get("/credits").await {
            Ok(answer) if answer.is_success() => {
                let body = answer.into_json().ok();
                if let Some(body) = &body {
                    (info.total_credits_usd, info.total_usage_usd) = credit_totals(body);
                }
                body.as_ref().and_then(parse_credits)
            }
            Ok(answer) => {
                tracing::debug!(status = answer.status, "openrouter credits unknown");
                None
            }
            Err(e) => {
                tracing::debug!(error = %e, "openrouter credits unknown");
                None
            }
        };
        Ok(info)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    async fn post(&self, path: &str, body: &Value, route_key: &str) -> Result<Value, CloudError> {
        let request = self.http.post(self.url(path)).json(body);
        self.send(request, route_key).await?.into_json()
    }

    /// A misconfigured base URL (a proxy that echoes requests) must not carry the key into
    /// an error message, a log line, a chunk or a client's answer.
    pub(super) fn redact_key(&self, text: String) -> String {
        if text.contains(self.key.expose()) {
            text.replace(self.key.expose(), "[redacted]")
        } else {
            text
        }
    }

    /// Posts `body` and hands back a 2xx response unread (a stream to read as it comes);
    /// any other answer is read and classified as [`OpenRouterClient::post`] does.
    pub(super) async fn post_streaming(
        &self,
        path: &str,
        body: &Value,
        route_key: &str,
    ) -> Result<reqwest::Response, CloudError> {
        let request = self.http.post(self.url(path)).json(body);
        let response = request
            .bearer_auth(self.key.expose())
            .send()
            .await
            .map_err(transport)?;
        let status = response.status().as_u16();
        if (200..300).contains(&status) {
            tracing::debug!(route = %route_key, status, "openrouter stream opened");
            return Ok(response);
        }
        let headers = response.headers().clone();
        let body = self.redact_key(read_capped(response).await?);
        Err(CloudError::from_response(status, &headers, &body))
    }

    async fn get(&self, path: &str) -> Result<Answer, CloudError> {
        self.send(self.http.get(self.url(path)), path).await
    }

    /// Sends with the key as bearer token; transport failures become [`CloudError::Transport`].
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        label: &str,
    ) -> Result<Answer, CloudError> {
        let started = Instant::now();
        let sent = request.bearer_auth(self.key.expose()).send().await;
        let response = match sent {
            Ok(response) => response,
            Err(e) => {
                let latency_ms = elapsed_ms(started);
                tracing::debug!(route = %label, latency_ms, "openrouter call failed to send");
                return Err(transport(e));
            }
        };
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = self.redact_key(read_capped(response).await?);
        let latency_ms = elapsed_ms(started);
        tracing::debug!(route = %label, status, latency_ms, "openrouter call");
        Ok(Answer {
            status,
            headers,
            body,
        })
    }
}

/// Largest answer read: a 64-text embeddings batch of 4096-dim floats is about 6 MiB of JSON.
const MAX_ANSWER_BYTES: usize = 32 << 20;

/// Reads a body up to [`MAX_ANSWER_BYTES`]; a longer one is a bad answer, not an allocation.
/// (The fronted model servers' answers are read with it too.)
pub async fn read_capped(mut response: reqwest::Response) -> Result<String, CloudError> {
    let mut bytes = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(transport)? {
        if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(CloudError::BadResponse {
                message: format!("the answer is larger than {MAX_ANSWER_BYTES} bytes"),
            });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn elapsed_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn wrong_route(route: &CloudRoute, what: &str) -> CloudError {
    CloudError::NoEndpoints {
        message: truncate_chars(
            &format!("route {} cannot serve {what}", route.key()),
            MAX_MESSAGE_CHARS,
        ),
        pin_unmatched: false,
    }
}

/// A reqwest failure (it names the URL, never a header), with its causes.
pub(super) fn transport(e: reqwest::Error) -> CloudError {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    let mut message = format!("{kind}: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    CloudError::Transport {
        message: truncate_chars(&message, MAX_MESSAGE_CHARS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_checks_its_base_url_and_never_prints_the_key() {
        let key = Secret::new("sk-or-v1-very-secret");
        let client = OpenRouterClient::new(
            "https://openrouter.ai/api/v1/",
            key.clone(),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(client.base_url(), DEFAULT_BASE_URL);
        assert!(!format!("{client:?}").contains("very-secret"));
        for bad_url in ["ftp://x", "openrouter.ai/api/v1", "https://", ""] {
            assert!(
                OpenRouterClient::new(bad_url, key.clone(), Duration::from_secs(5)).is_err(),
                "{bad_url}"
            );
        }
    }
}
