//! The long-running commands: `hub`, `agent`, and `serve` (hub and one agent in one process).
//! Each prints one JSON line per listener on stdout (`{"listening": NAME, "addr": ADDR}`), so a
//! supervisor or a test can find a port chosen with `:0`, and stops cleanly on SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use tokio::sync::watch;

use super::ModelArgs;
use super::hub_etcd::{self, EtcdArgs};
use super::reload;
use crate::agent::local_server::LocalServers;
use crate::agent::{self, Agent, AgentOptions};
use crate::config::agent::{AgentConfig, ServedModel};
use crate::config::hub::{HubConfig, HubLayer};
use crate::config::tokens;
use crate::fantom;
use crate::fantom::containers::Containers;
use crate::fantom::relay::RelayContext;
use crate::fantom::sidecar::Sidecar;
use crate::fantom::slots::Slots;
use crate::http::{self, TlsFiles};
use crate::hub::core::HubSettings;
use crate::hub::gate::GateSettings;
use crate::hub::store::StateStore;
use crate::hub::store::file::FileStore;
use crate::hub::{Hub, HubOptions};
use crate::protocol::codec::DEFAULT_MAX_FRAME_BYTES;
use crate::roles::Role;
use crate::secret::Secret;
use crate::service::credentials;
use crate::service::notify::Notifier;

#[derive(Args, Clone, Debug)]
pub struct HubArgs {
    /// A TOML file with these settings as keys (snake_case); a flag given here wins over its
    /// key. SIGHUP reads it again (systemd/hub.example.toml).
    #[arg(long, env = "FANTOM_HUB_CONFIG")]
    config: Option<PathBuf>,
    /// Address of the client, admin and agent endpoints [default: 127.0.0.1:8090].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Where the hub keeps its safe config and generated tokens ($STATE_DIRECTORY under
    /// systemd; else ~/.local/state/fantom-sidecar).
    #[arg(long, env = "FANTOM_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// The admin API's token (else the admin-token credential; else generated into the state
    /// dir).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// The agents' token (else the fleet-token credential; else generated into the state dir).
    #[arg(long)]
    fleet_token_file: Option<PathBuf>,
    /// When given (or the client-token credential), client endpoints require this token.
    #[arg(long)]
    client_token_file: Option<PathBuf>,
    /// Every client request must present a project key (`fantom-sidecar projects add`); a
    /// request without one is refused instead of belonging to `default`.
    #[arg(long)]
    require_project_key: bool,
    /// Seconds a lease lives without a heartbeat renewing it, for every role without its own
    /// `[roles.<role>] lease_s` [default: 60 for embeddings and reranks, 120 for chats].
    #[arg(long)]
    lease_s: Option<u64>,
    /// Items each role queue holds before clients get 429 [default: 100000].
    #[arg(long)]
    queue_capacity: Option<usize>,
    /// Seconds a client request may wait for all its items, for every role without its own
    /// [default: 600 for embeddings and reranks, 900 for chats].
    #[arg(long)]
    request_timeout_s: Option<u64>,
    /// Seconds one provider call may take, for every role without its own [default: 120 for
    /// embeddings and reranks, 600 for chats].
    #[arg(long)]
    call_timeout_s: Option<u64>,
    /// Milliseconds between heartbeats (and the hub's pings); three of silence end a socket
    /// [default: 5000; 100..60000].
    #[arg(long)]
    heartbeat_ms: Option<u64>,
    /// MiB of input all accepted requests together may hold before new ones get 429
    /// [default: 1024].
    #[arg(long)]
    max_held_mb: Option<u64>,
    /// Inputs (texts, documents) one request may carry (more: 413) [default: 4096].
    #[arg(long)]
    max_inputs: Option<usize>,
    /// Characters one input may have (more: 413) [default: 1000000].
    #[arg(long)]
    max_input_chars: Option<usize>,
    /// `Idempotency-Key`s each project's table holds: a new key forgets the project's oldest
    /// answered one, never another project's [default: 16384].
    #[arg(long)]
    idempotency_keys_per_project: Option<usize>,
    /// MiB of answers (their memory) each project's `Idempotency-Key` table holds for
    /// retries: the project's oldest go first [default: 16].
    #[arg(long)]
    idempotency_answers_mib_per_project: Option<u64>,
    /// The gate's minimum cosine between a provider's probe vectors and the space's
    /// fingerprint (values under 0.99 are raised to 0.99) [default: 0.99].
    #[arg(long)]
    gate_min_cosine: Option<f64>,
    /// Seconds between the drift sentinel's re-probes of every serving embedding provider
    /// [default: 600].
    #[arg(long)]
    gate_sentinel_s: Option<u64>,
    /// `agent/provider` of the gate's reference for local policies (default: the first
    /// healthy local provider in a stable order).
    #[arg(long)]
    gate_reference: Option<String>,
    /// Local providers (`agent/provider`, comma-separated) whose embedding work frames carry no
    /// canary (cloud providers always carry one).
    #[arg(long, value_delimiter = ',')]
    gate_no_canary: Option<Vec<String>>,
    /// Seconds after its agent left that a provider's passing or probe-failed verdict, its
    /// counters and its metric series are forgotten; suspended and refused verdicts stay until
    /// an operator's verify [default: 86400].
    #[arg(long)]
    forget_departed_s: Option<u64>,
    /// Roles `GET /ready` waits for, comma-separated (every role a provider or a cloud route
    /// has offered counts too; `serve` adds the roles it loads).
    #[arg(long, value_delimiter = ',')]
    ready_roles: Option<Vec<Role>>,
    /// Recovery, for one start: a stored part (or a field of the state file) that cannot be
    /// read is copied into `<state dir>/unreadable/` and starts from its defaults, with an
    /// error in the log and in `/admin/status` → `ha.set_aside` (without it such a start fails,
    /// naming the part and the field).
    #[arg(long)]
    set_aside_unreadable_state: bool,
}

impl HubArgs {
    /// The flags as a layer over the file.
    fn layer(&self, tls: Option<&TlsArgs>) -> HubLayer {
        HubLayer {
            listen: self.listen,
            state_dir: self.state_dir.clone(),
            admin_token_file: self.admin_token_file.clone(),
            fleet_token_file: self.fleet_token_file.clone(),
            client_token_file: self.client_token_file.clone(),
            require_project_key: self.require_project_key.then_some(true),
            lease_s: self.lease_s,
            queue_capacity: self.queue_capacity,
            request_timeout_s: self.request_timeout_s,
            call_timeout_s: self.call_timeout_s,
            heartbeat_ms: self.heartbeat_ms,
            max_held_mb: self.max_held_mb,
            max_inputs: self.max_inputs,
            max_input_chars: self.max_input_chars,
            idempotency_keys_per_project: self.idempotency_keys_per_project,
            idempotency_answers_mib_per_project: self.idempotency_answers_mib_per_project,
            roles: Default::default(),
            gate_min_cosine: self.gate_min_cosine,
            gate_sentinel_s: self.gate_sentinel_s,
            gate_reference: self.gate_reference.clone(),
            gate_no_canary: self.gate_no_canary.clone(),
            forget_departed_s: self.forget_departed_s,
            ready_roles: self.ready_roles.clone(),
            tls_cert: tls.and_then(|t| t.tls_cert.clone()),
            tls_key: tls.and_then(|t| t.tls_key.clone()),
        }
    }

    /// The flags over the `--config` file (read now) over the defaults.
    fn resolve(&self, tls: Option<&TlsArgs>) -> anyhow::Result<HubConfig> {
        let file = match &self.config {
            Some(path) => HubLayer::load(path).map_err(anyhow::Error::msg)?,
            None => HubLayer::default(),
        };
        self.layer(tls).over(&file).map_err(anyhow::Error::msg)
    }
}

#[derive(Args, Clone, Debug)]
pub struct TlsArgs {
    /// PEM certificate chain: serve https:// and wss:// (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[derive(Args)]
pub struct HubCommand {
    #[command(flatten)]
    hub: HubArgs,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    etcd: EtcdArgs,
}

#[derive(Args)]
pub struct AgentCommand {
    /// The agent's TOML file (hub URL, Fantom masters, id, token source, models).
    #[arg(long)]
    config: PathBuf,
    /// Address of the agent's HTTP port: health and metrics, and with Fantom masters their
    /// status, role and chat routes (masters need a reachable address: 0.0.0.0:8098).
    #[arg(long, env = "FANTOM_AGENT_HTTP", default_value = "127.0.0.1:8098")]
    http: SocketAddr,
    /// OpenRouter's API base for cloud routes (overrides `openrouter_url` of the config).
    #[arg(long)]
    openrouter_url: Option<String>,
}

#[derive(Args)]
pub struct ServeCommand {
    #[command(flatten)]
    hub: HubArgs,
    /// The embedder (--model / --model-dir and the engine flags).
    #[command(flatten)]
    model: ModelArgs,
    /// Roles the embedder serves.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "embedding,code-embedding"
    )]
    roles: Vec<Role>,
    /// A pinned reranker model id (serves the reranker role).
    #[arg(long)]
    reranker_model: Option<String>,
    /// The reranker's files.
    #[arg(long)]
    reranker_model_dir: Option<PathBuf>,
    /// Work frames in flight per provider [default: 2 on the CPU, 4 on a GPU].
    #[arg(long)]
    pipeline_depth: Option<u32>,
    /// Items per work frame [default: 64 on the CPU, 256 on a GPU].
    #[arg(long)]
    max_items_per_work: Option<usize>,
    /// The embedded agent's id (default: the hostname).
    #[arg(long)]
    agent_id: Option<String>,
    /// Also serve the agent's own health/metrics here.
    #[arg(long)]
    http: Option<SocketAddr>,
    /// OpenRouter's API base for cloud routes (default https://openrouter.ai/api/v1).
    #[arg(long)]
    openrouter_url: Option<String>,
}

pub(super) fn default_state_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("STATE_DIRECTORY") {
        return PathBuf::from(dir);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    Path::new(&home).join(".local/state/fantom-sidecar")
}

/// How often the `STATUS=` line is brought up to date.
const STATUS_EVERY: Duration = Duration::from_secs(5);
/// The longest `READY=1` waits for a first dial (hub, each master) to be attempted.
const FIRST_DIAL_WAIT: Duration = Duration::from_secs(15);

/// SIGTERM or SIGINT flips the returned flag.
fn shutdown_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let term = async {
            #[cfg(unix)]
            if let Ok(mut s) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            {
                s.recv().await;
                return;
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            _ = term => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutdown requested");
        let _ = tx.send(true);
    });
    rx
}

async fn signalled(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// Warns when `name` listens beyond loopback without TLS: the fleet token, the admin and
/// client tokens and a pushed OpenRouter key would cross the network in the clear.
fn warn_if_plaintext(listen: SocketAddr, tls: bool, name: &str) {
    if !tls && !listen.ip().is_loopback() {
        tracing::warn!(
            %listen,
            name,
            "listening beyond loopback without TLS: the fleet, admin and client tokens and a pushed OpenRouter key would cross the network in the clear; give the hub --tls-cert/--tls-key (tls_cert/tls_key), or keep it on 127.0.0.1 behind a TLS-terminating proxy (docs/operations.md, \"Running behind TLS\")"
        );
    }
}

fn bind(addr: SocketAddr, name: &str) -> anyhow::Result<std::net::TcpListener> {
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    println!(
        "{}",
        serde_json::json!({"listening": name, "addr": bound.to_string()})
    );
    tracing::info!(%bound, name, "listening");
    Ok(listener)
}

/// Opens the hub's state store. First, before anything else: a second hub on a held state dir
/// stops here, before it loads a model or generates or reads a token.
fn open_store(args: &HubConfig, set_aside_unreadable: bool) -> anyhow::Result<StateStore> {
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    let file = FileStore::open(&state_dir)?;
    Ok(StateStore::File(if set_aside_unreadable {
        file.setting_aside_unreadable()
    } else {
        file
    }))
}

/// The admin token (its file, its credential, or generated into the state dir) and its path.
fn admin_token(args: &HubConfig) -> anyhow::Result<(Secret, PathBuf)> {
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    Ok(tokens::load_or_generate(
        args.admin_token_file.as_deref(),
        credentials::ADMIN_TOKEN,
        &state_dir,
        "admin.token",
    )?)
}

/// Opens the hub on `store`. `agents_elsewhere`: its agents are other processes, which may
/// hand over keyed chats' answers they kept (false for `serve`).
async fn open_hub(
    args: &HubConfig,
    store: StateStore,
    agents_elsewhere: bool,
) -> anyhow::Result<Hub> {
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    let (admin_token, admin_path) = admin_token(args)?;
    let (fleet_token, fleet_path) = tokens::load_or_generate(
        args.fleet_token_file.as_deref(),
        credentials::FLEET_TOKEN,
        &state_dir,
        "fleet.token",
    )?;
    let client_token = tokens::optional(
        args.client_token_file.as_deref(),
        None,
        credentials::CLIENT_TOKEN,
    )?;
    tracing::info!(admin_token = %admin_path.display(), fleet_token = %fleet_path.display(), state_dir = %state_dir.display(), client_auth = client_token.is_some(), "hub tokens (paths only)");
    let (timings, clamps) = args.role_timings();
    for note in clamps {
        tracing::warn!(note = %note, "a timing was clamped");
    }
    let settings = HubSettings {
        timings,
        heartbeat_interval: args.heartbeat(),
        queue_capacity: args.queue_capacity.max(1),
        limits: args.limits,
        replies: args.replies,
        ready_roles: args.ready_roles.iter().copied().collect(),
        handover_window: if agents_elsewhere {
            args.heartbeat() + std::time::Duration::from_secs(5)
        } else {
            std::time::Duration::ZERO
        },
        ..HubSettings::default()
    };
    warn_if_plaintext(args.listen, args.tls_cert.is_some(), "hub");
    if args.gate_min_cosine < crate::hub::gate::measure::MIN_COSINE_FLOOR {
        tracing::warn!(
            asked = args.gate_min_cosine,
            "the gate's minimum cosine is never under 0.99; using 0.99"
        );
    }
    let gate = GateSettings::from_config(args);
    tracing::info!(store = %store.describe(), "hub state store");
    let state = store.load().await?;
    Ok(Hub::open(
        HubOptions {
            settings,
            store,
            fleet_token,
            admin_token,
            client_token,
            require_project_key: args.require_project_key,
            gate,
        },
        state,
    )?)
}

pub async fn hub(cmd: HubCommand) -> anyhow::Result<()> {
    let notifier = Notifier::from_env();
    let _watchdog = notifier.spawn_watchdog();
    notifier.status("starting");
    let cfg = cmd.hub.resolve(Some(&cmd.tls))?;
    let tls = match (cfg.tls_cert.clone(), cfg.tls_key.clone()) {
        (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
        _ => None,
    };
    let stop = shutdown_signal();
    // SIGHUP is ours before any READY=1 (a standby's too) says a reload may be asked for.
    let hangups = reload::Hangups::listen();
    let (hub, listener, leading) = if cmd.etcd.enabled() {
        // Every hub of the store holds the same tokens, from files: nothing is generated.
        cmd.etcd
            .check_tokens(cfg.admin_token_file.as_ref(), cfg.fleet_token_file.as_ref())?;
        let listener = bind(cfg.listen, "hub")?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}", listener.local_addr()?);
        cmd.etcd.check_advertised(listener.local_addr()?)?;
        // Up and answering (as a standby) is what systemd waits for; leading may take long.
        notifier.ready("standby: campaigning for the lead");
        let state_dir = cfg.state_dir.clone().unwrap_or_else(default_state_dir);
        let me = http::standby::StandbySelf {
            admin_token: admin_token(&cfg)?.0,
            store: cmd.etcd.describe(),
            peer_trust: cmd.etcd.peer_trust()?,
        };
        let recovery = if cmd.hub.set_aside_unreadable_state {
            crate::hub::store::parts::Recovery::set_aside_into(&state_dir)
        } else {
            crate::hub::store::parts::Recovery::refuse()
        };
        let Some((store, leading)) = lead_behind_standby(
            &cmd.etcd,
            &listener,
            tls.clone(),
            url,
            me,
            recovery,
            stop.clone(),
        )
        .await?
        else {
            return Ok(());
        };
        hub_etcd::exit_when_deposed(leading.standing.clone());
        (open_hub(&cfg, store, true).await?, listener, Some(leading))
    } else {
        // The state dir is locked before anything else; the tokens exist before the listener.
        let hub = open_hub(
            &cfg,
            open_store(&cfg, cmd.hub.set_aside_unreadable_state)?,
            true,
        )
        .await?;
        (hub, bind(cfg.listen, "hub")?, None)
    };
    let _maintenance = hub.spawn_maintenance();
    let _aside = leading
        .as_ref()
        .and_then(|l| hub.spawn_aside_watch(l.peers.clone()))
        .map(AbortOnDrop);
    let (status_task, reload_task) = supervise_hub(
        &notifier,
        &hub,
        &stop,
        hangups,
        cmd.hub.clone(),
        Some(cmd.tls.clone()),
        cfg,
    );
    let draining = hub.clone();
    let shutdown = async move {
        signalled(stop).await;
        // Waiting clients are told now; they would otherwise hold the server open.
        draining.core().fail_all();
    };
    http::serve(listener, http::hub_router(hub.clone()), tls, shutdown).await?;
    reload_task.abort();
    let _ = status_task.await;
    if let Some(leading) = leading {
        leading.resign().await;
    }
    Ok(())
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves the standby surface on `listener` while campaigning; `None` when stopped first.
async fn lead_behind_standby(
    etcd: &EtcdArgs,
    listener: &std::net::TcpListener,
    tls: Option<TlsFiles>,
    url: String,
    me: http::standby::StandbySelf,
    recovery: crate::hub::store::parts::Recovery,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Option<(crate::hub::store::StateStore, hub_etcd::Leading)>> {
    let seen = http::standby::SeenLeader::default();
    let (won_tx, won_rx) = watch::channel(false);
    let standby = tokio::spawn(http::serve(
        listener.try_clone()?,
        http::standby::router(seen.clone(), won_rx.clone(), me),
        tls,
        signalled(won_rx),
    ));
    let outcome = tokio::select! {
        led = etcd.lead(url, seen, recovery) => Some(led),
        () = signalled(stop) => None,
    };
    // Forwards in flight end at once (503: send it again), idle connections close; a
    // connection that still lingers after that is cut.
    let _ = won_tx.send(true);
    let abort = standby.abort_handle();
    if tokio::time::timeout(Duration::from_secs(5), standby)
        .await
        .is_err()
    {
        abort.abort();
    }
    outcome.transpose()
}

/// `READY=1` with the hub's status line, then its `STATUS=` updates until `stop` (ending with
/// `STOPPING=1`) and SIGHUP reloads of its settings: the two tasks.
#[allow(clippy::too_many_arguments)]
fn supervise_hub(
    notifier: &Notifier,
    hub: &Hub,
    stop: &watch::Receiver<bool>,
    hangups: reload::Hangups,
    args: HubArgs,
    tls: Option<TlsArgs>,
    running: HubConfig,
) -> (tokio::task::JoinHandle<()>, tokio::task::JoinHandle<()>) {
    notifier.ready(&hub_status_line(hub));
    let status_task = {
        let hub = hub.clone();
        notifier.spawn_status_updates(
            STATUS_EVERY,
            stop.clone(),
            move || hub_status_line(&hub),
            || "draining".to_string(),
        )
    };
    let reload_task = tokio::spawn(reload_hub_on_hangup(
        hangups,
        args,
        tls,
        running,
        hub.clone(),
        notifier.clone(),
    ));
    (status_task, reload_task)
}

/// SIGHUP for the hub: read `--config` again; the roles' timings, the request limits, the
/// `Idempotency-Key` bounds and the gate's settings apply at once, the rest is named as
/// needing a restart.
async fn reload_hub_on_hangup(
    hangups: reload::Hangups,
    args: HubArgs,
    tls: Option<TlsArgs>,
    mut running: HubConfig,
    hub: Hub,
    notifier: Notifier,
) {
    reload::on_hangup(hangups, notifier, move || {
        let new = match args.resolve(tls.as_ref()) {
            Ok(new) => new,
            Err(e) => return reload::ReloadReport::failed(e.to_string()),
        };
        let needs_restart = running.needs_restart(&new);
        let mut applied = Vec::new();
        {
            let mut core = hub.core();
            if (&new.timings, &new.roles) != (&running.timings, &running.roles) {
                let (timings, clamps) = new.role_timings_beating(running.heartbeat());
                for note in clamps {
                    tracing::warn!(note = %note, "a timing was clamped");
                }
                core.settings.timings = timings;
                applied.push("role timings");
            }
            if new.limits != running.limits {
                core.settings.limits = new.limits;
                applied.push("request limits");
            }
            if new.replies != running.replies {
                core.settings.replies = new.replies;
                core.replies.set_limits(new.replies);
                applied.push("Idempotency-Key bounds");
            }
            let (gate, wanted) = (&mut core.gate.settings, GateSettings::from_config(&new));
            if new.gate_min_cosine != running.gate_min_cosine {
                gate.min_cosine = wanted.min_cosine;
                applied.push("gate_min_cosine");
            }
            if new.gate_sentinel_s != running.gate_sentinel_s {
                gate.sentinel = wanted.sentinel;
                applied.push("gate_sentinel_s");
            }
            if new.gate_reference != running.gate_reference {
                gate.reference = wanted.reference;
                applied.push("gate_reference");
            }
            if new.gate_no_canary != running.gate_no_canary {
                gate.no_canary = wanted.no_canary;
                applied.push("gate_no_canary");
            }
            if new.forget_departed_s != running.forget_departed_s {
                gate.forget_departed = wanted.forget_departed;
                applied.push("forget_departed_s");
            }
        }
        running = HubConfig {
            timings: new.timings,
            roles: new.roles,
            limits: new.limits,
            replies: new.replies,
            gate_min_cosine: new.gate_min_cosine,
            gate_sentinel_s: new.gate_sentinel_s,
            gate_reference: new.gate_reference,
            gate_no_canary: new.gate_no_canary,
            forget_departed_s: new.forget_departed_s,
            ..running.clone()
        };
        reload::ReloadReport {
            applied: applied.into_iter().map(String::from).collect(),
            needs_restart: needs_restart.into_iter().map(String::from).collect(),
            error: None,
        }
    })
    .await
}

/// The hub's `STATUS=` line.
fn hub_status_line(hub: &Hub) -> String {
    let core = hub.core();
    let queued: usize = Role::ALL.iter().map(|r| core.queue_depth(*r)).sum();
    format!(
        "serving: {} agents, {queued} items queued",
        core.agents().len()
    )
}

fn cloud_options(openrouter_url: Option<String>, depth: u32) -> agent::CloudOptions {
    let mut cloud = agent::CloudOptions::default();
    if let Some(url) = openrouter_url {
        cloud.openrouter_url = url;
    }
    cloud.pipeline_depth = depth.clamp(1, 256);
    cloud
}

pub async fn agent(cmd: AgentCommand) -> anyhow::Result<()> {
    let notifier = Notifier::from_env();
    let _watchdog = notifier.spawn_watchdog();
    notifier.status("loading models");
    let cfg = AgentConfig::load(&cmd.config)?;
    let hubs = cfg.hubs();
    let fleet_token = match hubs.first() {
        Some(_) => tokens::optional(
            cfg.fleet_token_file.as_deref(),
            cfg.fleet_token_env.as_deref(),
            credentials::FLEET_TOKEN,
        )?
        .ok_or(tokens::TokenError::NoSource)?,
        // Never sent: without a hub URL no hub session is dialled.
        None => Secret::new(String::new()),
    };
    let http_token = tokens::optional(
        cfg.http_token_file.as_deref(),
        cfg.http_token_env.as_deref(),
        credentials::HTTP_TOKEN,
    )?;
    let providers = agent::load_providers(&cfg.models).await?;
    if providers.is_empty() {
        tracing::info!(
            "no local models: this agent serves cloud routes only, once a push gives it a key"
        );
    }
    if hubs.is_empty() {
        tracing::info!("no hub_url: no hub session, Fantom masters only");
    }
    let cloud = cloud_options(
        cmd.openrouter_url.or(cfg.openrouter_url.clone()),
        cfg.cloud_pipeline_depth,
    );
    let stop = shutdown_signal();
    // Fronted servers: checked once now, so the first hello and heartbeat say where they stand.
    let servers = Arc::new(LocalServers::new(
        &cfg.local_servers,
        &cfg.systemctl,
        cloud.request_timeout,
    )?);
    servers.start(&stop).await;
    notifier.status("models loaded; connecting");
    let has_hub = !hubs.is_empty();
    let agent = Agent::new(AgentOptions {
        hub_urls: hubs,
        agent_id: cfg
            .agent_id
            .clone()
            .unwrap_or_else(crate::service::host::hostname),
        fleet_token,
        ca_file: cfg.ca_file.clone(),
        drain_timeout: Duration::from_secs(cfg.drain_timeout_s.clamp(1, 3600)),
        max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        // Without a hub the relay's containers are the models' only owners: a `stop` frees them.
        providers: if has_hub {
            providers.clone()
        } else {
            Vec::new()
        },
        servers: servers.clone(),
        cloud: cloud.clone(),
    });
    let listener = bind(cmd.http, "agent")?;
    let bound = listener.local_addr()?;
    let mut router = agent::http::router(agent.clone());
    let sidecar = if cfg.fantom_masters.is_empty() {
        None
    } else {
        let local = LocalRoles {
            providers: &providers,
            servers: &servers,
            shared_with_hub: has_hub,
        };
        let fantom = start_sidecar(&cfg, bound, local, cloud, http_token, &stop)?;
        router = router.merge(fantom::http::agent_port_router(fantom.clone()));
        Some(fantom)
    };
    let server = tokio::spawn(http::serve(listener, router, None, signalled(stop.clone())));
    let run = tokio::spawn(agent.clone().run(stop.clone()));

    // READY once the models are loaded and every first dial (hub, masters) was attempted.
    agent.first_dial(FIRST_DIAL_WAIT).await;
    if let Some(fantom) = &sidecar {
        fantom.slots.first_dials(FIRST_DIAL_WAIT).await;
    }
    // SIGHUP is ours before READY=1 says a reload may be asked for.
    let hangups = reload::Hangups::listen();
    notifier.ready(&agent_status_line(&agent, sidecar.as_deref()));
    let status_task = {
        let (agent, sidecar) = (agent.clone(), sidecar.clone());
        let draining = agent.clone();
        notifier.spawn_status_updates(
            STATUS_EVERY,
            stop.clone(),
            move || agent_status_line(&agent, sidecar.as_deref()),
            move || format!("draining: {} leases in flight", draining.in_flight()),
        )
    };
    let reload_task = tokio::spawn(reload_on_hangup(
        hangups,
        cmd.config.clone(),
        cfg.clone(),
        sidecar.clone(),
        notifier.clone(),
    ));

    run.await.context("the agent task panicked")??;
    reload_task.abort();
    let _ = status_task.await;
    // The relays saw the same shutdown; give their close frames a moment.
    if let Some(fantom) = &sidecar
        && !fantom.join_relays(Duration::from_secs(5)).await
    {
        tracing::warn!("relay sockets did not close within 5 s");
    }
    server.abort();
    Ok(())
}

/// What an agent serves locally, as the relay's containers see it.
struct LocalRoles<'a> {
    providers: &'a [Arc<dyn agent::provider::Provider>],
    servers: &'a LocalServers,
    /// A hub session shares the providers (a `stop` cannot free them).
    shared_with_hub: bool,
}

/// An agent's drop-in for Fantom masters: its slots (with each master's token), containers
/// and relay loops, and its role ports, listening already. The caller merges its agent-port
/// routes.
fn start_sidecar(
    cfg: &AgentConfig,
    bound: SocketAddr,
    local: LocalRoles<'_>,
    cloud: agent::CloudOptions,
    http_token: Option<Secret>,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<Arc<Sidecar>> {
    if bound.ip().is_loopback() {
        tracing::warn!(http = %bound, "Fantom masters are configured but the agent's HTTP port listens on loopback only: masters cannot reach it (e.g. --http 0.0.0.0:8098)");
    }
    let hostname = cfg
        .hostname
        .clone()
        .unwrap_or_else(crate::service::host::hostname);
    let ctx = RelayContext {
        agent_url: cfg
            .agent_url
            .clone()
            .unwrap_or_else(|| format!("http://{hostname}:{}", bound.port())),
        hostname,
        version: env!("CARGO_PKG_VERSION").to_string(),
        started: Instant::now(),
    };
    let slots = Slots::new(&[], cloud);
    for m in &cfg.fantom_masters {
        slots.add(&m.server_url, m.ws_port, m.auth_token()?);
    }
    let containers = Containers::new(
        local.providers,
        &cfg.models,
        local.servers,
        &cfg.role_ports,
        bound.port(),
        local.shared_with_hub,
    );
    let fantom = Sidecar::new(ctx, slots, containers, http_token, stop.clone());
    tracing::info!(masters = cfg.fantom_masters.len(), agent_url = %fantom.ctx.agent_url, "relaying to Fantom masters");
    if !fantom.auth_required() {
        tracing::warn!(
            "no bearer token is configured for the agent's HTTP port: /api/masters, start/stop/acquire/release and the chat proxy are refused until one is (http_token_file, http_token_env or the http-token credential, or auth_token_file on a [[fantom_master]]); the inference routes stay open, as Ollama's are"
        );
    }
    // Role ports: the master sends each role's inference to its `config.port`.
    let mut by_port: std::collections::BTreeMap<u16, Vec<Role>> = Default::default();
    for (role, port) in &cfg.role_ports {
        by_port.entry(*port).or_default().push(*role);
    }
    for (port, roles) in by_port {
        if port == bound.port() {
            continue;
        }
        let names: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
        let listener = bind(
            SocketAddr::new(bound.ip(), port),
            &format!("role port {}", names.join(",")),
        )?;
        tokio::spawn(http::serve(
            listener,
            fantom::http::role_port_router(fantom.clone(), roles),
            None,
            signalled(stop.clone()),
        ));
    }
    fantom.start_relays();
    Ok(fantom)
}

/// The agent's `STATUS=` line: its hub session and its masters.
fn agent_status_line(agent: &Agent, sidecar: Option<&Sidecar>) -> String {
    let mut parts = Vec::new();
    if !agent.has_hub() {
        let roles = sidecar.map_or(0, |s| {
            s.containers.iter().count() + s.containers.servers().count()
        });
        parts.push(format!("serving: {roles} local roles"));
    } else if agent.is_connected() {
        parts.push(format!(
            "serving: hub connected, {} providers",
            agent.providers().len()
        ));
    } else {
        parts.push("hub unreachable; retrying".to_string());
    }
    if let Some(fantom) = sidecar {
        let (registered, all) = fantom.slots.registered_count();
        parts.push(format!("{registered}/{all} masters registered"));
    }
    parts.join("; ")
}

/// SIGHUP: reload the config file where that is safe, and say what could not be applied.
async fn reload_on_hangup(
    hangups: reload::Hangups,
    path: PathBuf,
    mut current: AgentConfig,
    sidecar: Option<Arc<Sidecar>>,
    notifier: Notifier,
) {
    reload::on_hangup(hangups, notifier, move || {
        reload::reload_agent(&path, &mut current, sidecar.as_ref())
    })
    .await
}

pub async fn serve(cmd: ServeCommand) -> anyhow::Result<()> {
    let notifier = Notifier::from_env();
    let _watchdog = notifier.spawn_watchdog();
    let hub_cfg = cmd.hub.resolve(None)?;
    if hub_cfg.tls_cert.is_some() || hub_cfg.tls_key.is_some() {
        // The file's keys are never dropped without a word: refused, saying how to get TLS.
        anyhow::bail!(
            "serve runs the hub and its agent in one process over plain loopback and serves no \
             TLS, but the config file sets tls_cert/tls_key: run `fantom-sidecar hub --config \
             <file>` (which serves TLS) with `fantom-sidecar agent`, or remove tls_cert and \
             tls_key from the file and put serve behind a TLS-terminating proxy"
        );
    }
    let store = open_store(&hub_cfg, cmd.hub.set_aside_unreadable_state)?;
    notifier.status("loading models");
    let mut models = Vec::new();
    let embedder = cmd.model.choice();
    if embedder.model.is_some() || embedder.model_dir.is_some() {
        models.push(ServedModel {
            roles: cmd.roles.clone(),
            pipeline_depth: cmd.pipeline_depth,
            max_items_per_work: cmd.max_items_per_work,
            model: embedder.clone(),
        });
    }
    if cmd.reranker_model.is_some() || cmd.reranker_model_dir.is_some() {
        let mut reranker = embedder;
        reranker.model = cmd.reranker_model.clone();
        reranker.model_dir = cmd.reranker_model_dir.clone();
        reranker.random_weights = false;
        models.push(ServedModel {
            roles: vec![Role::Reranker],
            pipeline_depth: cmd.pipeline_depth,
            max_items_per_work: cmd.max_items_per_work,
            model: reranker,
        });
    }
    if models.is_empty() {
        tracing::info!(
            "no local model (--model/--model-dir, --reranker-model/--reranker-model-dir): cloud routes only, once a push gives a key"
        );
    }
    let providers = agent::load_providers(&models).await?;
    let hub = open_hub(&hub_cfg, store, false).await?;
    // Ready once the roles it loads can serve (besides any the flags or the file name).
    hub.core()
        .settings
        .ready_roles
        .extend(models.iter().flat_map(|m| m.roles.iter().copied()));
    let listener = bind(hub_cfg.listen, "hub")?;
    let bound = listener.local_addr()?;
    let _maintenance = hub.spawn_maintenance();
    let stop = shutdown_signal();
    let server = tokio::spawn(http::serve(
        listener,
        http::hub_router(hub.clone()),
        None,
        signalled(stop.clone()),
    ));
    let agent = Agent::new(AgentOptions {
        hub_urls: vec![format!("ws://{bound}/v1/agent")],
        agent_id: cmd.agent_id.unwrap_or_else(crate::service::host::hostname),
        fleet_token: hub.fleet_token().clone(),
        ca_file: None,
        drain_timeout: Duration::from_secs(30),
        max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        providers,
        servers: Default::default(),
        cloud: cloud_options(cmd.openrouter_url.clone(), 8),
    });
    if let Some(addr) = cmd.http {
        let listener = bind(addr, "agent")?;
        tokio::spawn(http::serve(
            listener,
            agent::http::router(agent.clone()),
            None,
            signalled(stop.clone()),
        ));
    }
    let run = tokio::spawn(agent.clone().run(stop.clone()));
    agent.first_dial(FIRST_DIAL_WAIT).await;
    // SIGHUP is ours before READY=1 says a reload may be asked for.
    let hangups = reload::Hangups::listen();
    let (status_task, reload_task) = supervise_hub(
        &notifier,
        &hub,
        &stop,
        hangups,
        cmd.hub.clone(),
        None,
        hub_cfg,
    );
    run.await.context("the agent task panicked")??;
    reload_task.abort();
    let _ = status_task.await;
    hub.core().fail_all();
    match tokio::time::timeout(Duration::from_secs(10), server).await {
        Ok(joined) => joined.context("the hub server panicked")??,
        Err(_) => tracing::warn!("the hub server did not stop within 10 s"),
    }
    Ok(())
}
