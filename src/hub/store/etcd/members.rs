//! The hubs of a store, as each of them sees the others: every hub (standby or leader)
//! registers its advertised URL under a lease of its own (`<prefix>/hubs/<id>`), renews it,
//! and reads the list again every TTL. A leader cut off from etcd cannot read it any more, so
//! it keeps the last list it read: those are the peers it asks who leads
//! ([`crate::hub::aside`]); a leader they name that the list lacks (a hub that registered
//! after the cut) is asked too, never passed over.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::client::{EtcdClient, Op};
use crate::hub::peer_http::PeerTrust;

/// The other hubs' advertised URLs, as last read (shared with whoever asks them), and what
/// this hub trusts their certificates by.
#[derive(Clone, Debug, Default)]
pub struct Peers {
    urls: Arc<Mutex<Vec<String>>>,
    trust: PeerTrust,
}

impl Peers {
    pub fn urls(&self) -> Vec<String> {
        self.urls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The certificates this hub trusts for its peers (`--peer-ca-file`).
    pub fn trust(&self) -> &PeerTrust {
        &self.trust
    }

    fn set(&self, urls: Vec<String>) {
        *self
            .urls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = urls;
    }
}

pub fn members_prefix(prefix: &str) -> String {
    format!("{prefix}/hubs/")
}

/// Registers `url` as hub `id` under a lease of `ttl` and keeps the other hubs' list current,
/// for the process's life (errors are retried: a hub works on without the list).
pub fn register(
    client: Arc<EtcdClient>,
    prefix: &str,
    id: String,
    url: String,
    ttl: Duration,
    trust: PeerTrust,
) -> Peers {
    let peers = Peers {
        urls: Arc::default(),
        trust,
    };
    let list = peers.clone();
    let members = members_prefix(prefix);
    let key = format!("{members}{id}");
    let ttl_s = ttl.as_secs().max(1) as i64;
    tokio::spawn(async move {
        let mut lease: Option<i64> = None;
        loop {
            let renewed = match lease {
                Some(id) => client.keep_alive(id).await.ok().flatten().is_some(),
                None => false,
            };
            if !renewed {
                lease = match client.grant(ttl_s).await {
                    Ok(l) => {
                        let put = Op::Put {
                            key: key.clone(),
                            value: url.clone().into_bytes(),
                            lease: Some(l.id),
                        };
                        match client.txn(&[], &[put], &[]).await {
                            Ok(_) => Some(l.id),
                            Err(e) => {
                                tracing::debug!(error = %e, "this hub could not register itself in etcd; trying again");
                                None
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "this hub could not register itself in etcd; trying again");
                        None
                    }
                };
            }
            match client.get_prefix(&members).await {
                Ok(kvs) => list.set(
                    kvs.into_iter()
                        .filter(|kv| kv.key != key)
                        .filter_map(|kv| String::from_utf8(kv.value).ok())
                        // An earlier run of this hub, not yet expired, is not a peer.
                        .filter(|u| u != &url)
                        .collect(),
                ),
                Err(e) => {
                    tracing::debug!(error = %e, "the hubs' list could not be read; keeping the last")
                }
            }
            tokio::time::sleep(ttl / 3).await;
        }
    });
    peers
}
