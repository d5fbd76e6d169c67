//! The OpenRouter wire format, as pure functions: request bodies (the route's pin goes in as
//! the `provider` object) and response checks (count, order, width, finite numbers, usage,
//! `/key` and `/credits` numbers). No I/O here: [`super::openrouter`] sends and receives.

use base64::Engine as _;
use reqwest::header::HeaderMap;
use serde_json::{Map, Value};

use super::error::{CloudError, MAX_MESSAGE_CHARS, truncate_chars};
use super::openrouter::KeyInfo;
use super::route::CloudRoute;

/// A success whose body is wrong.
pub(super) fn bad(message: impl Into<String>) -> CloudError {
    CloudError::BadResponse {
        message: truncate_chars(&message.into(), MAX_MESSAGE_CHARS),
    }
}

/// A 2xx whose body is only an `error` object (OpenRouter can fail after the status is sent).
pub(super) fn error_in_success(
    value: &Value,
    headers: &HeaderMap,
    body: &str,
) -> Option<CloudError> {
    let error = value.get("error").filter(|e| e.is_object())?;
    if ["data", "choices", "results"]
        .iter()
        .any(|k| value.get(*k).is_some())
    {
        return None;
    }
    let status = error
        .get("code")
        .and_then(Value::as_u64)
        .filter(|c| (400..=599).contains(c))
        .and_then(|c| u16::try_from(c).ok())
        .unwrap_or(502);
    Some(CloudError::from_response(status, headers, body))
}

fn strings(items: &[String]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.clone())).collect())
}

pub(super) fn embed_body(
    route: &CloudRoute,
    texts: &[String],
    dimensions: Option<usize>,
    input_type: Option<&str>,
) -> Value {
    let mut body = Map::new();
    body.insert("model".to_string(), Value::from(route.model()));
    body.insert("input".to_string(), strings(texts));
    body.insert("encoding_format".to_string(), Value::from("float"));
    if let Some(dimensions) = dimensions {
        body.insert("dimensions".to_string(), Value::from(dimensions));
    }
    if let Some(input_type) = input_type {
        body.insert("input_type".to_string(), Value::from(input_type));
    }
    if let Some(provider) = route.provider_preferences() {
        body.insert("provider".to_string(), provider);
    }
    Value::Object(body)
}

pub(super) fn rerank_body(route: &CloudRoute, query: &str, documents: &[String]) -> Value {
    let mut body = Map::new();
    body.insert("model".to_string(), Value::from(route.model()));
    body.insert("query".to_string(), Value::from(query));
    body.insert("documents".to_string(), strings(documents));
    // Every document back, whatever a provider's default `top_n` is.
    body.insert("top_n".to_string(), Value::from(documents.len()));
    if let Some(provider) = route.provider_preferences() {
        body.insert("provider".to_string(), provider);
    }
    Value::Object(body)
}

/// The client's chat body on the route: its model (no `models` fallback list: only the
/// route's model may be billed), never streamed, and the route's pin when it has one.
pub(super) fn chat_body(route: &CloudRoute, body: Value) -> Result<Value, CloudError> {
    let Value::Object(mut body) = body else {
        return Err(CloudError::Rejected {
            status: 400,
            message: "a chat request body must be a JSON object".to_string(),
        });
    };
    body.insert("model".to_string(), Value::from(route.model()));
    body.remove("models");
    body.insert("stream".to_string(), Value::Bool(false));
    body.remove("stream_options");
    if let Some(provider) = route.provider_preferences() {
        body.insert("provider".to_string(), provider);
    }
    Ok(Value::Object(body))
}

/// `usage.total_tokens`, else `usage.prompt_tokens`, else 0.
pub fn parse_tokens(value: &Value) -> u64 {
    let usage = value.get("usage");
    let field = |key: &str| usage.and_then(|u| u.get(key)).and_then(Value::as_u64);
    field("total_tokens")
        .or_else(|| field("prompt_tokens"))
        .unwrap_or(0)
}

/// `usage.cost`: what the call cost in credits (US dollars), as OpenRouter reports it on
/// every answer (a stream's in its last event); `None` when absent or not a finite number
/// of zero or more.
pub fn parse_cost(value: &Value) -> Option<f64> {
    value
        .get("usage")?
        .get("cost")?
        .as_f64()
        .filter(|c| c.is_finite() && *c >= 0.0)
}

/// The `data[]` of an embeddings response in input order: exactly `expected` vectors (by
/// `index`, or position when absent), each `dims` wide (or, without `dims`, as wide as the
/// first) and finite.
pub fn parse_embeddings(
    body: &Value,
    expected: usize,
    dims: Option<usize>,
) -> Result<Vec<Vec<f32>>, CloudError> {
    let data = body
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("the embeddings response has no data array"))?;
    if data.len() != expected {
        return Err(bad(format!(
            "{} embeddings for {expected} inputs",
            data.len()
        )));
    }
    let mut slots: Vec<Option<Vec<f32>>> = vec![None; expected];
    let mut width = dims;
    for (position, item) in data.iter().enumerate() {
        let index = match item.get("index") {
            None => position,
            Some(i) => i
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| bad(format!("data[{position}].index is not an index")))?,
        };
        let Some(slot) = slots.get_mut(index) else {
            return Err(bad(format!(
                "index {index} is out of range for {expected} inputs"
            )));
        };
        if slot.is_some() {
            return Err(bad(format!("index {index} appears twice")));
        }
        let vector = decode_embedding(item.get("embedding"))
            .map_err(|why| bad(format!("embedding {index}: {why}")))?;
        let dims = *width.get_or_insert(vector.len());
        if vector.len() != dims || dims == 0 {
            return Err(bad(format!(
                "embedding {index} has {} dims where {dims} are expected",
                vector.len()
            )));
        }
        *slot = Some(vector);
    }
    slots
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| bad("an input has no embedding"))
}

/// One `embedding`: a number array, or base64 of little-endian f32. Every value finite.
fn decode_embedding(value: Option<&Value>) -> Result<Vec<f32>, String> {
    let vector: Vec<f32> = match value {
        Some(Value::Array(numbers)) => numbers
            .iter()
            .map(|n| n.as_f64().map(|x| x as f32))
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| "a value is not a number".to_string())?,
        Some(Value::String(encoded)) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .map_err(|e| format!("bad base64 ({e})"))?;
            if bytes.len() % 4 != 0 {
                return Err(format!("{} base64 bytes are not whole f32s", bytes.len()));
            }
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        }
        Some(_) => return Err("neither a number array nor a base64 string".to_string()),
        None => return Err("missing".to_string()),
    };
    if vector.iter().all(|x| x.is_finite()) {
        Ok(vector)
    } else {
        Err("a value is not finite".to_string())
    }
}

/// `results[]` of a rerank response as scores in document order: every index in
/// `0..expected` exactly once, every score finite.
pub(super) fn parse_rerank(body: &Value, expected: usize) -> Result<Vec<f32>, CloudError> {
    let results = body
        .get("results")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("the rerank response has no results array"))?;
    if results.len() != expected {
        return Err(bad(format!(
            "{} rerank results for {expected} documents",
            results.len()
        )));
    }
    let mut scores: Vec<Option<f32>> = vec![None; expected];
    for (position, result) in results.iter().enumerate() {
        let index = result
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|i| usize::try_from(i).ok())
            .ok_or_else(|| bad(format!("results[{position}] has no index")))?;
        let Some(slot) = scores.get_mut(index) else {
            return Err(bad(format!(
                "index {index} is out of range for {expected} documents"
            )));
        };
        if slot.is_some() {
            return Err(bad(format!("index {index} appears twice")));
        }
        let score = result
            .get("relevance_score")
            .and_then(Value::as_f64)
            .map(|s| s as f32)
            .filter(|s| s.is_finite())
            .ok_or_else(|| bad(format!("result {index} has no finite relevance_score")))?;
        *slot = Some(score);
    }
    scores
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| bad("a document has no score"))
}

/// A JSON number, or a string holding one.
fn number(value: &Value) -> Option<f64> {
    value
        .as_f64()
        .or_else(|| value.as_str().and_then(|s| s.trim().parse::<f64>().ok()))
        .filter(|x| x.is_finite())
}

/// `/key`'s `data` (or the body itself when there is no `data`).
pub(super) fn parse_key(body: &Value) -> KeyInfo {
    let data = body.get("data").unwrap_or(body);
    let rate_limit = data.get("rate_limit");
    KeyInfo {
        rpm: rate_limit.and_then(rate_limit_rpm),
        limit_usd: data.get("limit").and_then(number),
        limit_remaining_usd: data.get("limit_remaining").and_then(number),
        usage_usd: data.get("usage").and_then(number),
        is_free_tier: data.get("is_free_tier").and_then(Value::as_bool),
        credits_remaining_usd: None,
        rate_limit_requests: rate_limit
            .and_then(|r| r.get("requests"))
            .and_then(Value::as_i64),
        rate_limit_interval: rate_limit
            .and_then(|r| r.get("interval"))
            .and_then(Value::as_str)
            .map(str::to_string),
        total_credits_usd: None,
        total_usage_usd: None,
    }
}

/// `/credits` as it stands: `(total_credits, total_usage)`.
pub(super) fn credit_totals(body: &Value) -> (Option<f64>, Option<f64>) {
    let data = body.get("data").unwrap_or(body);
    (
        data.get("total_credits").and_then(number),
        data.get("total_usage").and_then(number),
    )
}

/// `/credits`: `total_credits - total_usage`; 0/0 is unknown (ordinary keys get it).
pub(super) fn parse_credits(body: &Value) -> Option<f64> {
    let (total, used) = credit_totals(body);
    let (total, used) = (total?, used?);
    if total == 0.0 && used == 0.0 {
        return None;
    }
    Some(total - used)
}

/// Requests per minute from `rate_limit {requests, interval}`.
fn rate_limit_rpm(rate_limit: &Value) -> Option<f64> {
    let requests = rate_limit.get("requests").and_then(number)?;
    if requests <= 0.0 {
        return None;
    }
    let window_secs = rate_limit
        .get("interval")
        .and_then(Value::as_str)
        .and_then(interval_secs)?;
    Some(requests * 60.0 / window_secs)
}

/// `"10s"`, `"1m"`, `"500ms"`, `"1h"`, `"1d"` in seconds; `None` for anything else (a bare
/// number has no unit and is refused).
fn interval_secs(text: &str) -> Option<f64> {
    let text = text.trim().to_ascii_lowercase();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (amount, unit) = text.split_at(split);
    let amount: f64 = amount.parse().ok()?;
    let scale = match unit.trim() {
        "ms" => 0.001,
        "s" | "sec" | "secs" | "second" | "seconds" => 1.0,
        "m" | "min" | "mins" | "minute" | "minutes" => 60.0,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3600.0,
        "d" | "day" | "days" => 86_400.0,
        _ => return None,
    };
    let secs = amount * scale;
    (secs.is_finite() && secs > 0.0).then_some(secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::push::AllowedModel;
    use crate::roles::Role;
    use serde_json::json;

    fn route(role: Role, json: &str) -> CloudRoute {
        let m: AllowedModel = serde_json::from_str(json).unwrap();
        CloudRoute::from_allowed(role, &m).unwrap()
    }

    fn embedding_route() -> CloudRoute {
        route(
            Role::CodeEmbedding,
            r#"{"model":"qwen/qwen3-embedding-4b","provider":"deepinfra/bf16","dims":3}"#,
        )
    }

    #[test]
    fn rate_limit_intervals_parse_and_the_deprecated_minus_one_is_none() {
        assert_eq!(interval_secs("10s"), Some(10.0));
        assert_eq!(interval_secs("1m"), Some(60.0));
        assert_eq!(interval_secs("60s"), Some(60.0));
        assert_eq!(interval_secs(" 500ms "), Some(0.5));
        assert_eq!(interval_secs("1h"), Some(3600.0));
        for bad in ["", "s", "10", "abc", "0s", "10 parsecs", "1.2.3s"] {
            assert_eq!(interval_secs(bad), None, "{bad}");
        }
        assert_eq!(
            rate_limit_rpm(&json!({"requests": 40, "interval": "10s"})),
            Some(240.0)
        );
        assert_eq!(
            rate_limit_rpm(&json!({"requests": 20, "interval": "1m"})),
            Some(20.0)
        );
        assert_eq!(
            rate_limit_rpm(&json!({"requests": -1, "interval": "10s", "note": "deprecated"})),
            None
        );
        assert_eq!(
            rate_limit_rpm(&json!({"requests": 40, "interval": "soon"})),
            None
        );
        assert_eq!(rate_limit_rpm(&json!({"interval": "10s"})), None);
    }

    #[test]
    fn embeddings_come_back_in_input_order_from_floats_or_base64() {
        let encoded = base64::engine::general_purpose::STANDARD.encode(
            [1.0f32, -2.5, 0.25]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let body = json!({"object": "list", "data": [
            {"object": "embedding", "index": 1, "embedding": encoded},
            {"object": "embedding", "index": 0, "embedding": [0.5, 0.0, -1.0]},
        ], "usage": {"prompt_tokens": 7, "total_tokens": 7}});
        let vectors = parse_embeddings(&body, 2, Some(3)).unwrap();
        assert_eq!(vectors, vec![vec![0.5, 0.0, -1.0], vec![1.0, -2.5, 0.25]]);
        assert_eq!(parse_tokens(&body), 7);
        assert_eq!(parse_tokens(&json!({"usage": {"prompt_tokens": 4}})), 4);
        assert_eq!(parse_tokens(&json!({})), 0);
        assert_eq!(
            parse_cost(&json!({"usage": {"cost": 0.0125}})),
            Some(0.0125)
        );
        assert_eq!(parse_cost(&json!({"usage": {"cost": -1}})), None);
        assert_eq!(parse_cost(&json!({"usage": {"total_tokens": 3}})), None);

        let wrong_count = json!({"data": [{"index": 0, "embedding": [1.0, 2.0, 3.0]}]});
        assert!(matches!(
            parse_embeddings(&wrong_count, 2, Some(3)),
            Err(CloudError::BadResponse { .. })
        ));
        let wrong_dims = json!({"data": [{"index": 0, "embedding": [1.0, 2.0]}]});
        assert!(parse_embeddings(&wrong_dims, 1, Some(3)).is_err());
        let twice = json!({"data": [
            {"index": 0, "embedding": [1.0, 2.0, 3.0]},
            {"index": 0, "embedding": [1.0, 2.0, 3.0]},
        ]});
        assert!(parse_embeddings(&twice, 2, Some(3)).is_err());
        let out_of_range = json!({"data": [{"index": 5, "embedding": [1.0, 2.0, 3.0]}]});
        assert!(parse_embeddings(&out_of_range, 1, Some(3)).is_err());
        let not_numbers = json!({"data": [{"index": 0, "embedding": [1.0, "x", 3.0]}]});
        assert!(parse_embeddings(&not_numbers, 1, Some(3)).is_err());
        let overflow = json!({"data": [{"index": 0, "embedding": [1.0, 1e300, 3.0]}]});
        assert!(parse_embeddings(&overflow, 1, Some(3)).is_err());
        let nan = base64::engine::general_purpose::STANDARD.encode(f32::NAN.to_le_bytes());
        assert!(decode_embedding(Some(&json!(nan))).is_err());
        assert!(
            decode_embedding(Some(&json!("AAAAAAA="))).is_err(),
            "5 bytes"
        );
        assert!(parse_embeddings(&json!({"error": "x"}), 1, Some(3)).is_err());
    }

    #[test]
    fn rerank_scores_follow_document_order() {
        let body = json!({"results": [
            {"index": 2, "relevance_score": 0.9},
            {"index": 0, "relevance_score": 0.5},
            {"index": 1, "relevance_score": 0.1},
        ], "usage": {"search_units": 1, "total_tokens": 30}});
        assert_eq!(parse_rerank(&body, 3).unwrap(), vec![0.5, 0.1, 0.9]);
        assert_eq!(parse_tokens(&body), 30);

        let missing = json!({"results": [
            {"index": 0, "relevance_score": 0.5},
            {"index": 0, "relevance_score": 0.1},
        ]});
        assert!(parse_rerank(&missing, 2).is_err());
        let short = json!({"results": [{"index": 0, "relevance_score": 0.5}]});
        assert!(parse_rerank(&short, 2).is_err());
        let no_score = json!({"results": [{"index": 0}]});
        assert!(parse_rerank(&no_score, 1).is_err());
    }

    #[test]
    fn funded_reads_any_signal_and_zero_zero_credits_are_unknown() {
        assert_eq!(KeyInfo::default().funded(), None);
        let paid = KeyInfo {
            is_free_tier: Some(false),
            ..KeyInfo::default()
        };
        assert_eq!(paid.funded(), Some(true));
        let credits = KeyInfo {
            credits_remaining_usd: Some(3.5),
            is_free_tier: Some(true),
            ..KeyInfo::default()
        };
        assert_eq!(credits.funded(), Some(true));
        let broke = KeyInfo {
            credits_remaining_usd: Some(-0.2),
            limit_remaining_usd: Some(0.0),
            is_free_tier: Some(true),
            ..KeyInfo::default()
        };
        assert_eq!(broke.funded(), Some(false));

        assert_eq!(
            parse_credits(&json!({"data": {"total_credits": 0, "total_usage": 0}})),
            None
        );
        assert_eq!(
            parse_credits(&json!({"data": {"total_credits": 10.0, "total_usage": 2.5}})),
            Some(7.5)
        );
        let key = parse_key(&json!({"data": {
            "label": "sk-or-v1-abc...", "limit": 25, "limit_remaining": 20.5, "usage": 4.5,
            "is_free_tier": false,
            "rate_limit": {"requests": -1, "interval": "10s", "note": "deprecated"}
        }}));
        assert_eq!(
            key,
            KeyInfo {
                rpm: None,
                limit_usd: Some(25.0),
                limit_remaining_usd: Some(20.5),
                usage_usd: Some(4.5),
                is_free_tier: Some(false),
                credits_remaining_usd: None,
                rate_limit_requests: Some(-1),
                rate_limit_interval: Some("10s".into()),
                total_credits_usd: None,
                total_usage_usd: None,
            }
        );
    }

    #[test]
    fn request_bodies_carry_the_pin_and_the_route_model() {
        let texts = vec!["fn main() {}".to_string()];
        let body = embed_body(&embedding_route(), &texts, Some(3), Some("search_document"));
        assert_eq!(
            body,
            json!({
                "model": "qwen/qwen3-embedding-4b",
                "input": ["fn main() {}"],
                "encoding_format": "float",
                "dimensions": 3,
                "input_type": "search_document",
                "provider": {"only": ["deepinfra/bf16"], "allow_fallbacks": false, "require_parameters": true}
            })
        );

        let chat = route(Role::CodeAssistant, r#"{"model":"poolside/laguna-s-2.1"}"#);
        let body = chat_body(
            &chat,
            json!({"model": "code-assistant", "models": ["a/b"], "stream": true,
                   "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap();
        assert_eq!(
            body,
            json!({"model": "poolside/laguna-s-2.1", "stream": false,
                   "messages": [{"role": "user", "content": "hi"}]})
        );
        assert!(chat_body(&chat, json!([1, 2])).is_err());

        let rerank = route(Role::Reranker, r#"{"model":"cohere/rerank-v3.5"}"#);
        let body = rerank_body(&rerank, "q", &["a".to_string(), "b".to_string()]);
        assert_eq!(
            body,
            json!({"model": "cohere/rerank-v3.5", "query": "q", "documents": ["a", "b"], "top_n": 2})
        );
    }

    #[test]
    fn an_error_inside_a_success_is_classified() {
        let body = r#"{"error":{"code":503,"message":"provider_overloaded"}}"#;
        let value: Value = serde_json::from_str(body).unwrap();
        assert!(matches!(
            error_in_success(&value, &HeaderMap::new(), body),
            Some(CloudError::Unavailable { status: 503, .. })
        ));
        let fine = json!({"choices": [], "error": {"code": 1}});
        assert_eq!(error_in_success(&fine, &HeaderMap::new(), "{}"), None);
    }
}
