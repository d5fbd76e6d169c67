//! One relay connection per slot (§2.1): dial `ws://<master>:<wsPort>/sidecar`, `register`,
//! wait for `registered`, heartbeat every 5 s, answer `command`s, merge `config` pushes, follow
//! `master-identity`; on a lost socket, dial again after a backoff (1 s doubling to 30 s, full
//! jitter, reset after a `registered`).
//!
//! One socket per slot, ever: [`run_slot`] is sequential, so a new socket is dialled only after
//! the previous one has ended, and slots are independent tasks (a close on one never touches
//! another, §2.1.11). Reads are never blocked by command work: handlers are spawned and their
//! results go through one channel to the socket's writer. tungstenite answers WebSocket pings
//! as the stream is read. A master frame's text is never logged (`config` carries the key near
//! its head); only decode errors and outcomes are.
//!
//! While the relay cannot be dialled, the same heartbeat goes to the master's HTTP fallback,
//! `POST <serverUrl>/api/admin/gpu/sidecars/heartbeat`, every 5 s (§3.4); the WebSocket is
//! retried all along (the fallback never creates the master's registry entry).

use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::sync::{mpsc, watch};
use tokio::time::{Interval, MissedTickBehavior};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use super::commands;
use super::frames::{
    CommandResult, ConfigFrame, HEARTBEAT_INTERVAL_MS, MasterFrame, Register, SidecarFrame,
    decode_master, decode_master_bytes, encode_sidecar,
};
use super::sidecar::Sidecar;
use super::slots::{ConfigOutcome, Connection, Slots, same_origin};
pub use super::snapshot::RelayContext;
use crate::agent::connection::backoff_delay;
use crate::config::push::PushRefused;

/// The master's HTTP-fallback heartbeat route (§3.4).
pub const HTTP_HEARTBEAT_PATH: &str = "/api/admin/gpu/sidecars/heartbeat";

/// A dial that has not completed in this long is abandoned.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// A socket whose `registered` has not come in this long is dropped.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);

type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How one socket's life ended.
enum SessionEnd {
    /// The socket went away; dial again after a backoff (reset if it had registered).
    Lost {
        why: String,
        registered: bool,
    },
    /// The slot's relay port changed: dial the new one at once.
    Redial,
    /// The slot is gone.
    Removed,
    Shutdown,
}

/// Runs the slot `server_url` (generation `generation`) until shutdown or until the slot is
/// removed or handed to a newer loop.
pub async fn run_slot(
    sidecar: Arc<Sidecar>,
    server_url: String,
    generation: u64,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = &sidecar.slots;
    let master = server_url.as_str();
    let mut attempt = 0u32;
    let mut last_http_beat = None;
    loop {
        if *shutdown.borrow() {
            return;
        }
        if slots.generation(master) != Some(generation) {
            tracing::info!(master, "the slot is gone; its relay loop ends");
            return;
        }
        let Some(url) = slots.ws_url(master) else {
            return;
        };
        let dialled = tokio::select! {
            r = dial(&url) => r,
            _ = shutdown.changed() => return,
        };
        slots.note_dial();
        // Heartbeats go over HTTP only while the relay cannot be dialled at all.
        let mut unreachable = false;
        match dialled {
            Ok(ws) => {
                tracing::info!(master, relay = %url, "relay socket open");
                slots.set_connection(master, Connection::WebSocket);
                let end = session(&sidecar, master, &url, ws, &mut shutdown).await;
                slots.set_connection(master, Connection::None);
                match end {
                    SessionEnd::Shutdown | SessionEnd::Removed => return,
                    SessionEnd::Redial => {
                        tracing::info!(master, "the relay port changed: dialling it now");
                        attempt = 0;
                        continue;
                    }
                    SessionEnd::Lost { why, registered } => {
                        tracing::warn!(master, relay = %url, reason = %why, "relay socket lost");
                        slots.set_error(master, why);
                        if registered {
                            attempt = 0;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(master, relay = %url, error = %e, "cannot connect to the relay");
                slots.set_error(master, e.to_string());
                slots.set_connection(master, Connection::Http);
                unreachable = true;
            }
        }
        let delay = backoff_delay(attempt, &mut rand::rng());
        attempt = attempt.saturating_add(1);
        tracing::info!(
            master,
            delay_ms = delay.as_millis() as u64,
            attempt,
            "relay: reconnecting after a backoff"
        );
        let http_beats = async {
            if unreachable {
                http_heartbeats(&sidecar, master, &mut last_http_beat).await
            } else {
                std::future::pending::<()>().await
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = http_beats => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// Heartbeats over HTTP every 5 s (the first at once), until the caller stops waiting (§3.4).
/// `last` spans the caller's backoff waits, so short early waits do not beat more often.
async fn http_heartbeats(sidecar: &Sidecar, master: &str, last: &mut Option<tokio::time::Instant>) {
    let target = format!("{}{HTTP_HEARTBEAT_PATH}", master.trim_end_matches('/'));
    let every = Duration::from_millis(HEARTBEAT_INTERVAL_MS);
    loop {
        if let Some(at) = *last {
            tokio::time::sleep_until(at + every).await;
        }
        *last = Some(tokio::time::Instant::now());
        let frame = SidecarFrame::Heartbeat(sidecar.heartbeat(master, true));
        let sent = sidecar
            .fallback_http
            .post(&target)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(encode_sidecar(&frame))
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => {
                tracing::debug!(master, "heartbeat sent over the HTTP fallback")
            }
            Ok(r) => {
                tracing::warn!(
                    master,
                    status = r.status().as_u16(),
                    "the HTTP fallback refused a heartbeat"
                )
            }
            Err(e) => tracing::debug!(master, error = %e, "the HTTP fallback is unreachable too"),
        }
    }
}

async fn dial(url: &str) -> anyhow::Result<WsStream> {
    crate::http::install_crypto_provider();
    match tokio::time::timeout(DIAL_TIMEOUT, tokio_tungstenite::connect_async(url)).await {
        Ok(Ok((ws, _))) => Ok(ws),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => anyhow::bail!("no answer within {} s", DIAL_TIMEOUT.as_secs()),
    }
}

/// Waits for the next heartbeat; never, before `registered`.
async fn tick(heartbeat: &mut Option<Interval>) {
    match heartbeat {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// One socket's life: register, registered, heartbeats, commands, pushes.
async fn session(
    sidecar: &Arc<Sidecar>,
    master: &str,
    url: &str,
    ws: WsStream,
    shutdown: &mut watch::Receiver<bool>,
) -> SessionEnd {
    let slots = &sidecar.slots;
    let ctx = &sidecar.ctx;
    let mut changes = slots.subscribe();
    let generation = slots.generation(master);
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Message>();
    let mut writer = tokio::spawn(async move {
        while let Some(msg) = rx.recv().await {
            let closing = matches!(msg, Message::Close(_));
            if sink.send(msg).await.is_err() || closing {
                break;
            }
        }
        let _ = sink.close().await;
    });
    let send = |frame: &SidecarFrame| tx.send(Message::Text(encode_sidecar(frame).into())).is_ok();
    send(&SidecarFrame::Register(Register {
        agent_url: ctx.agent_url.clone(),
        hostname: Some(ctx.hostname.clone()),
        containers: sidecar.containers.names(),
    }));
    let register_deadline = tokio::time::sleep(REGISTER_TIMEOUT);
    tokio::pin!(register_deadline);
    let mut heartbeat: Option<Interval> = None;
    let mut registered = false;

    let end = loop {
        tokio::select! {
            next = stream.next() => {
                let decoded = match next {
                    Some(Ok(Message::Text(text))) => decode_master(text.as_str()),
                    Some(Ok(Message::Binary(bytes))) => decode_master_bytes(&bytes),
                    Some(Ok(Message::Close(frame))) => {
                        let why = frame.map_or_else(|| "closed by the master".to_string(), |f| format!("closed by the master: {} {}", f.code, f.reason));
                        break SessionEnd::Lost { why, registered };
                    }
                    Some(Ok(_)) => continue, // pings are answered by tungstenite
                    Some(Err(e)) => break SessionEnd::Lost { why: e.to_string(), registered },
                    None => break SessionEnd::Lost { why: "the socket ended".into(), registered },
                };
                let frame = match decoded {
                    Ok(frame) => frame,
                    Err(e) => {
                        tracing::warn!(master, error = %crate::secret::redact(&e.to_string()), "a relay frame not understood; ignored");
                        continue;
                    }
                };
                match frame {
                    MasterFrame::Registered { ok: true } if !registered => {
                        registered = true;
                        slots.set_registered(master);
                        tracing::info!(master, "registered with the master");
                        let mut beat = tokio::time::interval(Duration::from_millis(HEARTBEAT_INTERVAL_MS));
                        beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
                        heartbeat = Some(beat);
                    }
                    MasterFrame::Registered { ok } => tracing::debug!(master, ok, "another registered frame; ignored"),
                    MasterFrame::Error { message } => tracing::warn!(master, message = %message, "the master reported an error"),
                    MasterFrame::Command(cmd) => {
                        tracing::info!(master, id = %cmd.id, action = %cmd.action, "command");
                        let tx = tx.clone();
                        let (sidecar, master) = (sidecar.clone(), master.to_string());
                        tokio::spawn(async move {
                            let result = commands::answer(&sidecar, &master, &cmd).await;
                            match &result.error {
                                Some(error) => tracing::info!(master = %master, id = %result.id, action = %cmd.action, error = %error, "command refused or failed"),
                                None => tracing::info!(master = %master, id = %result.id, action = %cmd.action, "command answered"),
                            }
                            let _ = tx.send(Message::Text(encode_sidecar(&SidecarFrame::Result(result)).into()));
                        });
                    }
                    MasterFrame::Config(frame) | MasterFrame::ConfigPush(frame) => {
                        if let Err(refused) = apply_config(slots, master, frame) {
                            send(&SidecarFrame::Result(refused));
                        }
                    }
                    // A master corrects its own slot's relay port (or an alias of its origin),
                    // never another master's.
                    MasterFrame::MasterIdentity(identity) if !same_origin(&identity.canonical_url, master) => {
                        tracing::warn!(master, "a master-identity named another master's slot: refused");
                        send(&SidecarFrame::Result(CommandResult::err(
                            "master-identity",
                            "master-identity may name only this master's own slot",
                        )));
                    }
                    MasterFrame::MasterIdentity(identity) => {
                        let fixed = slots.fix_ws_port(&identity.canonical_url, identity.ws_port);
                        tracing::info!(master, ws_port = identity.ws_port, slot_found = fixed.is_some(), changed = fixed.unwrap_or(false), "master-identity");
                        if slots.ws_url(master).as_deref() != Some(url) {
                            break SessionEnd::Redial;
                        }
                    }
                }
            }
            _ = &mut register_deadline, if !registered => {
                break SessionEnd::Lost { why: format!("no registered within {} s", REGISTER_TIMEOUT.as_secs()), registered };
            }
            Ok(()) = changes.changed() => {
                // Removed through the API, or moved by a master-identity on another socket.
                if slots.generation(master) != generation {
                    break SessionEnd::Removed;
                }
                match slots.ws_url(master) {
                    None => break SessionEnd::Removed,
                    Some(now) if now != url => break SessionEnd::Redial,
                    Some(_) => {}
                }
            }
            _ = tick(&mut heartbeat) => {
                let beat = SidecarFrame::Heartbeat(sidecar.heartbeat(master, false));
                if !send(&beat) {
                    break SessionEnd::Lost { why: "the socket's writer stopped".into(), registered };
                }
            }
            _ = shutdown.changed() => break SessionEnd::Shutdown,
        }
    };
    if matches!(end, SessionEnd::Lost { .. }) {
        drop(tx);
        writer.abort();
    } else {
        let _ = tx.send(Message::Close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "agent closing this relay socket".into(),
        })));
        drop(tx);
        if tokio::time::timeout(Duration::from_secs(2), &mut writer)
            .await
            .is_err()
        {
            writer.abort();
        }
    }
    end
}

/// Merges a `config`/`config-push` into this slot (no `result` is sent, §2.1.10, unless the
/// push is refused for naming another master's slot). Logs the outcome only: never the push.
fn apply_config(slots: &Slots, master: &str, frame: ConfigFrame) -> Result<(), CommandResult> {
    // The id is the master's string: shown (logged, echoed) only when it reads as an id.
    let config_id = frame
        .id
        .filter(|id| plain_id(id))
        .unwrap_or_else(|| "(unreadable config id)".into());
    if let Some(revoked) = frame.payload.revoke_server_url.as_deref() {
        // A master revokes its own slot's settings, never another master's.
        if !same_origin(revoked, master) {
            tracing::warn!(master, config_id = %config_id, "a config push named another master's slot in revokeServerUrl: refused, nothing applied");
            return Err(CommandResult::err(
                config_id,
                "revokeServerUrl may name only this master's own slot; nothing was applied",
            ));
        }
        let found = slots.revoke(revoked);
        tracing::info!(master, config_id = %config_id, found, "config push revoked this master's key and settings");
    }
    let Some(push) = frame.payload.openrouter else {
        tracing::info!(master, config_id = %config_id, "config push without an openrouter object");
        return Ok(());
    };
    match slots.apply_config(master, push) {
        ConfigOutcome::Applied(report) => {
            let key = if report.key_included {
                "included"
            } else {
                "unchanged"
            };
            tracing::info!(master, config_id = %config_id, key, roles = ?report.roles, "config push applied");
        }
        ConfigOutcome::Refused(PushRefused::FirstPushWithoutKey) => {
            tracing::warn!(master, config_id = %config_id, "pushed with no apiKey (and none on file) — ignoring");
        }
        ConfigOutcome::Refused(refused) => {
            tracing::warn!(master, config_id = %config_id, reason = %refused, "config push refused");
        }
        ConfigOutcome::NoSlot => {
            tracing::warn!(master, config_id = %config_id, "config push for a slot that is gone")
        }
    }
    Ok(())
}

/// Whether a frame's id may be logged and echoed as is: short, of an id's alphabet, and not
/// shaped like a key.
fn plain_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
        && !crate::secret::looks_like_key(id)
}
