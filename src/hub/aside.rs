//! A leader cut off from etcd (but not from its agents and clients) stepping aside.
//!
//! Fenced, a leader grants and writes nothing; but cut off from etcd it never learns that
//! another hub won, so it would keep its agents and accept keys the new leader rotated out. A
//! full TTL after its last good renewal was sent (etcd may extend a lease across its own
//! elections, so the lease is not assumed expired), a fenced leader asks its peers (the hubs'
//! list it last read, [`crate::hub::store::etcd::members`]) who leads, every half second:
//!
//! * a peer names a leader under a **higher epoch**: this hub becomes a standby in all but
//!   name ([`Aside::Leader`]): it refuses agents' upgrades naming that leader, tells its
//!   connected agents to go, fails what waits here (the clients send it again) and forwards
//!   every client request to the leader as a standby does (`http::aside_layer`);
//! * peers answer and **none leads** under a higher epoch: etcd is down for everyone; it goes on
//!   as a fenced leader (local work that passes);
//! * **no peer answers** ([`Aside::Isolated`]): this hub may be the one cut off; work
//!   authenticated by a project key (which a leader it cannot see may have rotated) and cloud
//!   work get 503 with the reason; keyless local work goes on.
//!
//! A renewal etcd answers (the cut healed, the lease lived) clears either; a lease gone
//! deposes the hub, which exits as before (a hub that stepped aside finds its lease gone).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde::Serialize;

use super::Hub;
use super::store::StateStore;
use super::store::etcd::members::Peers;

/// What a fenced leader learned from its peers.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Aside {
    /// Another hub leads under a higher epoch: this one forwards to it.
    Leader { url: String, epoch: i64 },
    /// No peer answered: this hub may be the one cut off.
    Isolated { reason: String },
}

/// What the peers said.
#[derive(Debug, PartialEq)]
enum PeerAnswer {
    Leader { url: String, epoch: i64 },
    NoneLeads,
    NoAnswer,
}

/// How often a fenced leader asks its peers (and how long one ask may take).
const ASK_EVERY: Duration = Duration::from_millis(500);

/// Asks every peer's `/health` who leads; a leader under an epoch above `epoch` wins.
async fn ask_peers(http: &reqwest::Client, peers: &[String], epoch: i64) -> PeerAnswer {
    let mut asks: FuturesUnordered<_> = peers
        .iter()
        .map(|peer| async move {
            let url = format!("{}/health", peer.trim_end_matches('/'));
            let body: serde_json::Value = http.get(url).send().await.ok()?.json().await.ok()?;
            // A leader answers its own epoch; a standby, the leader it sees and its epoch. A
            // leader named is followed only when it is one of the hubs listed in etcd: client
            // requests (and their tokens) are forwarded there.
            let leader = if body["status"] == "standby" {
                body["leader"]
                    .as_str()
                    .map(|l| l.trim_end_matches('/').to_string())
                    .filter(|l| peers.iter().any(|p| p.trim_end_matches('/') == l))
            } else {
                Some(peer.trim_end_matches('/').to_string())
            };
            Some((leader, body["epoch"].as_i64()))
        })
        .collect();
    let mut answered = false;
    while let Some(answer) = asks.next().await {
        let Some((leader, named)) = answer else {
            continue;
        };
        answered = true;
        if let (Some(url), Some(named)) = (leader, named)
            && named > epoch
        {
            return PeerAnswer::Leader { url, epoch: named };
        }
    }
    if answered {
        PeerAnswer::NoneLeads
    } else {
        PeerAnswer::NoAnswer
    }
}

impl Hub {
    /// What a fenced leader learned from its peers (none while it leads unfenced).
    pub fn aside(&self) -> Option<Aside> {
        self.inner
            .aside
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sets what the peers said; what it means is acted on after `aside`'s lock is let go
    /// (the core's lock is never taken under it: status takes them the other way round).
    fn set_aside(&self, next: Option<Aside>) {
        {
            let mut aside = self
                .inner
                .aside
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *aside == next {
                return;
            }
            *aside = next.clone();
        }
        match &next {
            Some(Aside::Leader { url, epoch }) => {
                tracing::warn!(leader = %url, epoch, "cut off from etcd, and another hub leads under a newer epoch: this hub steps aside (its agents go to the leader, clients are forwarded)");
                let reason = format!("this hub stepped aside: {url} leads under epoch {epoch}");
                let mut core = self.core();
                core.close_agents(&reason);
                core.fail_all();
            }
            Some(Aside::Isolated { reason }) => {
                tracing::warn!(reason = %reason, "cut off from etcd and from every other hub: keyed and cloud work is refused until etcd answers");
            }
            None => tracing::info!("etcd answers again: this hub leads as before"),
        }
    }

    /// The other hubs' advertised URLs, as last read (etcd only).
    pub fn peers(&self) -> Option<Vec<String>> {
        self.inner
            .peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(Peers::urls)
    }

    pub fn spawn_aside_watch(&self, peers: Peers) -> Option<tokio::task::JoinHandle<()>> {
        *self
            .inner
            .peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(peers.clone());
        let StateStore::Etcd(store) = self.store() else {
            return None;
        };
        let (fence, ttl, deadline, epoch) = {
            let l = store.leadership();
            (l.fence.clone(), l.ttl, l.deadline(), l.epoch)
        };
        let hub = self.clone();
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(ASK_EVERY)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(ASK_EVERY).await;
                let now = Instant::now();
                if fence.check(now).is_ok() {
                    if hub.aside().is_some() {
                        hub.set_aside(None);
                    }
                    continue;
                }
                // The renewal deadline is two thirds of the TTL after the last good renewal
                // was sent: a full TTL after it is a third of the TTL later.
                let stale = fence
                    .valid_until()
                    .is_none_or(|until| now >= until + (ttl.saturating_sub(deadline)));
                if !stale || matches!(hub.aside(), Some(Aside::Leader { .. })) {
                    continue;
                }
                let answer = ask_peers(&http, &peers.urls(), epoch).await;
                match answer {
                    PeerAnswer::Leader { url, epoch } => {
                        hub.set_aside(Some(Aside::Leader { url, epoch }))
                    }
                    PeerAnswer::NoneLeads => hub.set_aside(None),
                    PeerAnswer::NoAnswer => hub.set_aside(Some(Aside::Isolated {
                        reason: format!(
                            "this hub cannot reach etcd to renew its lead, nor any other hub \
                             of the store ({} known) to learn who leads: work with a project \
                             key and cloud work wait until it can",
                            peers.urls().len()
                        ),
                    })),
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn peers_that_do_not_answer_are_no_answer_and_none_listed_is_none_either() {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(200))
            .build()
            .unwrap();
        assert_eq!(ask_peers(&http, &[], 3).await, PeerAnswer::NoAnswer);
        // A port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let peers = [format!("http://127.0.0.1:{port}")];
        assert_eq!(ask_peers(&http, &peers, 3).await, PeerAnswer::NoAnswer);
    }
}
