//! One leader among the hubs of a store: each campaigns by creating the leader key under a
//! lease of its own (`<prefix>/leader`, a transaction that succeeds only while the key does
//! not exist). The winner's **epoch** is the key's creation revision: every write it makes
//! checks that the key still has it, so a deposed leader's late write fails in etcd itself.
//!
//! The leader renews its lease every fifth of the TTL. If no renewal has succeeded within the
//! **deadline** (two thirds of the TTL, counted from the moment the last successful renewal was
//! sent), it is **fenced** at once ([`Fence`]), before etcd can expire the lease and let
//! another hub win: that gap is what keeps two leaders from granting at the same time. A
//! fenced leader keeps serving local work and keeps asking etcd; a renewal etcd answers (the
//! lease lived: etcd also extends every lease when its own Raft leader changes) lifts the
//! fence, and a lease etcd no longer knows deposes it. A renewal counts only with the leader
//! key read back at this epoch: a key deleted under a live lease (by hand, or a restore) lets
//! another hub win at once, so this one is deposed on the spot rather than at its next write.
//! Losers wait, reading the key, and campaign again when it is gone.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use super::client::{Compare, EtcdClient, EtcdError, Op};
use crate::hub::store::fence::Fence;

/// Who leads (the leader key's value).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LeaderRecord {
    /// How hubs, agents and clients reach it (`--advertise-url`).
    pub url: String,
    /// `pid N on host`.
    pub process: String,
    /// When it won (ms since the Unix epoch).
    pub since_ms: u64,
}

/// This hub leads.
#[derive(Debug)]
pub struct Leadership {
    /// The leader key's creation revision.
    pub epoch: i64,
    pub lease: i64,
    pub ttl: Duration,
    /// The leader key's full name.
    pub key: String,
    /// When the lease was asked for (sent): the deadline counts from here until a renewal.
    pub granted_at: Instant,
    /// Closed past the renewal deadline (everything that only a leader may do checks it).
    pub fence: Fence,
}

impl Leadership {
    /// A condition every write of this leader carries.
    pub fn guard(&self) -> Compare {
        Compare::CreateRevision {
            key: self.key.clone(),
            revision: self.epoch,
        }
    }

    /// The renewal deadline: past it without a renewal, the leader stops.
    pub fn deadline(&self) -> Duration {
        self.ttl * 2 / 3
    }
}

/// Where this leader stands, as the renewal task sees it.
#[derive(Clone, Debug, PartialEq)]
pub enum Standing {
    Leading,
    /// No renewal within the deadline: no grants or writes, local work goes on, etcd is asked
    /// again.
    Fenced {
        why: String,
    },
    /// The lease is gone, or etcd refused a write under the epoch: another hub may lead.
    Deposed {
        why: String,
    },
}

pub fn leader_key(prefix: &str) -> String {
    format!("{prefix}/leader")
}

/// The leader now, if any (for a standby's answers and status).
pub async fn current_leader(
    client: &EtcdClient,
    prefix: &str,
) -> Result<Option<(LeaderRecord, i64)>, EtcdError> {
    Ok(client
        .get(&leader_key(prefix))
        .await?
        .and_then(|kv| Some((serde_json::from_slice(&kv.value).ok()?, kv.create_revision))))
}

/// Campaigns until this hub leads: `waiting` is told each leader (and its epoch) seen while it
/// waits.
pub async fn campaign(
    client: &EtcdClient,
    prefix: &str,
    me: &LeaderRecord,
    ttl: Duration,
    mut waiting: impl FnMut(&LeaderRecord, i64),
) -> Result<Leadership, EtcdError> {
    let key = leader_key(prefix);
    let ttl_s = ttl.as_secs().max(1) as i64;
    let value = serde_json::to_vec(me).unwrap_or_default();
    let mut seen: Option<i64> = None;
    loop {
        // etcd counts the lease from its grant: so does the deadline.
        let granted_at = Instant::now();
        let lease = match client.grant(ttl_s).await {
            Ok(lease) => lease,
            Err(e) => {
                wait_out_or_fail(e).await?;
                continue;
            }
        };
        let outcome = client
            .txn(
                &[Compare::CreateRevision {
                    key: key.clone(),
                    revision: 0,
                }],
                &[Op::Put {
                    key: key.clone(),
                    value: value.clone(),
                    lease: Some(lease.id),
                }],
                &[Op::Get { key: key.clone() }],
            )
            .await;
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                let _ = client.revoke(lease.id).await;
                wait_out_or_fail(e).await?;
                continue;
            }
        };
        // A transaction that timed out may have been applied all the same, and its retry then
        // finds this hub's own key: that is a win too.
        let won = if outcome.succeeded {
            Some(outcome.revision)
        } else {
            outcome
                .read
                .first()
                .filter(|kv| kv.lease == lease.id)
                .map(|kv| kv.create_revision)
        };
        if let Some(epoch) = won {
            let ttl = Duration::from_secs(ttl_s as u64);
            let leadership = Leadership {
                epoch,
                lease: lease.id,
                ttl,
                key: key.clone(),
                granted_at,
                fence: Fence::leased((granted_at + ttl * 2 / 3).into_std()),
            };
            if Instant::now() < granted_at + leadership.deadline() {
                return Ok(leadership);
            }
            // Won too slowly to be sure of the lease: let it go and campaign again.
            tracing::warn!("the election took past the renewal deadline; campaigning again");
            let _ = client.revoke(lease.id).await;
            continue;
        }
        let _ = client.revoke(lease.id).await;
        // Someone leads: wait for its key to go (expired or revoked), then try again.
        if let Some(kv) = outcome.read.first()
            && seen != Some(kv.create_revision)
        {
            seen = Some(kv.create_revision);
            if let Ok(leader) = serde_json::from_slice::<LeaderRecord>(&kv.value) {
                waiting(&leader, kv.create_revision);
            }
        }
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            match client.get(&key).await {
                Ok(None) => break,
                Ok(Some(kv)) if Some(kv.create_revision) != seen => break,
                Ok(Some(_)) => {}
                Err(e) => tracing::warn!(error = %e, "a standby cannot read the leader key"),
            }
        }
    }
}

/// An error a campaign outlives (etcd unreachable for now: tried again in a second), or one
/// it cannot (refused: a wrong password, no permission), returned.
async fn wait_out_or_fail(e: EtcdError) -> Result<(), EtcdError> {
    match e {
        EtcdError::Unavailable { .. } => {
            tracing::warn!(error = %e, "a candidate cannot reach etcd; trying again");
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok(())
        }
        other => Err(other),
    }
}

/// What one renewal found.
enum Renewal {
    /// The lease lives and the leader key has this leader's epoch.
    Held,
    /// This hub no longer leads: why (the lease gone, the leader key gone or another's).
    Lost(String),
}

/// Renews the lease until the leader is deposed or `stop` fires. Past the deadline without a
/// renewal the fence closes by itself (it compares the clock) and `standing` turns `Fenced`;
/// a renewal etcd answers (with the leader key still at this epoch) lifts both; a lease etcd
/// no longer knows, or a leader key gone or another's, deposes the leader (the store deposes
/// it too, when etcd refuses a write under this epoch).
pub fn keep(
    client: Arc<EtcdClient>,
    leadership: &Leadership,
    mut stop: watch::Receiver<bool>,
    tx: Arc<watch::Sender<Standing>>,
) {
    let (lease, ttl, deadline, granted_at, fence) = (
        leadership.lease,
        leadership.ttl,
        leadership.deadline(),
        leadership.granted_at,
        leadership.fence.clone(),
    );
    let (key, epoch) = (leadership.key.clone(), leadership.epoch);
    tokio::spawn(async move {
        let every = ttl / 5;
        let mut renewed_at = granted_at;
        loop {
            let sent = Instant::now();
            let fenced = Instant::now() >= renewed_at + deadline;
            // The lease renewed, then the leader key read back: both, or it is no renewal.
            let renew = async {
                if client.keep_alive(lease).await?.is_none() {
                    let why = "the leader's lease is gone (etcd expired it)";
                    return Ok::<_, EtcdError>(Renewal::Lost(why.into()));
                }
                Ok(match client.get(&key).await? {
                    Some(kv) if kv.create_revision == epoch => Renewal::Held,
                    Some(kv) => Renewal::Lost(format!(
                        "the leader key is another campaign's (epoch {}, this hub's was {epoch})",
                        kv.create_revision
                    )),
                    None => Renewal::Lost(
                        "the leader key is gone from etcd though the lease lives (deleted, or etcd restored)"
                            .into(),
                    ),
                })
            };
            let renewal = if fenced {
                // Fenced already: nothing to race, wait for etcd's answer (bounded by the
                // client's own retry time).
                tokio::select! {
                    r = renew => Some(r),
                    _ = stop.changed() => return,
                }
            } else {
                tokio::select! {
                    r = renew => Some(r),
                    () = tokio::time::sleep_until(renewed_at + deadline) => None,
                    _ = stop.changed() => return,
                }
            };
            match renewal {
                Some(Ok(Renewal::Held)) => {
                    renewed_at = sent;
                    fence.renewed((sent + deadline).into_std());
                    // Lifted only while this renewal's own deadline is ahead: an answer that
                    // came later than that keeps the fence (and the next renewal tries again).
                    let open = fence.check(std::time::Instant::now()).is_ok();
                    tx.send_if_modified(|s| {
                        let lift = open && matches!(s, Standing::Fenced { .. });
                        if lift {
                            *s = Standing::Leading;
                        }
                        lift
                    });
                }
                Some(Ok(Renewal::Lost(why))) => {
                    fence.depose(&why);
                    let _ = tx.send(Standing::Deposed { why });
                    return;
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "the leader's lease was not renewed");
                }
                None => {}
            }
            if Instant::now() >= renewed_at + deadline {
                let why = format!(
                    "no lease renewal within {} ms (the TTL is {} s)",
                    deadline.as_millis(),
                    ttl.as_secs()
                );
                tx.send_if_modified(|s| {
                    let close = *s == Standing::Leading;
                    if close {
                        *s = Standing::Fenced { why: why.clone() };
                    }
                    close
                });
                tokio::select! {
                    () = tokio::time::sleep_until(sent + every) => {}
                    _ = stop.changed() => return,
                }
                continue;
            }
            let next = (sent + every).min(renewed_at + deadline);
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                _ = stop.changed() => return,
            }
        }
    });
}
