//! One agent's WebSocket on the hub: authentication happens before the upgrade (in
//! [`crate::http`]); here, `hello` first, then frames into the [`super::core::Core`], and
//! the socket's end hands back whatever it held.
//!
//! Bad input never kills the socket where the stream is still sound: a malformed frame, an
//! unknown type, a frame before `hello`, an oversized control frame each get an `error`
//! frame naming the problem. A wrong protocol version closes it (nothing useful can follow).

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;

use super::Hub;
use super::registry::Outgoing;
use crate::protocol::{self, AgentFrame, FrameError, HubFrame};

/// Serves one authenticated agent socket until it closes.
pub async fn serve_agent(socket: WebSocket, hub: Hub) {
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
    let mut writer = tokio::spawn(async move {
        while let Some(out) = rx.recv().await {
            let sent = match out {
                Outgoing::Frame(text) => sink.send(Message::Text(text.into())).await,
                Outgoing::Close(reason) => {
                    let close = CloseFrame {
                        code: 4000,
                        reason: Utf8Bytes::from(reason),
                    };
                    let _ = sink.send(Message::Close(Some(close))).await;
                    break;
                }
            };
            if sent.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });

    let (max_frame, silence) = {
        let core = hub.core();
        (
            core.settings.max_frame_bytes,
            core.settings.heartbeat_interval * 3,
        )
    };
    let mut session: Option<(String, u64)> = None;
    let error = |message: String| Outgoing::Frame(protocol::encode(&HubFrame::Error { message }));
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(silence, stream.next()) => next,
            // The writer ends after a close it was asked to send (superseded, refused): this
            // socket is done; stop reading so its session is released now.
            _ = &mut writer => {
                if let Some((agent, sid)) = session {
                    hub.core().disconnect(&agent, sid);
                }
                return;
            }
        };
        let next = match next {
            Ok(next) => next,
            Err(_) => {
                tracing::warn!(agent = ?session.as_ref().map(|s| &s.0), silent_s = silence.as_secs(), "agent socket silent; closing it");
                let _ = tx.send(Outgoing::Close(
                    "no frames for three heartbeat intervals".into(),
                ));
                break;
            }
        };
        let text = match next {
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Binary(_))) => {
                let _ = tx.send(error(FrameError::Binary.to_string()));
                continue;
            }
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_))) | None => break,
            Some(Err(e)) => {
                tracing::info!(agent = ?session.as_ref().map(|s| &s.0), error = %e, "agent socket error");
                break;
            }
        };
        let frame = match protocol::decode_agent(text.as_str(), max_frame) {
            Ok(frame) => frame,
            Err(e) => {
                tracing::debug!(agent = ?session.as_ref().map(|s| &s.0), error = %e, "bad frame from agent");
                let _ = tx.send(error(e.to_string()));
                continue;
            }
        };
        let Some((agent, sid)) = &session else {
            let AgentFrame::Hello(hello) = frame else {
                let _ = tx.send(error("the first frame must be hello".into()));
                continue;
            };
            let agent_id = hello.agent_id.clone();
            let version_ok = hello.protocol_version == protocol::PROTOCOL_VERSION;
            match hub.core().hello(hello, tx.clone()) {
                Ok(sid) => {
                    tracing::info!(agent = %agent_id, session = sid, "agent connected");
                    session = Some((agent_id, sid));
                }
                Err(message) => {
                    let _ = tx.send(error(message.clone()));
                    if !version_ok {
                        let _ = tx.send(Outgoing::Close(message));
                        break;
                    }
                }
            }
            continue;
        };
        let result = {
            let mut core = hub.core();
            match frame {
                AgentFrame::Hello(_) => Err("hello was already said on this socket".to_string()),
                AgentFrame::Providers { providers } => core.set_providers(agent, *sid, providers),
                AgentFrame::Heartbeat(hb) => core.heartbeat(agent, *sid, hb),
                AgentFrame::Pull(pull) => core.pull(agent, *sid, &pull.provider, pull.credits),
                AgentFrame::Done(done) => core.done(agent, *sid, done),
                AgentFrame::Failed(failed) => core.failed(agent, *sid, failed),
                AgentFrame::ConfigAck(ack) => core.config_ack(agent, *sid, ack),
                AgentFrame::ProbeResult(result) => core.probe_result(agent, *sid, result),
                AgentFrame::Limits(limits) => core.account_limits(agent, *sid, limits),
            }
        };
        if let Err(message) = result {
            let _ = tx.send(error(message));
        }
    }
    if let Some((agent, sid)) = session {
        hub.core().disconnect(&agent, sid);
    }
    drop(tx);
    let _ = writer.await;
}
