//! Test support for the fleet: real `fantom-sidecar` processes (hub, agent, serve) on loopback
//! ports they choose themselves, an HTTP client, and a raw WebSocket "agent" that speaks the
//! protocol frame by frame (for leases, bad input and supersede cases a real agent never
//! produces on purpose).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

pub use crate::local_support::{cosine, minilm_dir};

pub const BIN: &str = env!("CARGO_BIN_EXE_fantom-sidecar");

/// The agent's GET routes a master (or the host) may read: none may show a key or token.
pub const AGENT_GET_ROUTES: [&str; 5] = [
    "/api/status",
    "/status",
    "/api/health",
    "/health",
    "/api/masters",
];

/// Every wait in these tests is bounded by this.
pub const PATIENCE: Duration = Duration::from_secs(120);

/// A running process of ours; killed when dropped.
pub struct Proc {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `fantom-sidecar args…`, stderr to `log`, and waits for its `listener` line.
    pub fn start(args: &[String], envs: &[(&str, &str)], log: &Path, listener: &str) -> Proc {
        let mut cmd = Command::new(BIN);
        cmd.args(["--log-format", "json"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).expect("log file"));
        if !envs.iter().any(|(k, _)| *k == "RUST_LOG") {
            cmd.env("RUST_LOG", "info");
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn fantom-sidecar");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel::<Value>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(v) if v["listening"] == listener => {
                    let addr = v["addr"].as_str().unwrap().parse().unwrap();
                    return Proc {
                        child: Some(child),
                        addr,
                        log: log.to_path_buf(),
                    };
                }
                Ok(_) => continue,
                Err(_) => {
                    let _ = child.kill();
                    let log = std::fs::read_to_string(log).unwrap_or_default();
                    panic!("fantom-sidecar {args:?} never listened ({listener}); log:\n{log}");
                }
            }
        }
    }

    /// SIGKILL: no goodbye, sockets just drop.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal by name (`HUP`, `TERM`, ...).
    pub fn signal(&self, name: &str) {
        let child = self.child.as_ref().expect("running");
        let sent = Command::new("kill")
            .args([format!("-{name}"), child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{name} failed");
    }

    /// SIGTERM, then wait (bounded) for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) for the process to exit by itself.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                self.child = None;
                return status;
            }
            assert!(Instant::now() < deadline, "the process did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }
}

/// Runs `fantom-sidecar args…` that should end by itself (bounded by [`PATIENCE`], killed
/// past it): its exit status and stderr.
pub fn run_to_exit(args: &[String], log: &Path) -> (ExitStatus, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("spawn fantom-sidecar");
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("fantom-sidecar {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(log).unwrap_or_default())
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A hub process with its state dir and tokens.
pub struct HubProc {
    pub proc: Proc,
    pub state: PathBuf,
    pub admin: String,
    pub fleet: String,
    pub fleet_file: PathBuf,
    pub http: reqwest::Client,
}

impl HubProc {
    /// `hub --listen ADDR --state-dir DIR/state` (+ `extra`), logging to `DIR/<log>`.
    pub fn start(
        dir: &Path,
        addr: Option<SocketAddr>,
        extra: &[&str],
        envs: &[(&str, &str)],
        log: &str,
    ) -> HubProc {
        let state = dir.join("state");
        let listen = addr.map_or_else(|| "127.0.0.1:0".to_string(), |a| a.to_string());
        let mut args: Vec<String> = vec![
            "hub".into(),
            "--listen".into(),
            listen,
            "--state-dir".into(),
        ];
        args.push(state.display().to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        let proc = Proc::start(&args, envs, &dir.join(log), "hub");
        Self::around(proc, state)
    }

    /// Wraps a process that runs a hub (`hub` or `serve`) with its state dir.
    pub fn around(proc: Proc, state: PathBuf) -> HubProc {
        let read = |name: &str| {
            std::fs::read_to_string(state.join(name))
                .unwrap()
                .trim()
                .to_string()
        };
        HubProc {
            admin: read("admin.token"),
            fleet: read("fleet.token"),
            fleet_file: state.join("fleet.token"),
            proc,
            state,
            http: reqwest::Client::new(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        self.proc.url(path)
    }

    /// A scripted agent connected with the fleet token.
    pub async fn raw_agent(&self) -> RawAgent {
        RawAgent::connect(&self.ws_url(), Some(&self.fleet))
            .await
            .expect("the hub takes an agent")
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/v1/agent", self.proc.addr)
    }

    pub async fn status(&self) -> Value {
        self.admin_get("/admin/status").await
    }

    pub async fn admin_get(&self, path: &str) -> Value {
        let r = self
            .http
            .get(self.url(path))
            .bearer_auth(&self.admin)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.unwrap()
    }

    pub async fn push(&self, body: Value) -> (u16, Value) {
        self.post_admin("/admin/config", &body).await
    }

    /// POSTs `body` to an admin route with the admin token.
    pub async fn post_admin(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.url(path))
            .bearer_auth(&self.admin)
            .json(body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// `GET path` without a token: the status and the JSON body (`Null` when it is not JSON).
    /// POSTs `body` and reads the answer's server-sent events (`data:` payloads, in order),
    /// after checking it is a 200.
    pub async fn post_events(&self, path: &str, body: &Value) -> Vec<String> {
        let r = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        read_sse(r).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.http.get(self.url(path)).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// Waits until `agent` is connected with a provider for `role`.
    pub async fn wait_for_agent(&self, agent: &str) -> Value {
        eventually(&format!("agent {agent} connected"), || async {
            let s = self.status().await;
            s["agents"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["id"] == agent)
                .cloned()
        })
        .await
    }

    /// Waits until space `id` is its role's current one; returns it as status shows it.
    pub async fn wait_for_current_space(&self, id: &str) -> Value {
        eventually(&format!("{id} is its role's space"), || async {
            let s = self.status().await;
            s["gate"]["spaces"]
                .as_array()?
                .iter()
                .find(|x| x["id"] == id && x["current"] == true)
                .cloned()
        })
        .await
    }

    /// A counter or gauge from `/metrics` (summed over matching label sets).
    pub async fn metric(&self, name_and_labels: &str) -> f64 {
        let text = self
            .http
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|l| l.starts_with(name_and_labels))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// `serve` with the MiniLM embedder on a loopback port (agent `solo`, state in `dir/state`,
/// its log in `dir/serve.log`), with `extra` flags.
pub fn start_serve(dir: &Path, extra: &[&str]) -> HubProc {
    let state = dir.join("state");
    let minilm = crate::local_support::minilm_dir().display().to_string();
    let state_arg = state.display().to_string();
    let mut args: Vec<String> = [
        "serve",
        "--model",
        "all-minilm-l6-v2",
        "--model-dir",
        &minilm,
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        &state_arg,
        "--agent-id",
        "solo",
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    let proc = Proc::start(&args, &[], &dir.join("serve.log"), "hub");
    HubProc::around(proc, state)
}

/// Polls `probe` until it yields `Some` (bounded by [`PATIENCE`]).
pub async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + PATIENCE;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "gave up waiting for: {what}");
    }
}

/// An agent process serving the MiniLM embedder (and so both embedding roles).
pub fn start_agent(dir: &Path, hub: &HubProc, id: &str, envs: &[(&str, &str)]) -> Proc {
    start_agent_with(dir, &hub.ws_url(), &hub.fleet_file, id, "", envs)
}

/// [`start_agent`] for any hub URL, with extra top-level TOML lines.
pub fn start_agent_with(
    dir: &Path,
    hub_url: &str,
    fleet_file: &Path,
    id: &str,
    extra: &str,
    envs: &[(&str, &str)],
) -> Proc {
    let models = format!("{extra}\n{}", minilm_models_toml());
    start_agent_toml(dir, hub_url, fleet_file, id, &models, envs)
}

/// An agent whose TOML is the hub, id and token lines plus `body` (models, cloud settings;
/// an empty body is an agent with no local model).
pub fn start_agent_toml(
    dir: &Path,
    hub_url: &str,
    fleet_file: &Path,
    id: &str,
    body: &str,
    envs: &[(&str, &str)],
) -> Proc {
    let toml = format!(
        r#"hub_url = "{hub_url}"
agent_id = "{id}"
fleet_token_file = "{}"
drain_timeout_s = 60
{body}
"#,
        fleet_file.display(),
    );
    run_agent(dir, id, &toml, envs)
}

/// Writes `<dir>/<id>.toml` and runs `agent --config` on it (`--http` on a free port),
/// logging to `<dir>/<id>.log`.
fn run_agent(dir: &Path, id: &str, toml: &str, envs: &[(&str, &str)]) -> Proc {
    let config = dir.join(format!("{id}.toml"));
    std::fs::write(&config, toml).unwrap();
    Proc::start(
        &agent_args(&config),
        envs,
        &dir.join(format!("{id}.log")),
        "agent",
    )
}

/// `agent --config <config> --http 127.0.0.1:0`.
pub fn agent_args(config: &Path) -> Vec<String> {
    vec![
        "agent".into(),
        "--config".into(),
        config.display().to_string(),
        "--http".into(),
        "127.0.0.1:0".into(),
    ]
}

/// An agent with no hub: its TOML is only `agent_id`, `drain_timeout_s` and `body` (the
/// Fantom relay's `agent_url`, `[[fantom_master]]` tables, models, cloud settings). Top-level
/// keys of `body` must come before its first table.
pub fn start_relay_agent(dir: &Path, id: &str, body: &str, envs: &[(&str, &str)]) -> Proc {
    let toml = format!(
        r#"agent_id = "{id}"
drain_timeout_s = 60
{body}
"#
    );
    run_agent(dir, id, &toml, envs)
}

/// The `[[models]]` table of [`start_agent_with`]: MiniLM on the CPU for both embedding roles.
pub fn minilm_models_toml() -> String {
    format!(
        r#"
[[models]]
roles = ["embedding", "code-embedding"]
model = "all-minilm-l6-v2"
model_dir = "{}"
device = "cpu"
pipeline_depth = 2
max_items_per_work = 16
"#,
        minilm_dir().display()
    )
}

/// A `[[models]]` table serving the reranker role: the MiniLM cross-encoder fixture (the
/// committed head shard, MiniLM's trunk weights linked) assembled under `dir`, on the CPU.
pub fn cross_encoder_models_toml(dir: &Path) -> String {
    let model_dir = crate::local_support::assemble_cross_encoder(dir);
    format!(
        r#"
[[models]]
roles = ["reranker"]
model_dir = "{}"
device = "cpu"
"#,
        model_dir.display()
    )
}

/// A loopback port nothing listens on (bound, then released).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().unwrap().port()
}

/// A protocol-level agent driven frame by frame.
pub struct RawAgent {
    ws: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    /// Gate probes are answered on the way (every text: the unit vector along `probe_axis`
    /// of this width), so tests see the frames they are about.
    pub probe_dims: usize,
    pub probe_axis: usize,
}

impl RawAgent {
    pub async fn connect(url: &str, token: Option<&str>) -> Result<RawAgent, tungstenite::Error> {
        let mut request = url.into_client_request()?;
        if let Some(t) = token {
            request
                .headers_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        let (ws, _) = tokio_tungstenite::connect_async(request).await?;
        Ok(RawAgent {
            ws,
            probe_dims: 2,
            probe_axis: 0,
        })
    }

    pub async fn send(&mut self, frame: Value) {
        self.send_text(&frame.to_string()).await;
    }

    pub async fn send_text(&mut self, text: &str) {
        self.ws.send(Message::Text(text.into())).await.unwrap();
    }

    pub async fn send_binary(&mut self, bytes: Vec<u8>) {
        self.ws.send(Message::Binary(bytes.into())).await.unwrap();
    }

    /// The next text frame as it came (pings and other control frames skipped); `None` when
    /// the socket closed. One deadline for the frame wanted: the hub's pings never extend it.
    async fn next_text(&mut self) -> Option<String> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .expect("a frame in time");
            match next {
                Some(Ok(Message::Text(t))) => return Some(t.to_string()),
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
                Some(Ok(_)) => continue,
            }
        }
    }

    /// Answers `frame` if it is a gate probe (every text: [`RawAgent::probe_unit`]); whether
    /// it was one.
    async fn answer_if_probe(&mut self, frame: &str) -> bool {
        let Ok(v) = serde_json::from_str::<Value>(frame) else {
            return false;
        };
        if v["type"] != "probe" {
            return false;
        }
        let n = v["texts"].as_array().map_or(0, Vec::len);
        if v["query"].is_string() {
            // The scorer check's probe pairs: every raw agent scores them alike.
            let scores: Vec<Value> = (0..n)
                .map(|i| json!({"score": -(i as f64), "probability": 1.0 / (1.0 + i as f64)}))
                .collect();
            self.send(json!({"type":"probe_result","probe":v["probe"],
                "provider":v["provider"],"scores":scores}))
                .await;
            return true;
        }
        self.send(json!({"type":"probe_result","probe":v["probe"],
            "provider":v["provider"],"vectors":vec![self.probe_unit(); n]}))
            .await;
        true
    }

    /// The next text frame as text, gate probes answered on the way; `None` when the socket
    /// closed (bounded wait).
    pub async fn recv_text(&mut self) -> Option<String> {
        loop {
            let text = self.next_text().await?;
            if !self.answer_if_probe(&text).await {
                return Some(text);
            }
        }
    }

    /// Reads frames until one gate probe came and was answered (the gate's first word with a
    /// new provider).
    pub async fn answer_one_probe(&mut self) {
        loop {
            let text = self
                .next_text()
                .await
                .expect("the socket closed before a probe came");
            if self.answer_if_probe(&text).await {
                return;
            }
        }
    }

    /// What this agent answers a probe text with.
    fn probe_unit(&self) -> Vec<f32> {
        let mut unit = vec![0.0f32; self.probe_dims];
        unit[self.probe_axis] = 1.0;
        unit
    }

    /// The next text frame, parsed, probes included (not answered); panics on close.
    pub async fn recv_unanswered(&mut self) -> Value {
        let text = self.next_text().await.expect("socket open");
        serde_json::from_str(&text).unwrap()
    }

    /// The next text frame, parsed; panics on close.
    pub async fn recv(&mut self) -> Value {
        let text = self.recv_text().await.expect("socket open");
        serde_json::from_str(&text).unwrap()
    }

    /// The next frame of `kind`, skipping others (e.g. frames of other kinds in between).
    pub async fn recv_kind(&mut self, kind: &str) -> Value {
        loop {
            let v = self.recv().await;
            if v["type"] == kind {
                return v;
            }
        }
    }

    /// Says hello with one embedding provider `id` (dims 2) and returns `welcome`.
    pub async fn hello(&mut self, agent: &str, providers: Value) -> Value {
        self.send(
            json!({"type":"hello","agent_id":agent,"hostname":"test","version":"0",
            "protocol_version":1,"providers":providers}),
        )
        .await;
        let w = self.recv().await;
        assert_eq!(w["type"], "welcome", "{w}");
        w
    }

    pub async fn close(mut self) {
        let _ = self.ws.close(None).await;
    }
}

/// A fake embedding provider's description.
pub fn fake_provider(id: &str, role: &str, max_items: usize) -> Value {
    json!({"id":id,"role":role,"backend":"local","model":"fake","dims":2,
           "max_batch_items":max_items,"max_batch_tokens":1_000_000})
}

/// Texts for the kill test: varied lengths, code and prose, all distinct.
pub fn many_texts(n: usize) -> Vec<String> {
    let words = [
        "vector",
        "fn",
        "index",
        "lease",
        "queue",
        "tensor",
        "struct",
        "embedding",
        "hub",
        "agent",
        "während",
        "数据",
        "async",
        "await",
        "let",
        "match",
        "impl",
        "pub",
        "mod",
        "crate",
    ];
    (0..n)
        .map(|i| {
            let len = 3 + (i * 7919) % 40;
            let body: Vec<&str> = (0..len)
                .map(|k| words[(i * 31 + k * 17) % words.len()])
                .collect();
            format!("{i}: {}", body.join(" "))
        })
        .collect()
}

pub fn vector(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Files under `dir` (recursively, `skip` aside) whose bytes contain `needle`.
pub fn files_containing(dir: &Path, needle: &str, skip: &[&Path]) -> Vec<String> {
    let mut hits = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return hits;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if skip.contains(&path.as_path()) {
            continue;
        }
        if path.is_dir() {
            hits.extend(files_containing(&path, needle, skip));
        } else if let Ok(bytes) = std::fs::read(&path)
            && bytes.windows(needle.len()).any(|w| w == needle.as_bytes())
        {
            hits.push(path.display().to_string());
        }
    }
    hits
}

/// A whole server-sent-event answer (200, `text/event-stream`): each event's `data:`, in order.
pub async fn read_sse(r: reqwest::Response) -> Vec<String> {
    assert_eq!(r.status(), 200);
    let kind = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(kind.starts_with("text/event-stream"), "{kind}");
    let text = r.text().await.unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// The content a stream's chunks add up to (`choices[0].delta.content`, in order).
pub fn streamed_content(events: &[String]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}
