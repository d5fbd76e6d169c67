//! Classification of OpenRouter failures: which limit answered (platform, upstream provider,
//! in-flight spending budget, credits, key cap), whether retrying can help, and when.
//!
//! Owns reading `Retry-After`, `X-RateLimit-*` and the error body's `metadata` (see the notes'
//! table of 402/429 signals). Messages are bounded to [`MAX_MESSAGE_CHARS`] and come from the
//! response only: nothing of the request (no header, no key) is ever in them.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use reqwest::header::HeaderMap;
use serde_json::Value;

use crate::protocol::{FailureClass, LimitKind, Refusal};

/// The longest message a [`CloudError`] carries.
pub const MAX_MESSAGE_CHARS: usize = 300;
/// How much of a non-JSON body becomes the message.
const BODY_PREVIEW_CHARS: usize = 200;
const DAY_MS: u64 = 86_400_000;
/// Below this, an `X-RateLimit-Reset` value is epoch seconds rather than epoch milliseconds.
const EPOCH_MS_FLOOR: f64 = 1e11;
const RATE_LIMIT_HEADERS: [&str; 3] = [
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

/// A failed OpenRouter call, classified.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CloudError {
    /// OpenRouter's own 429 (X-RateLimit-* headers). `daily`: a per-day cap.
    #[error("OpenRouter platform rate limit{}: {message}", daily_note(.daily))]
    PlatformRateLimited {
        retry_after_ms: Option<u64>,
        /// When the window resets (milliseconds since the Unix epoch).
        reset_at_ms: Option<u64>,
        remaining: Option<i64>,
        daily: bool,
        message: String,
    },
    /// A 429 from the upstream provider, or every provider of the model at capacity.
    #[error("upstream rate limit ({}): {message}", upstream_note(.provider_name, .capacity_exhausted))]
    UpstreamRateLimited {
        provider_name: Option<String>,
        capacity_exhausted: bool,
        retry_after_ms: Option<u64>,
        message: String,
    },
    /// 402 from the in-flight spending budget: transient, retry after `retry_after_ms`.
    #[error("OpenRouter in-flight spending budget exhausted (transient): {message}")]
    InFlightBudget {
        retry_after_ms: Option<u64>,
        message: String,
    },
    /// Any other 402: credits exhausted, one request over budget, or the key's cap. Retrying
    /// cannot help.
    #[error("OpenRouter payment required ({limit}): {message}")]
    PaymentRequired { limit: HardLimit, message: String },
    /// 408, 5xx, 524, 529: try again.
    #[error("OpenRouter unavailable (HTTP {status}): {message}")]
    Unavailable {
        status: u16,
        retry_after_ms: Option<u64>,
        message: String,
    },
    /// 401/403: the key is refused.
    #[error("OpenRouter refused the key (HTTP {status}): {message}")]
    Unauthorized { status: u16, message: String },
    /// 404 `no_endpoints` and other routing or configuration problems (the pin matches
    /// nothing, a route used for the wrong operation, a bad base URL). `pin_unmatched`: the
    /// answer says no endpoint matches the provider preferences (a standing refusal).
    #[error("OpenRouter routing/config problem: {message}")]
    NoEndpoints {
        message: String,
        pin_unmatched: bool,
    },
    /// Other 4xx (400, 413, 422, a moderation 403...): this input cannot be served.
    #[error("OpenRouter rejected the input (HTTP {status}): {message}")]
    Rejected { status: u16, message: String },
    /// Connection and timeout failures.
    #[error("OpenRouter unreachable: {message}")]
    Transport { message: String },
    /// A success whose body is wrong (bad JSON, wrong count, wrong dims, non-finite numbers).
    #[error("OpenRouter answered with a bad body: {message}")]
    BadResponse { message: String },
}

/// Which hard (non-retryable) spending limit a 402 hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HardLimit {
    /// Out of credits, or one request larger than the whole budget.
    Credits,
    /// The key's own spending cap (until its `limit_reset`).
    KeyLimit,
}

impl fmt::Display for HardLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HardLimit::Credits => "credits exhausted or request over budget",
            HardLimit::KeyLimit => "the key's spending limit is reached",
        })
    }
}

impl CloudError {
    /// Classifies a non-2xx answer from its status, response headers and body (any body:
    /// non-JSON bodies become the message, cut to 200 characters).
    pub fn from_response(status: u16, headers: &HeaderMap, body: &str) -> CloudError {
        let json: Option<Value> = serde_json::from_str(body).ok();
        let error = json.as_ref().and_then(|j| j.get("error"));
        let metadata = error.and_then(|e| e.get("metadata"));
        let echoed = metadata.and_then(|m| m.get("headers"));
        let availability = error
            .and_then(|e| e.get("availability"))
            .or_else(|| metadata.and_then(|m| m.get("availability")));
        let message = body_message(status, error, metadata, body);

        let echoed_retry_after = || {
            let value = echoed_header(echoed, "retry-after")?;
            match value.as_str() {
                Some(text) => super::retry_after::parse(text, std::time::SystemTime::now()),
                None => number(value).and_then(super::retry_after::seconds),
            }
        };
        let retry_after_ms = super::retry_after::from_headers(headers)
            .or_else(echoed_retry_after)
            .map(|d| d.as_secs_f64())
            .or_else(|| field_number(metadata, "retry_after"))
            .or_else(|| field_number(error, "retry_after"))
            .or_else(|| field_number(availability, "retry_after"))
            .and_then(seconds_to_ms);

        match status {
            429 => {
                let provider_name = field_str(metadata, "provider_name").map(str::to_string);
                let has_provider_code =
                    metadata.is_some_and(|m| m.get("provider_code").is_some_and(|c| !c.is_null()));
                let capacity_exhausted = field_str(availability, "code")
                    == Some("capacity_exhausted")
                    || field_str(error, "code") == Some("capacity_exhausted");
                let limit_source = field_str(metadata, "limit_source");
                let lower = message.to_ascii_lowercase();
                let daily = limit_source == Some("openrouter_free_tier_daily")
                    || lower.contains("per-day")
                    || lower.contains("per day")
                    || lower.contains("rpd");
                let has_platform_headers = RATE_LIMIT_HEADERS.iter().any(|name| {
                    headers.contains_key(*name) || echoed_header(echoed, name).is_some()
                });
                let upstream = provider_name.is_some() || has_provider_code || capacity_exhausted;
                if !upstream && (has_platform_headers || daily) {
                    let reset_at_ms = header_number(headers, "x-ratelimit-reset")
                        .or_else(|| echoed_header(echoed, "x-ratelimit-reset").and_then(number))
                        .and_then(epoch_to_ms);
                    let remaining = header_number(headers, "x-ratelimit-remaining")
                        .or_else(|| echoed_header(echoed, "x-ratelimit-remaining").and_then(number))
                        .filter(|r| r.is_finite())
                        .map(|r| r as i64);
                    CloudError::PlatformRateLimited {
                        retry_after_ms,
                        reset_at_ms,
                        remaining,
                        daily,
                        message,
                    }
                } else {
                    CloudError::UpstreamRateLimited {
                        provider_name,
                        capacity_exhausted,
                        retry_after_ms,
                        message,
                    }
                }
            }
            402 => {
                let limit_source = field_str(metadata, "limit_source");
                if limit_source == Some("openrouter_in_flight_budget")
                    || field_str(metadata, "reason") == Some("in_flight_budget_exhausted")
                {
                    CloudError::InFlightBudget {
                        retry_after_ms,
                        message,
                    }
                } else if field_str(metadata, "reason") == Some("weight_exceeds_budget") {
                    // This one request costs more than the whole budget: the request's fault
                    // (e.g. a huge max_tokens), not a reason to stop every cloud route.
                    CloudError::Rejected { status, message }
                } else if limit_source == Some("openrouter_key_limit") {
                    CloudError::PaymentRequired {
                        limit: HardLimit::KeyLimit,
                        message,
                    }
                } else {
                    CloudError::PaymentRequired {
                        limit: HardLimit::Credits,
                        message,
                    }
                }
            }
            // A moderation 403 (the input was flagged) is about the input, not the key.
            403 if metadata.is_some_and(|m| m.get("flagged_input").is_some()) => {
                CloudError::Rejected { status, message }
            }
            401 | 403 => CloudError::Unauthorized { status, message },
            404 => {
                let pin_unmatched = field_str(availability, "code") == Some("no_endpoints")
                    || message.to_lowercase().contains("no endpoints found");
                CloudError::NoEndpoints {
                    message,
                    pin_unmatched,
                }
            }
            408 | 500..=599 => CloudError::Unavailable {
                status,
                retry_after_ms,
                message,
            },
            400..=499 => CloudError::Rejected { status, message },
            _ => CloudError::BadResponse {
                message: truncate_chars(
                    &format!("unexpected HTTP {status}: {message}"),
                    MAX_MESSAGE_CHARS,
                ),
            },
        }
    }

    /// The HTTP status that says this failure to a client of ours: OpenRouter's own where it
    /// answered (429, 402, 401/403, 4xx), 404 for routing problems, 502 when it could not be
    /// reached or answered badly, 503 when it was unavailable.
    pub fn http_status(&self) -> u16 {
        match self {
            CloudError::PlatformRateLimited { .. } | CloudError::UpstreamRateLimited { .. } => 429,
            CloudError::InFlightBudget { .. } | CloudError::PaymentRequired { .. } => 402,
            CloudError::Unauthorized { status, .. } | CloudError::Rejected { status, .. } => {
                *status
            }
            CloudError::NoEndpoints { .. } => 404,
            CloudError::Unavailable { .. } => 503,
            CloudError::Transport { .. } | CloudError::BadResponse { .. } => 502,
        }
    }

    /// How the hub treats the failure.
    pub fn failure_class(&self) -> FailureClass {
        match self {
            CloudError::PlatformRateLimited { .. }
            | CloudError::UpstreamRateLimited { .. }
            | CloudError::InFlightBudget { .. } => FailureClass::RateLimited,
            CloudError::PaymentRequired { .. }
            | CloudError::Unauthorized { .. }
            | CloudError::NoEndpoints { .. }
            | CloudError::BadResponse { .. } => FailureClass::Refused,
            CloudError::Unavailable { .. } | CloudError::Transport { .. } => {
                FailureClass::Transient
            }
            CloudError::Rejected { .. } => FailureClass::Fatal,
        }
    }

    /// How long to wait before trying again, when the answer says. A platform limit with only
    /// a reset time waits until then; a daily cap with neither waits until UTC midnight.
    pub fn retry_after_ms(&self) -> Option<u64> {
        self.retry_after_ms_at(now_ms())
    }

    /// [`Self::retry_after_ms`] as seen at `now_ms` (milliseconds since the Unix epoch).
    pub fn retry_after_ms_at(&self, now_ms: u64) -> Option<u64> {
        match self {
            CloudError::PlatformRateLimited {
                retry_after_ms,
                reset_at_ms,
                daily,
                ..
            } => {
                let retry_after_ms: Option<u64> = *retry_after_ms;
                let reset_at_ms: Option<u64> = *reset_at_ms;
                retry_after_ms
                    .or_else(|| reset_at_ms.map(|reset| reset.saturating_sub(now_ms)))
                    .or_else(|| (*daily).then_some(DAY_MS - now_ms % DAY_MS))
            }
            CloudError::UpstreamRateLimited { retry_after_ms, .. }
            | CloudError::InFlightBudget { retry_after_ms, .. }
            | CloudError::Unavailable { retry_after_ms, .. } => *retry_after_ms,
            CloudError::PaymentRequired { .. }
            | CloudError::Unauthorized { .. }
            | CloudError::NoEndpoints { .. }
            | CloudError::Rejected { .. }
            | CloudError::Transport { .. }
            | CloudError::BadResponse { .. } => None,
        }
    }

    /// A standing refusal no retry can lift (a rejected key, no endpoint for the pin); the hub
    /// fails what only this route could serve instead of requeueing it.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            // 401 is the key itself; a 403 may be about one model or route, not the key.
            CloudError::Unauthorized { status: 401, .. } => Some(Refusal::KeyRejected),
            CloudError::NoEndpoints {
                pin_unmatched: true,
                ..
            } => Some(Refusal::NoEndpoint),
            _ => None,
        }
    }

    /// The budget scope of a throttle or spending limit; `None` for other failures.
    pub fn limit(&self) -> Option<LimitKind> {
        match self {
            CloudError::PlatformRateLimited { .. } => Some(LimitKind::Platform),
            CloudError::UpstreamRateLimited { .. } => Some(LimitKind::Upstream),
            CloudError::InFlightBudget { .. } => Some(LimitKind::InFlightBudget),
            CloudError::PaymentRequired {
                limit: HardLimit::Credits,
                ..
            } => Some(LimitKind::Credits),
            CloudError::PaymentRequired {
                limit: HardLimit::KeyLimit,
                ..
            } => Some(LimitKind::KeyLimit),
            CloudError::Unavailable { .. }
            | CloudError::Unauthorized { .. }
            | CloudError::NoEndpoints { .. }
            | CloudError::Rejected { .. }
            | CloudError::Transport { .. }
            | CloudError::BadResponse { .. } => None,
        }
    }
}

/// `text` cut to at most `max_chars` characters (on a character boundary).
pub(crate) fn truncate_chars(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((cut, _)) => text[..cut].to_string(),
        None => text.to_string(),
    }
}

fn daily_note(daily: &bool) -> &'static str {
    if *daily { " (daily cap)" } else { "" }
}

fn upstream_note(provider_name: &Option<String>, capacity_exhausted: &bool) -> String {
    let provider = provider_name.as_deref().unwrap_or("provider unknown");
    if *capacity_exhausted {
        format!("{provider}, capacity exhausted")
    } else {
        provider.to_string()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The error's message (plus the provider's raw text when there is one), or the start of a
/// body that is not OpenRouter's error JSON.
fn body_message(
    status: u16,
    error: Option<&Value>,
    metadata: Option<&Value>,
    body: &str,
) -> String {
    let from_json = error
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .or_else(|| error.and_then(Value::as_str))
        .map(str::trim)
        .filter(|m| !m.is_empty());
    let text = match from_json {
        Some(m) => match field_str(metadata, "raw")
            .map(str::trim)
            .filter(|r| !r.is_empty())
        {
            Some(raw) if raw != m => format!("{m} ({raw})"),
            _ => m.to_string(),
        },
        None => {
            let trimmed = body.trim();
            if trimmed.is_empty() {
                format!("HTTP {status} with an empty body")
            } else {
                truncate_chars(trimmed, BODY_PREVIEW_CHARS)
            }
        }
    };
    truncate_chars(&text, MAX_MESSAGE_CHARS)
}

fn field_str<'a>(object: Option<&'a Value>, key: &str) -> Option<&'a str> {
    object.and_then(|o| o.get(key)).and_then(Value::as_str)
}

fn field_number(object: Option<&Value>, key: &str) -> Option<f64> {
    object.and_then(|o| o.get(key)).and_then(number)
}

/// A JSON number, or a string holding one.
fn number(value: &Value) -> Option<f64> {
    value
        .as_f64()
        .or_else(|| value.as_str().and_then(|s| s.trim().parse::<f64>().ok()))
}

fn header_number(headers: &HeaderMap, name: &str) -> Option<f64> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
}

/// A response header OpenRouter echoed into `error.metadata.headers` (any letter case).
fn echoed_header<'a>(echoed: Option<&'a Value>, name: &str) -> Option<&'a Value> {
    echoed
        .and_then(Value::as_object)
        .and_then(|o| o.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)))
        .map(|(_, v)| v)
}

fn seconds_to_ms(seconds: f64) -> Option<u64> {
    (seconds.is_finite() && seconds >= 0.0).then(|| (seconds * 1000.0).round() as u64)
}

/// An epoch timestamp in milliseconds (values below 10^11 are read as seconds).
fn epoch_to_ms(value: f64) -> Option<u64> {
    if !value.is_finite() || value < 0.0 {
        return None;
    }
    if value < EPOCH_MS_FLOOR {
        Some((value * 1000.0).round() as u64)
    } else {
        Some(value.round() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in pairs {
            map.insert(name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn a_platform_429_reads_the_reset_header_in_milliseconds() {
        let h = headers(&[
            ("x-ratelimit-limit", "20"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1767225600000"),
        ]);
        let body = r#"{"error":{"code":429,"message":"Rate limit exceeded: limit_rpm/google/gemma-3-27b-it/0a1b","metadata":{"headers":{"X-RateLimit-Limit":"20","X-RateLimit-Remaining":"0","X-RateLimit-Reset":"1767225600000"},"provider_name":null}}}"#;
        let e = CloudError::from_response(429, &h, body);
        assert_eq!(
            e,
            CloudError::PlatformRateLimited {
                retry_after_ms: None,
                reset_at_ms: Some(1_767_225_600_000),
                remaining: Some(0),
                daily: false,
                message: "Rate limit exceeded: limit_rpm/google/gemma-3-27b-it/0a1b".into(),
            }
        );
        assert_eq!(e.retry_after_ms_at(1_767_225_590_000), Some(10_000));
        assert_eq!(e.retry_after_ms_at(1_767_225_700_000), Some(0));
        assert_eq!(e.failure_class(), FailureClass::RateLimited);
        assert_eq!(e.limit(), Some(LimitKind::Platform));

        // Only echoed in the body, reset in seconds, and a daily cap.
        let body = r#"{"error":{"code":429,"message":"Rate limit exceeded: free-models-per-day. Add 10 credits to unlock 1000 free model requests per day","metadata":{"headers":{"X-RateLimit-Limit":"50","X-RateLimit-Remaining":"0","X-RateLimit-Reset":"1767225600"}}}}"#;
        let e = CloudError::from_response(429, &HeaderMap::new(), body);
        assert!(matches!(
            e,
            CloudError::PlatformRateLimited {
                daily: true,
                reset_at_ms: Some(1_767_225_600_000),
                ..
            }
        ));
        assert!(e.to_string().contains("daily cap"), "{e}");
    }

    #[test]
    fn an_upstream_429_names_its_provider_and_reads_retry_after() {
        let h = headers(&[("retry-after", "3")]);
        let body = r#"{"error":{"code":429,"message":"qwen/qwen3-embedding-8b is temporarily rate-limited upstream. Please retry shortly, or add your own key","metadata":{"raw":"qwen/qwen3-embedding-8b is temporarily rate-limited upstream. Please retry shortly, or add your own key","provider_name":"DeepInfra"}}}"#;
        let e = CloudError::from_response(429, &h, body);
        assert!(matches!(
            &e,
            CloudError::UpstreamRateLimited {
                provider_name: Some(p),
                capacity_exhausted: false,
                retry_after_ms: Some(3000),
                ..
            } if p == "DeepInfra"
        ));
        assert_eq!(e.retry_after_ms(), Some(3000));
        assert_eq!(e.limit(), Some(LimitKind::Upstream));
        assert_eq!(e.failure_class(), FailureClass::RateLimited);
    }

    #[test]
    fn retry_after_as_an_http_date_is_the_time_left() {
        let at = std::time::SystemTime::now() + std::time::Duration::from_secs(30);
        let date = httpdate::fmt_http_date(at);
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_str(&date).unwrap());
        let body = r#"{"error":{"code":429,"message":"rate-limited upstream","metadata":{"provider_name":"DeepInfra"}}}"#;
        let e = CloudError::from_response(429, &h, body);
        let ms = e.retry_after_ms().expect("read from the date");
        assert!((28_000..=30_000).contains(&ms), "{ms}");
    }

    #[test]
    fn capacity_exhausted_is_an_upstream_limit() {
        let body = r#"{"error":{"code":429,"message":"All providers for this model are at capacity","availability":{"code":"capacity_exhausted","retry_after":2}}}"#;
        let e = CloudError::from_response(429, &HeaderMap::new(), body);
        assert!(matches!(
            e,
            CloudError::UpstreamRateLimited {
                capacity_exhausted: true,
                retry_after_ms: Some(2000),
                provider_name: None,
                ..
            }
        ));
    }

    #[test]
    fn the_in_flight_402_is_transient_and_the_others_are_hard() {
        let h = headers(&[("retry-after", "1.5")]);
        let body = r#"{"error":{"code":402,"message":"Too much spend in flight for your balance","metadata":{"reason":"in_flight_budget_exhausted","limit_source":"openrouter_in_flight_budget","remedy_hint":"retry after Retry-After or add credits"}}}"#;
        let e = CloudError::from_response(402, &h, body);
        assert!(matches!(
            e,
            CloudError::InFlightBudget {
                retry_after_ms: Some(1500),
                ..
            }
        ));
        assert_eq!(e.failure_class(), FailureClass::RateLimited);
        assert_eq!(e.limit(), Some(LimitKind::InFlightBudget));

        let body = r#"{"error":{"code":402,"message":"This request requires more credits, or fewer max_tokens","metadata":{"reason":"weight_exceeds_budget","limit_source":"openrouter_credits"}}}"#;
        let e = CloudError::from_response(402, &HeaderMap::new(), body);
        assert!(
            matches!(e, CloudError::Rejected { status: 402, .. }),
            "{e:?}"
        );
        assert_eq!(
            e.failure_class(),
            FailureClass::Fatal,
            "the request's fault alone"
        );
        assert_eq!(e.limit(), None, "no stop for every route");
        let body = r#"{"error":{"code":402,"message":"Insufficient credits","metadata":{"reason":"insufficient_credits","limit_source":"openrouter_credits"}}}"#;
        let e = CloudError::from_response(402, &HeaderMap::new(), body);
        assert!(matches!(
            e,
            CloudError::PaymentRequired {
                limit: HardLimit::Credits,
                ..
            }
        ));
        assert_eq!(e.failure_class(), FailureClass::Refused);
        assert_eq!(e.limit(), Some(LimitKind::Credits));
        assert_eq!(e.retry_after_ms(), None);

        let body = r#"{"error":{"code":402,"message":"Key limit exceeded","metadata":{"limit_source":"openrouter_key_limit"}}}"#;
        let e = CloudError::from_response(402, &HeaderMap::new(), body);
        assert_eq!(e.limit(), Some(LimitKind::KeyLimit));
        assert_eq!(e.failure_class(), FailureClass::Refused);
    }

    #[test]
    fn config_server_and_input_failures_are_told_apart() {
        let body = r#"{"error":{"code":404,"message":"No endpoints found matching your data policy and provider preferences"}}"#;
        let e = CloudError::from_response(404, &HeaderMap::new(), body);
        assert!(matches!(e, CloudError::NoEndpoints { .. }));
        assert_eq!(e.failure_class(), FailureClass::Refused);
        assert_eq!(e.limit(), None);
        assert_eq!(e.refusal(), Some(Refusal::NoEndpoint));

        let body = r#"{"error":{"code":503,"message":"provider_overloaded","metadata":{"retry_after":4}}}"#;
        let e = CloudError::from_response(503, &HeaderMap::new(), body);
        assert_eq!(
            e,
            CloudError::Unavailable {
                status: 503,
                retry_after_ms: Some(4000),
                message: "provider_overloaded".into()
            }
        );
        assert_eq!(e.failure_class(), FailureClass::Transient);

        let html = format!("<html><body>{}</body></html>", "Bad gateway. ".repeat(40));
        let e = CloudError::from_response(502, &HeaderMap::new(), &html);
        let CloudError::Unavailable {
            status: 502,
            message,
            ..
        } = &e
        else {
            panic!("{e:?}");
        };
        assert_eq!(message.chars().count(), 200);
        assert!(html.starts_with(message.as_str()));

        let body = r#"{"error":{"code":400,"message":"Input is too long for this model"}}"#;
        let e = CloudError::from_response(400, &HeaderMap::new(), body);
        assert!(matches!(e, CloudError::Rejected { status: 400, .. }));
        assert_eq!(e.failure_class(), FailureClass::Fatal);

        let body = r#"{"error":{"code":401,"message":"No auth credentials found"}}"#;
        let e = CloudError::from_response(401, &HeaderMap::new(), body);
        assert!(matches!(e, CloudError::Unauthorized { status: 401, .. }));
        assert_eq!(e.failure_class(), FailureClass::Refused);
        assert_eq!(e.refusal(), Some(Refusal::KeyRejected));

        let e = CloudError::from_response(529, &HeaderMap::new(), "");
        assert!(matches!(e, CloudError::Unavailable { status: 529, .. }));
    }

    #[test]
    fn messages_are_bounded_on_a_char_boundary() {
        let long = "é".repeat(1000);
        let body = serde_json::json!({"error": {"code": 400, "message": long}}).to_string();
        let CloudError::Rejected { message, .. } =
            CloudError::from_response(400, &HeaderMap::new(), &body)
        else {
            panic!("not rejected");
        };
        assert_eq!(message.chars().count(), MAX_MESSAGE_CHARS);
        assert_eq!(truncate_chars("abc", 2), "ab");
        assert_eq!(truncate_chars("ab", 5), "ab");
    }
}
