//! The hub: the controller of the fleet. It owns the shared role queues, the requests (each
//! bound to one space or scorer) and the leases ([`core`]), the agents' sockets ([`socket`]),
//! the routing policy ([`policy`]), the global cloud budget ([`budget`]), the compatibility
//! gate ([`gate`]), the safe persisted config ([`state`]) with the store that keeps it
//! ([`store`]) and the views of it all ([`status`]). HTTP front doors live in [`crate::http`]; they call the [`Hub`] handle.
//!
//! State writes (a push, the budget override, a new space) run on a blocking thread under the
//! writers' lock, to their end even if the caller goes away; readers clone the last state
//! written and never wait for a disk.

pub mod aside;
pub mod budget;
pub mod core;
pub mod events;
pub mod gate;
mod handover;
pub mod history;
pub mod measured;
pub mod metrics;
pub mod migration;
pub mod peer_http;
pub mod policy;
pub mod project_admin;
pub mod projects;
pub mod queue;
pub mod registry;
pub mod replies;
pub mod scorer_check;
pub mod socket;
pub mod space_scales;
pub mod state;
pub mod status;
pub mod store;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use self::core::{Completed, Core, HubSettings, RequestFailure, SubmitError};
use self::queue::{RequestId, Shape};
use self::state::{HubState, KeyRecord, StateError};
use self::store::StateStore;
use crate::config::push::{self, OpenRouterPush, PushRefused, RoleOutcome};
use crate::roles::Role;
use crate::secret::Secret;

/// How a hub starts.
pub struct HubOptions {
    pub settings: HubSettings,
    /// Where the persisted state lives (opened, and locked, before anything else).
    pub store: StateStore,
    pub fleet_token: Secret,
    pub admin_token: Secret,
    /// When set, client endpoints require a bearer token: this one (project `default`) or a
    /// project's key.
    pub client_token: Option<Secret>,
    /// Every client request must present a project key (none: `default`).
    pub require_project_key: bool,
    pub gate: gate::GateSettings,
}

/// A handle to the running hub; clones share it.
#[derive(Clone)]
pub struct Hub {
    inner: Arc<Inner>,
}

struct Inner {
    core: Mutex<Core>,
    /// The safe config as last written: readers clone it and never wait for a disk.
    state: Mutex<HubState>,
    /// Serialises writers of the state store; a save runs on a blocking thread while held
    /// (never the core lock, never `state`'s lock).
    state_writes: tokio::sync::Mutex<()>,
    store: Arc<StateStore>,
    fleet_token: Secret,
    admin_token: Secret,
    client_token: Option<Secret>,
    require_project_key: bool,
    started: Instant,
    /// When the projects' day usage was last checkpointed (ms since the epoch).
    usage_saved_ms: std::sync::atomic::AtomicU64,
    /// When the handover (verdicts, the budget's window) was last tried.
    handover_tried_ms: std::sync::atomic::AtomicU64,
    /// When the last handover write succeeded (ms since the Unix epoch; 0: none yet).
    handover_saved_ms: std::sync::atomic::AtomicU64,
    /// Writes of the state the store took ([`Hub::persist`]).
    state_saves: std::sync::atomic::AtomicU64,
    /// What a fenced leader heard from the other hubs: another leads (confirmed or not), or
    /// none says who leads.
    aside: std::sync::Mutex<Option<aside::Aside>>,
    /// The other hubs of an etcd store, as last read (what a fenced leader asks).
    peers: std::sync::Mutex<Option<store::etcd::members::Peers>>,
    /// The console's charts: recent samples, in memory only.
    history: std::sync::Mutex<history::History>,
}

/// Why a client request did not complete.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error(transparent)]
    Failed(#[from] RequestFailure),
    #[error("the request was not served within {0} s")]
    Timeout(u64),
}

impl HubError {
    /// The code its client is told (the HTTP layer picks the status; status counts refusals
    /// and failures per role by it).
    pub fn code(&self) -> &'static str {
        match self {
            HubError::Submit(SubmitError::Unservable(u) | SubmitError::NotYet(u))
            | HubError::Failed(RequestFailure::Unservable(u)) => u.code.as_str(),
            HubError::Submit(SubmitError::DimensionsTooLarge { .. }) => "dimensions_too_large",
            HubError::Submit(SubmitError::PinNotEmbedding(_)) => "pin_not_embedding",
            HubError::Submit(SubmitError::QueueFull { .. } | SubmitError::HeldBytesFull { .. }) => {
                "queue_full"
            }
            HubError::Submit(SubmitError::TooLarge { .. } | SubmitError::TooManyInputs { .. }) => {
                "too_many_inputs"
            }
            HubError::Submit(
                SubmitError::InputTooLong { .. } | SubmitError::InputTooLargeForFrame { .. },
            ) => "input_too_large",
            HubError::Submit(SubmitError::TooManyBytes { .. }) => "request_too_large",
            HubError::Submit(SubmitError::Project(r))
            | HubError::Failed(RequestFailure::Project(r)) => r.code(),
            HubError::Failed(RequestFailure::Fatal { .. }) => "input_refused",
            HubError::Failed(RequestFailure::TooManyAttempts { .. }) => "provider_failures",
            HubError::Failed(RequestFailure::StreamCut { .. }) => "stream_cut",
            HubError::Failed(RequestFailure::Stopped) => "shutting_down",
            HubError::Timeout(_) => "timeout",
        }
    }
}

/// Why a config push did not apply.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error(transparent)]
    Refused(#[from] PushRefused),
    #[error(transparent)]
    State(#[from] StateError),
}

/// What an admin push did.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PushResult {
    pub id: String,
    pub applied: bool,
    pub key_included: bool,
    pub roles: std::collections::BTreeMap<String, RoleOutcome>,
    /// Agents the config frame went to (their acks show in `/admin/status`).
    pub sent_to: Vec<String>,
}

/// Runs `work` to its end even if the caller stops waiting (an admin client that disconnects
/// mid-push): a state write is never cut between the file and the state in memory, and the
/// writers' lock is held until it is done.
async fn to_the_end<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, StateError> {
    match tokio::spawn(work).await {
        Ok(done) => Ok(done),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(StateError::Interrupted(e.to_string())),
    }
}

/// A streamed chat in progress (see [`Hub::run_streaming`]).
pub struct Streaming {
    /// The chunks, in order, as they arrive.
    pub chunks: tokio::sync::mpsc::UnboundedReceiver<serde_json::Value>,
    /// How it ended (the whole completion, or why not), bounded by the request timeout.
    pub outcome:
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Completed, HubError>> + Send>>,
}

/// An accepted request: where its outcome arrives, and the guard that cancels it if the
/// client stops waiting.
struct Running {
    role: Role,
    guard: CancelOnDrop,
    reply: tokio::sync::oneshot::Receiver<Result<Completed, RequestFailure>>,
    timeout: Duration,
}

impl Running {
    async fn outcome(mut self) -> Result<Completed, HubError> {
        let result = tokio::time::timeout(self.timeout, &mut self.reply).await;
        let outcome = match result {
            Ok(Ok(outcome)) => {
                self.guard.armed = false;
                outcome.map_err(HubError::from)
            }
            Ok(Err(_)) => Err(RequestFailure::Stopped.into()),
            Err(_) => Err(HubError::Timeout(self.timeout.as_secs())),
        };
        if let Err(e) = &outcome {
            self.guard.hub.core().count_failed(self.role, e.code());
        }
        outcome
    }
}

/// Cancels a request whose client stopped waiting (timeout, dropped connection).
struct CancelOnDrop {
    hub: Hub,
    id: RequestId,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.hub.core().cancel_request(self.id);
        }
    }
}

tokio::task_local! {
    /// The client's request id (`X-Request-Id`) while the HTTP layer serves its request: the
    /// hub keeps it with the request it accepts, for the log lines about that request.
    pub static REQUEST_ID: Arc<str>;
}

fn current_request_id() -> Option<Arc<str>> {
    REQUEST_ID.try_with(Arc::clone).ok()
}

/// Milliseconds since the Unix epoch (what status and the state file show).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Hub {
    /// Builds the hub on `state`, as its store loaded it (no sockets yet).
    pub fn open(opts: HubOptions, state: HubState) -> Result<Self, StateError> {
        let mut core = Core::with_gate(
            opts.settings,
            state.cloud.clone(),
            opts.gate,
            state.spaces.clone(),
        );
        core.gate.restore_live(state.role_spaces.clone());
        core.projects = projects::Projects::new(state.projects.clone(), &state.project_usage);
        core.fence = opts.store.fence();
        core.epoch = opts.store.ha_view().epoch;
        if opts.store.is_shared() {
            handover::take_over(&mut core, &state, Instant::now());
        }
        if state.budget_override.is_some() {
            core.budget
                .set_override(state.budget_override, Instant::now());
        }
        // The revision and key generation survive a restart: agents that hold them keep
        // serving without a new push.
        core.set_config(
            state.cloud.clone(),
            core::ConfigRevision {
                revision: state.config_revision,
                key_generation: state.key_generation.clone(),
            },
        );
        Ok(Self {
            inner: Arc::new(Inner {
                core: Mutex::new(core),
                state: Mutex::new(state),
                state_writes: tokio::sync::Mutex::new(()),
                store: Arc::new(opts.store),
                fleet_token: opts.fleet_token,
                admin_token: opts.admin_token,
                client_token: opts.client_token,
                require_project_key: opts.require_project_key,
                started: Instant::now(),
                usage_saved_ms: std::sync::atomic::AtomicU64::new(now_ms()),
                handover_tried_ms: std::sync::atomic::AtomicU64::new(0),
                handover_saved_ms: std::sync::atomic::AtomicU64::new(0),
                state_saves: std::sync::atomic::AtomicU64::new(0),
                aside: std::sync::Mutex::new(None),
                peers: std::sync::Mutex::new(None),
                history: std::sync::Mutex::new(history::History::default()),
            }),
        })
    }

    /// The state machine (short critical sections only; no await while held).
    pub fn core(&self) -> MutexGuard<'_, Core> {
        self.inner
            .core
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn fleet_token(&self) -> &Secret {
        &self.inner.fleet_token
    }

    pub fn admin_token(&self) -> &Secret {
        &self.inner.admin_token
    }

    pub fn client_token(&self) -> Option<&Secret> {
        self.inner.client_token.as_ref()
    }

    pub fn uptime(&self) -> Duration {
        self.inner.started.elapsed()
    }

    /// Queues `texts` for `role` and waits for every item's result. When the only hope is a
    /// gate probe under way (or a provider that just left), admission waits a little
    /// ([`HubSettings::admission_wait`]) for the fleet to settle, then answers why not.
    pub async fn run(
        &self,
        caller: projects::Caller,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
    ) -> Result<Completed, HubError> {
        self.run_in(caller, role, shape, texts, None).await
    }

    /// As [`Hub::run`], for an embedding request `pin`ned to one of its role's live spaces
    /// (`None`: the current one).
    pub async fn run_in(
        &self,
        caller: projects::Caller,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
        pin: Option<gate::SpacePin>,
    ) -> Result<Completed, HubError> {
        self.accept(caller, role, shape, texts, None, pin)
            .await?
            .outcome()
            .await
    }

    /// As [`Hub::run`] for a chat that asked to stream: its chunks arrive on
    /// [`Streaming::chunks`] as the provider sends them, then [`Streaming::outcome`] says how
    /// it ended. Dropping it cancels the request (the upstream call is aborted).
    pub async fn run_streaming(
        &self,
        caller: projects::Caller,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
    ) -> Result<Streaming, HubError> {
        let (tx, chunks) = tokio::sync::mpsc::unbounded_channel();
        let running = self
            .accept(caller, role, shape, texts, Some(tx), None)
            .await?;
        Ok(Streaming {
            chunks,
            outcome: Box::pin(running.outcome()),
        })
    }

    /// Admits and queues a request (waiting a little while the fleet settles); a refusal is
    /// counted for the role, by its code.
    async fn accept(
        &self,
        caller: projects::Caller,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
        stream: Option<core::ChunkTx>,
        pin: Option<gate::SpacePin>,
    ) -> Result<Running, HubError> {
        let accepted = self
            .admit_and_queue(caller, role, shape, texts, stream, pin)
            .await;
        if let Err(e) = &accepted {
            self.core().count_refused(role, e.code());
        }
        accepted
    }

    async fn admit_and_queue(
        &self,
        caller: projects::Caller,
        role: Role,
        shape: Shape,
        texts: Vec<String>,
        stream: Option<core::ChunkTx>,
        pin: Option<gate::SpacePin>,
    ) -> Result<Running, HubError> {
        let (wait, mut changes) = {
            let core = self.core();
            // A request past the hub's limits can never be served: refused before any wait.
            core.check_limits(&shape, &texts)?;
            (core.settings.admission_wait, core.watch_changes())
        };
        let give_up = tokio::time::Instant::now() + wait;
        let mut stream = stream;
        let traceparent = crate::traces::traceparent(&tracing::Span::current()).map(Arc::from);
        loop {
            let attempt = {
                let mut core = self.core();
                core.check_allowance(&caller, role)
                    .map_err(SubmitError::Project)?;
                match core.admit_in(role, &shape, pin.as_ref()) {
                    Ok(binding) => {
                        let timeout = core.settings.timings(role).request_timeout;
                        let (id, reply) = core.enqueue(
                            caller,
                            role,
                            binding,
                            shape,
                            texts,
                            core::Origin {
                                request_id: current_request_id(),
                                traceparent: traceparent.clone(),
                            },
                        )?;
                        if let Some(tx) = stream.take() {
                            core.stream_to(id, tx);
                        }
                        return Ok(Running {
                            role,
                            guard: CancelOnDrop {
                                hub: self.clone(),
                                id,
                                armed: true,
                            },
                            reply,
                            timeout,
                        });
                    }
                    Err(e) => e,
                }
            };
            match attempt {
                SubmitError::NotYet(why) if tokio::time::Instant::now() < give_up => {
                    tracing::debug!(role = %role, reason = %why, "admission waits for the fleet to settle");
                    tokio::select! {
                        _ = changes.changed() => {}
                        _ = tokio::time::sleep_until(give_up) => {}
                    }
                }
                SubmitError::NotYet(why) | SubmitError::Unservable(why) => {
                    self.core().count_unservable(&why);
                    return Err(SubmitError::Unservable(why).into());
                }
                other => return Err(other.into()),
            }
        }
    }

    /// Applies an admin push: merge (the hub holds no key, only that one was pushed),
    /// persist with a new revision (and a new key generation when it carried a key), send the
    /// whole merged config to every connected agent, then drop the key.
    pub async fn push_config(&self, push: OpenRouterPush) -> Result<PushResult, PushError> {
        let hub = self.clone();
        to_the_end(async move { hub.apply_push(push).await })
            .await
            .unwrap_or_else(|e| Err(PushError::State(e)))
    }

    async fn apply_push(&self, mut push: OpenRouterPush) -> Result<PushResult, PushError> {
        // Writers one at a time; the file is written (and synced) off the runtime's threads
        // and before the core is held, so dispatch and status never wait on a disk.
        let _writing = self.inner.state_writes.lock().await;
        let mut next = self.state();
        let report = push::merge(&mut next.cloud, next.key.is_some(), &push)?;
        let at = now_ms();
        next.last_push_ms = Some(at);
        next.config_revision = next.config_revision.saturating_add(1);
        if report.key_included {
            next.key = Some(KeyRecord {
                pushed_at_ms: at,
                pushes: next.key.as_ref().map_or(0, |k| k.pushes) + 1,
            });
            next.key_generation = Some(core::ConfigRevision::new_key_generation());
        }
        let next = self.persist(next).await?;
        let (cloud, revision) = (
            next.cloud.clone(),
            core::ConfigRevision {
                revision: next.config_revision,
                key_generation: next.key_generation.clone(),
            },
        );
        *self.lock_state() = next;
        // Only what the merge kept leaves the hub (the whole config at its revision), and the
        // key; never the request's body.
        let key = push.api_key.take();
        drop(push);
        let mut core = self.core();
        core.set_config(cloud, revision);
        // A push may fix what a route was refused for (its pin): it is asked again.
        core.push_applied();
        if report.key_included {
            // A new key: forget a hard stop and the old account's limits; ask again.
            core.budget.key_changed(Instant::now());
        }
        let id = format!("cfg-{}", core.config_revision().revision);
        let sent_to = core.broadcast_config(&id, key);
        // A policy may change a role's reference, and so its space: before any dispatch.
        core.gate_tick(Instant::now());
        core.dispatch_all();
        tracing::info!(config_id = %id, revision = core.config_revision().revision, key_included = report.key_included, agents = sent_to.len(), "config push applied");
        Ok(PushResult {
            id,
            applied: true,
            key_included: report.key_included,
            roles: report.roles,
            sent_to,
        })
    }

    /// Whether this hub may write its state now (a leader on etcd past its renewal deadline
    /// may not: the fence says why).
    fn writable(&self) -> Result<(), StateError> {
        self.inner
            .store
            .fence()
            .check(Instant::now())
            .map_err(|fenced| StateError::Fenced(fenced.0))
    }

    fn lock_state(&self) -> MutexGuard<'_, HubState> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes `next` to the store; it is the state once written.
    async fn persist(&self, next: HubState) -> Result<HubState, StateError> {
        self.inner.store.save(&next).await?;
        self.inner
            .state_saves
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(next)
    }

    /// Writes of the state the store took since this hub started.
    pub fn state_saves(&self) -> u64 {
        self.inner
            .state_saves
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Persists the vector spaces and the roles' live spaces (a new one was fingerprinted, one
    /// retired, a role's first space adopted, a migration's next space named). They are taken
    /// from the gate once the write lock is held, so a scale stored meanwhile
    /// ([`Hub::int8_scale`]) is never written over by an older copy.
    async fn save_spaces(&self) {
        if self.inner.store.fence().check(Instant::now()).is_err() {
            // Fenced: written when etcd answers again (the fence logs why, once).
            self.core().gate.mark_dirty();
            return;
        }
        let _writing = self.inner.state_writes.lock().await;
        let mut next = self.state();
        {
            let core = self.core();
            next.spaces = core.gate.spaces().clone();
            next.role_spaces = core.gate.live().clone();
        }
        match self.persist(next).await {
            Ok(next) => *self.lock_state() = next,
            Err(e) => {
                tracing::error!(error = %e, "the vector spaces could not be saved; trying again");
                self.core().gate.mark_dirty();
            }
        }
    }

    /// The operator's live budget override (`None` clears it); persisted.
    pub async fn set_budget_override(&self, permits: Option<u32>) -> Result<(), StateError> {
        let hub = self.clone();
        to_the_end(async move { hub.apply_budget_override(permits).await })
            .await
            .unwrap_or_else(Err)
    }

    async fn apply_budget_override(&self, permits: Option<u32>) -> Result<(), StateError> {
        let _writing = self.inner.state_writes.lock().await;
        let mut next = self.state();
        next.budget_override = permits;
        let next = self.persist(next).await?;
        *self.lock_state() = next;
        // Applied while the writers' lock is held, so two concurrent overrides leave the file
        // and the live budget with the same number.
        let mut core = self.core();
        core.budget.set_override(permits, Instant::now());
        core.dispatch_all();
        drop(core);
        tracing::info!(permits = ?permits, "budget override set");
        Ok(())
    }

    /// Where the state is kept.
    pub fn store(&self) -> &StateStore {
        &self.inner.store
    }

    /// The safe config as persisted.
    pub fn state(&self) -> HubState {
        self.lock_state().clone()
    }

    /// The console's chart samples.
    pub fn history(&self) -> std::sync::MutexGuard<'_, history::History> {
        self.inner.history.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Expires leases on a short tick; runs until the hub is dropped by every other holder.
    pub fn spawn_maintenance(&self) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            let mut sampled = Instant::now();
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let hub = Hub { inner };
                let (spaces_changed, sample) = {
                    let mut core = hub.core();
                    let now = Instant::now();
                    core.expire(now);
                    core.replies.expire(now);
                    core.discover_if_due(now);
                    core.gate_tick(now);
                    core.forget_departed();
                    core.tell_suspensions();
                    let sample = (now.saturating_duration_since(sampled) >= history::SAMPLE_EVERY)
                        .then(|| {
                            sampled = now;
                            sample_of(&mut core, now)
                        });
                    (core.gate.take_dirty(), sample)
                };
                if let Some(sample) = sample {
                    hub.history().push(sample);
                }
                if spaces_changed {
                    hub.save_spaces().await;
                }
                hub.checkpoint_usage_if_due().await;
                hub.checkpoint_handover_if_due().await;
                // A provider whose bench or pause ended gets work without waiting for a pull.
                hub.core().dispatch_all();
            }
        })
    }
}

/// The hub now, for the console's charts.
fn sample_of(core: &mut Core, now: Instant) -> history::Sample {
    let budget = core.budget.view(now);
    history::Sample {
        t_ms: now_ms(),
        ceiling: budget.ceiling,
        limit: budget.limit,
        in_flight: budget.in_flight,
        throttles: budget.throttles,
        cooling: budget.cooldown_remaining_ms > 0,
        stopped: budget.stopped.is_some() || budget.key_rejected.is_some(),
        queue_depth: Role::ALL
            .into_iter()
            .map(|r| (r, core.queue_depth(r)))
            .collect(),
        agents: core.agents().len(),
    }
}

#[cfg(test)]
impl Hub {
    /// A hub on a state dir at `dir`, with fixed tokens, for unit tests.
    pub(crate) fn open_for_tests(
        dir: &std::path::Path,
        client_token: Option<&str>,
        require_project_key: bool,
        gate: gate::GateSettings,
    ) -> Hub {
        Hub::open_for_tests_from(
            dir,
            client_token,
            require_project_key,
            gate,
            HubState::fresh(),
        )
    }

    /// [`Hub::open_for_tests`] from a state as loaded (a restart, the next leader).
    pub(crate) fn open_for_tests_from(
        dir: &std::path::Path,
        client_token: Option<&str>,
        require_project_key: bool,
        gate: gate::GateSettings,
        state: HubState,
    ) -> Hub {
        Hub::open(
            HubOptions {
                settings: HubSettings::default(),
                store: StateStore::File(store::file::FileStore::open(dir).unwrap()),
                fleet_token: Secret::new("fleet-token-for-tests"),
                admin_token: Secret::new("admin-token-for-tests"),
                client_token: client_token.map(Secret::new),
                require_project_key,
                gate,
            },
            state,
        )
        .unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn status_and_the_config_never_wait_for_a_state_write_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::open_for_tests(dir.path(), None, false, gate::GateSettings::default());
        // A writer holds the state (its fsync under way on a blocking thread).
        let writing = hub.inner.state_writes.lock().await;
        let status = hub.status();
        assert!(!status.config.key_pushed);
        assert_eq!(hub.state().last_push_ms, None);
        drop(writing);
        // Writers take turns; the write lands, then the state shows it.
        let (a, b) = tokio::join!(
            hub.set_budget_override(Some(3)),
            hub.set_budget_override(None)
        );
        a.unwrap();
        b.unwrap();
        assert_eq!(hub.state().budget_override, None);
        let on_disk = store::file::read(dir.path()).unwrap();
        assert_eq!(on_disk.budget_override, None);
        // The two overrides are events in status, in order.
        let overrides = hub.status().events;
        assert_eq!(overrides.len(), 2, "{overrides:?}");
        assert!(
            overrides
                .iter()
                .all(|e| e.kind == events::EventKind::Override)
        );
    }

    #[tokio::test]
    async fn a_refused_request_is_counted_for_its_role_by_the_code_its_client_got() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::open_for_tests(dir.path(), None, false, gate::GateSettings::default());
        let caller = || projects::Caller::default_project(crate::protocol::WorkClass::Batch);
        let rerank = || Shape::Rerank {
            query: "q".into(),
            instruction: None,
        };
        // Nothing connected: refused at once, twice; and one past the hub's input limit.
        for _ in 0..2 {
            let e = hub
                .run(caller(), Role::Reranker, rerank(), vec!["d".into()])
                .await
                .unwrap_err();
            assert_eq!(e.code(), "no_provider", "{e}");
        }
        let many = vec!["d".to_string(); HubSettings::default().limits.max_inputs + 1];
        let e = hub
            .run(caller(), Role::Reranker, rerank(), many)
            .await
            .unwrap_err();
        assert_eq!(e.code(), "too_many_inputs", "{e}");
        let status = hub.status();
        let reranker = &status.roles[&Role::Reranker];
        assert_eq!(
            reranker.refused,
            std::collections::BTreeMap::from([("no_provider", 2), ("too_many_inputs", 1)])
        );
        assert!(reranker.failed.is_empty() && reranker.wait_ms.is_none());
        assert!(status.roles[&Role::Embedding].refused.is_empty());
    }
}
