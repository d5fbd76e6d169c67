//! A stand-in for Fantom MCP Server's side of the sidecar relay, written from the protocol
//! reference alone (`shared/reference/fantom-relay-protocol.md` §2.1, §2.2, §3.4), not from our
//! crate's wire types: frames are built and read as plain JSON, as the master does.
//!
//! Two listeners, as on the real master (§1.1): the master's main HTTP port (its `serverUrl`,
//! with the HTTP-fallback routes of §3.4) and the dedicated relay port with its WebSocket
//! upgrade on `/sidecar` only (any other upgrade path: 404; a plain GET: the `ok` JSON).
//! Optionally a second relay listener at a stale port, for the `master-identity` correction.
//!
//! Behaviours modelled (master side):
//!
//! * the first frame must be `register` within the register deadline (30 s, configurable), else
//!   the socket is terminated; the master sends nothing before a `register`;
//! * `register` → `{"type":"registered","ok":true}`; it binds the agentUrl to this socket; an
//!   older socket bound to the same agentUrl is superseded and terminated after the grace
//!   (45 s, configurable; 0 = at once). Open sockets per agentUrl are counted, with their
//!   maximum;
//! * `error` frames, the socket left open: `invalid JSON`, `missing type`,
//!   `register: missing agentUrl`, `heartbeat before register`;
//! * a heartbeat counts as one only if its raw text starts with exactly `{"type":"heartbeat"`:
//!   heartbeats that do not are counted as prefix violations;
//! * ping sweep: a WebSocket ping every `ping_every`; a client that missed `max_missed_pongs`
//!   consecutive pongs is terminated;
//! * `command` frames flat (`{"type":"command","id":"cmd-…","action":…, …payload}`), answered by
//!   a `result` with the same id (an unknown id is ignored);
//! * `config` frames, fire and forget (`{"type":"config","id":"cfg-…","payload":{…}}`);
//! * `master-identity` on a heartbeat whose `statusData.masters` has a row whose `serverUrl`
//!   port is this master's HTTP port but whose `wsPort` is not the relay port, at most once per
//!   `identity_interval` (60 s) per agentUrl (switchable off); also sent on demand;
//! * on close, the agentUrl binding is removed only if it still points at that socket.
//!
//! Every frame received is recorded in order (text and parsed JSON), so tests can assert on the
//! wire itself. Waits are on a change counter (`watch`), each bounded by a timeout: no sleeps
//! as synchronisation.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::support::PATIENCE;

/// The master counts a frame as a heartbeat only when its text starts with exactly this.
pub const HEARTBEAT_PREFIX: &str = r#"{"type":"heartbeat""#;
/// The relay's only WebSocket path.
pub const RELAY_PATH: &str = "/sidecar";
/// The master logs this many characters of every frame it receives.
pub const LOGGED_HEAD_CHARS: usize = 120;

/// The master's timings and switches; [`Default`] is the reference's values.
#[derive(Clone, Debug)]
pub struct TestMasterOpts {
    /// A socket must send `register` within this of connecting (30 s).
    pub register_deadline: Duration,
    /// The ping sweep's period (30 s).
    pub ping_every: Duration,
    /// Consecutive unanswered pings that get a client terminated (3).
    pub max_missed_pongs: u32,
    /// How long a superseded socket lives on (45 s; zero: terminated at once).
    pub superseded_grace: Duration,
    /// How long [`TestMaster::command`] waits for the `result` (60 s, the master's default).
    pub command_timeout: Duration,
    /// `master-identity` at most once per this per agentUrl (60 s).
    pub identity_interval: Duration,
    /// Send `master-identity` on heartbeats that show this master with the wrong `wsPort`.
    pub auto_identity: bool,
    /// Also run a second relay listener (its port in [`TestMaster::old_ws_port`]): a stale
    /// `wsPort` a slot may have, served by the same master state.
    pub old_relay: bool,
}

impl Default for TestMasterOpts {
    fn default() -> Self {
        TestMasterOpts {
            register_deadline: Duration::from_secs(30),
            ping_every: Duration::from_secs(30),
            max_missed_pongs: 3,
            superseded_grace: Duration::from_secs(45),
            command_timeout: Duration::from_secs(60),
            identity_interval: Duration::from_secs(60),
            auto_identity: true,
            old_relay: false,
        }
    }
}

/// One frame the master received on a relay socket.
#[derive(Clone, Debug)]
pub struct Received {
    /// 1-based, in arrival order over all sockets.
    pub seq: u64,
    /// The socket (connection number, 1-based, in accept order).
    pub conn: u64,
    /// The relay port it arrived on.
    pub port: u16,
    pub text: String,
    /// `None`: not JSON (or a binary frame that is not UTF-8).
    pub value: Option<Value>,
    /// Whether the socket had registered when the frame arrived (a heartbeat before that is
    /// refused, not counted).
    pub registered: bool,
}

impl Received {
    pub fn kind(&self) -> Option<&str> {
        self.value.as_ref()?.get("type")?.as_str()
    }
}

/// How a relay socket ended, as the master saw it.
#[derive(Clone, Debug)]
pub struct Closed {
    pub conn: u64,
    pub port: u16,
    pub agent_url: Option<String>,
    pub why: String,
    pub heartbeats: u64,
}

enum Out {
    Text(String),
    /// A close frame (code, reason), then the socket is dropped.
    Close(u16, &'static str),
    /// Dropped without a close frame (the master's `terminate()`).
    Terminate(&'static str),
}

struct Conn {
    port: u16,
    tx: mpsc::UnboundedSender<Out>,
    agent_url: Option<String>,
    /// Registration order (for "the latest registered socket").
    registered_at: u64,
    superseded: bool,
    heartbeats: u64,
}

#[derive(Default)]
struct Inner {
    next_conn: u64,
    next_registration: u64,
    conns: HashMap<u64, Conn>,
    /// agentUrl → the socket bound to it.
    bound: HashMap<String, u64>,
    open_by_url: HashMap<String, usize>,
    max_by_url: HashMap<String, usize>,
    frames: Vec<Received>,
    prefix_violations: u64,
    pings: u64,
    pongs: u64,
    ping_terminations: u64,
    register_timeouts: u64,
    supersedes: u64,
    registered_sent: u64,
    errors_sent: Vec<String>,
    identities_sent: Vec<Value>,
    last_identity: HashMap<String, Instant>,
    pending: HashMap<String, oneshot::Sender<Value>>,
    http_heartbeats: Vec<Value>,
    http_texts: Vec<String>,
    closed: Vec<Closed>,
}

struct Shared {
    opts: TestMasterOpts,
    http_port: u16,
    ws_port: u16,
    inner: Mutex<Inner>,
    /// Bumped on every change; waiters re-check their condition on each bump.
    events: watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.events.send_modify(|n| *n += 1);
    }

    fn open(&self, port: u16, tx: mpsc::UnboundedSender<Out>) -> u64 {
        let id = {
            let mut s = self.lock();
            s.next_conn += 1;
            let id = s.next_conn;
            s.conns.insert(
                id,
                Conn {
                    port,
                    tx,
                    agent_url: None,
                    registered_at: 0,
                    superseded: false,
                    heartbeats: 0,
                },
            );
            id
        };
        self.bump();
        id
    }

    /// Unbinds and forgets a socket; called before its close goes out, so a client that
    /// reconnects on seeing the close never finds its old socket still counted.
    fn close(&self, id: u64, why: &str) {
        {
            let mut s = self.lock();
            let Some(conn) = s.conns.remove(&id) else {
                return;
            };
            if let Some(url) = &conn.agent_url {
                unbind(&mut s, url, id);
            }
            s.closed.push(Closed {
                conn: id,
                port: conn.port,
                agent_url: conn.agent_url,
                why: why.to_string(),
                heartbeats: conn.heartbeats,
            });
        }
        self.bump();
    }

    fn registered(&self, id: u64) -> bool {
        self.lock()
            .conns
            .get(&id)
            .is_some_and(|c| c.agent_url.is_some())
    }

    fn pong(&self) {
        self.lock().pongs += 1;
        self.bump();
    }

    fn count(&self, f: impl FnOnce(&mut Inner)) {
        f(&mut self.lock());
        self.bump();
    }

    /// One text frame from socket `id`: recorded, then handled as the master does.
    fn on_frame(&self, id: u64, port: u16, text: String) {
        {
            let mut s = self.lock();
            let value = serde_json::from_str::<Value>(&text).ok();
            let seq = s.frames.len() as u64 + 1;
            let registered = s.conns.get(&id).is_some_and(|c| c.agent_url.is_some());
            s.frames.push(Received {
                seq,
                conn: id,
                port,
                text: text.clone(),
                value: value.clone(),
                registered,
            });
            self.handle(&mut s, id, &text, value);
        }
        self.bump();
    }

    fn handle(&self, s: &mut Inner, id: u64, text: &str, value: Option<Value>) {
        let Some(v) = value else {
            send_error(s, id, "invalid JSON");
            return;
        };
        let Some(kind) = v.get("type").and_then(Value::as_str) else {
            send_error(s, id, "missing type");
            return;
        };
        match kind {
            "register" => self.on_register(s, id, &v),
            "heartbeat" => {
                let Some(url) = s.conns.get(&id).and_then(|c| c.agent_url.clone()) else {
                    send_error(s, id, "heartbeat before register");
                    return;
                };
                if !text.starts_with(HEARTBEAT_PREFIX) {
                    s.prefix_violations += 1;
                }
                if let Some(c) = s.conns.get_mut(&id) {
                    c.heartbeats += 1;
                }
                if self.opts.auto_identity {
                    self.check_identity(s, id, &url, &v);
                }
            }
            "result" => {
                // An unknown id is silently ignored.
                if let Some(rid) = v.get("id").and_then(Value::as_str)
                    && let Some(waiter) = s.pending.remove(rid)
                {
                    let _ = waiter.send(v.clone());
                }
            }
            // The master has no use for anything else on the relay.
            _ => {}
        }
    }

    fn on_register(&self, s: &mut Inner, id: u64, v: &Value) {
        let Some(url) = v
            .get("agentUrl")
            .and_then(Value::as_str)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
        else {
            send_error(s, id, "register: missing agentUrl");
            return;
        };
        // A second register on one socket rebinds it.
        let previous = s.conns.get_mut(&id).and_then(|c| c.agent_url.take());
        if let Some(previous) = previous {
            unbind(s, &previous, id);
        }
        // Supersede: the older socket lives on for the grace, then is terminated.
        if let Some(&older) = s.bound.get(&url)
            && older != id
        {
            s.supersedes += 1;
            if let Some(c) = s.conns.get_mut(&older) {
                c.superseded = true;
                let tx = c.tx.clone();
                let grace = self.opts.superseded_grace;
                if grace.is_zero() {
                    let _ = tx.send(Out::Terminate("superseded"));
                } else {
                    tokio::spawn(async move {
                        tokio::time::sleep(grace).await;
                        let _ = tx.send(Out::Terminate("superseded"));
                    });
                }
            }
        }
        s.bound.insert(url.clone(), id);
        let open = s.open_by_url.entry(url.clone()).or_default();
        *open += 1;
        let open = *open;
        let max = s.max_by_url.entry(url.clone()).or_default();
        *max = (*max).max(open);
        s.next_registration += 1;
        let order = s.next_registration;
        if let Some(c) = s.conns.get_mut(&id) {
            c.agent_url = Some(url);
            c.registered_at = order;
            let _ =
                c.tx.send(Out::Text(r#"{"type":"registered","ok":true}"#.into()));
        }
        s.registered_sent += 1;
    }

    /// §2.1.8: a slot at this master's HTTP port with another `wsPort` is told the relay port.
    fn check_identity(&self, s: &mut Inner, id: u64, url: &str, v: &Value) {
        let Some(masters) = v["statusData"]["masters"].as_array() else {
            return;
        };
        let wrong = masters.iter().find_map(|m| {
            let server = m.get("serverUrl")?.as_str()?;
            let port = reqwest::Url::parse(server).ok()?.port_or_known_default()?;
            let ws = m.get("wsPort").and_then(Value::as_u64);
            (port == self.http_port && ws != Some(u64::from(self.ws_port)))
                .then(|| server.to_string())
        });
        let Some(canonical) = wrong else {
            return;
        };
        let now = Instant::now();
        if s.last_identity
            .get(url)
            .is_some_and(|t| now.duration_since(*t) < self.opts.identity_interval)
        {
            return;
        }
        s.last_identity.insert(url.to_string(), now);
        let frame = identity_frame(&canonical, self.ws_port);
        if let Some(c) = s.conns.get(&id) {
            let _ = c.tx.send(Out::Text(frame.to_string()));
        }
        s.identities_sent.push(frame);
    }
}

fn unbind(s: &mut Inner, url: &str, id: u64) {
    if let Some(n) = s.open_by_url.get_mut(url) {
        *n = n.saturating_sub(1);
    }
    if s.bound.get(url) == Some(&id) {
        s.bound.remove(url);
    }
}

fn send_error(s: &mut Inner, id: u64, message: &str) {
    s.errors_sent.push(message.to_string());
    if let Some(c) = s.conns.get(&id) {
        let _ = c.tx.send(Out::Text(
            json!({"type":"error","message":message}).to_string(),
        ));
    }
}

fn identity_frame(canonical_url: &str, ws_port: u16) -> Value {
    json!({"type":"master-identity","canonicalUrl":canonical_url,"wsPort":ws_port})
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap()
}

/// Fantom's command id: `cmd-<ms in base36>-<6 random base36 chars>`.
fn command_id() -> String {
    let tail = base36(rand::random::<u64>());
    let tail: String = format!("{tail:0>6}").chars().rev().take(6).collect();
    format!("cmd-{}-{tail}", base36(now_ms()))
}

/// The running master; dropping it stops its listeners and drops every relay socket.
pub struct TestMaster {
    /// The dedicated relay port (`ws://127.0.0.1:<ws_port>/sidecar`).
    pub ws_port: u16,
    /// A second relay listener at a stale port ([`TestMasterOpts::old_relay`]).
    pub old_ws_port: Option<u16>,
    /// The main HTTP port (the port of `http_url`).
    pub http_port: u16,
    /// `http://127.0.0.1:<http_port>`: the master's `serverUrl`.
    pub http_url: String,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for TestMaster {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        for c in self.shared.lock().conns.values() {
            let _ = c.tx.send(Out::Terminate("master stopped"));
        }
    }
}

#[derive(Clone)]
struct RelayState {
    shared: Arc<Shared>,
    port: u16,
}

impl TestMaster {
    pub async fn start(opts: TestMasterOpts) -> TestMaster {
        let bind = || async {
            tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind a test master port")
        };
        let http = bind().await;
        let relay = bind().await;
        let old = if opts.old_relay {
            Some(bind().await)
        } else {
            None
        };
        let port = |l: &tokio::net::TcpListener| l.local_addr().unwrap().port();
        let (http_port, ws_port) = (port(&http), port(&relay));
        let old_ws_port = old.as_ref().map(port);
        let (events, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            opts,
            http_port,
            ws_port,
            inner: Mutex::new(Inner::default()),
            events,
        });

        let http_app = Router::new()
            .route("/api/admin/gpu/sidecars/heartbeat", post(http_heartbeat))
            .route(
                "/api/admin/gpu/sidecars/poll",
                post(|| async { Json(json!({"commands": []})) }),
            )
            .route(
                "/api/admin/gpu/sidecars/result",
                post(|| async { Json(json!({"ok": true})) }),
            )
            .with_state(shared.clone());
        let mut tasks = vec![tokio::spawn(async move {
            let _ = axum::serve(http, http_app).await;
        })];
        for listener in std::iter::once(relay).chain(old) {
            let state = RelayState {
                shared: shared.clone(),
                port: port(&listener),
            };
            let app = Router::new()
                .route(RELAY_PATH, get(relay_upgrade))
                .fallback(relay_other)
                .with_state(state);
            tasks.push(tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            }));
        }
        TestMaster {
            ws_port,
            old_ws_port,
            http_port,
            http_url: format!("http://127.0.0.1:{http_port}"),
            shared,
            tasks,
        }
    }

    /// `ws://127.0.0.1:<ws_port>/sidecar`.
    pub fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}{RELAY_PATH}", self.ws_port)
    }

    /// Waits (bounded by [`PATIENCE`]) until `probe` yields `Some` over the master's state.
    async fn wait_for<T>(&self, what: &str, mut probe: impl FnMut(&Inner) -> Option<T>) -> T {
        let mut changes = self.shared.events.subscribe();
        let deadline = Instant::now() + PATIENCE;
        loop {
            let found = {
                let s = self.shared.lock();
                probe(&s)
            };
            if let Some(v) = found {
                return v;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => panic!("the test master is gone while waiting for: {what}"),
                Err(_) => panic!("gave up waiting for: {what}\n{}", self.summary()),
            }
        }
    }

    /// Counts and the heads of the last frames, for failure messages.
    pub fn summary(&self) -> String {
        let s = self.shared.lock();
        let heads: Vec<String> = s
            .frames
            .iter()
            .rev()
            .take(8)
            .rev()
            .map(|f| {
                let head: String = f.text.chars().take(LOGGED_HEAD_CHARS).collect();
                format!("  #{} conn {} port {}: {head}", f.seq, f.conn, f.port)
            })
            .collect();
        format!(
            "test master: {} frames, {} open sockets, errors sent {:?}, closed {:?}, \
             {} http heartbeats; last frames:\n{}",
            s.frames.len(),
            s.conns.len(),
            s.errors_sent,
            s.closed
                .iter()
                .map(|c| format!("conn {} ({})", c.conn, c.why))
                .collect::<Vec<_>>(),
            s.http_heartbeats.len(),
            heads.join("\n")
        )
    }

    /// The first `register` frame whose agentUrl starts with `agent_url_prefix`.
    pub async fn wait_registered(&self, agent_url_prefix: &str) -> Value {
        self.wait_registrations(agent_url_prefix, 1).await.remove(0)
    }

    /// Every `register` frame whose agentUrl starts with the prefix, once there are `n`.
    pub async fn wait_registrations(&self, agent_url_prefix: &str, n: usize) -> Vec<Value> {
        self.wait_for(&format!("{n} register(s) from {agent_url_prefix}"), |s| {
            let found: Vec<Value> = registers(s, agent_url_prefix)
                .map(|f| f.value.clone().unwrap())
                .collect();
            (found.len() >= n).then_some(found)
        })
        .await
    }

    /// `register` frames so far whose agentUrl starts with the prefix.
    pub fn registrations(&self, agent_url_prefix: &str) -> usize {
        registers(&self.shared.lock(), agent_url_prefix).count()
    }

    /// Every heartbeat so far on a registered socket (parsed), once there are at least `n`.
    pub async fn wait_heartbeats(&self, n: usize) -> Vec<Value> {
        self.wait_heartbeats_after(0, n)
            .await
            .into_iter()
            .map(|f| f.value.unwrap())
            .collect()
    }

    /// Heartbeats on registered sockets with a sequence number above `seq`, once there are at
    /// least `n`.
    pub async fn wait_heartbeats_after(&self, seq: u64, n: usize) -> Vec<Received> {
        self.wait_for(&format!("{n} heartbeat(s) after frame #{seq}"), |s| {
            let found: Vec<Received> = s
                .frames
                .iter()
                .filter(|f| f.seq > seq && f.registered && f.kind() == Some("heartbeat"))
                .cloned()
                .collect();
            (found.len() >= n).then_some(found)
        })
        .await
    }

    /// The first frame received that satisfies `pred`.
    pub async fn wait_frame(&self, what: &str, pred: impl Fn(&Received) -> bool) -> Received {
        self.wait_for(what, |s| s.frames.iter().find(|f| pred(f)).cloned())
            .await
    }

    /// Waits (bounded) until `pred` holds over the master's counters, via a snapshot.
    /// The first heartbeat on a registered socket whose `statusData.containers` shows every
    /// role of `roles` running.
    pub async fn wait_running(&self, roles: &[&str]) -> Received {
        self.wait_frame(&format!("a heartbeat with {roles:?} running"), |f| {
            f.registered
                && f.kind() == Some("heartbeat")
                && roles.iter().all(|r| {
                    f.value
                        .as_ref()
                        .is_some_and(|v| v["statusData"]["containers"][r]["status"] == "running")
                })
        })
        .await
    }

    pub async fn wait_until(&self, what: &str, pred: impl Fn(&TestMaster) -> bool) {
        let mut changes = self.shared.events.subscribe();
        let deadline = Instant::now() + PATIENCE;
        while !pred(self) {
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => panic!("the test master is gone while waiting for: {what}"),
                Err(_) => panic!("gave up waiting for: {what}\n{}", self.summary()),
            }
        }
    }

    /// The number of frames received so far (the `seq` of the latest one).
    pub fn seq(&self) -> u64 {
        self.shared.lock().frames.len() as u64
    }

    /// Every frame received so far.
    pub fn frames(&self) -> Vec<Received> {
        self.shared.lock().frames.clone()
    }

    /// The raw texts of every relay frame received (for leak checks).
    pub fn frames_text(&self) -> Vec<String> {
        self.shared
            .lock()
            .frames
            .iter()
            .map(|f| f.text.clone())
            .collect()
    }

    /// The raw bodies of every HTTP-fallback heartbeat received.
    pub fn http_texts(&self) -> Vec<String> {
        self.shared.lock().http_texts.clone()
    }

    /// HTTP-fallback heartbeats accepted (with an agentUrl), parsed.
    pub fn http_heartbeats(&self) -> Vec<Value> {
        self.shared.lock().http_heartbeats.clone()
    }

    /// Every HTTP-fallback heartbeat accepted so far (parsed), once there are at least `n`.
    pub async fn wait_http_heartbeats(&self, n: usize) -> Vec<Value> {
        self.wait_for(&format!("{n} HTTP-fallback heartbeat(s)"), |s| {
            (s.http_heartbeats.len() >= n).then(|| s.http_heartbeats.clone())
        })
        .await
    }

    /// Heartbeats whose text did not start with exactly `{"type":"heartbeat"`.
    pub fn prefix_violations(&self) -> u64 {
        self.shared.lock().prefix_violations
    }

    /// The most sockets open at once under one agentUrl (over all agentUrls).
    pub fn max_concurrent_sockets(&self) -> usize {
        self.shared
            .lock()
            .max_by_url
            .values()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// The most sockets open at once under `agent_url`.
    pub fn max_concurrent_sockets_for(&self, agent_url: &str) -> usize {
        self.shared
            .lock()
            .max_by_url
            .get(agent_url)
            .copied()
            .unwrap_or(0)
    }

    /// Registered sockets open now under `agent_url`.
    pub fn open_sockets(&self, agent_url: &str) -> usize {
        self.shared
            .lock()
            .open_by_url
            .get(agent_url)
            .copied()
            .unwrap_or(0)
    }

    /// Sockets open now on relay port `port`, registered or not.
    pub fn open_sockets_on(&self, port: u16) -> usize {
        self.shared
            .lock()
            .conns
            .values()
            .filter(|c| c.port == port)
            .count()
    }

    pub fn pings(&self) -> u64 {
        self.shared.lock().pings
    }

    pub fn pongs(&self) -> u64 {
        self.shared.lock().pongs
    }

    /// Sockets terminated for missing pongs.
    pub fn ping_terminations(&self) -> u64 {
        self.shared.lock().ping_terminations
    }

    /// Sockets terminated for sending no `register` in time.
    pub fn register_timeouts(&self) -> u64 {
        self.shared.lock().register_timeouts
    }

    /// Registers that found another socket bound to their agentUrl.
    pub fn supersedes(&self) -> u64 {
        self.shared.lock().supersedes
    }

    pub fn registered_sent(&self) -> u64 {
        self.shared.lock().registered_sent
    }

    /// The `message` of every `error` frame sent, in order.
    pub fn errors_sent(&self) -> Vec<String> {
        self.shared.lock().errors_sent.clone()
    }

    /// Every `master-identity` frame sent (automatic or on demand).
    pub fn identities_sent(&self) -> Vec<Value> {
        self.shared.lock().identities_sent.clone()
    }

    /// Every relay socket that ended, in order.
    pub fn closed(&self) -> Vec<Closed> {
        self.shared.lock().closed.clone()
    }

    /// The latest registered socket still open (not superseded); waits (bounded) for one.
    async fn target(&self) -> mpsc::UnboundedSender<Out> {
        self.wait_for("a registered relay socket", |s| {
            s.conns
                .values()
                .filter(|c| c.agent_url.is_some() && !c.superseded)
                .max_by_key(|c| c.registered_at)
                .map(|c| c.tx.clone())
        })
        .await
    }

    /// Sends `text` as is to the latest registered socket.
    pub async fn send_raw(&self, text: &str) {
        let tx = self.target().await;
        tx.send(Out::Text(text.to_string()))
            .expect("the relay socket is open");
    }

    /// Sends `{"type":"command","id":"cmd-…","action":action, …payload}` (flat, as Fantom
    /// builds it: `type`, `id` and `action` first) to the latest registered socket and returns
    /// the `result` frame with that id. Panics when none comes within the command timeout.
    pub async fn command(&self, action: &str, payload: Map<String, Value>) -> Value {
        for reserved in ["type", "id", "action"] {
            assert!(
                !payload.contains_key(reserved),
                "a command payload may not carry '{reserved}'"
            );
        }
        let id = command_id();
        let mut text = format!(
            "{{\"type\":\"command\",\"id\":{},\"action\":{}",
            Value::from(id.as_str()),
            Value::from(action)
        );
        for (k, v) in &payload {
            text.push_str(&format!(",{}:{}", Value::from(k.as_str()), v));
        }
        text.push('}');
        let tx = self.target().await;
        let (done, answer) = oneshot::channel();
        self.shared.lock().pending.insert(id.clone(), done);
        tx.send(Out::Text(text)).expect("the relay socket is open");
        match tokio::time::timeout(self.shared.opts.command_timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => panic!("command {action} ({id}): the master dropped the waiter"),
            Err(_) => {
                self.shared.lock().pending.remove(&id);
                panic!(
                    "command {action} ({id}): no result within {:?}\n{}",
                    self.shared.opts.command_timeout,
                    self.summary()
                )
            }
        }
    }

    /// Sends `{"type":"config","id":"cfg-…","payload":payload}` (fire and forget: no
    /// `result` is expected). `payload` is the frame's `payload` (`{"openrouter":{…}}`).
    pub async fn push_config(&self, payload: Value) {
        self.push_config_as("config", payload).await;
    }

    /// As [`TestMaster::push_config`] with the payload given as JSON text, so a test decides
    /// the key order (Fantom's frame has `apiKey` first in `payload.openrouter`).
    pub async fn push_config_text(&self, payload_text: &str) {
        serde_json::from_str::<Value>(payload_text).expect("the config payload is JSON");
        let text = format!(
            "{{\"type\":\"config\",\"id\":{},\"payload\":{payload_text}}}",
            Value::from(format!("cfg-{}", base36(now_ms())))
        );
        self.send_raw(&text).await;
    }

    /// Fantom's push as its frame has it: `payload.openrouter` with `apiKey` first, then the
    /// keys of `rest` (an object: `allowedModels`, `modeByRole`, `domain`, …).
    pub async fn push_openrouter_with_key(&self, key: &str, rest: Value) {
        let rest = rest
            .as_object()
            .expect("the rest of payload.openrouter is an object");
        let mut text = format!("{{\"openrouter\":{{\"apiKey\":{}", Value::from(key));
        for (k, v) in rest {
            text.push_str(&format!(",{}:{v}", Value::from(k.as_str())));
        }
        text.push_str("}}");
        self.push_config_text(&text).await;
    }

    /// As [`TestMaster::push_config`] with another frame type (the upstream sidecar also
    /// accepts `config-push`).
    pub async fn push_config_as(&self, kind: &str, payload: Value) {
        let text = format!(
            "{{\"type\":{},\"id\":{},\"payload\":{payload}}}",
            Value::from(kind),
            Value::from(format!("cfg-{}", base36(now_ms())))
        );
        self.send_raw(&text).await;
    }

    /// Sends `{"type":"master-identity","canonicalUrl":…,"wsPort":…}` to the latest
    /// registered socket.
    pub async fn send_identity(&self, canonical_url: &str, ws_port: u16) {
        let frame = identity_frame(canonical_url, ws_port);
        let tx = self.target().await;
        self.shared.lock().identities_sent.push(frame.clone());
        tx.send(Out::Text(frame.to_string()))
            .expect("the relay socket is open");
    }

    /// Closes every relay socket now (a close frame, 1001 "going away") and returns once the
    /// master has forgotten them all. Each socket is unbound before its close goes out.
    pub async fn close_all(&self) {
        let ids: Vec<u64> = {
            let s = self.shared.lock();
            for c in s.conns.values() {
                let _ = c.tx.send(Out::Close(1001, "going away"));
            }
            s.conns.keys().copied().collect()
        };
        self.wait_for("every relay socket closed", |s| {
            ids.iter().all(|id| !s.conns.contains_key(id)).then_some(())
        })
        .await;
    }

    /// Drops every relay socket without a close frame (a dead peer, from the client's side).
    pub async fn terminate_all(&self) {
        let ids: Vec<u64> = {
            let s = self.shared.lock();
            for c in s.conns.values() {
                let _ = c.tx.send(Out::Terminate("terminated by the test"));
            }
            s.conns.keys().copied().collect()
        };
        self.wait_for("every relay socket dropped", |s| {
            ids.iter().all(|id| !s.conns.contains_key(id)).then_some(())
        })
        .await;
    }
}

fn registers<'a>(s: &'a Inner, prefix: &'a str) -> impl Iterator<Item = &'a Received> + 'a {
    s.frames.iter().filter(move |f| {
        f.kind() == Some("register")
            && f.value.as_ref().unwrap()["agentUrl"]
                .as_str()
                .is_some_and(|u| u.starts_with(prefix))
    })
}

/// `/sidecar`: the WebSocket upgrade; a plain GET gets the relay's `ok` JSON.
async fn relay_upgrade(
    State(state): State<RelayState>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match ws {
        Ok(ws) => ws.on_upgrade(move |socket| run_socket(state.shared, state.port, socket)),
        Err(_) => relay_ok().into_response(),
    }
}

fn relay_ok() -> Json<Value> {
    Json(json!({"ok":true,"role":"fantom-soundsuite-master","wsPath":RELAY_PATH}))
}

/// Any other path on the relay port: an upgrade gets a 404, a plain request the `ok` JSON.
async fn relay_other(headers: HeaderMap) -> Response {
    if headers.contains_key(header::UPGRADE) {
        StatusCode::NOT_FOUND.into_response()
    } else {
        relay_ok().into_response()
    }
}

/// One relay socket, master side: reads, the master's writes, the ping sweep, the register
/// deadline. Every way out unbinds the socket first ([`Shared::close`]).
async fn run_socket(shared: Arc<Shared>, port: u16, socket: WebSocket) {
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Out>();
    let id = shared.open(port, tx);
    let register_by = Instant::now() + shared.opts.register_deadline;
    let every = shared.opts.ping_every;
    let mut ping = tokio::time::interval_at(Instant::now() + every, every);
    // A stalled test runtime must not fire a burst of pings and count them all as missed.
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut missed = 0u32;
    let why: String = loop {
        let registered = shared.registered(id);
        tokio::select! {
            msg = stream.next() => match msg {
                Some(Ok(Message::Text(t))) => shared.on_frame(id, port, t.as_str().to_string()),
                // Binary frames are decoded as UTF-8 and parsed the same way.
                Some(Ok(Message::Binary(b))) => match String::from_utf8(b.to_vec()) {
                    Ok(t) => shared.on_frame(id, port, t),
                    Err(_) => shared.on_frame(id, port, String::from_utf8_lossy(&b).into_owned()),
                },
                Some(Ok(Message::Pong(_))) => {
                    missed = 0;
                    shared.pong();
                }
                // axum answers pings itself.
                Some(Ok(Message::Ping(_))) => {}
                Some(Ok(Message::Close(frame))) => {
                    break format!("client closed ({:?})", frame.map(|f| f.code));
                }
                None => break "client went away".into(),
                Some(Err(e)) => break format!("read error: {e}"),
            },
            out = rx.recv() => match out {
                Some(Out::Text(text)) => {
                    if let Err(e) = sink.send(Message::Text(text.into())).await {
                        break format!("write error: {e}");
                    }
                }
                Some(Out::Close(code, reason)) => {
                    shared.close(id, reason);
                    let frame = CloseFrame { code, reason: reason.into() };
                    let _ = sink.send(Message::Close(Some(frame))).await;
                    return;
                }
                Some(Out::Terminate(reason)) => {
                    shared.close(id, reason);
                    return;
                }
                // Shared holds a sender while the socket is open.
                None => break "master gone".into(),
            },
            _ = ping.tick() => {
                if missed >= shared.opts.max_missed_pongs {
                    shared.count(|s| s.ping_terminations += 1);
                    shared.close(id, "missed pongs");
                    return;
                }
                missed += 1;
                shared.count(|s| s.pings += 1);
                if let Err(e) = sink.send(Message::Ping(Bytes::new())).await {
                    break format!("ping write error: {e}");
                }
            }
            _ = tokio::time::sleep_until(register_by), if !registered => {
                shared.count(|s| s.register_timeouts += 1);
                shared.close(id, "no register in time");
                return;
            }
        }
    };
    shared.close(id, &why);
}

/// `POST /api/admin/gpu/sidecars/heartbeat`: the WS heartbeat's content plus `agentUrl` (top
/// level, else `statusData.agentUrl`); `{ok:true, commands:[]}` or 400.
async fn http_heartbeat(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let text = String::from_utf8_lossy(&body).into_owned();
    let parsed = serde_json::from_str::<Value>(&text);
    let answer = {
        let mut s = shared.lock();
        s.http_texts.push(text);
        match parsed {
            Err(_) => (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": "invalid JSON"})),
            ),
            Ok(v) => {
                let url = v
                    .get("agentUrl")
                    .and_then(Value::as_str)
                    .or_else(|| v["statusData"]["agentUrl"].as_str())
                    .filter(|u| !u.is_empty());
                if url.is_none() {
                    (
                        StatusCode::BAD_REQUEST,
                        Json(json!({"error": "missing agentUrl"})),
                    )
                } else {
                    s.http_heartbeats.push(v);
                    (StatusCode::OK, Json(json!({"ok": true, "commands": []})))
                }
            }
        }
    };
    shared.bump();
    answer.into_response()
}

// The master itself, driven by a protocol-level client (no agent process).

type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn dial(url: &str) -> Client {
    tokio_tungstenite::connect_async(url)
        .await
        .expect("dial the test master")
        .0
}

async fn send(ws: &mut Client, text: &str) {
    use tokio_tungstenite::tungstenite::Message as M;
    ws.send(M::Text(text.into())).await.unwrap();
}

/// The next text frame, parsed; `None` when the socket ended.
async fn next_json(ws: &mut Client) -> Option<Value> {
    use tokio_tungstenite::tungstenite::Message as M;
    loop {
        match tokio::time::timeout(PATIENCE, ws.next())
            .await
            .expect("a frame in time")
        {
            Some(Ok(M::Text(t))) => return Some(serde_json::from_str(t.as_str()).unwrap()),
            Some(Ok(M::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => continue,
        }
    }
}

#[tokio::test]
async fn the_test_master_speaks_the_relay_as_the_reference_describes() {
    let master = TestMaster::start(TestMasterOpts {
        superseded_grace: Duration::ZERO,
        ..Default::default()
    })
    .await;
    assert_ne!(master.ws_port, master.http_port);
    let mut ws = dial(&master.ws_url()).await;
    send(&mut ws, r#"{"type":"heartbeat","statusData":{}}"#).await;
    assert_eq!(
        next_json(&mut ws).await.unwrap(),
        json!({"type":"error","message":"heartbeat before register"})
    );
    send(&mut ws, "not json").await;
    assert_eq!(next_json(&mut ws).await.unwrap()["message"], "invalid JSON");
    send(&mut ws, r#"{"agentUrl":"x"}"#).await;
    assert_eq!(next_json(&mut ws).await.unwrap()["message"], "missing type");
    send(&mut ws, r#"{"type":"register"}"#).await;
    assert_eq!(
        next_json(&mut ws).await.unwrap()["message"],
        "register: missing agentUrl"
    );
    send(
        &mut ws,
        r#"{"type":"register","agentUrl":"http://10.0.0.5:8098","hostname":"gpu-01"}"#,
    )
    .await;
    assert_eq!(
        next_json(&mut ws).await.unwrap(),
        json!({"type":"registered","ok":true})
    );
    // A heartbeat with `type` first counts; one with another key first is a violation.
    send(&mut ws, r#"{"type":"heartbeat","activeRequests":0}"#).await;
    send(&mut ws, r#"{"activeRequests":0,"type":"heartbeat"}"#).await;
    master.wait_heartbeats(2).await;
    assert_eq!(master.prefix_violations(), 1);
    assert_eq!(master.open_sockets("http://10.0.0.5:8098"), 1);

    // A command goes out flat, `type` first; the result with its id comes back.
    let asking = master.command("bogus", {
        let mut p = Map::new();
        p.insert("role".into(), json!("embedding"));
        p
    });
    let answering = async {
        let cmd = next_json(&mut ws).await.unwrap();
        assert_eq!(cmd["type"], "command");
        assert_eq!(cmd["action"], "bogus");
        assert_eq!(cmd["role"], "embedding");
        assert!(cmd["id"].as_str().unwrap().starts_with("cmd-"), "{cmd}");
        // An unknown id is ignored; the right one answers.
        send(&mut ws, r#"{"type":"result","id":"cmd-nope","error":"x"}"#).await;
        let reply = json!({"type":"result","id":cmd["id"],"error":"Unknown action: bogus"});
        send(&mut ws, &reply.to_string()).await;
    };
    let (result, ()) = tokio::join!(asking, answering);
    assert_eq!(result["error"], "Unknown action: bogus");

    // A second socket for the same agentUrl supersedes the first (grace 0: at once).
    let mut second = dial(&master.ws_url()).await;
    send(
        &mut second,
        r#"{"type":"register","agentUrl":"http://10.0.0.5:8098"}"#,
    )
    .await;
    assert_eq!(next_json(&mut second).await.unwrap()["type"], "registered");
    assert_eq!(next_json(&mut ws).await, None, "the superseded socket ends");
    assert_eq!(master.supersedes(), 1);
    assert_eq!(master.max_concurrent_sockets(), 2);
    master
        .wait_until("the superseded socket forgotten", |m| {
            m.open_sockets("http://10.0.0.5:8098") == 1
        })
        .await;

    // close_all: the client sees the close, and the master has already unbound it.
    master.close_all().await;
    assert_eq!(master.open_sockets("http://10.0.0.5:8098"), 0);
    assert_eq!(next_json(&mut second).await, None);

    // The HTTP fallback.
    let http = reqwest::Client::new();
    let url = format!("{}/api/admin/gpu/sidecars/heartbeat", master.http_url);
    let r = http
        .post(&url)
        .json(&json!({"type":"heartbeat"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"error":"missing agentUrl"})
    );
    let r = http
        .post(&url)
        .json(&json!({"type":"heartbeat","agentUrl":"http://10.0.0.5:8098"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"ok":true,"commands":[]})
    );
    assert_eq!(master.http_heartbeats().len(), 1);

    // The relay port: a plain GET is the `ok` JSON; an upgrade elsewhere is a 404.
    let plain: Value = http
        .get(format!("http://127.0.0.1:{}/", master.ws_port))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(plain["wsPath"], "/sidecar");
    let elsewhere =
        tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{}/other", master.ws_port)).await;
    assert!(elsewhere.is_err(), "an upgrade off /sidecar is refused");
}

#[tokio::test]
async fn the_test_master_ends_silent_sockets_and_corrects_a_stale_ws_port() {
    let master = TestMaster::start(TestMasterOpts {
        register_deadline: Duration::from_millis(300),
        old_relay: true,
        ..Default::default()
    })
    .await;
    // No register within the deadline: terminated.
    let mut silent = dial(&master.ws_url()).await;
    assert_eq!(next_json(&mut silent).await, None);
    assert_eq!(master.register_timeouts(), 1);

    // A heartbeat that shows this master's HTTP port with a stale wsPort gets one
    // master-identity (rate-limited), naming the serverUrl exactly as the sidecar has it.
    let old = master.old_ws_port.unwrap();
    let mut ws = dial(&format!("ws://127.0.0.1:{old}/sidecar")).await;
    send(
        &mut ws,
        r#"{"type":"register","agentUrl":"http://10.0.0.6:8098"}"#,
    )
    .await;
    assert_eq!(next_json(&mut ws).await.unwrap()["type"], "registered");
    let beat = json!({"type":"heartbeat","statusData":{"masters":[
        {"serverUrl": master.http_url, "wsPort": old, "connectionMode": "websocket"},
        {"serverUrl": "http://127.0.0.1:1", "wsPort": 3002, "connectionMode": "websocket"}]}});
    send(&mut ws, &beat.to_string()).await;
    send(&mut ws, &beat.to_string()).await;
    assert_eq!(
        next_json(&mut ws).await.unwrap(),
        json!({"type":"master-identity","canonicalUrl":master.http_url,"wsPort":master.ws_port})
    );
    master.wait_heartbeats(2).await;
    assert_eq!(master.identities_sent().len(), 1);
}
