//! `POST /v1/chat/completions`: OpenAI's chat shape, routed by role (`model` names
//! `code-assistant` or `rlm-sandbox`). A chat is one item on its role's queue; the provider
//! that takes it (a cloud route) names the upstream model, so the client's `model` is a role,
//! never an upstream id.
//!
//! `stream: true` answers as server-sent events in OpenAI's chunk format, relayed chunk by
//! chunk as the upstream sends them (`chunk` frames through the fleet); a stream cut short
//! ends with an `error` event. A provider that cannot stream answers whole, and the hub cuts
//! that completion into chunks.
//!
//! `Idempotency-Key` (optional, per project): a retry with the same key and body gets the
//! first answer again (`Idempotent-Replayed: true`) without a second upstream call, across a
//! takeover too ([`crate::hub::replies`]); the same key with another body is 422, a retry
//! while the first runs is 409, and a project whose every remembered key is still under way
//! gets 429 for a new one. A keyed chat that is not streamed finishes even when its client
//! leaves, so the retry finds its answer; a streamed one ends with its client (while its
//! lease is live the call is stopped; once the lease was lost, the agent's call runs on and
//! the key waits for its outcome).

use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use tracing::Instrument;

use super::client_api::{client_auth, role_for};
use super::error::ApiError;
use crate::hub::Hub;
use crate::hub::core::ItemOutput;
use crate::hub::queue::Shape;
use crate::hub::replies::{self, KeyHold, KeyRefusal, Keyed, ReplyId};
use crate::protocol::WorkClass;
use crate::roles::Op;

/// Messages one chat may carry.
const MAX_MESSAGES: usize = 4096;

/// OpenAI's chat request; fields other than these are passed to the upstream as they are
/// (`provider` and `models` are removed: routing is the hub's).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // a schema only: the body is read as JSON
#[schema(example = json!({"model": "code-assistant", "messages": [{"role": "user", "content": "Say hello"}]}))]
pub struct ChatRequest {
    /// A chat role: `code-assistant` or `rlm-sandbox`.
    model: String,
    /// OpenAI's messages (at most 4096).
    #[schema(value_type = Vec<Object>)]
    messages: Vec<Value>,
    /// Answer as server-sent events.
    stream: Option<bool>,
}

/// One server-sent event of a streamed chat: `data` is a chunk's JSON (the last with the
/// provenance), then `[DONE]`; an `error` event ends a stream that was cut.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // a schema only
pub struct ChatEvent {
    data: String,
    /// `error` for the event that ends a cut stream.
    event: Option<String>,
}

/// Runs a chat role; `stream: true` answers as server-sent events in OpenAI's chunk format,
/// ending with `data: [DONE]` (or an `error` event when the stream was cut).
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatRequest,
    params(("Idempotency-Key" = Option<String>, Header,
        description = "1 to 255 visible ASCII characters (a UUID): a retry with the same key and \
body gets the first answer again (`Idempotent-Replayed: true`) without a second upstream call; \
the same key with another body is 422, a retry while the first runs is 409, a new key of a \
project whose every remembered key is still under way is 429")),
    responses(
        (status = 200, description = "A chat completion, or its chunks as server-sent events",
            content((Object = "application/json"), (ChatEvent = "text/event-stream"))),
        super::openapi::ClientErrors),
    security((), ("client_key" = [])))]
pub async fn completions(
    State(hub): State<Hub>,
    headers: HeaderMap,
    request: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let client = client_auth(&hub, &headers)?;
    client.unpinned("chat")?;
    let caller = client.caller(WorkClass::Interactive);
    let key = idempotency_key(&headers)?;
    let Json(body) = request.map_err(|e| {
        let shown = crate::secret::redact(&e.body_text());
        ApiError::bad_request(format!("invalid request body: {shown}"))
    })?;
    let Value::Object(mut body) = body else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    let role = match body.remove("model") {
        Some(Value::String(name)) => role_for(&name, Op::Chat)?,
        Some(_) => {
            return Err(ApiError::bad_request(
                "model must be a string (a chat role)",
            ));
        }
        None => {
            return Err(ApiError::bad_request(
                "model is missing: name a chat role (code-assistant or rlm-sandbox)",
            ));
        }
    };
    let stream = match body.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => return Err(ApiError::bad_request("stream must be true or false")),
    };
    check_messages(&body)?;
    // Routing is the hub's: a client cannot steer the upstream.
    body.remove("provider");
    body.remove("models");
    let hold = match key {
        None => None,
        Some(key) => {
            let id = ReplyId {
                project: caller.project.clone(),
                key: replies::key_id(&key),
            };
            let digest = replies::digest(role, &body);
            let wait = hub.core().settings.timings(role).request_timeout;
            match hub.claim_key(id, digest, wait).await {
                Ok(Keyed::Replay(completion)) => return Ok(replay(&completion, stream)),
                Ok(Keyed::Run(hold)) => Some(hold),
                Err(refusal) => return Err(key_refused(refusal)),
            }
        }
    };
    let idempotency = hold.as_ref().map(KeyHold::tag);
    if !stream {
        let shape = Shape::Chat {
            body: Value::Object(body),
            idempotency,
        };
        let run = {
            let hub = hub.clone();
            async move {
                let done = hub.run(caller, role, shape, vec![String::new()]).await?;
                completion_of(done)
            }
        };
        let completion = match hold {
            None => run.await?,
            // A keyed chat finishes even when its client leaves: its answer waits for the
            // retry.
            Some(hold) => {
                let task = tokio::spawn(
                    async move {
                        let completion = run.await?;
                        hold.answered(&Value::Object(completion.clone()));
                        Ok::<_, ApiError>(completion)
                    }
                    .in_current_span(),
                );
                task.await.map_err(|_| {
                    ApiError::new(
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        "internal",
                        "the chat's task ended unexpectedly",
                    )
                })??
            }
        };
        return Ok(Json(Value::Object(completion)).into_response());
    }
    // The provider streams what the upstream sends as it comes.
    body.insert("stream".into(), Value::Bool(true));
    let mut streaming = hub
        .run_streaming(
            caller,
            role,
            Shape::Chat {
                body: Value::Object(body),
                idempotency,
            },
            vec![String::new()],
        )
        .await?;
    let mut hold = hold;
    // The first chunk starts the event stream; an outcome before any chunk is answered whole:
    // a failure with its status, a completion (a provider that does not stream) cut into
    // chunks.
    let first = tokio::select! {
        biased;
        Some(first) = streaming.chunks.recv() => first,
        outcome = &mut streaming.outcome => {
            let completion = completion_of(outcome?)?;
            if let Some(hold) = hold.take() {
                hold.answered(&Value::Object(completion.clone()));
            }
            let events: Vec<Result<Event, Infallible>> = chunks(&completion)
                .into_iter()
                .map(|c| Ok(Event::default().data(c.to_string())))
                .chain(std::iter::once(Ok(Event::default().data("[DONE]"))))
                .collect();
            return Ok(Sse::new(futures_util::stream::iter(events)).into_response());
        }
    };
    let state = Relay {
        streaming,
        hold,
        pending: std::collections::VecDeque::from([Event::default().data(first.to_string())]),
        ended: false,
    };
    // The events are sent after this handler (and its span) returned: they keep the span, so
    // the stream's log lines name the request too.
    let span = tracing::Span::current();
    let events = futures_util::stream::unfold((state, span), |(mut state, span)| async move {
        let event = state.next().instrument(span.clone()).await?;
        Some((Ok::<_, Infallible>(event), (state, span)))
    });
    Ok(super::event_stream::event_stream(
        events,
        super::event_stream::KEEP_ALIVE,
    ))
}

/// A streamed chat relayed as server-sent events: the provider's chunks as they arrive, then
/// a last chunk with the provenance and `[DONE]`, or an `error` event when the stream was cut
/// (a lost agent, an upstream error, the request timeout): never a silent truncation. Dropped
/// (the client went away), it cancels the request.
struct Relay {
    streaming: crate::hub::Streaming,
    /// A keyed chat's hold on its key: the whole completion is kept for a retry.
    hold: Option<KeyHold>,
    pending: std::collections::VecDeque<Event>,
    ended: bool,
}

impl Relay {
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if self.ended {
                return None;
            }
            tokio::select! {
                biased;
                Some(chunk) = self.streaming.chunks.recv() => {
                    return Some(Event::default().data(chunk.to_string()));
                }
                outcome = &mut self.streaming.outcome => {
                    self.ended = true;
                    // Chunks sent before the outcome come first.
                    while let Ok(chunk) = self.streaming.chunks.try_recv() {
                        self.pending.push_back(Event::default().data(chunk.to_string()));
                    }
                    match outcome {
                        Ok(done) => {
                            let provenance = done
                                .items
                                .first()
                                .and_then(|s| serde_json::to_value(&*s.provider).ok())
                                .unwrap_or(Value::Null);
                            if let Some(hold) = self.hold.take()
                                && let Ok(completion) = completion_of(done)
                            {
                                hold.answered(&Value::Object(completion));
                            }
                            let last = json!({"object": "chat.completion.chunk", "choices": [],
                                              "provenance": provenance});
                            self.pending.push_back(Event::default().data(last.to_string()));
                            self.pending.push_back(Event::default().data("[DONE]"));
                        }
                        Err(e) => {
                            let e = ApiError::from(e);
                            tracing::warn!(code = e.code, error = %e.message, "a streamed chat ended with an error");
                            self.pending.push_back(Event::default().data(e.body().to_string()));
                        }
                    }
                }
            }
        }
    }
}

/// The completion of a finished chat, with its provenance.
fn completion_of(done: crate::hub::core::Completed) -> Result<Map<String, Value>, ApiError> {
    let Some(served) = done.items.into_iter().next() else {
        return Err(ApiError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "bad_output",
            "no completion came back",
        ));
    };
    let ItemOutput::Chat(Value::Object(mut completion)) = served.output else {
        return Err(ApiError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "bad_output",
            "a provider returned something other than a chat completion",
        ));
    };
    completion.insert(
        "provenance".into(),
        serde_json::to_value(&*served.provider).unwrap_or(Value::Null),
    );
    Ok(completion)
}

/// The client's `Idempotency-Key`, checked (the error never repeats it).
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::bad_request(
            "send one Idempotency-Key header, not several",
        ));
    }
    let key = value.to_str().unwrap_or("");
    replies::check_key(key).map_err(ApiError::bad_request)?;
    Ok(Some(key.to_string()))
}

/// A keyed request that may not run, and how to get what the client wanted.
fn key_refused(refusal: KeyRefusal) -> ApiError {
    use axum::http::StatusCode;
    match refusal {
        KeyRefusal::Reused => {
            let mut e = ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                "this Idempotency-Key was sent before with another request body; send a new key \
                 for a new request",
            );
            e.final_answer = true;
            e
        }
        KeyRefusal::InUse => {
            let mut e = ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_in_use",
                "a request with this Idempotency-Key is still running; send it again shortly to \
                 get its answer",
            );
            e.retry_after_s = Some(1);
            e
        }
        KeyRefusal::Full => {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "idempotency_keys_full",
                "this project holds as many Idempotency-Keys as the hub keeps for it, each for a \
                 chat still under way; send it again shortly (or without a key)",
            );
            e.retry_after_s = Some(1);
            e
        }
        KeyRefusal::Gone => {
            let mut e = ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_answered",
                format!(
                    "this Idempotency-Key was answered and its answer is no longer held (answers \
                     are kept {} minutes); send the request with a new key to run it again (it \
                     is paid again)",
                    replies::KEEP_ANSWER.as_secs() / 60
                ),
            );
            e.final_answer = true;
            e
        }
    }
}

/// The answer a keyed request got before, given again: whole, or as the chunks of a stream.
fn replay(completion: &Value, stream: bool) -> Response {
    let mut response = match (stream, completion.as_object()) {
        (true, Some(c)) => {
            let events: Vec<Result<Event, Infallible>> = chunks(c)
                .into_iter()
                .map(|c| Ok(Event::default().data(c.to_string())))
                .chain(std::iter::once(Ok(Event::default().data("[DONE]"))))
                .collect();
            Sse::new(futures_util::stream::iter(events)).into_response()
        }
        _ => Json(completion.clone()).into_response(),
    };
    response.headers_mut().insert(
        "idempotent-replayed",
        axum::http::HeaderValue::from_static("true"),
    );
    response
}

fn check_messages(body: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(ApiError::bad_request("messages must be a non-empty array"));
    };
    if messages.is_empty() || messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad_request(format!(
            "messages has {} entries; 1..={MAX_MESSAGES} are accepted",
            messages.len()
        )));
    }
    for (i, m) in messages.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::bad_request(format!("messages[{i}] has no role")));
        }
    }
    Ok(())
}

/// OpenAI `chat.completion.chunk` objects for a finished completion: the role, the content,
/// then the finish reason with the usage.
fn chunks(completion: &Map<String, Value>) -> Vec<Value> {
    let id = completion.get("id").cloned().unwrap_or(Value::Null);
    let model = completion.get("model").cloned().unwrap_or(Value::Null);
    let created = completion.get("created").cloned().unwrap_or(json!(0));
    let choice = completion
        .get("choices")
        .and_then(|c| c.get(0))
        .cloned()
        .unwrap_or(Value::Null);
    let message = choice.get("message").cloned().unwrap_or(Value::Null);
    let chunk = |delta: Value, finish: Value, extra: Option<(&str, Value)>| {
        let mut c = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        });
        if let (Some((k, v)), Some(obj)) = (extra, c.as_object_mut()) {
            obj.insert(k.to_string(), v);
        }
        c
    };
    let mut delta = Map::new();
    delta.insert(
        "role".into(),
        message.get("role").cloned().unwrap_or(json!("assistant")),
    );
    if let Some(content) = message.get("content") {
        delta.insert("content".into(), content.clone());
    }
    if let Some(calls) = message.get("tool_calls") {
        delta.insert("tool_calls".into(), calls.clone());
    }
    let finish = choice
        .get("finish_reason")
        .cloned()
        .unwrap_or(json!("stop"));
    let mut last = vec![(
        "usage",
        completion.get("usage").cloned().unwrap_or(Value::Null),
    )];
    if let Some(p) = completion.get("provenance") {
        last.push(("provenance", p.clone()));
    }
    let mut end = chunk(json!({}), finish, None);
    if let Some(obj) = end.as_object_mut() {
        for (k, v) in last {
            obj.insert(k.to_string(), v);
        }
    }
    vec![chunk(Value::Object(delta), Value::Null, None), end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_becomes_a_role_content_chunk_and_a_final_one() {
        let c = json!({"id":"gen-1","created":5,"model":"m","choices":[{"index":0,
            "message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],
            "usage":{"total_tokens":7}});
        let out = chunks(c.as_object().unwrap());
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["choices"][0]["delta"]["content"], "hello there");
        assert_eq!(out[0]["object"], "chat.completion.chunk");
        assert_eq!(out[1]["choices"][0]["finish_reason"], "stop");
        assert_eq!(out[1]["usage"]["total_tokens"], 7);
    }
}
