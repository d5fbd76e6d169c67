//! A streamed chat completion (`stream: true`): OpenRouter's server-sent events read as they
//! arrive, each chunk handed on at once, and the whole completion assembled from them (the
//! usage, the finish reason, the content and tool calls) for accounting and non-streaming
//! callers.
//!
//! The wire ([`super::sse`] decodes it): `data: {chunk}` events, `: OPENROUTER PROCESSING`
//! comments while the upstream thinks, `data: [DONE]` at the end. An error after the stream
//! began comes as a chunk with an `error` object (and `finish_reason: "error"`), an `error`
//! event, or llama.cpp's `error:` line; it ends the call with that error. A stream silent for
//! longer than its idle limit ends the call as a transport failure.

use std::time::Duration;

use reqwest::header::HeaderMap;
use serde_json::{Map, Value, json};

use super::error::CloudError;
use super::openrouter::{Chatted, OpenRouterClient};
use super::route::CloudRoute;
use super::sse::{SseDecoder, SseEvent};
use super::wire::{chat_body, parse_cost, parse_tokens};

/// The most bytes one streamed completion may carry (its chunks together).
const MAX_STREAM_BYTES: usize = 32 << 20;

/// How long a cloud stream may stay silent: OpenRouter sends `: OPENROUTER PROCESSING`
/// comments every few seconds while the upstream thinks, so a minute without a byte is a
/// stalled upstream, noticed long before the call's own timeout.
pub const CLOUD_STREAM_IDLE: Duration = Duration::from_secs(60);

/// What one event of the stream says.
#[derive(Debug, PartialEq)]
enum StreamEvent {
    /// A chunk object.
    Chunk(Value),
    /// `data: [DONE]`.
    Done,
    /// An event of another name (`ping`, …): not part of the completion.
    Other,
}

/// Reads one event: a chunk, `[DONE]`, or the error it reports (an `error` event, llama.cpp's
/// `error:` line, or a chunk with an `error` object).
fn read_event(event: &SseEvent) -> Result<StreamEvent, CloudError> {
    if let Some(name) = event.name.as_deref()
        && !matches!(name, "error" | "message")
    {
        return Ok(StreamEvent::Other);
    }
    if event.data.trim() == "[DONE]" {
        return Ok(StreamEvent::Done);
    }
    let value = serde_json::from_str::<Value>(&event.data);
    if event.name.as_deref() == Some("error") {
        let error = match value {
            Ok(Value::Object(mut o)) => o.remove("error").unwrap_or(Value::Object(o)),
            _ => json!({"message": crate::secret::redact(&event.data)}),
        };
        return Err(
            chunk_error(&json!({ "error": error })).unwrap_or(CloudError::BadResponse {
                message: "the stream reported an error".into(),
            }),
        );
    }
    match value {
        Ok(v @ Value::Object(_)) => match chunk_error(&v) {
            Some(e) => Err(e),
            None => Ok(StreamEvent::Chunk(v)),
        },
        _ => Err(CloudError::BadResponse {
            message: "a streamed chunk is not a JSON object".into(),
        }),
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
        let response = read_events(
            response,
            CLOUD_STREAM_IDLE,
            |line| self.redact_key(line),
            on_chunk,
        )
        .await?;
        let (tokens, cost_usd) = (parse_tokens(&response), parse_cost(&response));
        Ok(Chatted {
            response,
            tokens,
            cost_usd,
        })
    }
}

/// Reads a chat stream's events to the end (`[DONE]`, or a close after a finish reason):
/// each chunk to `on_chunk` as it arrives (event data passes `redact` first), the completion
/// assembled from them. An error event, a cut stream, one silent for `idle`, or one over
/// 32 MiB ends it with that error. OpenRouter's stream and the fronted model servers' (vLLM,
/// Ollama, llama.cpp) are read by this one loop.
pub async fn read_events(
    mut response: reqwest::Response,
    idle: Duration,
    redact: impl Fn(String) -> String,
    mut on_chunk: impl FnMut(Value) + Send,
) -> Result<Value, CloudError> {
    let (mut decoder, mut whole, mut read) = (SseDecoder::default(), Assembled::default(), 0usize);
    let too_long = |e: super::sse::EventTooLong| CloudError::BadResponse {
        message: e.to_string(),
    };
    loop {
        let next = tokio::time::timeout(idle, response.chunk())
            .await
            .map_err(|_| CloudError::Transport {
                message: format!(
                    "the stream sent nothing for {} s (a stalled upstream)",
                    idle.as_secs_f64()
                ),
            })?
            .map_err(super::openrouter::transport)?;
        let closed = next.is_none();
        let events = match next {
            Some(bytes) => {
                read = read.saturating_add(bytes.len());
                if read > MAX_STREAM_BYTES {
                    return Err(CloudError::BadResponse {
                        message: format!("the stream is longer than {MAX_STREAM_BYTES} bytes"),
                    });
                }
                decoder.feed(&bytes).map_err(too_long)?
            }
            None => decoder.finish().map_err(too_long)?.into_iter().collect(),
        };
        let mut done = false;
        for mut event in events {
            event.data = redact(event.data);
            match read_event(&event)? {
                StreamEvent::Chunk(chunk) => {
                    whole.add(&chunk);
                    on_chunk(chunk);
                }
                StreamEvent::Done => done = true,
                StreamEvent::Other => {}
            }
        }
        if done {
            break;
        }
        if closed {
            // The upstream closed without `[DONE]`: what came is the answer if it ended
            // with a finish reason; else the stream was cut.
            if whole.finish_reason.is_some() {
                break;
            }
            return Err(CloudError::BadResponse {
                message: "the stream ended before the completion finished".into(),
            });
        }
    }
    Ok(whole.finish())
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt as _;

    use super::*;

    /// The chunks of `stream` fed in pieces of `piece` bytes, as `read_events` reads them.
    fn events_of(stream: &str, piece: usize) -> Result<(usize, bool, Assembled), CloudError> {
        let mut decoder = SseDecoder::default();
        let (mut chunks, mut done, mut whole) = (0, false, Assembled::default());
        let mut events = Vec::new();
        for part in stream.as_bytes().chunks(piece) {
            events.extend(decoder.feed(part).unwrap());
        }
        events.extend(decoder.finish().unwrap());
        for event in events {
            match read_event(&event)? {
                StreamEvent::Chunk(c) => {
                    chunks += 1;
                    whole.add(&c);
                }
                StreamEvent::Done => done = true,
                StreamEvent::Other => {}
            }
        }
        Ok((chunks, done, whole))
    }

    #[test]
    fn events_split_across_reads_and_chunks_add_up_to_the_completion() {
        let stream = concat!(
            ": OPENROUTER PROCESSING\n\n",
            "data: {\"id\":\"gen-1\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hel\"}}]}\n\n",
            "data: {\"id\":\"gen-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\",\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\r\n\r\n",
            // One chunk in two data lines, with bare CR line ends.
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\":1}\"}}]},\r",
            "data: \"finish_reason\":\"stop\"}],\"usage\":{\"total_tokens\":9}}\r\r",
            "data: [DONE]\n\n"
        );
        // Bytes arrive in pieces that cut lines (and line ends) anywhere.
        for piece in [1, 7, 4096] {
            let (chunks, done, whole) = events_of(stream, piece).unwrap();
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
        }
        assert!(events_of("data: [1,2]\n\n", 10).is_err());
        // An event of another name is not a chunk, whatever its data.
        let (chunks, _, _) = events_of("event: ping\ndata: not json\n\n", 4).unwrap();
        assert_eq!(chunks, 0);
    }

    #[test]
    fn llama_cpps_error_lines_and_error_events_end_the_stream_with_their_error() {
        let llama = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\nerror: {\"code\":400,\"message\":\"the request exceeds the available context size\",\"type\":\"exceed_context_size_error\"}\n\n";
        let Err(e) = events_of(llama, 3) else {
            panic!("an error line is an error")
        };
        assert_eq!(e.http_status(), 400);
        assert!(e.to_string().contains("context size"), "{e}");
        let named = "event: error\ndata: {\"error\":{\"code\":503,\"message\":\"overloaded\"}}\n\n";
        let Err(e) = events_of(named, 5) else {
            panic!("an error event is an error")
        };
        assert_eq!(e.http_status(), 503);
    }

    /// An upstream that sends one chunk and then nothing, keeping the connection open: the
    /// stream ends as a transport failure after `idle`, not at the call's timeout.
    #[tokio::test]
    async fn a_stalled_stream_is_noticed_after_its_idle_limit() {
        let first = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n";
        let app = axum::Router::new().route(
            "/stream",
            axum::routing::get(move || async move {
                let stalled = futures_util::stream::iter([Ok::<_, std::io::Error>(
                    axum::body::Bytes::from(first),
                )])
                .chain(futures_util::stream::pending());
                axum::body::Body::from_stream(stalled)
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let response = reqwest::get(format!("http://{addr}/stream")).await.unwrap();
        let mut chunks = 0;
        let e = read_events(response, Duration::from_millis(200), |l| l, |_| chunks += 1)
            .await
            .unwrap_err();
        assert_eq!(chunks, 1, "the chunk before the stall was handed on");
        assert!(matches!(e, CloudError::Transport { .. }), "{e}");
        assert!(e.to_string().contains("sent nothing for 0.2 s"), "{e}");
        server.abort();
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
