//! A stand-in for OpenRouter: a real HTTP server on `127.0.0.1` (random port) that answers our
//! OpenRouter client the way the real service does (see
//! `shared/reference/openrouter-budget-gate-notes.md` §1). Behaviours modelled:
//!
//! * bearer auth (401 `No auth credentials found` for a wrong or missing key);
//! * `POST /api/v1/embeddings`, `/rerank`, `/chat/completions` (non-stream and SSE stream);
//! * provider routing: `only` / `ignore` (a base slug matches every `base/…` variant, the full
//!   slug exactly one endpoint), `quantizations`; none left → 404 `no_endpoints`; unknown model
//!   → 400; a model of another kind → 400 `wrong_endpoint`;
//! * limits, in this order: hard 402 (out of credits) → platform RPM 429 over a sliding 60 s
//!   window with `X-RateLimit-*` headers (reset in epoch ms, echoed in `metadata.headers`) →
//!   transient 402 `in_flight_budget_exhausted` → upstream capacity 429 with `provider_name`;
//!   the transient ones carry `Retry-After`. Every request that gets past the RPM check counts
//!   toward the window, including those then refused by the in-flight budget or the capacity
//!   (requests refused by the RPM check itself do not, so `X-RateLimit-Reset` stays truthful);
//! * per-request latency (seeded uniform), and a test "hold" that parks admitted requests so
//!   concurrency tests need no sleeps;
//! * embedding vectors: clean from a supplied embedder (or hash-based), a per-endpoint cosine
//!   perturbation that is exact (`cos(clean, served) = c`), a per-endpoint width override,
//!   `dimensions` truncation, `encoding_format: "base64"`;
//! * `GET /api/v1/key` (deprecated `rate_limit` −1 answer, configurable), `/api/v1/auth/key` →
//!   404 (old path not served), `/api/v1/credits` → the lying 200 `0/0` answer (configurable).
#![allow(dead_code)]
// Handlers answer errors as ready-made responses, as axum handlers do.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Clean embeddings for a batch of texts (one vector per text, any scale).
pub type Embedder = Arc<dyn Fn(&[String]) -> Vec<Vec<f32>> + Send + Sync>;

/// One provider endpoint of one model.
/// What a chat token costs here (OpenRouter's `usage.cost`); embeddings report no cost.
pub const CHAT_USD_PER_TOKEN: f64 = 0.000_002;

#[derive(Clone)]
pub struct Endpoint {
    pub model: String,
    /// Full endpoint slug, e.g. `deepinfra/fp32`.
    pub slug: String,
    pub quantization: String,
    pub kind: EndpointKind,
}

#[derive(Clone)]
pub enum EndpointKind {
    Embed { dims: usize },
    Rerank,
    Chat,
}

pub struct UpstreamConfig {
    pub key: String,
    pub endpoints: Vec<Endpoint>,
    pub embedder: Option<Embedder>,
    pub max_concurrency: Option<usize>,
    pub rpm: Option<u32>,
    pub in_flight_budget: Option<usize>,
    pub latency_ms: (u64, u64),
    pub retry_after_s: u64,
    pub seed: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            key: "sk-or-test".into(),
            endpoints: Vec::new(),
            embedder: None,
            max_concurrency: None,
            rpm: None,
            in_flight_budget: None,
            latency_ms: (0, 0),
            retry_after_s: 1,
            seed: 7,
        }
    }
}

const WINDOW_MS: u64 = 60_000;
const KEEP_PROVIDERS: usize = 1000;
const KEEP_BODIES: usize = 10_000;
const MAX_BODY: usize = 8 << 20;

/// The running server; dropping it stops accepting connections.
pub struct Upstream {
    /// `http://127.0.0.1:PORT/api/v1`
    pub base_url: String,
    pub state: Arc<UpstreamState>,
    task: JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    pub async fn start(cfg: UpstreamConfig) -> Upstream {
        let state = Arc::new(UpstreamState::new(cfg));
        let app = Router::new()
            .route("/api/v1/embeddings", post(embeddings))
            .route("/api/v1/rerank", post(rerank))
            .route("/api/v1/chat/completions", post(chat))
            .route("/api/v1/key", get(key))
            .route("/api/v1/auth/key", get(auth_key))
            .route("/api/v1/credits", get(credits))
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Upstream {
            base_url: format!("http://{addr}/api/v1"),
            state,
            task,
        }
    }
}

/// Admission state, decided under one lock so concurrent arrivals are counted exactly.
struct Gate {
    in_flight: usize,
    max_seen: usize,
    starts: VecDeque<u64>,
    capacity: Option<usize>,
}

pub struct UpstreamState {
    /// The key the account accepts now (a test may replace it, as a key rotation does).
    key: Mutex<String>,
    /// Calls refused for a wrong or missing key.
    unauthorised: AtomicU64,
    endpoints: Vec<Endpoint>,
    embedder: Option<Embedder>,
    rpm: Option<u32>,
    in_flight_budget: Option<usize>,
    latency_ms: (u64, u64),
    retry_after_s: u64,
    seed: u64,
    rng: Mutex<StdRng>,
    gate: Mutex<Gate>,
    requests: AtomicU64,
    served: AtomicU64,
    throttled: AtomicU64,
    refused: AtomicU64,
    aborted: AtomicU64,
    next_id: AtomicU64,
    by_slug: Mutex<HashMap<String, u64>>,
    probes: AtomicU64,
    providers: Mutex<VecDeque<Value>>,
    bodies: Mutex<VecDeque<String>>,
    cosine: Mutex<HashMap<String, f32>>,
    /// A cosine that applies to an endpoint after this many more production calls.
    drift_after: Mutex<HashMap<String, (u64, f32)>>,
    /// Probe texts met inside production calls (the hub's canaries), counted apart.
    canaries: AtomicU64,
    dims_override: Mutex<HashMap<String, usize>>,
    hard_402: AtomicBool,
    key_answer: Mutex<Value>,
    credits_answer: Mutex<(u16, Value)>,
    hold: watch::Sender<bool>,
    /// While on, a streamed chat stops after its first content chunk (until turned off).
    stream_hold: watch::Sender<bool>,
    decided: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl UpstreamState {
    fn new(cfg: UpstreamConfig) -> UpstreamState {
        let key_answer = json!({"data": {
            "label": "sk-or-v1-abc...xyz", "limit": null, "limit_remaining": null,
            "limit_reset": null, "usage": 1.25, "usage_daily": 0.5, "is_free_tier": false,
            "rate_limit": {"requests": -1, "interval": "10s",
                           "note": "This field is deprecated and safe to ignore."}}});
        UpstreamState {
            rng: Mutex::new(StdRng::seed_from_u64(cfg.seed)),
            gate: Mutex::new(Gate {
                in_flight: 0,
                max_seen: 0,
                starts: VecDeque::new(),
                capacity: cfg.max_concurrency,
            }),
            key: Mutex::new(cfg.key),
            unauthorised: AtomicU64::new(0),
            endpoints: cfg.endpoints,
            embedder: cfg.embedder,
            rpm: cfg.rpm,
            in_flight_budget: cfg.in_flight_budget,
            latency_ms: cfg.latency_ms,
            retry_after_s: cfg.retry_after_s,
            seed: cfg.seed,
            requests: AtomicU64::new(0),
            served: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            by_slug: Mutex::new(HashMap::new()),
            probes: AtomicU64::new(0),
            providers: Mutex::new(VecDeque::new()),
            bodies: Mutex::new(VecDeque::new()),
            cosine: Mutex::new(HashMap::new()),
            drift_after: Mutex::new(HashMap::new()),
            canaries: AtomicU64::new(0),
            dims_override: Mutex::new(HashMap::new()),
            hard_402: AtomicBool::new(false),
            key_answer: Mutex::new(key_answer),
            credits_answer: Mutex::new((
                200,
                json!({"data": {"total_credits": 0, "total_usage": 0}}),
            )),
            hold: watch::Sender::new(false),
            stream_hold: watch::Sender::new(false),
            decided: watch::Sender::new(0),
        }
    }

    /// Every request received on the inference paths (including 401/400/404 answers), gate
    /// probes aside.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
    /// Gate probes received (embeddings requests of exactly the hub's probe texts).
    pub fn probes(&self) -> u64 {
        self.probes.load(Ordering::SeqCst)
    }
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }
    pub fn throttled_429(&self) -> u64 {
        self.throttled.load(Ordering::SeqCst)
    }
    pub fn refused_402(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }
    /// Admitted requests whose caller went away before the answer was written (the handler
    /// was dropped: the connection closed).
    pub fn aborted(&self) -> u64 {
        self.aborted.load(Ordering::SeqCst)
    }
    /// Highest concurrency seen by an arriving request (admitted ones in flight + itself).
    pub fn max_in_flight(&self) -> usize {
        lock(&self.gate).max_seen
    }
    /// Admitted requests in flight right now.
    pub fn in_flight(&self) -> usize {
        lock(&self.gate).in_flight
    }
    /// Items (texts, documents, chats) served per endpoint slug.
    pub fn served_by_slug(&self, slug: &str) -> u64 {
        lock(&self.by_slug).get(slug).copied().unwrap_or(0)
    }
    /// Every `provider` object received (the last 1000).
    pub fn provider_objects(&self) -> Vec<Value> {
        lock(&self.providers).iter().cloned().collect()
    }
    pub fn bodies_seen_contain(&self, needle: &str) -> bool {
        lock(&self.bodies).iter().any(|b| b.contains(needle))
    }
    /// Request bodies received (of the last 10,000) that contain `needle`.
    pub fn bodies_containing(&self, needle: &str) -> usize {
        lock(&self.bodies)
            .iter()
            .filter(|b| b.contains(needle))
            .count()
    }
    pub fn set_cosine(&self, slug: &str, cosine: Option<f32>) {
        let mut m = lock(&self.cosine);
        match cosine {
            Some(c) => m.insert(slug.to_string(), c),
            None => m.remove(slug),
        };
    }
    /// After `calls` more production embedding calls to `slug` are answered clean, every
    /// later one is served at `cosine` (a redeploy behind the same slug).
    pub fn set_cosine_after(&self, slug: &str, calls: u64, cosine: f32) {
        lock(&self.drift_after).insert(slug.to_string(), (calls, cosine));
    }
    /// Probe texts (the hub's canaries) seen inside production embedding calls.
    pub fn canaries(&self) -> u64 {
        self.canaries.load(Ordering::SeqCst)
    }
    pub fn set_dims_override(&self, slug: &str, dims: Option<usize>) {
        let mut m = lock(&self.dims_override);
        match dims {
            Some(d) => m.insert(slug.to_string(), d),
            None => m.remove(slug),
        };
    }
    pub fn set_hard_402(&self, on: bool) {
        self.hard_402.store(on, Ordering::SeqCst);
    }
    pub fn set_capacity(&self, max_concurrency: Option<usize>) {
        lock(&self.gate).capacity = max_concurrency;
    }
    pub fn set_key_answer(&self, v: Value) {
        *lock(&self.key_answer) = v;
    }
    pub fn set_credits_answer(&self, status: u16, body: Value) {
        *lock(&self.credits_answer) = (status, body);
    }
    /// While on, admitted inference requests wait (after their latency) before answering;
    /// they keep their in-flight slot. Turning it off releases them all.
    pub fn set_hold(&self, on: bool) {
        self.hold.send_replace(on);
    }
    /// While on, a streamed chat sends its processing comment and first content chunk, then
    /// waits; turning it off sends the rest.
    pub fn set_stream_hold(&self, on: bool) {
        self.stream_hold.send_replace(on);
    }
    /// Resolves once `n` inference requests have been received and either answered with an
    /// error (auth, routing, limits) or admitted. Bound it with `tokio::time::timeout`.
    pub async fn wait_for_requests(&self, n: u64) {
        let mut rx = self.decided.subscribe();
        loop {
            let seen = *rx.borrow_and_update();
            if seen >= n || rx.changed().await.is_err() {
                return;
            }
        }
    }

    fn authorised(&self, headers: &HeaderMap) -> bool {
        let want = format!("Bearer {}", lock(&self.key));
        let ok = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            == Some(want.as_str());
        if !ok {
            self.unauthorised.fetch_add(1, Ordering::SeqCst);
        }
        ok
    }

    /// The account accepts `key` from now on (the old one is refused with 401).
    pub fn set_key(&self, key: &str) {
        *lock(&self.key) = key.to_string();
    }

    /// Calls refused for a wrong or missing key.
    pub fn unauthorised(&self) -> u64 {
        self.unauthorised.load(Ordering::SeqCst)
    }
}

// ---------------------------------------------------------------- responses

fn error(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

fn err_msg(code: u16, msg: &str) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
    error(status, json!({"error": {"code": code, "message": msg}}))
}

fn unauthorised() -> Response {
    err_msg(401, "No auth credentials found")
}

fn retry_after(secs: u64) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    h
}

fn platform_429(rpm: u32, reset_ms: u64, now: u64, model: &str) -> Response {
    let mut h = retry_after(reset_ms.saturating_sub(now).div_ceil(1000).max(1));
    h.insert("x-ratelimit-limit", HeaderValue::from(rpm));
    h.insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
    h.insert("x-ratelimit-reset", HeaderValue::from(reset_ms));
    let body = json!({"error": {"code": 429,
        "message": format!("Rate limit exceeded: limit_rpm/{model}"),
        "metadata": {"headers": {"X-RateLimit-Limit": rpm.to_string(),
            "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset_ms.to_string()}}}});
    (StatusCode::TOO_MANY_REQUESTS, h, Json(body)).into_response()
}

// ---------------------------------------------------------------- routing and admission

#[derive(Clone, Copy, PartialEq)]
enum Route {
    Embed,
    Rerank,
    Chat,
}

impl Route {
    fn matches(self, kind: &EndpointKind) -> bool {
        matches!(
            (self, kind),
            (Route::Embed, EndpointKind::Embed { .. })
                | (Route::Rerank, EndpointKind::Rerank)
                | (Route::Chat, EndpointKind::Chat)
        )
    }
    fn path(self) -> &'static str {
        match self {
            Route::Embed => "/api/v1/embeddings",
            Route::Rerank => "/api/v1/rerank",
            Route::Chat => "/api/v1/chat/completions",
        }
    }
}

/// An in-flight slot; released on every exit path.
struct Slot(Arc<UpstreamState>);

impl Drop for Slot {
    fn drop(&mut self) {
        let mut g = lock(&self.0.gate);
        g.in_flight = g.in_flight.saturating_sub(1);
    }
}

struct Admitted {
    _slot: Slot,
    endpoint: Endpoint,
    req: Value,
    model: String,
}

fn pick_endpoint(
    s: &UpstreamState,
    route: Route,
    model: &str,
    provider: Option<&Value>,
) -> Result<Endpoint, Response> {
    let of_model: Vec<&Endpoint> = s.endpoints.iter().filter(|e| e.model == model).collect();
    if of_model.is_empty() {
        return Err(err_msg(400, &format!("{model} is not a valid model ID")));
    }
    let mut cands: Vec<&Endpoint> = of_model
        .into_iter()
        .filter(|e| route.matches(&e.kind))
        .collect();
    if cands.is_empty() {
        let msg = format!("{model} is not available on {}", route.path());
        return Err(error(
            StatusCode::BAD_REQUEST,
            json!({"error": {"code": 400, "message": msg, "metadata": {"error_type": "wrong_endpoint"}}}),
        ));
    }
    let list = |k: &str| -> Option<Vec<String>> {
        provider
            .and_then(|p| p.get(k))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
    };
    let hits = |slug: &str, entry: &str| slug == entry || slug.starts_with(&format!("{entry}/"));
    if let Some(only) = list("only") {
        cands.retain(|e| only.iter().any(|o| hits(e.slug.as_str(), o.as_str())));
    }
    if let Some(ignore) = list("ignore") {
        cands.retain(|e| !ignore.iter().any(|o| hits(e.slug.as_str(), o.as_str())));
    }
    if let Some(q) = list("quantizations") {
        cands.retain(|e| q.contains(&e.quantization));
    }
    // allow_fallbacks true or false: the first remaining endpoint is the primary either way.
    match cands.first() {
        Some(e) => Ok((*e).clone()),
        None => Err(error(
            StatusCode::NOT_FOUND,
            json!({"error": {"code": 404,
                "message": "No endpoints found matching your data policy and provider preferences",
                "metadata": {"availability": {"code": "no_endpoints"}}}}),
        )),
    }
}

/// Auth, JSON, routing and limits; synchronous, so admission is decided without awaiting.
fn admit(
    s: &Arc<UpstreamState>,
    route: Route,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Admitted, Response> {
    if !s.authorised(headers) {
        return Err(unauthorised());
    }
    let req: Value = serde_json::from_slice(body)
        .map_err(|e| err_msg(400, &format!("invalid JSON body: {e}")))?;
    if !req.is_object() {
        return Err(err_msg(400, "request body must be a JSON object"));
    }
    let model = match req["model"].as_str() {
        Some(m) => m.to_string(),
        None => return Err(err_msg(400, "missing field `model`")),
    };
    let provider = req.get("provider").filter(|p| !p.is_null()).cloned();
    if let Some(p) = &provider {
        let mut all = lock(&s.providers);
        if all.len() >= KEEP_PROVIDERS {
            all.pop_front();
        }
        all.push_back(p.clone());
    }
    let endpoint = pick_endpoint(s, route, &model, provider.as_ref())?;

    if s.hard_402.load(Ordering::SeqCst) {
        s.refused.fetch_add(1, Ordering::SeqCst);
        return Err(error(
            StatusCode::PAYMENT_REQUIRED,
            json!({"error": {"code": 402, "message": "Insufficient credits",
                "metadata": {"limit_source": "openrouter_credits", "reason": "insufficient_credits"}}}),
        ));
    }
    let now = now_ms();
    let mut gate = lock(&s.gate);
    while gate.starts.front().is_some_and(|t| t + WINDOW_MS <= now) {
        gate.starts.pop_front();
    }
    if let Some(rpm) = s.rpm.filter(|r| gate.starts.len() >= *r as usize) {
        let reset = gate
            .starts
            .front()
            .map_or(now + WINDOW_MS, |t| t + WINDOW_MS);
        s.throttled.fetch_add(1, Ordering::SeqCst);
        return Err(platform_429(rpm, reset, now, &model));
    }
    gate.starts.push_back(now);
    let arriving = gate.in_flight + 1;
    gate.max_seen = gate.max_seen.max(arriving);
    if s.in_flight_budget.is_some_and(|b| arriving > b) {
        s.refused.fetch_add(1, Ordering::SeqCst);
        let body = json!({"error": {"code": 402, "message": "In-flight budget exhausted",
            "metadata": {"limit_source": "openrouter_in_flight_budget",
                "reason": "in_flight_budget_exhausted", "remedy_hint": "retry later"}}});
        return Err((
            StatusCode::PAYMENT_REQUIRED,
            retry_after(s.retry_after_s),
            Json(body),
        )
            .into_response());
    }
    if gate.capacity.is_some_and(|c| arriving > c) {
        s.throttled.fetch_add(1, Ordering::SeqCst);
        let body = json!({"error": {"code": 429,
            "message": format!("{model} is temporarily rate-limited upstream. Please retry shortly."),
            "metadata": {"provider_name": endpoint.slug, "raw": "rate limited", "provider_code": 429}}});
        return Err((
            StatusCode::TOO_MANY_REQUESTS,
            retry_after(s.retry_after_s),
            Json(body),
        )
            .into_response());
    }
    gate.in_flight += 1;
    let slot = Slot(s.clone());
    drop(gate);
    Ok(Admitted {
        _slot: slot,
        endpoint,
        req,
        model,
    })
}

async fn inference(
    s: Arc<UpstreamState>,
    route: Route,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // The hub's gate probes are counted apart, so tests count production traffic exactly.
    let probe = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("input").cloned())
        .is_some_and(|input| input == json!(fantom_sidecar::hub::gate::measure::probe_texts()));
    if probe {
        s.probes.fetch_add(1, Ordering::SeqCst);
    } else {
        s.requests.fetch_add(1, Ordering::SeqCst);
    }
    {
        let mut bodies = lock(&s.bodies);
        if bodies.len() >= KEEP_BODIES {
            bodies.pop_front();
        }
        bodies.push_back(String::from_utf8_lossy(&body).into_owned());
    }
    let admitted = admit(&s, route, &headers, &body);
    if !probe {
        s.decided.send_modify(|n| *n += 1);
    }
    let adm = match admitted {
        Ok(a) => a,
        Err(resp) => return resp,
    };
    let mut unanswered = Unanswered {
        state: &s,
        answered: false,
    };
    let (lo, hi) = s.latency_ms;
    let ms = if hi > lo {
        lock(&s.rng).random_range(lo..=hi)
    } else {
        lo
    };
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut hold = s.hold.subscribe();
    loop {
        let held = *hold.borrow_and_update();
        if !held || hold.changed().await.is_err() {
            break;
        }
    }
    // Canaries are the hub's, not production traffic: counted apart.
    let canaries = if probe || route != Route::Embed {
        0
    } else {
        let probes = fantom_sidecar::hub::gate::measure::probe_texts();
        adm.req["input"].as_array().map_or(0, |a| {
            a.iter()
                .filter(|t| probes.iter().any(|p| *t == p.as_str()))
                .count()
        }) as u64
    };
    if !probe && route == Route::Embed {
        let slug = &adm.endpoint.slug;
        let mut drift = lock(&s.drift_after);
        if let Some((left, cos)) = drift.get_mut(slug) {
            if *left == 0 {
                let cos = *cos;
                drift.remove(slug);
                lock(&s.cosine).insert(slug.clone(), cos);
            } else {
                *left -= 1;
            }
        }
    }
    let id = s.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    let result = match route {
        Route::Embed => embed_answer(&s, &adm, id).await,
        Route::Rerank => rerank_answer(&adm, id),
        Route::Chat => chat_answer(&s, &adm, id),
    };
    unanswered.answered = true;
    match result {
        Ok((resp, _)) if probe => resp,
        Ok((resp, items)) => {
            s.served.fetch_add(1, Ordering::SeqCst);
            s.canaries.fetch_add(canaries, Ordering::SeqCst);
            *lock(&s.by_slug)
                .entry(adm.endpoint.slug.clone())
                .or_insert(0) += items.saturating_sub(canaries);
            resp
        }
        Err(resp) => resp,
    }
}

/// Counts an admitted request whose handler is dropped before it answers.
struct Unanswered<'a> {
    state: &'a UpstreamState,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.state.aborted.fetch_add(1, Ordering::SeqCst);
        }
    }
}

// ---------------------------------------------------------------- answers

fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter().chain(std::iter::once(&0xffu8)) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

pub fn normalise(mut v: Vec<f32>) -> Vec<f32> {
    let n = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    if n > 0.0 {
        for x in &mut v {
            *x = (f64::from(*x) / n) as f32;
        }
    }
    v
}

fn hash_vector(seed: u64, model: &str, text: &str, dims: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(fnv(&[
        &seed.to_le_bytes()[..],
        model.as_bytes(),
        text.as_bytes(),
    ]));
    (0..dims).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `c·v + sqrt(1−c²)·u`, `u` a deterministic unit vector orthogonal to the unit vector `v`.
/// The embedder's vectors, computed on a blocking thread (it may run a model).
pub async fn embed_off_runtime(embedder: &Embedder, texts: &[String]) -> Vec<Vec<f32>> {
    let (e, t) = (embedder.clone(), texts.to_vec());
    tokio::task::spawn_blocking(move || e(t.as_slice()))
        .await
        .expect("embedder panicked")
}

pub fn perturb(v: &[f32], c: f32, seed: u64) -> Vec<f32> {
    let c = f64::from(c).clamp(-1.0, 1.0);
    let v64: Vec<f64> = v.iter().map(|x| f64::from(*x)).collect();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..8 {
        let mut u: Vec<f64> = (0..v.len())
            .map(|_| rng.random::<f64>() * 2.0 - 1.0)
            .collect();
        for _ in 0..2 {
            let d = dot(&u, &v64);
            for (x, y) in u.iter_mut().zip(&v64) {
                *x -= d * y;
            }
        }
        let n = dot(&u, &u).sqrt();
        if n > 1e-9 {
            let s = (1.0 - c * c).sqrt();
            return v64
                .iter()
                .zip(&u)
                .map(|(a, b)| (c * a + s * b / n) as f32)
                .collect();
        }
    }
    v.to_vec()
}

fn tokens(text: &str) -> u64 {
    (text.len() / 4 + 1) as u64
}

async fn embed_answer(
    s: &UpstreamState,
    adm: &Admitted,
    id: u64,
) -> Result<(Response, u64), Response> {
    let req = &adm.req;
    let texts: Vec<String> = match &req["input"] {
        Value::String(t) => vec![t.clone()],
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_string) => a
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect(),
        _ => {
            return Err(err_msg(
                400,
                "`input` must be a string or a non-empty array of strings",
            ));
        }
    };
    let dims = match adm.endpoint.kind {
        EndpointKind::Embed { dims } => dims,
        _ => 0,
    };
    let clean: Vec<Vec<f32>> = match &s.embedder {
        Some(e) => embed_off_runtime(e, &texts).await,
        None => texts
            .iter()
            .map(|t| hash_vector(s.seed, &adm.model, t, dims))
            .collect(),
    };
    assert_eq!(
        clean.len(),
        texts.len(),
        "embedder returned the wrong number of vectors"
    );
    let slug = &adm.endpoint.slug;
    let cos = lock(&s.cosine).get(slug).copied();
    let width = lock(&s.dims_override).get(slug).copied();
    let dimensions = req["dimensions"].as_u64().map(|d| d as usize);
    let as_base64 = req["encoding_format"].as_str() == Some("base64");
    let mut data = Vec::with_capacity(texts.len());
    let mut total = 0;
    for (i, (text, v)) in texts.iter().zip(clean).enumerate() {
        let mut v = normalise(v);
        if let Some(d) = dimensions.filter(|d| *d >= 1 && *d < v.len()) {
            v.truncate(d);
            v = normalise(v);
        }
        if let Some(c) = cos {
            v = perturb(
                &v,
                c,
                fnv(&[&s.seed.to_le_bytes()[..], slug.as_bytes(), text.as_bytes()]),
            );
        }
        if let Some(w) = width {
            v.resize(w, 0.0);
        }
        let embedding = if as_base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "embedding": embedding, "index": i}));
        total += tokens(text);
    }
    let body = json!({"id": format!("embd-{id}"), "object": "list", "data": data,
        "model": adm.model, "usage": {"prompt_tokens": total, "total_tokens": total}});
    Ok((Json(body).into_response(), texts.len() as u64))
}

fn words(text: &str) -> impl Iterator<Item = String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
}

fn rerank_answer(adm: &Admitted, id: u64) -> Result<(Response, u64), Response> {
    let req = &adm.req;
    let Some(query) = req["query"].as_str() else {
        return Err(err_msg(400, "missing field `query`"));
    };
    let docs: Vec<String> = match req["documents"].as_array() {
        Some(a) if !a.is_empty() => a
            .iter()
            .map(|d| {
                d.as_str()
                    .or_else(|| d["text"].as_str())
                    .unwrap_or_default()
                    .to_string()
            })
            .collect(),
        _ => return Err(err_msg(400, "`documents` must be a non-empty array")),
    };
    let qwords: BTreeSet<String> = words(query).collect();
    let mut scored: Vec<(usize, f64)> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let dwords: HashSet<String> = words(d).collect();
            let hit = qwords.iter().filter(|w| dwords.contains(*w)).count();
            let frac = if qwords.is_empty() {
                0.0
            } else {
                hit as f64 / qwords.len() as f64
            };
            (i, frac * 0.9 + 0.05)
        })
        .collect();
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if let Some(n) = req["top_n"].as_u64() {
        scored.truncate(n as usize);
    }
    let results: Vec<Value> = scored
        .iter()
        .map(|(i, s)| json!({"index": i, "relevance_score": s, "document": {"text": docs[*i]}}))
        .collect();
    let total = tokens(query) + docs.iter().map(|d| tokens(d.as_str())).sum::<u64>();
    let body = json!({"id": format!("gen-rerank-{id}"), "model": adm.model,
        "provider": adm.endpoint.slug, "results": results,
        "usage": {"search_units": 1, "total_tokens": total}});
    Ok((Json(body).into_response(), docs.len() as u64))
}

fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(" "),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn chat_answer(s: &UpstreamState, adm: &Admitted, id: u64) -> Result<(Response, u64), Response> {
    let req = &adm.req;
    let Some(messages) = req["messages"].as_array() else {
        return Err(err_msg(400, "missing field `messages`"));
    };
    let last_user = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .map(|m| content_text(&m["content"]))
        .unwrap_or_default();
    let content = format!("echo: {last_user}");
    let p: u64 = messages
        .iter()
        .map(|m| tokens(&content_text(&m["content"])))
        .sum();
    let c = tokens(&content);
    // OpenRouter reports each call's cost in credits (US dollars) with its usage.
    let usage = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                       "cost": (p + c) as f64 * CHAT_USD_PER_TOKEN});
    let gen_id = format!("gen-{id}");
    let created = now_ms() / 1000;
    let (model, slug) = (&adm.model, &adm.endpoint.slug);
    if req["stream"].as_bool() != Some(true) {
        let body = json!({"id": gen_id, "object": "chat.completion", "created": created,
            "model": model, "provider": slug,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}],
            "usage": usage});
        return Ok((Json(body).into_response(), 1));
    }
    let mut out = vec![": OPENROUTER PROCESSING\n\n".to_string()];
    for (i, w) in content.split_whitespace().enumerate() {
        let piece = if i == 0 {
            w.to_string()
        } else {
            format!(" {w}")
        };
        let chunk = json!({"id": gen_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "provider": slug,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": piece},
                         "finish_reason": null}]});
        out.push(format!("data: {chunk}\n\n"));
    }
    let last = json!({"id": gen_id, "object": "chat.completion.chunk", "created": created,
        "model": model, "provider": slug,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage});
    out.push(format!("data: {last}\n\n"));
    out.push("data: [DONE]\n\n".to_string());
    // Sent piece by piece, as an upstream does; a stream hold parks it after the first
    // content chunk.
    let hold = s.stream_hold.subscribe();
    let pieces = futures_util::stream::unfold(
        (out.into_iter(), 0usize, hold),
        |(mut pieces, sent, mut hold)| async move {
            if sent == 2 {
                loop {
                    let held = *hold.borrow_and_update();
                    if !held || hold.changed().await.is_err() {
                        break;
                    }
                }
            }
            let piece = pieces.next()?;
            Some((
                Ok::<_, std::convert::Infallible>(piece),
                (pieces, sent + 1, hold),
            ))
        },
    );
    let resp = (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream")],
        axum::body::Body::from_stream(pieces),
    )
        .into_response();
    Ok((resp, 1))
}

// ---------------------------------------------------------------- handlers

async fn embeddings(
    State(s): State<Arc<UpstreamState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inference(s, Route::Embed, headers, body).await
}

async fn rerank(State(s): State<Arc<UpstreamState>>, headers: HeaderMap, body: Bytes) -> Response {
    inference(s, Route::Rerank, headers, body).await
}

async fn chat(State(s): State<Arc<UpstreamState>>, headers: HeaderMap, body: Bytes) -> Response {
    inference(s, Route::Chat, headers, body).await
}

async fn key(State(s): State<Arc<UpstreamState>>, headers: HeaderMap) -> Response {
    if !s.authorised(&headers) {
        return unauthorised();
    }
    let answer = lock(&s.key_answer).clone();
    Json(answer).into_response()
}

async fn auth_key() -> Response {
    err_msg(404, "Not Found")
}

async fn credits(State(s): State<Arc<UpstreamState>>, headers: HeaderMap) -> Response {
    if !s.authorised(&headers) {
        return unauthorised();
    }
    let (code, body) = lock(&s.credits_answer).clone();
    error(StatusCode::from_u16(code).unwrap_or(StatusCode::OK), body)
}

// ---------------------------------------------------------------- the stand-in's own tests

#[cfg(test)]
mod self_tests {
    use super::*;

    const M: &str = "sentence-transformers/all-minilm-l6-v2";
    const KEY: &str = "sk-or-test";

    type Reply = (u16, Option<String>, Value);

    fn ep(model: &str, slug: &str, quantization: &str, kind: EndpointKind) -> Endpoint {
        Endpoint {
            model: model.into(),
            slug: slug.into(),
            quantization: quantization.into(),
            kind,
        }
    }

    /// POST (with a body) or GET; the answer parsed as JSON, or kept as a string.
    async fn call(
        up: &Upstream,
        path: &str,
        key: &str,
        body: Option<Value>,
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let url = format!("{}{path}", up.base_url);
        let client = reqwest::Client::new();
        let req = match body {
            Some(b) => client.post(url).json(&b),
            None => client.get(url),
        };
        let r = req
            .bearer_auth(key)
            .send()
            .await
            .expect("upstream reachable");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.expect("body");
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, headers, v)
    }

    fn floats(v: &Value) -> Vec<f32> {
        let a = v.as_array().expect("float embedding");
        a.iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect()
    }

    fn cos(a: &[f32], b: &[f32]) -> f64 {
        let (a, b): (Vec<f64>, Vec<f64>) = (
            a.iter().map(|x| f64::from(*x)).collect(),
            b.iter().map(|x| f64::from(*x)).collect(),
        );
        dot(&a, &b) / (dot(&a, &a).sqrt() * dot(&b, &b).sqrt())
    }

    async fn vectors(up: &Upstream, slug: &str, extra: Value) -> Vec<Vec<f32>> {
        let mut body = json!({"model": M, "input": ["hello world", "a rather longer sentence"],
            "provider": {"only": [slug], "allow_fallbacks": false}});
        if let (Some(o), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        let (st, _, b) = call(up, "/embeddings", KEY, Some(body)).await;
        assert_eq!(st, 200, "{b}");
        let data = b["data"].as_array().expect("data");
        data.iter().map(|d| floats(&d["embedding"])).collect()
    }

    /// Starts `n` embedding requests at once; they run concurrently on their own tasks.
    fn fire(up: &Upstream, n: usize) -> Vec<JoinHandle<Reply>> {
        let client = reqwest::Client::new();
        (0..n)
            .map(|i| {
                let (c, url) = (client.clone(), format!("{}/embeddings", up.base_url));
                tokio::spawn(async move {
                    let body = json!({"model": M, "input": format!("text {i}")});
                    let r = c
                        .post(url)
                        .bearer_auth(KEY)
                        .json(&body)
                        .send()
                        .await
                        .expect("send");
                    let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok());
                    let retry = retry.map(str::to_string);
                    (
                        r.status().as_u16(),
                        retry,
                        r.json::<Value>().await.expect("json"),
                    )
                })
            })
            .collect()
    }

    async fn settle(up: &Upstream, n: u64) {
        tokio::time::timeout(Duration::from_secs(60), up.state.wait_for_requests(n))
            .await
            .expect("every request reached the upstream");
    }

    async fn join(tasks: Vec<JoinHandle<Reply>>) -> Vec<Reply> {
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("request task"));
        }
        out
    }

    #[tokio::test]
    async fn routing_follows_provider_preferences() {
        let chat_model = "openai/gpt-4o-mini";
        let up = Upstream::start(UpstreamConfig {
            endpoints: vec![
                ep(
                    M,
                    "deepinfra/fp32",
                    "fp32",
                    EndpointKind::Embed { dims: 16 },
                ),
                ep(
                    M,
                    "deepinfra/turbo",
                    "fp8",
                    EndpointKind::Embed { dims: 16 },
                ),
                ep(chat_model, "openai", "unknown", EndpointKind::Chat),
            ],
            ..Default::default()
        })
        .await;
        let embed = |p: Value| Some(json!({"model": M, "input": ["a b", "c"], "provider": p}));

        // A base slug matches every variant; the quantization filter narrows it to one.
        let pin =
            json!({"only": ["deepinfra"], "quantizations": ["fp8"], "allow_fallbacks": false});
        let (st, _, b) = call(&up, "/embeddings", KEY, embed(pin)).await;
        assert_eq!(st, 200, "{b}");
        assert_eq!(b["data"].as_array().map(Vec::len), Some(2));
        assert_eq!(floats(&b["data"][1]["embedding"]).len(), 16);
        assert_eq!(up.state.served_by_slug("deepinfra/turbo"), 2);
        // The full slug hits exactly that endpoint.
        let (st, _, _) = call(
            &up,
            "/embeddings",
            KEY,
            embed(json!({"only": ["deepinfra/fp32"]})),
        )
        .await;
        assert_eq!(st, 200);
        assert_eq!(up.state.served_by_slug("deepinfra/fp32"), 2);
        // Nothing left: 404 no_endpoints. "deep" is not a slug segment of "deepinfra/…".
        for only in ["together", "deep"] {
            let (st, _, b) = call(&up, "/embeddings", KEY, embed(json!({"only": [only]}))).await;
            assert_eq!(st, 404, "{b}");
            assert_eq!(
                b["error"]["metadata"]["availability"]["code"],
                "no_endpoints"
            );
        }
        assert_eq!(up.state.provider_objects().len(), 4);

        let (st, _, b) = call(
            &up,
            "/embeddings",
            KEY,
            Some(json!({"model": "x/y", "input": "a"})),
        )
        .await;
        assert_eq!(
            (st, b["error"]["message"].clone()),
            (400, json!("x/y is not a valid model ID"))
        );
        let (st, _, b) = call(&up, "/embeddings", "sk-or-wrong", embed(json!({}))).await;
        assert_eq!(
            (st, b["error"]["message"].clone()),
            (401, json!("No auth credentials found"))
        );

        // Chat: a plain answer, then the same as an SSE stream.
        let ask =
            json!({"model": chat_model, "messages": [{"role": "user", "content": "hello there"}]});
        let (st, _, b) = call(&up, "/chat/completions", KEY, Some(ask.clone())).await;
        assert_eq!(st, 200, "{b}");
        assert_eq!(b["choices"][0]["message"]["content"], "echo: hello there");
        let mut stream = ask;
        stream["stream"] = json!(true);
        let (st, _, b) = call(&up, "/chat/completions", KEY, Some(stream)).await;
        assert_eq!(st, 200);
        let text = b.as_str().expect("an event stream, not JSON");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let said: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: {"))
            .map(|l| serde_json::from_str::<Value>(&format!("{{{l}")).expect("chunk"))
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        assert_eq!(said, "echo: hello there");

        assert_eq!(up.state.requests(), 8);
        assert_eq!(up.state.served(), 4);
        assert!(up.state.bodies_seen_contain("hello there"));
        assert!(!up.state.bodies_seen_contain(KEY));

        // Account paths: /key answers, the old /auth/key does not, /credits lies with 0/0.
        let (st, _, b) = call(&up, "/key", KEY, None).await;
        assert_eq!(
            (st, b["data"]["rate_limit"]["requests"].clone()),
            (200, json!(-1))
        );
        assert_eq!(call(&up, "/key", "sk-or-wrong", None).await.0, 401);
        assert_eq!(call(&up, "/auth/key", KEY, None).await.0, 404);
        let (st, _, b) = call(&up, "/credits", KEY, None).await;
        assert_eq!((st, b["data"]["total_credits"].clone()), (200, json!(0)));
    }

    #[tokio::test]
    async fn rpm_429_carries_platform_headers() {
        let up = Upstream::start(UpstreamConfig {
            endpoints: vec![ep(
                M,
                "deepinfra/fp32",
                "fp32",
                EndpointKind::Embed { dims: 8 },
            )],
            rpm: Some(2),
            ..Default::default()
        })
        .await;
        let body = json!({"model": M, "input": "x"});
        for _ in 0..2 {
            assert_eq!(
                call(&up, "/embeddings", KEY, Some(body.clone())).await.0,
                200
            );
        }
        let before = now_ms();
        let (st, h, b) = call(&up, "/embeddings", KEY, Some(body)).await;
        assert_eq!(st, 429, "{b}");
        let header = |n: &str| {
            h.get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(header("x-ratelimit-limit"), "2");
        assert_eq!(header("x-ratelimit-remaining"), "0");
        let reset: u64 = header("x-ratelimit-reset")
            .parse()
            .expect("reset in epoch ms");
        assert!(
            reset > before && reset <= before + WINDOW_MS,
            "reset {reset}, now {before}"
        );
        let retry: u64 = header("retry-after").parse().expect("retry-after seconds");
        assert!((1..=60).contains(&retry), "retry-after {retry}");
        assert_eq!(
            b["error"]["metadata"]["headers"]["X-RateLimit-Reset"],
            reset.to_string()
        );
        let msg = b["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.starts_with("Rate limit exceeded: limit_rpm/"), "{msg}");
        let s = &up.state;
        assert_eq!((s.requests(), s.served(), s.throttled_429()), (3, 2, 1));
    }

    #[tokio::test]
    async fn cosine_perturbation_is_exact() {
        let embedder: Embedder = Arc::new(|texts: &[String]| -> Vec<Vec<f32>> {
            let one = |n: f32| vec![1.0, n, -0.5, 2.0, 0.1 * n, 0.3, -1.5, 0.7];
            texts.iter().map(|t| one(t.len() as f32)).collect()
        });
        let up = Upstream::start(UpstreamConfig {
            endpoints: vec![
                ep(M, "clean/fp32", "fp32", EndpointKind::Embed { dims: 8 }),
                ep(M, "drift/bf16", "bf16", EndpointKind::Embed { dims: 8 }),
            ],
            embedder: Some(embedder.clone()),
            ..Default::default()
        })
        .await;
        let texts: Vec<String> = vec!["hello world".into(), "a rather longer sentence".into()];
        let raw = embedder(texts.as_slice());

        up.state.set_cosine("drift/bf16", Some(0.97));
        let clean = vectors(&up, "clean/fp32", json!({})).await;
        let drift = vectors(&up, "drift/bf16", json!({})).await;
        for ((c, d), r) in clean.iter().zip(&drift).zip(&raw) {
            assert!(
                (cos(c, r) - 1.0).abs() < 1e-6,
                "clean route is the embedder's vector"
            );
            let got = cos(c, d);
            assert!((got - 0.97).abs() < 1e-5, "cosine {got}");
        }

        // base64 carries the same little-endian f32 values.
        let pin = json!({"only": ["clean/fp32"]});
        let ask = json!({"model": M, "input": "hello world", "encoding_format": "base64", "provider": pin});
        let (st, _, b) = call(&up, "/embeddings", KEY, Some(ask)).await;
        assert_eq!(st, 200, "{b}");
        let b64 = b["data"][0]["embedding"].as_str().expect("base64 string");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("valid base64");
        let decoded: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(decoded, clean[0]);

        // `dimensions` truncates and re-normalises; the override changes the width only.
        for v in vectors(&up, "clean/fp32", json!({"dimensions": 4})).await {
            assert_eq!(v.len(), 4);
            let norm2: f32 = v.iter().map(|x| x * x).sum();
            assert!((norm2 - 1.0).abs() < 1e-5, "squared norm {norm2}");
        }
        up.state.set_dims_override("drift/bf16", Some(5));
        assert!(
            vectors(&up, "drift/bf16", json!({}))
                .await
                .iter()
                .all(|v| v.len() == 5)
        );
        up.state.set_dims_override("drift/bf16", Some(12));
        for v in vectors(&up, "drift/bf16", json!({})).await {
            assert_eq!((v.len(), &v[8..]), (12, &[0.0f32; 4][..]));
        }
        // Back to clean: both routes agree exactly.
        up.state.set_dims_override("drift/bf16", None);
        up.state.set_cosine("drift/bf16", None);
        assert_eq!(vectors(&up, "drift/bf16", json!({})).await, clean);
    }

    #[tokio::test]
    async fn concurrency_limits_are_exact_under_hold() {
        let endpoints = vec![ep(
            M,
            "deepinfra/fp32",
            "fp32",
            EndpointKind::Embed { dims: 8 },
        )];
        // Capacity 2: with the first two held in flight, the other three get upstream 429s.
        let up = Upstream::start(UpstreamConfig {
            endpoints: endpoints.clone(),
            max_concurrency: Some(2),
            latency_ms: (5, 20),
            retry_after_s: 3,
            ..Default::default()
        })
        .await;
        up.state.set_hold(true);
        let tasks = fire(&up, 5);
        settle(&up, 5).await;
        assert_eq!((up.state.in_flight(), up.state.throttled_429()), (2, 3));
        up.state.set_hold(false);
        let got = join(tasks).await;
        assert_eq!(got.iter().filter(|g| g.0 == 200).count(), 2);
        for g in got.iter().filter(|g| g.0 != 200) {
            assert_eq!((g.0, g.1.as_deref()), (429, Some("3")), "{}", g.2);
            assert_eq!(g.2["error"]["metadata"]["provider_name"], "deepinfra/fp32");
        }
        assert_eq!((up.state.max_in_flight(), up.state.in_flight()), (3, 0));

        // In-flight budget 1: the second concurrent request is refused with a transient 402.
        let up = Upstream::start(UpstreamConfig {
            endpoints,
            in_flight_budget: Some(1),
            ..Default::default()
        })
        .await;
        up.state.set_hold(true);
        let tasks = fire(&up, 2);
        settle(&up, 2).await;
        assert_eq!(up.state.refused_402(), 1);
        up.state.set_hold(false);
        let got = join(tasks).await;
        let refused: Vec<&Reply> = got.iter().filter(|g| g.0 == 402).collect();
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].1.as_deref(), Some("1"));
        assert_eq!(
            refused[0].2["error"]["metadata"]["reason"],
            "in_flight_budget_exhausted"
        );

        // Out of credits: every request is a hard 402 without Retry-After.
        up.state.set_hard_402(true);
        let got = join(fire(&up, 1)).await;
        assert_eq!((got[0].0, got[0].1.as_deref()), (402, None));
        assert_eq!(
            got[0].2["error"]["metadata"]["reason"],
            "insufficient_credits"
        );
        assert_eq!(up.state.refused_402(), 2);
    }
}
