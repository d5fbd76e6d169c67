//! One agent's WebSocket on the hub: authentication happens before the upgrade (in
//! [`crate::http`]); here, `hello` first, then frames into the [`super::core::Core`], and
//! the socket's end hands back whatever it held.
//!
//! Bad input never kills the socket where the stream is still sound: a malformed frame, an
//! unknown type, a frame before `hello`, an oversized control frame each get an `error`
//! frame naming the problem. A wrong protocol version, or another live process claiming the
//! agent's id, closes it (nothing useful can follow).
//!
//! Liveness: the writer pings every heartbeat once the first frame is out and bounds every
//! write ([`crate::protocol::write_timeout`]); the reader ends the socket after three silent
//! heartbeats. Either way the session is released and its leases requeued within seconds.

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes};
use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;

use std::time::Duration;

use axum::extract::ws::WebSocket as Socket;
use futures_util::stream::SplitSink;

use super::Hub;
use super::registry::Outgoing;
use crate::protocol::codec::{self, Unreadable};
use crate::protocol::{self, AgentFrame, FrameError, HubFrame};

/// Serves one authenticated agent socket until it closes.
pub async fn serve_agent(socket: Socket, hub: Hub) {
    let (max_frame, heartbeat) = {
        let core = hub.core();
        (
            core.settings.max_frame_bytes,
            core.settings.heartbeat_interval,
        )
    };
    // Three heartbeats of silence end the socket, either way: nothing read (the agent
    // heartbeats), or a write that does not complete (a stuck peer, a black-holed route).
    let silence = heartbeat * 3;
    let (sink, mut stream) = socket.split();
    let (tx, rx) = mpsc::unbounded_channel::<Outgoing>();
    let mut writer = tokio::spawn(write_frames(sink, rx, heartbeat));
    let mut session: Option<(String, u64)> = None;
    let error = |message: String| {
        Outgoing::Frame(protocol::encode(&HubFrame::Error {
            message,
            code: None,
        }))
    };
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
                if let Some((agent, sid)) = &session {
                    fail_unreadable(&hub, agent, *sid, &e, text.as_str());
                }
                continue;
            }
        };
        let Some((agent, sid)) = &session else {
            let AgentFrame::Hello(hello) = frame else {
                let _ = tx.send(error("the first frame must be hello".into()));
                continue;
            };
            let agent_id = hello.agent_id.clone();
            match hub.core().hello(hello, tx.clone()) {
                Ok(sid) => {
                    tracing::info!(agent = %agent_id, session = sid, "agent connected");
                    session = Some((agent_id, sid));
                }
                Err(refused) => {
                    let frame = HubFrame::Error {
                        message: refused.message.clone(),
                        code: refused.code,
                    };
                    let _ = tx.send(Outgoing::Frame(protocol::encode(&frame)));
                    // A refusal with a code is final for this socket: nothing useful follows.
                    if refused.code.is_some() {
                        let _ = tx.send(Outgoing::Close(refused.message));
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
                AgentFrame::Chunk(chunk) => core.chunk(agent, *sid, chunk),
                AgentFrame::Done(done) => core.done(agent, *sid, done),
                AgentFrame::Failed(failed) => core.failed(agent, *sid, failed),
                AgentFrame::ConfigAck(ack) => core.config_ack(agent, *sid, ack),
                AgentFrame::ProbeResult(result) => core.probe_result(agent, *sid, result),
                AgentFrame::Limits(limits) => core.account_limits(agent, *sid, limits),
                AgentFrame::Kept(kept) => core.kept(agent, *sid, kept),
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

/// A refused `done` or `probe_result` still names what it answers: that lease goes back (a
/// transient failure of its provider) and that probe fails, at once and with the reason.
fn fail_unreadable(hub: &Hub, agent: &str, session: u64, e: &FrameError, text: &str) {
    let kind = match e {
        FrameError::Invalid { kind, .. } | FrameError::TooLarge { kind, .. } => kind,
        _ => return,
    };
    let why = format!("the agent's answer could not be read ({e})");
    let result = match codec::salvage(kind, text) {
        Some(Unreadable::Done { lease }) => hub.core().failed(
            agent,
            session,
            protocol::Failed {
                lease,
                class: protocol::FailureClass::Transient,
                retry_after_ms: None,
                limit: None,
                refusal: None,
                defect: None,
                message: why,
            },
        ),
        Some(Unreadable::ProbeResult { probe, provider }) => hub.core().probe_result(
            agent,
            session,
            protocol::ProbeResult {
                probe,
                provider,
                vectors: None,
                scores: None,
                error: Some(why),
                defect: None,
            },
        ),
        None => Ok(()),
    };
    if let Err(message) = result {
        tracing::debug!(agent, error = %message, "an unreadable answer named nothing live");
    }
}

/// The socket's writer: frames from the core, a ping every heartbeat, each write bounded by
/// [`protocol::write_timeout`]. It ends (and so does the session) on a close it was asked to
/// send, on a failed write, or on a write that did not complete in time: a stuck peer never
/// holds it.
async fn write_frames(
    mut sink: SplitSink<Socket, Message>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    heartbeat: Duration,
) {
    let mut ping = tokio::time::interval(heartbeat);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.tick().await;
    // Pings start after the first frame (welcome, or the refusal of hello): an agent waits
    // for welcome as the first message.
    let mut greeted = false;
    loop {
        let (message, closing, bytes) = tokio::select! {
            out = rx.recv() => match out {
                Some(Outgoing::Frame(text)) => {
                    let bytes = text.len();
                    (Message::Text(text.into()), false, bytes)
                }
                Some(Outgoing::Close(reason)) => {
                    let close = CloseFrame { code: 4000, reason: Utf8Bytes::from(reason) };
                    (Message::Close(Some(close)), true, 0)
                }
                None => break,
            },
            _ = ping.tick(), if greeted => (Message::Ping(Default::default()), false, 0),
        };
        if !greeted && bytes > 0 {
            greeted = true;
            ping.reset();
        }
        let write_timeout = protocol::write_timeout(heartbeat, bytes);
        match tokio::time::timeout(write_timeout, sink.send(message)).await {
            Ok(Ok(())) if !closing => {}
            Ok(Ok(())) => break,
            Ok(Err(_)) => break,
            Err(_) => {
                tracing::warn!(
                    timeout_s = write_timeout.as_secs_f64(),
                    "a write to an agent did not complete in time; closing its socket"
                );
                return;
            }
        }
    }
    let _ = tokio::time::timeout(heartbeat * 3, sink.close()).await;
}
