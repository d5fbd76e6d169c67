//! The OpenRouter chat proxy a master calls on this agent (§3.3):
//! `POST /api/v1/chat/completions` and `GET /api/v1/models`, on the key and the sandbox model
//! (`allowedModels["rlm-sandbox"]`) of the calling master's slot.
//!
//! Whose key is spent is the caller's token's: a master's token spends its own slot's key
//! whatever header it carries, and `X-FantomMCP-Master` (else `X-SoundSuite-Master`, byte for
//! byte a slot's `serverUrl`) only selects among the slots that token owns (another one: 403).
//! The operator's token may name any slot. With no token configured at all, nothing here
//! answers ([`super::access`]). The caller's `model` is replaced by the slot's: the sidecar
//! decides which model answers; `stream: true` relays OpenRouter's chunks as server-sent
//! events as they arrive. Status codes as Fantom expects them: 400 (bad JSON), 409 (no header while several of the caller's slots hold keys), 404 (unknown
//! master or nothing pushed), 503 (no sandbox model). The project and tools-token headers are
//! neither used nor logged.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{Value, json};

use super::Refusal;
use super::access::{Caller, NO_TOKEN};
use crate::fantom::commands::{SlotRoute, SlotRouteError, metered, slot_route};
use crate::fantom::sidecar::Sidecar;
use crate::roles::Role;

/// The headers that name the calling master, in the order they are read.
pub const MASTER_HEADERS: [&str; 2] = ["x-fantommcp-master", "x-soundsuite-master"];

pub fn router(sidecar: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/api/v1/chat/completions", post(chat))
        .route("/api/v1/models", get(models))
        .with_state(sidecar)
}

/// `{"error":{"message":…}}` with `status`.
fn failure(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        body: json!({"error": {"message": message.into()}}),
    }
}

/// The slot whose key this call spends: the one the header names, if the token owns it; else
/// the one slot of the token's that holds a key.
fn caller(sidecar: &Sidecar, who: &Caller, headers: &HeaderMap) -> Result<String, Refusal> {
    if *who == Caller::Nobody {
        return Err(failure(StatusCode::FORBIDDEN, NO_TOKEN));
    }
    let named = MASTER_HEADERS
        .iter()
        .find_map(|h| headers.get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty());
    if let Some(url) = named {
        if !who.owns(url) {
            return Err(failure(
                StatusCode::FORBIDDEN,
                "this token is another master's: the header may name only a slot the token owns (the operator's http_token may name any)",
            ));
        }
        return Ok(url.to_string());
    }
    let keyed: Vec<String> = sidecar
        .slots
        .keyed()
        .into_iter()
        .filter(|url| who.owns(url))
        .collect();
    match keyed.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(failure(
            StatusCode::NOT_FOUND,
            "no config pushed: no master has pushed an OpenRouter key to this agent",
        )),
        _ => Err(failure(
            StatusCode::CONFLICT,
            "several masters pushed keys to this agent: name yours in X-FantomMCP-Master",
        )),
    }
}

/// The caller's sandbox route, or the status that says why there is none.
fn sandbox(sidecar: &Sidecar, master: &str) -> Result<SlotRoute, Refusal> {
    slot_route(&sidecar.slots, master, Role::RlmSandbox, None, None).map_err(|e| match e {
        SlotRouteError::NoSlot(_) | SlotRouteError::NoKey => failure(
            StatusCode::NOT_FOUND,
            format!("no config pushed for master {master}"),
        ),
        SlotRouteError::NoModel(_) => failure(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no model configured under rlm-sandbox for master {master}"),
        ),
        other => failure(StatusCode::SERVICE_UNAVAILABLE, other.to_string()),
    })
}

async fn chat(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(body @ Value::Object(_)) => body,
        Ok(_) => {
            return failure(StatusCode::BAD_REQUEST, "the body must be a JSON object")
                .into_response();
        }
        Err(e) => {
            let shown = crate::secret::redact(&e.to_string());
            return failure(
                StatusCode::BAD_REQUEST,
                format!("invalid JSON body: {shown}"),
            )
            .into_response();
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return failure(StatusCode::BAD_REQUEST, "stream must be true or false")
                .into_response();
        }
    };
    let master = match caller(&sidecar, &who, &headers) {
        Ok(master) => master,
        Err(refusal) => return refusal.into_response(),
    };
    let SlotRoute { client, route } = match sandbox(&sidecar, &master) {
        Ok(route) => route,
        Err(refusal) => return refusal.into_response(),
    };
    let key = Role::RlmSandbox.as_str();
    if stream {
        return stream_chat(sidecar, master, SlotRoute { client, route }, body).await;
    }
    match metered(&sidecar.slots, &master, key, client.chat(&route, body)).await {
        Ok(done) => {
            tracing::info!(master = %master, model = %route.model(), tokens = done.tokens, "chat proxied");
            Json(done.response).into_response()
        }
        Err(e) => {
            tracing::warn!(master = %master, error = %e, "chat proxy call failed");
            upstream_failure(&e)
        }
    }
}

/// A streamed chat: OpenRouter's chunks relayed as server-sent events as they arrive. A
/// failure before the first chunk is answered with its status, as a whole answer would be;
/// one after it ends the stream with an `error` event. The client going away drops the call.
async fn stream_chat(
    sidecar: Arc<Sidecar>,
    master: String,
    SlotRoute { client, route }: SlotRoute,
    body: Value,
) -> Response {
    let (tx, mut chunks) = tokio::sync::mpsc::unbounded_channel::<Value>();
    let call: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> = {
        let (sidecar, master) = (sidecar.clone(), master.clone());
        Box::pin(async move {
            let forward = move |chunk| {
                let _ = tx.send(chunk);
            };
            let key = Role::RlmSandbox.as_str();
            let done = metered(
                &sidecar.slots,
                &master,
                key,
                client.chat_stream(&route, body, forward),
            )
            .await;
            (done, route.model().to_string())
        })
    };
    let mut call = call;
    let first = tokio::select! {
        biased;
        Some(first) = chunks.recv() => Some(first),
        (done, model) = &mut call => {
            // The call can finish in one poll when the whole stream was already there: its
            // chunks wait in the channel.
            let mut pending: std::collections::VecDeque<Event> = std::collections::VecDeque::new();
            while let Ok(chunk) = chunks.try_recv() {
                pending.push_back(Event::default().data(chunk.to_string()));
            }
            match done {
                Err(e) if pending.is_empty() => {
                    tracing::warn!(master = %master, error = %e, "chat proxy call failed");
                    return upstream_failure(&e);
                }
                Err(e) => {
                    tracing::warn!(master = %master, error = %e, "a streamed chat ended with an error");
                    pending.push_back(stream_error(&e));
                }
                Ok(done) => {
                    tracing::info!(master = %master, model = %model, tokens = done.tokens, "chat proxied (stream)");
                    pending.push_back(Event::default().data("[DONE]"));
                }
            }
            let events = pending.into_iter().map(Ok::<_, std::convert::Infallible>);
            return Sse::new(futures_util::stream::iter(events)).into_response();
        }
    };
    let Some(first) = first else {
        return failure(StatusCode::BAD_GATEWAY, "the stream ended").into_response();
    };
    let state = (
        Some(call),
        chunks,
        std::collections::VecDeque::from([Event::default().data(first.to_string())]),
        master,
    );
    let events = futures_util::stream::unfold(
        state,
        |(mut call, mut chunks, mut pending, master)| async move {
            loop {
                if let Some(event) = pending.pop_front() {
                    return Some((
                        Ok::<_, std::convert::Infallible>(event),
                        (call, chunks, pending, master),
                    ));
                }
                let running = call.as_mut()?;
                tokio::select! {
                    biased;
                    Some(chunk) = chunks.recv() => pending.push_back(Event::default().data(chunk.to_string())),
                    (done, model) = running => {
                        call = None;
                        while let Ok(chunk) = chunks.try_recv() {
                            pending.push_back(Event::default().data(chunk.to_string()));
                        }
                        match done {
                            Ok(done) => {
                                tracing::info!(master = %master, model = %model, tokens = done.tokens, "chat proxied (stream)");
                                pending.push_back(Event::default().data("[DONE]"));
                            }
                            Err(e) => {
                                tracing::warn!(master = %master, error = %e, "a streamed chat ended with an error");
                                pending.push_back(stream_error(&e));
                            }
                        }
                    }
                }
            }
        },
    );
    crate::http::event_stream::event_stream(events, crate::http::event_stream::KEEP_ALIVE)
}

/// An upstream failure as Fantom's envelope with its status; OpenRouter refusing the key is
/// not the master's credentials failing here (502, not 401/403).
fn upstream_failure(e: &crate::cloud::CloudError) -> Response {
    let status = match e.http_status() {
        401 | 403 => StatusCode::BAD_GATEWAY,
        code => StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY),
    };
    failure(status, e.to_string()).into_response()
}

/// The `error` event that ends a stream cut short (Fantom's envelope, with the status).
fn stream_error(e: &crate::cloud::CloudError) -> Event {
    let body = json!({"error": {"message": e.to_string(), "code": e.http_status()}});
    Event::default().data(body.to_string())
}

async fn models(
    State(sidecar): State<Arc<Sidecar>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
) -> Response {
    let master = match caller(&sidecar, &who, &headers) {
        Ok(master) => master,
        Err(refusal) => return refusal.into_response(),
    };
    match sandbox(&sidecar, &master) {
        Ok(SlotRoute { route, .. }) => Json(json!({
            "object": "list",
            "data": [{"id": route.model(), "object": "model", "owned_by": "openrouter"}],
        }))
        .into_response(),
        Err(refusal) => refusal.into_response(),
    }
}
