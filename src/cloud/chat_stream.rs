//! A streamed chat completion (`stream: true`): OpenRouter's server-sent events read as they
//! arrive, each chunk handed on at once, and the whole completion assembled from them (the
//! usage, the finish reason, the content and tool calls) for accounting and non-streaming
//! callers.
//!
//! The wire: `data: {chunk}` lines separated by blank lines, `: OPENROUTER PROCESSING`
//! comments while the upstream thinks, `data: [DONE]` at the end. An error after the stream
//! began comes as a chunk with an `error` object (and `finish_reason: "error"`); it ends the
//! call with that error.

use reqwest::header::HeaderMap;
use serde_json::{Map, Value, json};

use super::error::CloudError;
use super::openrouter::{Chatted, OpenRouterClient};
use super::route::CloudRoute;
use super::wire::{chat_body, parse_cost, parse_tokens};

/// The most bytes one streamed completion may carry (its chunks together).
const MAX_STREAM_BYTES: usize = 32 << 20;
/// The longest line an event may have.
const MAX_LINE_BYTES: usize = 4 << 20;

/// What one line of the stream says.
#[derive(Debug, PartialEq)]
pub enum SseLine {
    /// A chunk object.
    Chunk(Value),
    /// `data: [DONE]`.
    Done,
    /// A comment, a blank line, a field we do not use.
    Nothing,
}

/// Reads one line (without its line break).
pub fn parse_line(line: &str) -> Result<SseLine, CloudError> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let Some(data) = line.strip_prefix("data:") else {
        return Ok(SseLine::Nothing);
    };
    let data = data.strip_prefix(' ').unwrap_or(data);
    if data.trim() == "[DONE]" {
        return Ok(SseLine::Done);
    }
    match serde_json::from_str::<Value>(data) {
        Ok(v @ Value::Object(_)) => Ok(SseLine::Chunk(v)),
        _ => Err(CloudError::BadResponse {
            message: "a streamed chunk is not a JSON object".into(),
        }),
    }
}

/// Splits bytes as they come into complete lines.
#[derive(Default)]
pub struct Lines {
    pending: Vec<u8>,
}

impl Lines {
    /// Adds `bytes`; returns the lines they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, CloudError> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(at) = self.pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=at).collect();
            out.push(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
        }
        if self.pending.len() > MAX_LINE_BYTES {
            return Err(CloudError::BadResponse {
                message: format!("a streamed line is longer than {MAX_LINE_BYTES} bytes"),
            });
        }
        Ok(out)
    }
}

/// The completion the chunks add up to.
#[derive(Default)]
pub struct Assembled {
    head: Map<String, Value>,
    role: Option<Value>,
    content: String,
    reasoning: String,
    tool_calls: Vec<Value>,
    finish_reason: Option<Value>,
    usage: Option<Value>,
}

impl Assembled {
    /// Takes one chunk in.
    pub fn add(&mut self, chunk: &Value) {
        for key in ["id", "model", "created", "provider", "system_fingerprint"] {
            if let Some(v) = chunk.get(key)
                && !self.head.contains_key(key)
            {
                self.head.insert(key.into(), v.clone());
            }
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
            return;
        };
        if let Some(f) = choice.get("finish_reason").filter(|f| !f.is_null()) {
            self.finish_reason = Some(f.clone());
        }
        let Some(delta) = choice.get("delta") else {
            return;
        };
        if let Some(r) = delta.get("role").filter(|r| !r.is_null()) {
            self.role.get_or_insert_with(|| r.clone());
        }
        if let Some(c) = delta.get("content").and_then(Value::as_str) {
            self.content.push_str(c);
        }
        if let Some(r) = delta.get("reasoning").and_then(Value::as_str) {
            self.reasoning.push_str(r);
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            self.add_tool_call(call);
        }
    }

    /// A tool call's first delta names it; later ones (same `index`) extend its arguments.
    fn add_tool_call(&mut self, call: &Value) {
        let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
        let known = self
            .tool_calls
            .iter_mut()
            .find(|c| c.get("index").and_then(Value::as_u64) == Some(index));
        let Some(known) = known else {
            self.tool_calls.push(call.clone());
            return;
        };
        let more = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if let Some(Value::String(args)) = known.pointer_mut("/function/arguments") {
            args.push_str(more);
        }
    }

    /// The whole `chat.completion` object.
    pub fn finish(self) -> Value {
        let mut message = Map::new();
        message.insert(
            "role".into(),
            self.role.unwrap_or_else(|| json!("assistant")),
        );
        message.insert("content".into(), Value::String(self.content));
        if !self.reasoning.is_empty() {
            message.insert("reasoning".into(), Value::String(self.reasoning));
        }
        if !self.tool_calls.is_empty() {
            let calls = self
                .tool_calls
                .into_iter()
                .map(|mut c| {
                    if let Some(o) = c.as_object_mut() {
                        o.remove("index");
                    }
                    c
                })
                .collect();
            message.insert("tool_calls".into(), Value::Array(calls));
        }
        let mut out = self.head;
        out.insert("object".into(), json!("chat.completion"));
        out.insert(
            "choices".into(),
            json!([{"index": 0, "message": message,
                    "finish_reason": self.finish_reason.unwrap_or(Value::Null)}]),
        );
        if let Some(u) = self.usage {
            out.insert("usage".into(), u);
        }
        Value::Object(out)
    }
}

/// The error a chunk carries, when it carries one (a failure after the stream began).
fn chunk_error(chunk: &Value) -> Option<CloudError> {
    let error = chunk.get("error")?;
    let status = error
        .get("code")
        .and_then(Value::as_u64)
        .and_then(|c| u16::try_from(c).ok())
        .filter(|c| (400..600).contains(c))
        .unwrap_or(502);
    let body = json!({ "error": error }).to_string();
    Some(CloudError::from_response(status, &HeaderMap::new(), &body))
}

impl OpenRouterClient {
    /// A streamed chat completion of the client's body on the route's model: every chunk goes
    /// to `on_chunk` as it arrives; the answer is the whole completion. A failure before the
    /// first chunk is classified as for a whole answer (no chunk was handed on); one after it
    /// ends the stream with that error.
    pub async fn chat_stream(
        &self,
        route: &CloudRoute,
        body: Value,
        on_chunk: impl FnMut(Value) + Send,
    ) -> Result<Chatted, CloudError> {
        if !matches!(route, CloudRoute::Chat { .. }) {
            return Err(CloudError::NoEndpoints {
                message: format!("route {} cannot serve chat", route.key()),
                pin_unmatched: false,
            });
        }
        let mut body = chat_body(route, body)?;
        if let Some(o) = body.as_object_mut() {
            o.insert("stream".into(), Value::Bool(true));
        }
        let response = self
            .post_streaming("/chat/completions", &body, &route.key())
            .await?;
        let response = read_events(response, |line| self.redact_key(line), on_chunk).await?;
        let (tokens, cost_usd) = (parse_tokens(&response), parse_cost(&response));
        Ok(Chatted {
            response,
            tokens,
            cost_usd,
        })
    }
}

/// Reads a chat stream's events to the end (`[DONE]`, or a close after a finish reason):
/// each chunk to `on_chunk` as it arrives (lines pass `redact` first), the completion
/// assembled from them. An error chunk, a cut stream or one over 32 MiB ends it with that
/// error. OpenRouter's stream and the fronted model servers' (vLLM, Ollama, llama.cpp) are
/// read by this one loop.
pub async fn read_events(
    mut response: reqwest::Response,
    redact: impl Fn(String) -> String,
    mut on_chunk: impl FnMut(Value) + Send,
) -> Result<Value, CloudError> {
    let (mut lines, mut whole, mut read) = (Lines::default(), Assembled::default(), 0usize);
    loop {
        let Some(bytes) = response
            .chunk()
            .await
            .map_err(super::openrouter::transport)?
        else {
            // The upstream closed without `[DONE]`: what came is the answer if it ended
            // with a finish reason; else the stream was cut.
            if whole.finish_reason.is_some() {
                break;
            }
            return Err(CloudError::BadResponse {
                message: "the stream ended before the completion finished".into(),
            });
        };
        read = read.saturating_add(bytes.len());
        if read > MAX_STREAM_BYTES {
            return Err(CloudError::BadResponse {
                message: format!("the stream is longer than {MAX_STREAM_BYTES} bytes"),
            });
        }
        let mut done = false;
        for line in lines.feed(&bytes)? {
            match parse_line(&redact(line))? {
                SseLine::Chunk(chunk) => {
                    if let Some(e) = chunk_error(&chunk) {
                        return Err(e);
                    }
                    whole.add(&chunk);
                    on_chunk(chunk);
                }
                SseLine::Done => done = true,
                SseLine::Nothing => {}
            }
        }
        if done {
            break;
        }
    }
    Ok(whole.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_reads_and_chunks_add_up_to_the_completion() {
        let stream = concat!(
            ": OPENROUTER PROCESSING\n\n",
            "data: {\"id\":\"gen-1\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hel\"}}]}\n\n",
            "data: {\"id\":\"gen-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\",\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\r\n\r\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\":1}\"}}]},\"finish_reason\":\"stop\"}],\"usage\":{\"total_tokens\":9}}\n\n",
            "data: [DONE]\n\n"
        );
        let mut lines = Lines::default();
        let (mut chunks, mut done, mut whole) = (0, false, Assembled::default());
        // Bytes arrive in pieces that cut lines (and a UTF-8 free split) anywhere.
        for piece in stream.as_bytes().chunks(7) {
            for line in lines.feed(piece).unwrap() {
                match parse_line(&line).unwrap() {
                    SseLine::Chunk(c) => {
                        chunks += 1;
                        whole.add(&c);
                    }
                    SseLine::Done => done = true,
                    SseLine::Nothing => {}
                }
            }
        }
        assert!(done);
        assert_eq!(chunks, 3);
        let c = whole.finish();
        assert_eq!(c["id"], "gen-1");
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["choices"][0]["message"]["content"], "hello");
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            c["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert!(
            c["choices"][0]["message"]["tool_calls"][0]
                .get("index")
                .is_none()
        );
        assert_eq!(c["usage"]["total_tokens"], 9);
        assert!(parse_line("data: [1,2]").is_err());
    }

    #[test]
    fn an_error_chunk_is_classified_like_an_error_answer() {
        let e = chunk_error(
            &json!({"error": {"code": 429, "message": "Rate limit exceeded"}, "choices": []}),
        )
        .unwrap();
        assert_eq!(e.http_status(), 429);
        assert!(chunk_error(&json!({"choices": []})).is_none());
    }
}
