//! The agent's one socket to the hub: dial (with the fleet token), `hello`, then a session of
//! pull loops, heartbeats and results; reconnect with exponential backoff and full jitter.
//!
//! One socket, ever: the loop below is sequential, so a new socket is dialled only after the
//! previous one has ended, and nothing outlives the session that owns it.
//!
//! Liveness: heartbeats list the leases whose work runs (the hub renews them); a streamed
//! chat's chunks go out as `chunk` frames ahead of its `done`; three heartbeats with nothing
//! from a hub that pings, or a write that does not complete, end the session (then redial);
//! `hello` carries this process's instance id, and a hub that says another live process holds
//! the id ends the run ([`Refused`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tracing::Instrument;

use super::hub_finder::{self, WsStream};
use super::provider::{BoxFuture, Provider, ProviderFailure, WorkResult};
use super::{Agent, devices};
use crate::protocol::codec::encode_agent;
use crate::protocol::{
    self, AgentFrame, Chunk, Done, ErrorCode, Failed, FailureClass, Heartbeat, Hello, HubFrame,
    PROTOCOL_VERSION, ProviderInfo, Pull, Work, WorkInput,
};
use crate::service::host::hostname;

/// Reconnect delays: full jitter over `min(CAP, BASE · 2^attempt)`.
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);

/// A delay for reconnect attempt `attempt` (0-based): uniform in [0, min(cap, base·2^attempt)].
pub fn backoff_delay(attempt: u32, rng: &mut impl Rng) -> Duration {
    let ceiling = BACKOFF_BASE
        .saturating_mul(1u32 << attempt.min(16))
        .min(BACKOFF_CAP);
    ceiling.mul_f64(rng.random::<f64>())
}

/// How a session ended.
enum SessionEnd {
    /// The socket went away; dial again.
    Lost(String),
    /// Shutdown: leases finished or handed back, socket closed.
    Drained,
    /// The hub refused this process for good (see [`Refused`]).
    Refused(Refused),
}

/// The hub refused this process for good: another live process holds its agent id. Serving
/// on would only have the two take turns; the process exits with this message.
#[derive(Debug, thiserror::Error)]
#[error("the hub refused this agent: {0}")]
pub struct Refused(pub String);

pub async fn run(agent: Arc<Agent>, mut shutdown: watch::Receiver<bool>) -> Result<(), Refused> {
    let mut attempt = 0u32;
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        let dialled = tokio::select! {
            r = hub_finder::dial(&agent) => r,
            _ = shutdown.changed() => return Ok(()),
        };
        agent.note_dial();
        let mut electing = false;
        match dialled {
            Ok(ws) => {
                let welcomed_before = agent.sessions();
                match session(&agent, ws, &mut shutdown).await {
                    SessionEnd::Drained => return Ok(()),
                    SessionEnd::Refused(refused) => {
                        tracing::error!(reason = %refused.0, "the hub refused this agent for good; exiting");
                        return Err(refused);
                    }
                    SessionEnd::Lost(why) => {
                        tracing::warn!(reason = %why, "hub connection lost");
                    }
                }
                if agent.sessions() > welcomed_before {
                    attempt = 0;
                }
            }
            Err(e) => {
                electing = e.downcast_ref::<hub_finder::ElectionUnderWay>().is_some();
                tracing::warn!(hubs = ?agent.opts.hub_urls, error = %e, "cannot connect to the hub")
            }
        }
        let delay = if electing {
            hub_finder::STANDBY_REDIAL
        } else {
            let delay = backoff_delay(attempt, &mut rand::rng());
            attempt = attempt.saturating_add(1);
            delay
        };
        tracing::info!(
            delay_ms = delay.as_millis() as u64,
            attempt,
            "reconnecting after a backoff"
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => return Ok(()),
        }
    }
}

struct InFlight {
    lease: u64,
    /// The provider as it was when the work started (a push may change the set meanwhile).
    provider: ProviderInfo,
    items: usize,
    /// The credit grant it was pulled under ([`Grants`]).
    grant: u64,
}

/// A call's outcome and its latency (ms); `None`: cancelled by the hub.
type Outcome = Option<(Result<WorkResult, ProviderFailure>, f64)>;

/// The work running on this session: the tasks, what each is, and each lease's handle.
#[derive(Default)]
struct Jobs {
    tasks: JoinSet<Outcome>,
    running: HashMap<tokio::task::Id, InFlight>,
    by_lease: HashMap<u64, tokio::task::AbortHandle>,
}

/// Which grant of credits each provider's work belongs to. A provider that left the set and
/// came back (a fronted server down, then up) was pulled afresh for its whole depth, so work
/// it took before must not add one more credit each when it ends.
#[derive(Default)]
struct Grants {
    current: HashMap<String, u64>,
    next: u64,
}

impl Grants {
    /// A fresh pull of `id`'s whole depth.
    fn fresh(&mut self, id: &str) {
        self.next += 1;
        self.current.insert(id.to_string(), self.next);
    }

    fn of(&self, id: &str) -> u64 {
        self.current.get(id).copied().unwrap_or(0)
    }
}

/// The provider of `id` in `set`.
fn find<'a>(set: &'a [Arc<dyn Provider>], id: &str) -> Option<&'a Arc<dyn Provider>> {
    set.iter().find(|p| p.info().id == id)
}

/// One socket's life: hello, welcome, pulls, work, heartbeats, until it drops or we drain.
async fn session(
    agent: &Arc<Agent>,
    ws: WsStream,
    shutdown: &mut watch::Receiver<bool>,
) -> SessionEnd {
    let (sink, mut stream) = ws.split();
    let (tx, rx) = mpsc::unbounded_channel::<Message>();
    // Until welcome says the heartbeat, writes are bounded as for the default one.
    let heartbeat_ms = Arc::new(std::sync::atomic::AtomicU64::new(DEFAULT_HEARTBEAT_MS));
    let mut writer = tokio::spawn(write_frames(sink, rx, heartbeat_ms.clone()));
    let send = |frame: &AgentFrame| {
        let _ = tx.send(Message::Text(encode_agent(frame).into()));
    };
    let mut server_changes = agent.server_changes();
    server_changes.mark_unchanged();
    let mut providers = agent.providers();
    let socket = agent
        .sockets
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_add(1);
    send(&AgentFrame::Hello(Hello {
        agent_id: agent.id().to_string(),
        hostname: hostname(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        protocol_version: PROTOCOL_VERSION,
        providers: providers.iter().map(|p| p.info()).collect(),
        devices: devices(&providers),
        instance: Some(agent.instance().to_string()),
        config: agent.held_config(),
        suspensions: agent.suspensions(),
        answering: agent.kept.running_elsewhere(socket),
        keeps_answers: true,
    }));

    let max_frame = agent.opts.max_frame_bytes;
    // The first frame must be welcome (pings and pongs aside).
    let first = async {
        loop {
            match stream.next().await {
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                other => return other,
            }
        }
    };
    // Bounded like the upgrade: a hub that upgrades and then stalls is passed over as fast.
    let welcome_within = hub_finder::answer_timeout(
        agent.opts.hub_urls.len(),
        agent.dial_patience.load(Ordering::Relaxed),
    );
    let welcome = match tokio::time::timeout(welcome_within, first).await {
        Ok(Some(Ok(Message::Text(text)))) => match protocol::decode_hub(text.as_str(), max_frame) {
            Ok(HubFrame::Welcome(w)) => w,
            Ok(HubFrame::Error {
                message,
                code: Some(ErrorCode::AgentIdInUse),
            }) => {
                drop(tx);
                writer.abort();
                return SessionEnd::Refused(Refused(message));
            }
            Ok(HubFrame::Error { message, .. }) => {
                return end(tx, writer, format!("the hub refused hello: {message}")).await;
            }
            Ok(_) => return end(tx, writer, "the hub sent something before welcome".into()).await,
            Err(e) => return end(tx, writer, e.to_string()).await,
        },
        Ok(Some(Ok(Message::Close(frame)))) => {
            let reason = frame.map(|f| f.reason.to_string()).unwrap_or_default();
            return end(tx, writer, format!("the hub closed the socket: {reason}")).await;
        }
        Ok(Some(Ok(_))) => return end(tx, writer, "unexpected first frame".into()).await,
        Ok(Some(Err(e))) => return end(tx, writer, e.to_string()).await,
        Ok(None) => return end(tx, writer, "the hub closed the socket".into()).await,
        Err(_) => {
            // The next dial waits longer: the hub may be slow rather than frozen.
            agent.dial_patience.fetch_add(1, Ordering::Relaxed);
            let ms = welcome_within.as_millis();
            return end(tx, writer, format!("no welcome within {ms} ms")).await;
        }
    };
    if let Some(epoch) = welcome.epoch {
        let seen = agent.hub_epoch.fetch_max(epoch, Ordering::SeqCst);
        if epoch < seen {
            // A deposed leader that has not noticed yet: nothing of it is taken; the next
            // dial starts at the next hub.
            agent.hub_at.fetch_add(1, Ordering::Relaxed);
            return end(
                tx,
                writer,
                format!(
                    "the hub welcomed this agent under epoch {epoch}, older than epoch {seen} \
                     seen before: a deposed leader; dialling the others"
                ),
            )
            .await;
        }
    }
    agent.sessions.fetch_add(1, Ordering::Relaxed);
    agent.connected.store(true, Ordering::Relaxed);
    let hub = agent
        .opts
        .hub_urls
        .get(agent.hub_at.load(Ordering::Relaxed))
        .cloned()
        .unwrap_or_default();
    tracing::info!(session = welcome.session, hub = %hub, "connected to the hub");
    // Keyed chats' answers of earlier sessions go to a hub that takes them: now, and each one
    // that a call still running finishes later.
    let takes_answers = welcome.takes_answers;
    let mut kept_changes = agent.kept.changes();
    let mut kept_sent = Vec::new();
    let send_kept = |sent: &mut Vec<_>| {
        for answer in agent.kept.to_send(socket, sent) {
            tracing::info!(key = %answer.tag.key, project = %answer.tag.project, "handing a kept answer to the hub");
            send(&AgentFrame::Kept(answer));
        }
    };
    if takes_answers {
        kept_changes.mark_unchanged();
        send_kept(&mut kept_sent);
    }
    let mut grants = Grants::default();
    for p in &providers {
        let id = p.info().id;
        grants.fresh(&id);
        send(&AgentFrame::Pull(Pull {
            provider: id,
            credits: p.pipeline_depth(),
        }));
    }

    // A number off the wire: kept within the hub's own bounds.
    let (lo, hi) = crate::config::timings::HEARTBEAT_MS_RANGE;
    let heartbeat_every = Duration::from_millis(welcome.heartbeat_interval_ms.clamp(lo, hi));
    // Three heartbeats with nothing from the hub (it pings every one): the socket is dead,
    // whatever TCP thinks; so is a write that does not complete (`protocol::write_timeout`).
    let silence = heartbeat_every * 3;
    heartbeat_ms.store(
        u64::try_from(heartbeat_every.as_millis()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
    let mut heartbeat = tokio::time::interval(heartbeat_every);
    heartbeat.tick().await;
    let mut last_heard = Instant::now();
    // A hub of an older build does not ping (a mixed fleet): it is never taken for a dead one.
    let hub_pings = welcome.pings;
    let mut jobs = Jobs::default();
    let mut drain_deadline: Option<Instant> = None;
    let mut writer_done = false;
    let far = Duration::from_secs(365 * 24 * 3600);
    // While the hub is silent, the other hubs are asked who leads (at most once a second, and
    // one ask at a time): a frozen leader is left as soon as another leads under a newer epoch.
    let watch_peers = welcome.epoch.filter(|_| agent.opts.hub_urls.len() > 1);
    let current = agent.hub_at.load(Ordering::Relaxed);
    let ask_every = heartbeat_every.min(Duration::from_secs(1));
    let mut last_ask = Instant::now();
    let mut asking = false;
    let (moved_tx, mut moved) = mpsc::channel::<Option<String>>(1);

    let why = loop {
        let drain_sleep = tokio::time::sleep(
            drain_deadline.map_or(far, |d| d.saturating_duration_since(Instant::now())),
        );
        let silent =
            tokio::time::sleep((last_heard + silence).saturating_duration_since(Instant::now()));
        let ask_at = (last_heard + heartbeat_every).max(last_ask + ask_every);
        let ask = tokio::time::sleep(ask_at.saturating_duration_since(Instant::now()));
        tokio::select! {
            next = stream.next() => {
                last_heard = Instant::now();
                let text = match next {
                    Some(Ok(Message::Text(text))) => text,
                    Some(Ok(Message::Close(frame))) => {
                        break frame.map(|f| format!("closed by the hub: {}", f.reason)).unwrap_or_else(|| "closed by the hub".into());
                    }
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => break e.to_string(),
                    None => break "the socket ended".into(),
                };
                match protocol::decode_hub(text.as_str(), max_frame) {
                    Ok(HubFrame::Work(work)) => {
                        if drain_deadline.is_some() {
                            send(&failed(work.lease, FailureClass::Refused, "the agent is shutting down"));
                            continue;
                        }
                        let Some(provider) = find(&providers, &work.provider).cloned() else {
                            send(&failed(work.lease, FailureClass::Refused, &format!("no provider '{}' here", work.provider)));
                            continue;
                        };
                        let grant = grants.of(&work.provider);
                        start_work(agent, &tx, provider, work, grant, socket, &mut jobs);
                    }
                    Ok(HubFrame::Cancel { lease, reason }) => {
                        if let Some(handle) = jobs.by_lease.remove(&lease) {
                            tracing::info!(lease, reason = %reason, "lease cancelled by the hub");
                            handle.abort();
                        }
                    }
                    Ok(HubFrame::Config(cfg)) => {
                        let ack = agent.apply_config(cfg);
                        // The providers the config built first, then the ack: the hub never
                        // sees the config held with its routes' providers not there yet.
                        announce(&mut providers, agent.providers(), drain_deadline.is_some(), &mut grants, &send);
                        send(&AgentFrame::ConfigAck(ack));
                    }
                    Ok(HubFrame::Discover) => {
                        let (agent, tx) = (agent.clone(), tx.clone());
                        tokio::spawn(async move {
                            let limits = agent.discover_limits().await;
                            let _ = tx.send(Message::Text(encode_agent(&AgentFrame::Limits(limits)).into()));
                        });
                    }
                    Ok(HubFrame::Error { message, .. }) => tracing::warn!(message = %message, "the hub reported an error"),
                    Ok(HubFrame::Probe(probe)) => {
                        // Probes run like production work: the gate's as documents to embed (the
                        // answer is the vectors), the scorer check's as pairs to score.
                        let provider = find(&providers, &probe.provider).cloned();
                        let tx = tx.clone();
                        tokio::spawn(async move {
                            let result = answer_probe(provider, probe).await;
                            let _ = tx.send(Message::Text(encode_agent(&AgentFrame::ProbeResult(result)).into()));
                        });
                    }
                    Ok(HubFrame::Welcome(_)) => {}
                    Ok(HubFrame::Suspended(s)) => agent.note_suspension(s),
                    Ok(HubFrame::Delivered(tag)) => agent.kept.delivered(&tag),
                    Err(e) => tracing::warn!(error = %e, "bad frame from the hub"),
                }
            }
            Some(joined) = jobs.tasks.join_next_with_id(), if !jobs.tasks.is_empty() => {
                let (id, outcome) = match joined {
                    Ok((id, outcome)) => (id, outcome),
                    Err(e) => (e.id(), if e.is_cancelled() { None } else { Some((Err(ProviderFailure::new(FailureClass::Transient, "the provider panicked")), 0.0)) }),
                };
                let Some(job) = jobs.running.remove(&id) else { continue };
                jobs.by_lease.remove(&job.lease);
                agent.with_counters(&job.provider.id, |c| {
                    c.in_flight = c.in_flight.saturating_sub(1);
                    match &outcome {
                        Some((Ok(_), latency_ms)) => c.record_success(job.items, *latency_ms),
                        Some((Err(_), _)) => c.failures += 1,
                        None => {}
                    }
                });
                match outcome {
                    Some((Ok(result), latency_ms)) => send(&AgentFrame::Done(Done {
                        lease: job.lease,
                        output: result.output,
                        latency_ms,
                        tokens: result.tokens,
                        cost_usd: result.cost_usd,
                    })),
                    Some((Err(f), _)) => send(&AgentFrame::Failed(Failed {
                        lease: job.lease,
                        class: f.class,
                        retry_after_ms: f.retry_after_ms,
                        limit: f.limit,
                        refusal: f.refusal,
                        defect: f.defect,
                        message: f.message,
                    })),
                    None => {} // cancelled: the hub already took the lease back
                }
                if drain_deadline.is_none() {
                    // One more credit, unless a push removed or changed the provider meanwhile,
                    // or it left and came back with a fresh pull.
                    let same = find(&providers, &job.provider.id).is_some_and(|p| p.info() == job.provider);
                    if same && grants.of(&job.provider.id) == job.grant {
                        send(&AgentFrame::Pull(Pull { provider: job.provider.id, credits: 1 }));
                    }
                } else if jobs.tasks.is_empty() {
                    break String::new();
                }
            }
            Ok(()) = kept_changes.changed(), if takes_answers => send_kept(&mut kept_sent),
            Ok(()) = server_changes.changed() => {
                // A fronted server came up, went down or changed revision.
                announce(&mut providers, agent.providers(), drain_deadline.is_some(), &mut grants, &send);
            }
            _ = heartbeat.tick() => {
                send(&AgentFrame::Heartbeat(Heartbeat {
                    providers: agent.provider_stats(),
                    devices: devices(&providers),
                    // Work still running: its leases live on.
                    leases: jobs.by_lease.keys().copied().collect(),
                    config: agent.held_config(),
                }));
            }
            () = ask, if watch_peers.is_some() && !asking => {
                last_ask = Instant::now();
                asking = true;
                let (agent, tx, epoch) = (agent.clone(), moved_tx.clone(), watch_peers.unwrap_or(0));
                tokio::spawn(async move {
                    let _ = tx.send(hub_finder::probe_peers(agent, current, epoch).await).await;
                });
            }
            Some(answer) = moved.recv() => {
                asking = false;
                if let Some(why) = answer {
                    break format!("the hub went silent and {why}: moving");
                }
            }
            _ = silent, if hub_pings => {
                break format!("nothing from the hub for {} s (three heartbeats)", silence.as_secs_f64());
            }
            _ = &mut writer => {
                writer_done = true;
                break "a write to the hub failed or did not complete in time".to_string();
            }
            _ = shutdown.changed(), if drain_deadline.is_none() => {
                tracing::info!(in_flight = jobs.tasks.len(), "shutting down: no more pulls; finishing leases in progress");
                send(&AgentFrame::Providers { providers: Vec::new() });
                if jobs.tasks.is_empty() {
                    break String::new();
                }
                drain_deadline = Some(Instant::now() + agent.opts.drain_timeout);
            }
            _ = drain_sleep, if drain_deadline.is_some() => {
                // Hand back what did not finish in time: the hub requeues it at the front.
                for job in jobs.running.values() {
                    send(&failed(job.lease, FailureClass::Refused, "the agent shut down before this finished"));
                }
                // Keyed calls run on tasks of their own: handed back, they stop too.
                for handle in jobs.by_lease.values() {
                    handle.abort();
                }
                jobs.tasks.abort_all();
                break String::new();
            }
        }
    };
    agent.connected.store(false, Ordering::Relaxed);
    jobs.tasks.abort_all();
    for p in &providers {
        agent.with_counters(&p.info().id, |c| c.in_flight = 0);
    }
    if drain_deadline.is_some() && why.is_empty() {
        let _ = tx.send(Message::Close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "agent shutting down".into(),
        })));
        drop(tx);
        if !writer_done {
            let _ = writer.await;
        }
        tracing::info!("drained and closed");
        return SessionEnd::Drained;
    }
    end(tx, writer, why).await
}

/// Tells the hub the provider set `next` when it differs from the one it knows: the hub keeps
/// the credits of an unchanged provider; new or changed ones start from a fresh pull. A
/// draining session announces nothing (it already said: none).
fn announce(
    providers: &mut Vec<Arc<dyn Provider>>,
    next: Vec<Arc<dyn Provider>>,
    draining: bool,
    grants: &mut Grants,
    send: &impl Fn(&AgentFrame),
) {
    let infos: Vec<ProviderInfo> = next.iter().map(|p| p.info()).collect();
    if !draining && infos != providers.iter().map(|p| p.info()).collect::<Vec<_>>() {
        send(&AgentFrame::Providers { providers: infos });
        for p in &next {
            let info = p.info();
            if find(providers.as_slice(), &info.id).is_none_or(|old| old.info() != info) {
                grants.fresh(&info.id);
                send(&AgentFrame::Pull(Pull {
                    provider: info.id,
                    credits: p.pipeline_depth(),
                }));
            }
        }
    }
    // Always the new set: a new key rebuilds providers with equal infos.
    *providers = next;
}

fn failed(lease: u64, class: FailureClass, message: &str) -> AgentFrame {
    AgentFrame::Failed(Failed {
        lease,
        class,
        retry_after_ms: None,
        limit: None,
        refusal: None,
        defect: None,
        message: message.to_string(),
    })
}

/// Runs a chat that asked to stream: its chunks become `chunk` frames (`seq` from 0) as they
/// arrive, all of them sent before the call's result (the `done` frame follows them).
fn stream_chunks(
    provider: &dyn Provider,
    input: WorkInput,
    lease: u64,
    frames: mpsc::UnboundedSender<Message>,
) -> BoxFuture<Result<WorkResult, ProviderFailure>> {
    let (sink, mut chunks) = mpsc::unbounded_channel();
    let call = provider.run_streaming(input, sink);
    Box::pin(async move {
        tokio::pin!(call);
        let mut seq = 0u64;
        let mut send = |data| {
            let frame = AgentFrame::Chunk(Chunk { lease, seq, data });
            let _ = frames.send(Message::Text(encode_agent(&frame).into()));
            seq += 1;
        };
        loop {
            tokio::select! {
                biased;
                Some(chunk) = chunks.recv() => send(chunk),
                result = &mut call => {
                    while let Ok(chunk) = chunks.try_recv() {
                        send(chunk);
                    }
                    break result;
                }
            }
        }
    })
}

fn start_work(
    agent: &Arc<Agent>,
    tx: &mpsc::UnboundedSender<Message>,
    provider: Arc<dyn Provider>,
    work: Work,
    grant: u64,
    socket: u64,
    jobs: &mut Jobs,
) {
    let items = work.input.items();
    let info = provider.info();
    agent.with_counters(&info.id, |c| c.in_flight += 1);
    let call_timeout = work.call_timeout_ms.map(Duration::from_millis);
    let streaming = matches!(&work.input, WorkInput::Chat(body) if body.get("stream").and_then(serde_json::Value::as_bool) == Some(true));
    let (lease, frames, id) = (work.lease, tx.clone(), info.id.clone());
    // One span per frame: a child of its first request's trace, linked to every request (and
    // the engine's `tokenize` and `batch`, a cloud or server call, run inside it).
    let span = tracing::info_span!("work", lease, provider = %info.id, role = %work.role, items);
    crate::traces::join_requests(&span, &work.traces);
    let keyed = work.idempotency.clone().map(|tag| {
        let running = agent.kept.start(tag, &info.id, socket);
        (running, info.id.clone(), info.backend)
    });
    let call = async move {
        let started = Instant::now();
        let call = if streaming {
            stream_chunks(provider.as_ref(), work.input, lease, frames)
        } else {
            provider.run_class(work.input, work.class)
        };
        let result = match call_timeout {
            None => call.await,
            // Past the role's call timeout the work fails as fatal: a retry would bill a stuck
            // upstream again, and the client learns which setting to raise.
            Some(limit) => match tokio::time::timeout(limit, call).await {
                Ok(result) => result,
                Err(_) => Err(ProviderFailure::new(
                    FailureClass::Fatal,
                    format!(
                        "the call took longer than the role's call timeout ({} s; the hub's [roles.{}] call_timeout_s)",
                        limit.as_secs_f64(),
                        work.role
                    ),
                )),
            },
        };
        // JSON has no NaN: a model that produced one fails here, saying so, rather than
        // sending a frame no hub can read.
        let result = super::provider::finite(&id, result);
        (result, started.elapsed().as_secs_f64() * 1000.0)
    }
    .instrument(span);
    let (handle, abort) = match keyed {
        None => {
            let handle = jobs.tasks.spawn(async move { Some(call.await) });
            let abort = handle.clone();
            (handle, abort)
        }
        // A keyed chat runs on its own task: it ends even when this session does, and its
        // outcome is kept for the next hub. A cancel from the hub still aborts it.
        Some((running, provider_id, backend)) => {
            let detached = tokio::spawn(async move {
                let (result, latency_ms) = call.await;
                running.finish(kept_answer(&result, provider_id, backend));
                (result, latency_ms)
            });
            let abort = detached.abort_handle();
            let handle = jobs.tasks.spawn(async move {
                match detached.await {
                    Ok(outcome) => Some(outcome),
                    // A panic fails the work as an unkeyed call's would; a cancel is none.
                    Err(e) if e.is_panic() => Some((
                        Err(ProviderFailure::new(
                            FailureClass::Transient,
                            "the provider panicked",
                        )),
                        0.0,
                    )),
                    Err(_) => None,
                }
            });
            (handle, abort)
        }
    };
    jobs.running.insert(
        handle.id(),
        InFlight {
            lease: work.lease,
            provider: info,
            items,
            grant,
        },
    );
    jobs.by_lease.insert(lease, abort);
}

/// What is kept of a keyed call's outcome (the tag is the running entry's).
fn kept_answer(
    result: &Result<WorkResult, ProviderFailure>,
    provider: String,
    backend: protocol::Backend,
) -> impl FnOnce(protocol::IdempotencyTag) -> protocol::KeptAnswer {
    let (output, tokens, cost_usd, error, class) = match result {
        Ok(r) => (Some(r.output.clone()), r.tokens, r.cost_usd, None, None),
        Err(f) => (None, 0, None, Some(f.message.clone()), Some(f.class)),
    };
    move |tag| protocol::KeptAnswer {
        tag,
        provider,
        backend,
        output,
        tokens,
        cost_usd,
        error,
        class,
    }
}

/// The heartbeat writes are bounded by until the welcome names the hub's.
const DEFAULT_HEARTBEAT_MS: u64 = 5_000;

/// The socket's writer: each write bounded by [`protocol::write_timeout`] for the heartbeat in
/// `heartbeat_ms`; it ends on a close it sent, a failed write or one that did not complete in
/// time (the session ends with it).
async fn write_frames(
    mut sink: futures_util::stream::SplitSink<WsStream, Message>,
    mut rx: mpsc::UnboundedReceiver<Message>,
    heartbeat_ms: Arc<std::sync::atomic::AtomicU64>,
) {
    let heartbeat = || Duration::from_millis(heartbeat_ms.load(Ordering::Relaxed));
    while let Some(msg) = rx.recv().await {
        let closing = matches!(msg, Message::Close(_));
        let limit = protocol::write_timeout(heartbeat(), msg.len());
        match tokio::time::timeout(limit, sink.send(msg)).await {
            Ok(Ok(())) if !closing => {}
            Ok(_) => break,
            Err(_) => {
                tracing::warn!(
                    timeout_s = limit.as_secs_f64(),
                    "a write to the hub did not complete in time"
                );
                return;
            }
        }
    }
    let _ = tokio::time::timeout(heartbeat().saturating_mul(3), sink.close()).await;
}

async fn end(
    tx: mpsc::UnboundedSender<Message>,
    writer: tokio::task::JoinHandle<()>,
    why: String,
) -> SessionEnd {
    drop(tx);
    writer.abort();
    SessionEnd::Lost(why)
}

/// A probe's answer: vectors for the gate's texts, scores for a reranker's pairs.
async fn answer_probe(
    provider: Option<Arc<dyn Provider>>,
    probe: protocol::Probe,
) -> protocol::ProbeResult {
    let mut result = protocol::ProbeResult {
        probe: probe.probe,
        provider: probe.provider,
        vectors: None,
        scores: None,
        error: None,
        defect: None,
    };
    let Some(p) = provider else {
        result.error = Some(format!("no provider '{}' here", result.provider));
        return result;
    };
    let input = match probe.query {
        Some(query) => protocol::WorkInput::Rerank(protocol::RerankInput {
            query,
            documents: probe.texts,
            instruction: None,
        }),
        None => protocol::WorkInput::Embed(protocol::EmbedInput {
            texts: probe.texts,
            truncate: true,
            ..Default::default()
        }),
    };
    let id = p.info().id;
    match super::provider::finite(&id, p.run(input).await) {
        Ok(WorkResult {
            output: protocol::WorkOutput::Embeddings(v),
            ..
        }) => result.vectors = Some(v),
        Ok(WorkResult {
            output: protocol::WorkOutput::Scores(s),
            ..
        }) => result.scores = Some(s),
        Ok(_) => result.error = Some("the provider answered a probe with something else".into()),
        Err(f) => {
            result.error = Some(f.message);
            result.defect = f.defect;
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_full_jitter_under_a_doubling_ceiling_capped_at_30s() {
        let mut rng = rand::rng();
        for attempt in 0..40 {
            let ceiling = BACKOFF_BASE
                .saturating_mul(1u32 << attempt.min(16))
                .min(BACKOFF_CAP);
            let mut max_seen = Duration::ZERO;
            for _ in 0..200 {
                let d = backoff_delay(attempt, &mut rng);
                assert!(d <= ceiling, "attempt {attempt}: {d:?} > {ceiling:?}");
                max_seen = max_seen.max(d);
            }
            assert!(max_seen >= ceiling / 2, "jitter spans the range");
        }
        assert_eq!(
            BACKOFF_BASE.saturating_mul(1 << 16).min(BACKOFF_CAP),
            BACKOFF_CAP
        );
    }
}
