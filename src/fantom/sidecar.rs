//! What this agent is to Fantom masters, in one place: its identity ([`RelayContext`]), its
//! slots (one per master), its local containers, the bearer token of its HTTP port, and the
//! relay loops it runs (one per slot; `POST /api/masters` starts more).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

use super::containers::Containers;
use super::frames::Heartbeat;
use super::http::access::Caller;
use super::relay::run_slot;
use super::slots::Slots;
use super::snapshot::{RelayContext, status_data};
use super::status::StatusData;
use crate::secret::Secret;

pub struct Sidecar {
    pub ctx: RelayContext,
    pub slots: Arc<Slots>,
    pub containers: Containers,
    /// `http_token_file`/`http_token_env`: accepted on every route but `/health`, `/metrics`.
    http_token: Mutex<Option<Secret>>,
    shutdown: watch::Receiver<bool>,
    relays: Mutex<JoinSet<()>>,
    /// The client of the masters' HTTP-fallback heartbeats.
    pub fallback_http: reqwest::Client,
}

impl Sidecar {
    pub fn new(
        ctx: RelayContext,
        slots: Slots,
        containers: Containers,
        http_token: Option<Secret>,
        shutdown: watch::Receiver<bool>,
    ) -> Arc<Self> {
        Arc::new(Sidecar {
            ctx,
            slots: Arc::new(slots),
            containers,
            http_token: Mutex::new(http_token),
            shutdown,
            relays: Mutex::new(JoinSet::new()),
            fallback_http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
        })
    }

    /// Starts one relay loop per slot.
    pub fn start_relays(self: &Arc<Self>) {
        for url in self.slots.server_urls() {
            if let Some(generation) = self.slots.generation(&url) {
                self.spawn_relay(url, generation);
            }
        }
    }

    /// Starts the relay loop of slot `server_url` (generation `generation`).
    pub fn spawn_relay(self: &Arc<Self>, server_url: String, generation: u64) {
        let task = run_slot(self.clone(), server_url, generation, self.shutdown.clone());
        self.relays
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .spawn(task);
    }

    /// Waits (at most `timeout`) for every relay loop to end after shutdown.
    pub async fn join_relays(&self, timeout: Duration) -> bool {
        let mut relays =
            std::mem::take(&mut *self.relays.lock().unwrap_or_else(PoisonError::into_inner));
        let drained = async { while relays.join_next().await.is_some() {} };
        tokio::time::timeout(timeout, drained).await.is_ok()
    }

    /// Whether HTTP requests need a bearer token at all.
    pub fn auth_required(&self) -> bool {
        self.http_token().is_some() || self.slots.any_token()
    }

    /// Who `presented` (a bearer token) says the caller is: the operator, the master(s) whose
    /// slot token it is, or nobody. Every token is compared, each in constant time.
    pub fn caller(&self, presented: Option<&str>) -> Caller {
        let Some(presented) = presented else {
            return Caller::Nobody;
        };
        let operator = self.http_token().is_some_and(|t| t.matches(presented));
        let owned = self.slots.owners_of(presented);
        if operator {
            Caller::Operator
        } else if owned.is_empty() {
            Caller::Nobody
        } else {
            Caller::Master(owned)
        }
    }

    fn http_token(&self) -> Option<Secret> {
        self.http_token
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces the agent's bearer token (a reload); whether it changed.
    pub fn set_http_token(&self, token: Option<Secret>) -> bool {
        let mut held = self
            .http_token
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let changed = match (&*held, &token) {
            (Some(a), Some(b)) => !a.matches(b.expose()),
            (None, None) => false,
            _ => true,
        };
        *held = token;
        changed
    }

    /// A heartbeat for `master`, with the small snapshot (its own slot, and the slots of the
    /// same origin, whose relay port it may correct); over HTTP it names the agent at the
    /// top (§3.4).
    pub fn heartbeat(&self, master: &str, over_http: bool) -> Heartbeat {
        let mates = self.slots.origin_mates(master);
        let status = status_data(
            &self.ctx,
            &self.containers,
            &self.slots,
            Some(master),
            false,
            Some(&mates),
        );
        Heartbeat {
            agent_url: over_http.then(|| self.ctx.agent_url.clone()),
            active_requests: Some(self.containers.active_requests()),
            status_data: Some(Box::new(status)),
        }
    }

    /// The body of `GET /api/status` for `caller`: the slots it may see, with their virtual
    /// containers.
    pub fn status_for(&self, caller: &Caller) -> StatusData {
        status_data(
            &self.ctx,
            &self.containers,
            &self.slots,
            None,
            true,
            caller.shown(),
        )
    }
}
