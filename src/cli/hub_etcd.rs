//! `hub --etcd-endpoints …`: the options of a hub that shares an etcd store with others, and
//! its way to the lead: connect, serve the standby surface while another hub leads, win the
//! election, open the etcd state store under this leader's epoch. A leader past its renewal
//! deadline is fenced (see [`crate::hub::store::fence`]); one that is deposed (its lease gone,
//! or a write refused under its epoch) exits at once with status 75, so it grants and writes
//! nothing more; its service manager starts it again as a candidate. Also
//! `migrate-state`: a single hub's state dir copied into an empty etcd store, once.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio::sync::watch;

use crate::config::tokens;
use crate::hub::peer_http::PeerTrust;
use crate::hub::store::StateStore;
use crate::hub::store::etcd::EtcdStore;
use crate::hub::store::etcd::client::{EtcdClient, EtcdOptions};
use crate::hub::store::etcd::election::{self, LeaderRecord, Standing};
use crate::service::credentials;

/// `migrate-state`: copies a single hub's state into etcd, once, with every hub stopped.
#[derive(Args, Clone, Debug)]
pub struct MigrateArgs {
    /// The single hub's state dir (locked while copying: its hub must be stopped).
    #[arg(long)]
    state_dir: PathBuf,
    #[command(flatten)]
    etcd: EtcdArgs,
}

/// Exit status of a deposed leader (EX_TEMPFAIL: start it again).
pub const DEPOSED_EXIT: i32 = 75;

#[derive(Args, Clone, Debug)]
pub struct EtcdArgs {
    /// etcd client URLs, comma-separated: the hubs given the same endpoints and prefix elect one
    /// leader and keep their state there (the state dir's file is not used).
    #[arg(long, env = "FANTOM_ETCD_ENDPOINTS", value_delimiter = ',')]
    etcd_endpoints: Vec<String>,
    /// The key prefix of this fleet's hubs in etcd.
    #[arg(long, env = "FANTOM_ETCD_PREFIX", default_value = "/fantom-sidecar")]
    etcd_prefix: String,
    /// A CA bundle (PEM) that signed etcd's certificates (`https://` endpoints).
    #[arg(long)]
    etcd_ca_file: Option<PathBuf>,
    /// A client certificate (PEM) for etcd's `--client-cert-auth`, with --etcd-key-file.
    #[arg(long)]
    etcd_cert_file: Option<PathBuf>,
    #[arg(long)]
    etcd_key_file: Option<PathBuf>,
    /// An etcd user (with --etcd-password-file).
    #[arg(long, env = "FANTOM_ETCD_USER")]
    etcd_user: Option<String>,
    /// A file holding the etcd user's password.
    #[arg(long)]
    etcd_password_file: Option<PathBuf>,
    /// The leader's lease in seconds: a standby takes over about this long after the leader's
    /// machine vanished (at once when its process ends cleanly).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(2..=60))]
    leader_ttl_s: u64,
    /// How agents, clients and the other hubs reach this hub [default: http(s)://<--listen>].
    #[arg(long, env = "FANTOM_ADVERTISE_URL")]
    advertise_url: Option<String>,
    /// A CA bundle (PEM) that signed the other hubs' certificates (`--tls-cert` from a private
    /// CA), trusted beside the system's roots when this hub forwards to or asks its peers.
    #[arg(long, env = "FANTOM_PEER_CA_FILE")]
    peer_ca_file: Option<PathBuf>,
}

/// A hub that leads: what it needs to keep leading.
pub struct Leading {
    /// Turns `Deposed` the moment the leader must stop.
    pub standing: watch::Receiver<Standing>,
    /// The other hubs of the store, as last read (what a leader cut off from etcd asks).
    pub peers: crate::hub::store::etcd::members::Peers,
    client: Arc<EtcdClient>,
    lease: i64,
    stop_renewing: watch::Sender<bool>,
}

impl Leading {
    /// Ends the lease (a clean exit: a standby takes over at once, not after the TTL).
    pub async fn resign(self) {
        let _ = self.stop_renewing.send(true);
        if let Err(e) = self.client.revoke(self.lease).await {
            tracing::warn!(error = %e, "the leader's lease could not be revoked; it expires by itself");
        }
    }
}

impl EtcdArgs {
    pub fn enabled(&self) -> bool {
        !self.etcd_endpoints.is_empty()
    }

    /// With etcd every hub of a store must hold the same tokens, so none is generated.
    pub fn check_tokens(
        &self,
        admin: Option<&PathBuf>,
        fleet: Option<&PathBuf>,
    ) -> anyhow::Result<()> {
        let given = |file: Option<&PathBuf>, credential: &str| {
            file.is_some() || credentials::path(credential).is_some()
        };
        if !given(admin, credentials::ADMIN_TOKEN) || !given(fleet, credentials::FLEET_TOKEN) {
            anyhow::bail!(
                "with --etcd-endpoints every hub of the store must use the same tokens, so none \
                 is generated: give --admin-token-file and --fleet-token-file (or the systemd \
                 credentials admin-token and fleet-token), the same files on every hub"
            );
        }
        Ok(())
    }

    /// Other hubs forward clients to the advertised address: an unspecified one (`0.0.0.0`)
    /// reaches nobody, so `--advertise-url` is then required.
    pub fn check_advertised(&self, bound: std::net::SocketAddr) -> anyhow::Result<()> {
        if self.advertise_url.is_none() && bound.ip().is_unspecified() {
            anyhow::bail!(
                "the hub listens on {bound}, which other hubs cannot dial: give --advertise-url \
                 (the address the other hubs, agents and clients reach this one at)"
            );
        }
        Ok(())
    }

    /// What this hub trusts its peers' certificates by (`--peer-ca-file`), read at start.
    pub fn peer_trust(&self) -> anyhow::Result<PeerTrust> {
        PeerTrust::from_file(self.peer_ca_file.as_deref()).map_err(anyhow::Error::msg)
    }

    fn client(&self) -> anyhow::Result<EtcdClient> {
        let password = self
            .etcd_password_file
            .as_deref()
            .map(tokens::read_token_file)
            .transpose()
            .context("the etcd password")?;
        Ok(EtcdClient::new(&EtcdOptions {
            endpoints: self.etcd_endpoints.clone(),
            ca_file: self.etcd_ca_file.clone(),
            cert_file: self.etcd_cert_file.clone(),
            key_file: self.etcd_key_file.clone(),
            user: self.etcd_user.clone(),
            password,
            timeout: Duration::from_secs(2),
            retry_for: Duration::from_secs(5),
        })?)
    }

    /// The store as status names it (endpoints and prefix; never a credential).
    pub fn describe(&self) -> String {
        // Scheme, host and port only: nothing a URL might carry beside them is shown.
        let endpoints: Vec<String> = self
            .etcd_endpoints
            .iter()
            .map(|e| match reqwest::Url::parse(e) {
                Ok(u) => format!(
                    "{}://{}{}",
                    u.scheme(),
                    u.host_str().unwrap_or("?"),
                    u.port().map(|p| format!(":{p}")).unwrap_or_default()
                ),
                Err(_) => "(an endpoint that is not a URL)".to_string(),
            })
            .collect();
        format!("etcd {} under {}", endpoints.join(","), self.prefix())
    }

    fn prefix(&self) -> String {
        let p = self.etcd_prefix.trim_end_matches('/');
        if p.starts_with('/') {
            p.to_string()
        } else {
            format!("/{p}")
        }
    }

    /// Campaigns until this hub leads, telling `seen` each leader while it waits; then opens
    /// the store under this leader's epoch and keeps the lease renewed.
    pub async fn lead(
        &self,
        listen_url: String,
        seen: crate::http::standby::SeenLeader,
        recovery: crate::hub::store::parts::Recovery,
    ) -> anyhow::Result<(StateStore, Leading)> {
        let client = Arc::new(self.client()?);
        let prefix = self.prefix();
        let me = LeaderRecord {
            url: self.advertise_url.clone().unwrap_or(listen_url),
            process: format!(
                "pid {} on {}",
                std::process::id(),
                crate::service::host::hostname()
            ),
            since_ms: crate::hub::now_ms(),
        };
        tracing::info!(endpoints = %client.endpoints().join(","), prefix = %prefix, url = %me.url, "campaigning for the hub's lead");
        let ttl = Duration::from_secs(self.leader_ttl_s);
        // Listed from the start, as a standby too: a leader cut off from etcd asks the hubs it
        // last read who leads.
        let peers = crate::hub::store::etcd::members::register(
            Arc::clone(&client),
            &prefix,
            format!("{:016x}", rand::random::<u64>()),
            me.url.clone(),
            ttl,
            self.peer_trust()?,
        );
        let leadership = election::campaign(&client, &prefix, &me, ttl, |leader, epoch| {
            tracing::info!(leader = %leader.url, process = %leader.process, epoch, "standby: another hub leads");
            *seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some((leader.clone(), epoch));
        })
        .await
        .context("the election")?;
        tracing::info!(
            epoch = leadership.epoch,
            ttl_s = ttl.as_secs(),
            "this hub leads"
        );
        let (stop_renewing, stop_rx) = watch::channel(false);
        let (standing_tx, standing) = watch::channel(Standing::Leading);
        let standing_tx = Arc::new(standing_tx);
        election::keep(
            Arc::clone(&client),
            &leadership,
            stop_rx,
            Arc::clone(&standing_tx),
        );
        let lease = leadership.lease;
        let store = StateStore::Etcd(
            EtcdStore::new(Arc::clone(&client), &prefix, leadership, standing_tx)
                .with_recovery(recovery),
        );
        Ok((
            store,
            Leading {
                standing,
                peers,
                client,
                lease,
                stop_renewing,
            },
        ))
    }
}

/// Copies the state file of `args.state_dir` into an empty etcd store: it takes the lead for
/// the copy (so no hub writes beside it), refuses a store that already holds a state or has a
/// leader, and gives the lead back at once.
pub async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    use crate::hub::store::file::FileStore;
    let etcd = &args.etcd;
    if !etcd.enabled() {
        anyhow::bail!("give --etcd-endpoints: the etcd store to copy the state into");
    }
    // The dir is locked: a hub still running on it is named, and nothing is copied.
    let file = FileStore::open(&args.state_dir)?;
    let state = file.load()?;
    let client = Arc::new(etcd.client()?);
    let prefix = etcd.prefix();
    if let Some((leader, _)) = election::current_leader(&client, &prefix).await? {
        anyhow::bail!(
            "a hub leads the etcd store under {prefix} ({} at {}): stop every hub of the store \
             before migrating",
            leader.process,
            leader.url
        );
    }
    let me = LeaderRecord {
        url: "migrate-state".into(),
        process: format!(
            "pid {} on {} (migrate-state)",
            std::process::id(),
            crate::service::host::hostname()
        ),
        since_ms: crate::hub::now_ms(),
    };
    let ttl = Duration::from_secs(etcd.leader_ttl_s.max(10));
    let leadership = tokio::time::timeout(
        Duration::from_secs(30),
        election::campaign(&client, &prefix, &me, ttl, |leader, _| {
            tracing::warn!(leader = %leader.url, "a hub took the lead while migrating");
        }),
    )
    .await
    .context("a hub holds the lead of the etcd store: stop every hub before migrating")?
    .context("the election")?;
    let lease = leadership.lease;
    let (standing_tx, _standing) = watch::channel(Standing::Leading);
    let (stop_tx, stop_rx) = watch::channel(false);
    election::keep(
        Arc::clone(&client),
        &leadership,
        stop_rx,
        Arc::new(standing_tx.clone()),
    );
    let store = EtcdStore::new(
        Arc::clone(&client),
        &prefix,
        leadership,
        Arc::new(standing_tx),
    );
    // Empty is checked under the lead, so no hub can write between the check and the copy.
    // A save is whole: one that fails leaves no root, and deletes the chunks it wrote.
    let saved = match store.is_empty().await {
        Ok(true) => store
            .save(&state)
            .await
            .context("writing the state into etcd"),
        Ok(false) => Err(anyhow::anyhow!(
            "the etcd store under {prefix} already holds a hub state: it is not overwritten \
             (give another --etcd-prefix, or delete that prefix with etcdctl if it is unused)"
        )),
        Err(e) => Err(anyhow::Error::from(e).context("reading the etcd store")),
    };
    let _ = stop_tx.send(true);
    let _ = client.revoke(lease).await;
    saved?;
    let tokens: Vec<String> = ["admin.token", "fleet.token", "client.token"]
        .iter()
        .map(|f| args.state_dir.join(f))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    println!(
        "copied {} into etcd under {prefix}: config revision {}, {} space(s), {} project(s)",
        file.dir()
            .join(crate::hub::store::file::STATE_FILE)
            .display(),
        state.config_revision,
        state.spaces.len(),
        state.projects.len()
    );
    if !tokens.is_empty() {
        println!(
            "the tokens stay files ({}): give every hub of the store the same ones with \
             --admin-token-file and --fleet-token-file (--client-token-file)",
            tokens.join(", ")
        );
    }
    Ok(())
}

/// Follows the leader's standing: logs a fence closing and lifting (the fence itself is
/// checked by everything a leader alone may do), and exits the process the moment the leader
/// is deposed: nothing it would still do is safe once another hub may lead, and its agents'
/// sockets close with it, so they redial the hub that leads now.
pub fn exit_when_deposed(mut standing: watch::Receiver<Standing>) {
    tokio::spawn(async move {
        let mut was_fenced = false;
        loop {
            match &*standing.borrow_and_update() {
                Standing::Deposed { why } => {
                    tracing::error!(why = %why, "this hub no longer leads; exiting so that it grants and writes nothing more");
                    std::process::exit(DEPOSED_EXIT);
                }
                Standing::Fenced { why } => {
                    was_fenced = true;
                    tracing::error!(why = %why, "fenced: no cloud permits, new spaces, passing verdicts or state writes until etcd answers; local work that passes goes on");
                }
                Standing::Leading if was_fenced => {
                    was_fenced = false;
                    tracing::info!("etcd renewed the lead again: the fence is lifted");
                }
                Standing::Leading => {}
            }
            if standing.changed().await.is_err() {
                return;
            }
        }
    });
}
