//! A small etcd v3 client over etcd's JSON gateway: the gRPC API with JSON bodies
//! (`POST /v3/kv/range`, `/v3/kv/txn`, `/v3/lease/grant`, …) that every etcd since 3.4 serves
//! on its client port. Chosen over a gRPC client so that building needs no `protoc`.
//!
//! It fails over by itself (the common Rust etcd client does not): a call that cannot reach an
//! endpoint (refused, timed out, or the member answered that it is unavailable, as one without
//! a Raft leader does) is tried on the next, and the endpoint that answered is tried first the
//! next time. Every call is bounded by the per-endpoint timeout, so a store without quorum is
//! an error within seconds, never a hang. With a user and password it authenticates and keeps
//! the token (a [`Secret`]); a call refused for its token (unknown, older than an auth change,
//! or without a user: [`needs_login`]) logs in again and is retried once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Value, json};

use crate::secret::Secret;

/// How to reach the store.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// Client URLs (`http://…:2379` or `https://…`), tried in turn.
    pub endpoints: Vec<String>,
    /// A CA bundle (PEM) to trust for `https://` endpoints, beside the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// A client certificate and its key (PEM), for etcd's `--client-cert-auth`.
    pub cert_file: Option<std::path::PathBuf>,
    pub key_file: Option<std::path::PathBuf>,
    pub user: Option<String>,
    pub password: Option<Secret>,
    /// One call on one endpoint.
    pub timeout: Duration,
    /// How long a call goes round the endpoints again while none can serve it (etcd electing
    /// its own leader takes about a second); then it fails.
    pub retry_for: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no etcd endpoint answered ({tried} tried; the last: {last})")]
    Unavailable { tried: usize, last: String },
    #[error("etcd refused {call}: {message}")]
    Refused { call: &'static str, message: String },
    #[error("etcd's answer to {call} could not be read: {message}")]
    Malformed { call: &'static str, message: String },
    #[error("the etcd client cannot be set up: {0}")]
    Setup(String),
}

/// One key with its value and revisions.
#[derive(Clone, Debug, PartialEq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub lease: i64,
}

/// A condition of a transaction.
#[derive(Clone, Debug)]
pub enum Compare {
    /// The key's creation revision is this (0: the key does not exist).
    CreateRevision { key: String, revision: i64 },
    /// The key's last modification is this revision (0: the key does not exist).
    ModRevision { key: String, revision: i64 },
}

/// An operation of a transaction.
#[derive(Clone, Debug)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Get {
        key: String,
    },
    Delete {
        key: String,
    },
    /// Every key that starts with this.
    DeletePrefix {
        prefix: String,
    },
}

/// What a transaction did: which branch ran, the keys its gets read, the store's revision.
#[derive(Clone, Debug)]
pub struct TxnOutcome {
    pub succeeded: bool,
    pub read: Vec<Kv>,
    pub revision: i64,
}

/// A live lease.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lease {
    pub id: i64,
    pub ttl_s: i64,
}

pub struct EtcdClient {
    http: reqwest::Client,
    endpoints: Vec<String>,
    /// The endpoint tried first (the last that answered).
    first: AtomicUsize,
    credentials: Option<(String, Secret)>,
    token: tokio::sync::Mutex<Option<Secret>>,
    retry_for: Duration,
}

impl std::fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClient")
            .field("endpoints", &self.endpoints)
            .field("user", &self.credentials.as_ref().map(|(u, _)| u))
            .finish_non_exhaustive()
    }
}

impl EtcdClient {
    pub fn new(opts: &EtcdOptions) -> Result<Self, EtcdError> {
        if opts.endpoints.is_empty() {
            return Err(EtcdError::Setup("no endpoint given".into()));
        }
        let mut endpoints = Vec::new();
        let n = opts.endpoints.len();
        for (i, e) in opts.endpoints.iter().enumerate() {
            // Never echoed: a mistyped endpoint may hold a password.
            let which = format!("etcd endpoint {} of {n}", i + 1);
            let url = reqwest::Url::parse(e.trim())
                .map_err(|why| EtcdError::Setup(format!("the {which} is not a URL ({why})")))?;
            if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
                return Err(EtcdError::Setup(format!(
                    "the {which} is not http(s)://host:port"
                )));
            }
            if !url.username().is_empty() || url.password().is_some() {
                return Err(EtcdError::Setup(format!(
                    "the {which} carries credentials: give --etcd-user and --etcd-password-file instead"
                )));
            }
            let mut shown = url.clone();
            shown.set_query(None);
            shown.set_fragment(None);
            endpoints.push(shown.as_str().trim_end_matches('/').to_string());
        }
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .timeout(opts.timeout)
            .connect_timeout(opts.timeout)
            .pool_idle_timeout(Duration::from_secs(30));
        if let Some(ca) = &opts.ca_file {
            let pem = std::fs::read(ca)
                .map_err(|e| EtcdError::Setup(format!("cannot read {}: {e}", ca.display())))?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| EtcdError::Setup(format!("{}: {e}", ca.display())))?
            {
                builder = builder.add_root_certificate(cert);
            }
        }
        match (&opts.cert_file, &opts.key_file) {
            (Some(cert), Some(key)) => {
                let mut pem = std::fs::read(cert).map_err(|e| {
                    EtcdError::Setup(format!("cannot read {}: {e}", cert.display()))
                })?;
                pem.push(b'\n');
                pem.extend(std::fs::read(key).map_err(|e| {
                    EtcdError::Setup(format!("cannot read {}: {e}", key.display()))
                })?);
                let identity = reqwest::Identity::from_pem(&pem)
                    .map_err(|e| EtcdError::Setup(format!("the client certificate: {e}")))?;
                builder = builder.identity(identity);
            }
            (None, None) => {}
            _ => {
                return Err(EtcdError::Setup(
                    "a client certificate needs its key, and a key its certificate".into(),
                ));
            }
        }
        let credentials = match (&opts.user, &opts.password) {
            (Some(user), Some(password)) => Some((user.clone(), password.clone())),
            (None, None) => None,
            _ => {
                return Err(EtcdError::Setup(
                    "etcd authentication needs both a user and a password".into(),
                ));
            }
        };
        let http = builder
            .build()
            .map_err(|e| EtcdError::Setup(e.to_string()))?;
        Ok(Self {
            http,
            endpoints,
            first: AtomicUsize::new(0),
            credentials,
            token: tokio::sync::Mutex::new(None),
            retry_for: opts.retry_for,
        })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Calls `path` with `body` on the endpoints in turn, from the last that answered, and
    /// round them again for `retry_for` while none can serve it.
    async fn call(&self, name: &'static str, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let mut renewed = false;
        let until = tokio::time::Instant::now() + self.retry_for;
        loop {
            let token = match self.token().await {
                Err(EtcdError::Unavailable { .. }) if tokio::time::Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                other => other?,
            };
            match self.call_once(name, path, body, token.as_ref()).await {
                Err(EtcdError::Unavailable { .. }) if tokio::time::Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(EtcdError::Refused { message, .. })
                    if !renewed && self.credentials.is_some() && needs_login(&message) =>
                {
                    // Forget the token only if no other call has logged in again meanwhile.
                    let mut stored = self.token.lock().await;
                    let used = token.as_ref().map(Secret::expose);
                    if stored.as_ref().map(Secret::expose) == used {
                        *stored = None;
                    }
                    tracing::debug!(call = name, "etcd wants a new login; logging in again");
                    renewed = true;
                }
                other => return other,
            }
        }
    }

    async fn call_once(
        &self,
        name: &'static str,
        path: &str,
        body: &Value,
        token: Option<&Secret>,
    ) -> Result<Value, EtcdError> {
        let n = self.endpoints.len();
        let start = self.first.load(Ordering::Relaxed) % n;
        let mut last = String::new();
        for i in 0..n {
            let at = (start + i) % n;
            let endpoint = &self.endpoints[at];
            let mut request = self.http.post(format!("{endpoint}{path}")).json(body);
            if let Some(token) = token {
                request = request.header(reqwest::header::AUTHORIZATION, token.expose());
            }
            let response = match request.send().await {
                Ok(r) => r,
                Err(e) => {
                    last = format!("{endpoint}: {}", transport_error(&e));
                    tracing::debug!(endpoint = %endpoint, call = name, error = %last, "etcd endpoint unreachable; trying the next");
                    continue;
                }
            };
            let status = response.status();
            let answer: Value = match response.json().await {
                Ok(v) => v,
                Err(e) => {
                    last = format!("{endpoint}: {}", transport_error(&e));
                    continue;
                }
            };
            // A unary call's error is `{"error": "…", "code": N}`; a streaming call's (lease
            // keepalive) is `{"error": {"grpc_code": N, "message": "…"}}`, with HTTP 200.
            let failure = match answer.get("error") {
                Some(Value::String(m)) => Some((
                    m.clone(),
                    answer.get("code").and_then(Value::as_i64).unwrap_or(0),
                )),
                Some(Value::Object(o)) => Some((
                    o.get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("an error without a message")
                        .to_string(),
                    o.get("grpc_code").and_then(Value::as_i64).unwrap_or(0),
                )),
                _ => None,
            };
            if let Some((message, code)) = failure {
                // 14 Unavailable, 4 DeadlineExceeded: this member cannot serve it now (no
                // leader, stopping, partitioned); another may.
                if code == 14 || code == 4 || status.is_server_error() && code == 0 {
                    last = format!("{endpoint}: {message}");
                    continue;
                }
                return Err(EtcdError::Refused {
                    call: name,
                    message,
                });
            }
            if !status.is_success() {
                last = format!("{endpoint}: HTTP {status}");
                continue;
            }
            self.first.store(at, Ordering::Relaxed);
            return Ok(answer);
        }
        Err(EtcdError::Unavailable { tried: n, last })
    }

    /// The auth token (authenticating first when there is none yet).
    async fn token(&self) -> Result<Option<Secret>, EtcdError> {
        let Some((user, password)) = &self.credentials else {
            return Ok(None);
        };
        let mut token = self.token.lock().await;
        if let Some(t) = token.as_ref() {
            return Ok(Some(t.clone()));
        }
        let body = json!({"name": user, "password": password.expose()});
        let answer = self
            .call_once("authenticate", "/v3/auth/authenticate", &body, None)
            .await?;
        let value = answer
            .get("token")
            .and_then(Value::as_str)
            .ok_or_else(|| malformed("authenticate", "no token"))?;
        *token = Some(Secret::new(value));
        Ok(token.clone())
    }

    /// One key, or `None`.
    pub async fn get(&self, key: &str) -> Result<Option<Kv>, EtcdError> {
        let answer = self
            .call(
                "range",
                "/v3/kv/range",
                &json!({"key": b64(key.as_bytes())}),
            )
            .await?;
        Ok(kvs("range", &answer)?.into_iter().next())
    }

    /// Every key that starts with `prefix`, in key order.
    pub async fn get_prefix(&self, prefix: &str) -> Result<Vec<Kv>, EtcdError> {
        let body = json!({"key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix))});
        let answer = self.call("range", "/v3/kv/range", &body).await?;
        kvs("range", &answer)
    }

    /// The keys (no values) that start with `prefix`, in key order.
    pub async fn keys_with_prefix(&self, prefix: &str) -> Result<Vec<String>, EtcdError> {
        let body = json!({"key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix)),
            "keys_only": true});
        let answer = self.call("range", "/v3/kv/range", &body).await?;
        Ok(kvs("range", &answer)?
            .into_iter()
            .map(|kv| kv.key)
            .collect())
    }

    /// Runs `success` if every compare holds, else `failure`.
    pub async fn txn(
        &self,
        compare: &[Compare],
        success: &[Op],
        failure: &[Op],
    ) -> Result<TxnOutcome, EtcdError> {
        let compare: Vec<Value> = compare
            .iter()
            .map(|c| match c {
                Compare::CreateRevision { key, revision } => json!({
                    "key": b64(key.as_bytes()),
                    "target": "CREATE",
                    "result": "EQUAL",
                    "create_revision": revision.to_string(),
                }),
                Compare::ModRevision { key, revision } => json!({
                    "key": b64(key.as_bytes()),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": revision.to_string(),
                }),
            })
            .collect();
        let body = json!({
            "compare": compare,
            "success": success.iter().map(op_json).collect::<Vec<_>>(),
            "failure": failure.iter().map(op_json).collect::<Vec<_>>(),
        });
        let answer = self.call("txn", "/v3/kv/txn", &body).await?;
        let succeeded = answer
            .get("succeeded")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let mut read = Vec::new();
        for r in answer
            .get("responses")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(range) = r.get("response_range") {
                read.extend(kvs("txn", range)?);
            }
        }
        Ok(TxnOutcome {
            succeeded,
            read,
            revision: revision("txn", &answer)?,
        })
    }

    /// A new lease of `ttl_s` seconds.
    pub async fn grant(&self, ttl_s: i64) -> Result<Lease, EtcdError> {
        let answer = self
            .call("lease grant", "/v3/lease/grant", &json!({"TTL": ttl_s}))
            .await?;
        Ok(Lease {
            id: int("lease grant", &answer, "ID")?,
            ttl_s: int("lease grant", &answer, "TTL")?,
        })
    }

    /// Renews a lease: its TTL now, or `None` when it is gone (expired or revoked).
    pub async fn keep_alive(&self, id: i64) -> Result<Option<i64>, EtcdError> {
        let answer = self
            .call(
                "lease keepalive",
                "/v3/lease/keepalive",
                &json!({"ID": id.to_string()}),
            )
            .await?;
        let result = answer.get("result").unwrap_or(&answer);
        if let Some(message) = answer
            .get("error")
            .and_then(|e| e.get("message"))
            .and_then(Value::as_str)
        {
            return Err(EtcdError::Refused {
                call: "lease keepalive",
                message: message.to_string(),
            });
        }
        let ttl = opt_int(result, "TTL").unwrap_or(0);
        Ok((ttl > 0).then_some(ttl))
    }

    /// Ends a lease now (its keys go with it).
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        match self
            .call(
                "lease revoke",
                "/v3/lease/revoke",
                &json!({"ID": id.to_string()}),
            )
            .await
        {
            Err(EtcdError::Refused { message, .. }) if message.contains("lease not found") => {
                Ok(())
            }
            other => other.map(|_| ()),
        }
    }

    /// Each endpoint's own answer to a status call: its member id and the Raft leader it
    /// sees, or why it did not answer.
    pub async fn member_status(&self) -> Vec<(String, Result<MemberStatus, String>)> {
        let mut out = Vec::new();
        for endpoint in &self.endpoints {
            let answer = async {
                let r = self
                    .http
                    .post(format!("{endpoint}/v3/maintenance/status"))
                    .json(&json!({}))
                    .send()
                    .await
                    .map_err(|e| transport_error(&e))?;
                let v: Value = r.json().await.map_err(|e| transport_error(&e))?;
                if let Some(m) = v.get("error").and_then(Value::as_str) {
                    return Err(m.to_string());
                }
                let member = v
                    .get("header")
                    .and_then(|h| opt_int(h, "member_id"))
                    .unwrap_or(0);
                Ok(MemberStatus {
                    member,
                    leader: opt_int(&v, "leader").unwrap_or(0),
                })
            }
            .await;
            out.push((endpoint.clone(), answer));
        }
        out
    }
}

/// One member's view.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemberStatus {
    pub member: i64,
    /// The Raft leader it follows (0: none).
    pub leader: i64,
}

/// A transport error without its URL (the endpoint is named beside it).
fn transport_error(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else if e.is_decode() {
        "an answer that is not JSON"
    } else {
        "the request failed"
    };
    let mut source = std::error::Error::source(e);
    let mut detail = String::new();
    while let Some(s) = source {
        detail = s.to_string();
        source = s.source();
    }
    if detail.is_empty() {
        kind.to_string()
    } else {
        format!("{kind} ({detail})")
    }
}

fn b64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// The first key after every key that starts with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from here on.
    vec![0]
}

fn op_json(op: &Op) -> Value {
    match op {
        Op::Put { key, value, lease } => {
            let mut put = json!({"key": b64(key.as_bytes()), "value": b64(value)});
            if let Some(lease) = lease {
                put["lease"] = json!(lease.to_string());
            }
            json!({"request_put": put})
        }
        Op::Get { key } => json!({"request_range": {"key": b64(key.as_bytes())}}),
        Op::Delete { key } => json!({"request_delete_range": {"key": b64(key.as_bytes())}}),
        Op::DeletePrefix { prefix } => json!({"request_delete_range": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
        }}),
    }
}

fn malformed(call: &'static str, message: impl Into<String>) -> EtcdError {
    EtcdError::Malformed {
        call,
        message: message.into(),
    }
}

/// An int64 field (the gateway writes them as strings); absent is `None`.
fn opt_int(v: &Value, field: &str) -> Option<i64> {
    match v.get(field)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

fn int(call: &'static str, v: &Value, field: &str) -> Result<i64, EtcdError> {
    opt_int(v, field).ok_or_else(|| malformed(call, format!("no {field}")))
}

fn revision(call: &'static str, v: &Value) -> Result<i64, EtcdError> {
    v.get("header")
        .and_then(|h| opt_int(h, "revision"))
        .ok_or_else(|| malformed(call, "no header revision"))
}

fn kvs(call: &'static str, v: &Value) -> Result<Vec<Kv>, EtcdError> {
    let mut out = Vec::new();
    for kv in v.get("kvs").and_then(Value::as_array).into_iter().flatten() {
        let decode = |field: &str| -> Result<Vec<u8>, EtcdError> {
            match kv.get(field).and_then(Value::as_str) {
                None => Ok(Vec::new()),
                Some(s) => STANDARD
                    .decode(s)
                    .map_err(|e| malformed(call, format!("{field}: {e}"))),
            }
        };
        let key = String::from_utf8(decode("key")?)
            .map_err(|_| malformed(call, "a key that is not UTF-8"))?;
        out.push(Kv {
            key,
            value: decode("value")?,
            create_revision: opt_int(kv, "create_revision").unwrap_or(0),
            mod_revision: opt_int(kv, "mod_revision").unwrap_or(0),
            lease: opt_int(kv, "lease").unwrap_or(0),
        });
    }
    Ok(out)
}

/// Whether etcd refused a call for its token rather than for what it asked: the token
/// expired or is unknown (`invalid auth token`), was issued before an auth change (`revision
/// of auth store is old`: any user, role or grant changed since), or carried no user (`user
/// name is empty`: the member lost it). etcd's own Go client logs in again on exactly these.
fn needs_login(message: &str) -> bool {
    [
        "invalid auth token",
        "revision of auth store is old",
        "user name is empty",
    ]
    .iter()
    .any(|m| message.contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_older_than_an_auth_change_logs_in_again() {
        assert!(needs_login("etcdserver: invalid auth token"));
        assert!(needs_login("etcdserver: revision of auth store is old"));
        assert!(needs_login("etcdserver: user name is empty"));
        assert!(!needs_login("etcdserver: permission denied"));
        assert!(!needs_login(
            "etcdserver: authentication failed, invalid user ID or password"
        ));
    }

    #[test]
    fn prefix_ends_step_the_last_byte() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }

    #[test]
    fn endpoints_must_be_http_urls_without_credentials() {
        let opts = |e: &str| EtcdOptions {
            endpoints: vec![e.into()],
            ca_file: None,
            cert_file: None,
            key_file: None,
            user: None,
            password: None,
            timeout: Duration::from_secs(1),
            retry_for: Duration::ZERO,
        };
        assert!(EtcdClient::new(&opts("http://127.0.0.1:2379")).is_ok());
        let refused = EtcdClient::new(&opts("http://root:hunter2@127.0.0.1:2379")).unwrap_err();
        assert!(!refused.to_string().contains("hunter2"), "{refused}");
        assert!(EtcdClient::new(&opts("127.0.0.1:2379")).is_err());
        assert!(EtcdClient::new(&opts("unix:///run/etcd.sock")).is_err());
    }

    #[test]
    fn int64_fields_read_as_strings_or_numbers() {
        let v = json!({"a": "12", "b": 7, "c": true});
        assert_eq!(opt_int(&v, "a"), Some(12));
        assert_eq!(opt_int(&v, "b"), Some(7));
        assert_eq!(opt_int(&v, "c"), None);
    }
}
