//! A real three-member etcd cluster on loopback for the HA tests: Debian's `etcd` binary
//! (`etcd-server`: installed by `.ci/run`; without it, the package is fetched with
//! `apt-get download` and unpacked into `.cache/etcd`, no root needed), each member in a
//! temporary dir on ports it was given, started and killed by the test (dropped: all killed).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{PATIENCE, free_port};

/// The `etcd` binary: on the PATH, else Debian's package unpacked into `.cache/etcd`.
fn etcd_binary() -> std::path::PathBuf {
    static BINARY: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BINARY
        .get_or_init(|| {
            let on_path = Command::new("etcd")
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if on_path {
                return "etcd".into();
            }
            let cache = Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/etcd");
            let unpacked = cache.join("root/usr/bin/etcd");
            if unpacked.exists() {
                return unpacked;
            }
            std::fs::create_dir_all(&cache).unwrap();
            let fetched = Command::new("apt-get")
                .args(["download", "etcd-server"])
                .current_dir(&cache)
                .status()
                .is_ok_and(|s| s.success());
            let deb = std::fs::read_dir(&cache)
                .unwrap()
                .filter_map(Result::ok)
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "deb"));
            let Some(deb) = deb.filter(|_| fetched) else {
                panic!(
                    "no etcd: install Debian's etcd-server (`apt-get install etcd-server`; .ci/run \
                     does), or let `apt-get download etcd-server` work (run `apt-get update`)"
                );
            };
            let unpacked_ok = Command::new("dpkg-deb")
                .arg("-x")
                .arg(&deb)
                .arg(cache.join("root"))
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                unpacked_ok && unpacked.exists(),
                "cannot unpack {}",
                deb.display()
            );
            unpacked
        })
        .clone()
}

pub struct Member {
    pub name: String,
    pub client_url: String,
    child: Option<Child>,
}

pub struct Cluster {
    pub members: Vec<Member>,
}

impl Cluster {
    /// Starts three members under `dir` and waits (bounded) until each reports healthy.
    pub async fn start(dir: &Path) -> Cluster {
        Self::start_with(dir, &[]).await
    }

    /// [`Cluster::start`] with more arguments for every member.
    pub async fn start_with(dir: &Path, more: &[String]) -> Cluster {
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let token = format!("fantom-test-{}", std::process::id());
        let mut members = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let data = dir.join(&name);
            let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
            let child = Command::new(etcd_binary())
                .args([
                    "--name",
                    &name,
                    "--data-dir",
                    &data.display().to_string(),
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &initial.join(","),
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    &token,
                ])
                .args(more)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run etcd: {e}"));
            members.push(Member {
                name,
                client_url: format!("http://127.0.0.1:{client}"),
                child: Some(child),
            });
        }
        let cluster = Cluster { members };
        for m in &cluster.members {
            cluster.wait_healthy(m, dir).await;
        }
        cluster
    }

    async fn wait_healthy(&self, m: &Member, dir: &Path) {
        let http = reqwest::Client::new();
        let deadline = Instant::now() + PATIENCE;
        loop {
            let healthy = match http
                .get(format!("{}/health", m.client_url))
                .timeout(Duration::from_secs(2))
                .send()
                .await
            {
                Ok(r) => r
                    .json::<serde_json::Value>()
                    .await
                    .is_ok_and(|v| v["health"] == "true"),
                Err(_) => false,
            };
            if healthy {
                return;
            }
            if Instant::now() >= deadline {
                let log = std::fs::read_to_string(dir.join(format!("{}.log", m.name)))
                    .unwrap_or_default();
                panic!("etcd member {} never became healthy:\n{log}", m.name);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The client URLs, comma-separated (what `--etcd-endpoints` takes).
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| m.client_url.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The member that is etcd's own Raft leader now (bounded wait for one to be elected).
    pub async fn raft_leader(&self) -> usize {
        let http = reqwest::Client::new();
        crate::support::eventually("an etcd Raft leader", || async {
            for (i, m) in self.members.iter().enumerate() {
                if m.child.is_none() {
                    continue;
                }
                let Ok(r) = http
                    .post(format!("{}/v3/maintenance/status", m.client_url))
                    .json(&serde_json::json!({}))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                else {
                    continue;
                };
                let Ok(v) = r.json::<serde_json::Value>().await else {
                    continue;
                };
                if v["leader"].is_string() && v["leader"] == v["header"]["member_id"] {
                    return Some(i);
                }
            }
            None
        })
        .await
    }

    /// `body` posted to `path` of the JSON gateway of the first running member that answers
    /// (with a JSON body), and that answer.
    async fn gateway(&self, path: &str, body: serde_json::Value) -> Option<serde_json::Value> {
        let http = reqwest::Client::new();
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            let Ok(r) = http
                .post(format!("{}{path}", m.client_url))
                .json(&body)
                .timeout(Duration::from_secs(2))
                .send()
                .await
            else {
                continue;
            };
            if r.status().is_success()
                && let Ok(v) = r.json::<serde_json::Value>().await
            {
                return Some(v);
            }
        }
        None
    }

    /// `body` posted to `path` as `token`'s user (etcd auth); the answer, or etcd's error.
    pub async fn call_as(
        &self,
        token: Option<&str>,
        path: &str,
        body: serde_json::Value,
    ) -> serde_json::Value {
        let http = reqwest::Client::new();
        let m = self
            .members
            .iter()
            .find(|m| m.child.is_some())
            .expect("a running member");
        let mut r = http.post(format!("{}{path}", m.client_url)).json(&body);
        if let Some(t) = token {
            r = r.header("authorization", t);
        }
        let answer: serde_json::Value = r
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("etcd answers")
            .json()
            .await
            .expect("a JSON answer");
        assert!(answer.get("error").is_none(), "{path}: {answer}");
        answer
    }

    /// Turns etcd's auth on with a `root` user of `password` (as `etcdctl user add root`,
    /// `role add root`, `user grant-role root root`, `auth enable` do); root's token after.
    pub async fn enable_auth(&self, password: &str) -> String {
        use serde_json::json;
        self.call_as(
            None,
            "/v3/auth/user/add",
            json!({"name": "root", "password": password}),
        )
        .await;
        self.call_as(None, "/v3/auth/role/add", json!({"name": "root"}))
            .await;
        self.call_as(
            None,
            "/v3/auth/user/grant",
            json!({"user": "root", "role": "root"}),
        )
        .await;
        self.call_as(None, "/v3/auth/enable", json!({})).await;
        let answer = self
            .call_as(
                None,
                "/v3/auth/authenticate",
                json!({"name": "root", "password": password}),
            )
            .await;
        answer["token"].as_str().expect("a token").to_string()
    }

    /// Deletes `key` (through a running member's JSON gateway), as an operator with etcdctl
    /// could; whether a member answered.
    pub async fn delete_key(&self, key: &str) -> bool {
        let body = serde_json::json!({"key": base64_key(key)});
        self.gateway("/v3/kv/deleterange", body).await.is_some()
    }

    /// Sends a signal (`STOP`, `CONT`) to a running member.
    pub fn signal(&self, i: usize, name: &str) {
        let child = self.members[i].child.as_ref().expect("running");
        let sent = Command::new("kill")
            .args([format!("-{name}"), child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{name} failed");
    }

    /// SIGKILL one member.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// A key as etcd's JSON gateway takes it.
fn base64_key(key: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(key)
}

/// A loopback HTTP forwarder in front of one etcd member that passes every call until it is
/// armed with a number of transactions, then passes that many more and answers every call
/// after them as a member without a Raft leader does (code 14): a store that fails midway.
pub struct Cutter {
    pub url: String,
    budget: std::sync::Arc<std::sync::atomic::AtomicI64>,
    /// Transactions to pass before the one [`Cutter::delay_after`] holds (`i64::MAX`: none).
    late: std::sync::Arc<std::sync::atomic::AtomicI64>,
    /// Lets the held transaction go; told when etcd answered it.
    release: std::sync::Arc<(tokio::sync::Notify, tokio::sync::Notify)>,
    server: tokio::task::JoinHandle<()>,
}

impl Cutter {
    pub async fn start(member_url: &str) -> Cutter {
        use axum::body::Bytes;
        use axum::extract::{Request, State};
        use axum::response::IntoResponse;
        use std::sync::atomic::{AtomicI64, Ordering};
        type Shared = (
            reqwest::Client,
            String,
            std::sync::Arc<AtomicI64>,
            std::sync::Arc<AtomicI64>,
            std::sync::Arc<(tokio::sync::Notify, tokio::sync::Notify)>,
        );
        let budget = std::sync::Arc::new(AtomicI64::new(i64::MAX));
        let late = std::sync::Arc::new(AtomicI64::new(i64::MAX));
        let release = std::sync::Arc::new((tokio::sync::Notify::new(), tokio::sync::Notify::new()));
        let shared: Shared = (
            reqwest::Client::new(),
            member_url.to_string(),
            budget.clone(),
            late.clone(),
            release.clone(),
        );
        async fn pass(
            State((http, to, budget, late, release)): State<Shared>,
            req: Request,
        ) -> axum::response::Response {
            let path = req.uri().path().to_string();
            let auth = req.headers().get("authorization").cloned();
            let body: Bytes = axum::body::to_bytes(req.into_body(), 16 << 20)
                .await
                .unwrap_or_default();
            let writes = path == "/v3/kv/txn" && body.windows(11).any(|w| w == b"request_put");
            if writes && late.load(Ordering::SeqCst) < 0 {
                // A put while one is held: lost too (its retries among them).
                return (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    axum::Json(serde_json::json!({"error": "no answer (the test)", "code": 14})),
                )
                    .into_response();
            }
            if path == "/v3/kv/txn" && late.fetch_sub(1, Ordering::SeqCst) == 0 {
                // Answered as lost at once; applied only when the test releases it.
                let (http, to, late) = (http.clone(), to.clone(), late.clone());
                tokio::spawn(async move {
                    release.0.notified().await;
                    let mut r = http.post(format!("{to}{path}")).body(body);
                    if let Some(a) = auth {
                        r = r.header("authorization", a);
                    }
                    let _ = r.send().await;
                    late.store(i64::MAX, Ordering::SeqCst);
                    release.1.notify_one();
                });
                return (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    axum::Json(serde_json::json!({"error": "no answer (the test)", "code": 14})),
                )
                    .into_response();
            }
            let cut = budget.load(Ordering::SeqCst) <= 0
                || (path == "/v3/kv/txn" && budget.fetch_sub(1, Ordering::SeqCst) <= 0);
            if cut {
                return (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    axum::Json(serde_json::json!({"error": "cut by the test", "code": 14})),
                )
                    .into_response();
            }
            let mut r = http.post(format!("{to}{path}")).body(body);
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            match r.send().await {
                Ok(answer) => {
                    let status = answer.status();
                    let bytes = answer.bytes().await.unwrap_or_default();
                    (status, bytes).into_response()
                }
                Err(_) => axum::http::StatusCode::BAD_GATEWAY.into_response(),
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new().fallback(pass).with_state(shared);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Cutter {
            url,
            budget,
            late,
            release,
            server,
        }
    }

    /// From now on, `n` more transactions pass; the next is answered as lost (no answer from
    /// etcd) but held, and applied only at [`Cutter::apply_held`]: a write that lands after
    /// its writer gave up on it. Until then every transaction that puts is lost too (a retry
    /// of it among them); reads and deletes pass.
    pub fn delay_after(&self, n: i64) {
        self.late.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Applies the held transaction now (returns once etcd answered it).
    pub async fn apply_held(&self) {
        self.release.0.notify_one();
        self.release.1.notified().await;
    }

    /// From now on, `n` more transactions pass; every call after them is cut.
    pub fn cut_after(&self, n: i64) {
        self.budget.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Every call passes again.
    pub fn heal(&self) {
        self.budget
            .store(i64::MAX, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Cutter {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Cluster {
    /// The first running member's client URL.
    pub fn first_url(&self) -> String {
        self.members
            .iter()
            .find(|m| m.child.is_some())
            .expect("a running member")
            .client_url
            .clone()
    }

    /// Waits (bounded) until the stored root under `prefix` names `part`.
    pub async fn part_stored(&self, prefix: &str, part: &str) {
        crate::support::eventually(&format!("the part {part} is stored"), || async {
            self.stored_parts(prefix)
                .await
                .iter()
                .any(|p| p == part)
                .then_some(())
        })
        .await
    }

    /// The part names the stored root under `prefix` names (empty: no root).
    pub async fn stored_parts(&self, prefix: &str) -> Vec<String> {
        use base64::Engine as _;
        let body = serde_json::json!({"key": base64_key(&format!("{prefix}/state/root"))});
        let Some(answer) = self.gateway("/v3/kv/range", body).await else {
            return Vec::new();
        };
        let Some(value) = answer["kvs"][0]["value"].as_str() else {
            return Vec::new();
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(value)
            .unwrap();
        let root: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        root["parts"]
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default()
    }
}
