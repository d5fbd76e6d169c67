//! A leader cut off from etcd (but not from its agents and clients) stepping aside.
//!
//! Fenced, a leader grants and writes nothing; but cut off from etcd it never learns that
//! another hub won, so it would keep its agents and accept keys the new leader rotated out. A
//! full TTL after its last good renewal was sent (etcd may extend a lease across its own
//! elections, so the lease is not assumed expired), a fenced leader asks who leads, every half
//! second and for as long as it stays fenced (stepped aside or not): every hub of the list it
//! last read ([`crate::hub::store::etcd::members`]), and the leader it follows or was told of.
//! Each round waits for every answer and goes by the **highest epoch** any of them names (a
//! leader's own `/health` names its epoch; a standby's, the leader it sees and that leader's
//! epoch), whichever hub it names, listed or not (a hub that won after the cut is in no list
//! this hub could read):
//!
//! * a leader under an epoch above this hub's **confirms it leads** under that epoch, asked
//!   directly (its own `/health`: in the round, or asked at once when only another hub named
//!   it, following a few hops should it name a newer one still): this hub becomes a standby in
//!   all but name ([`Aside::Leader`]): it refuses agents' upgrades naming that leader, tells its
//!   connected agents to go, fails what waits here (the clients send it again) and forwards
//!   every client request to the leader as a standby does (`http::aside_layer`). A leader
//!   another hub names is trusted as far as that hub is: it read the name from the leader key,
//!   the same store that lists the hubs; asking the leader itself shows it is there and leads;
//! * a leader under a higher epoch is named but **cannot be confirmed** (it does not answer
//!   this hub, or answers as no leader) ([`Aside::Unconfirmed`]): work authenticated by a
//!   project key gets 503 naming that leader (the new leader may have rotated or removed the
//!   key), and so does cloud work (the fence grants no permit); keyless local work goes on;
//! * once a newer epoch was heard it is **never forgotten** while the fence holds: a round in
//!   which nobody answers, or nobody names anything newer, leaves this hub following that
//!   leader (or refusing keyed work, unconfirmed); a round that names a still newer leader
//!   moves it there (confirmed or not), and a confirmation moves it from unconfirmed to
//!   following;
//! * hubs answer, naming leaders, and **none is newer** than this hub: etcd is down for
//!   everyone; it goes on as a fenced leader (local work that passes, keys honoured: no other
//!   hub can have written the store);
//! * **no hub answers**, or those that do name no leader (a standby that has not read the
//!   leader key yet knows nothing) ([`Aside::Isolated`]): this hub may be the one cut off;
//!   keyed and cloud work get 503 with the reason; keyless local work goes on.
//!
//! A renewal etcd answers (the cut healed, the lease lived) clears any of them; a lease gone
//! deposes the hub, which exits as before (a hub that heard of a newer epoch finds its lease
//! gone).

use std::time::{Duration, Instant};

use serde::Serialize;

use super::Hub;
use super::store::StateStore;
use super::store::etcd::members::Peers;

/// What a fenced leader learned from the other hubs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Aside {
    /// Another hub leads under a higher epoch and said so itself: this one forwards to it.
    Leader { url: String, epoch: i64 },
    /// Another hub was named leader under a higher epoch, but did not confirm it when asked:
    /// keyed and cloud work are refused, naming it.
    Unconfirmed {
        url: String,
        epoch: i64,
        reason: String,
    },
    /// No hub answered, or none named a leader: this hub may be the one cut off.
    Isolated { reason: String },
}

impl Aside {
    /// The newer leader this hub follows or was told of, and its epoch.
    fn newer(&self) -> Option<(&str, i64)> {
        match self {
            Aside::Leader { url, epoch } | Aside::Unconfirmed { url, epoch, .. } => {
                Some((url.as_str(), *epoch))
            }
            Aside::Isolated { .. } => None,
        }
    }

    /// Why work authenticated by a project key (or a key this hub does not know) is refused
    /// here: in every state this hub's key table may be out of date. A hub that stepped aside
    /// forwards such work; this answers one that reached it as it stepped aside.
    pub fn keyed_refusal(&self) -> String {
        match self {
            Aside::Leader { url, epoch } => format!(
                "this hub is cut off from etcd and stepped aside for the leader {url} (epoch \
                 {epoch}): send the request again (it is forwarded there now), or to {url}"
            ),
            Aside::Unconfirmed { reason, .. } | Aside::Isolated { reason } => reason.clone(),
        }
    }
}

/// One hub's answer to "who leads?" (its `/health`).
#[derive(Clone, Debug, PartialEq)]
enum Heard {
    /// It leads under `epoch` (its own word: a leader's `/health`, fenced or not).
    Leads { url: String, epoch: i64 },
    /// A standby (or a hub that stepped aside) naming the leader it sees, and its epoch.
    Names { leader: String, epoch: i64 },
    /// A hub that names no leader (a standby while no hub leads, or before it read the
    /// leader key): it says nothing of who leads.
    Nobody,
    /// No answer: down, unreachable, frozen past the ask's timeout, or no hub's answer.
    NoAnswer,
}

/// The newest leader a round heard of.
#[derive(Clone, Debug, PartialEq)]
struct Claim {
    url: String,
    epoch: i64,
    /// The leader said so itself (else another hub named it).
    own_word: bool,
}

/// How often a fenced leader asks (and how long one ask may take).
const ASK_EVERY: Duration = Duration::from_millis(500);

/// How many leaders, each named by the last, one round asks directly.
const MAX_HOPS: usize = 3;

fn normalized(url: &str) -> String {
    url.trim_end_matches('/').to_string()
}

/// What `asked`'s `/health` answer says of who leads.
fn read_health(asked: &str, body: &serde_json::Value) -> Heard {
    let epoch = body["epoch"].as_i64();
    match (body["status"].as_str(), epoch) {
        (None, _) => Heard::NoAnswer,
        (Some("standby"), Some(epoch)) => match body["leader"].as_str().map(normalized) {
            Some(leader) if !leader.is_empty() => Heard::Names { leader, epoch },
            _ => Heard::Nobody,
        },
        (Some("standby"), None) => Heard::Nobody,
        (Some(_), Some(epoch)) => Heard::Leads {
            url: normalized(asked),
            epoch,
        },
        (Some(_), None) => Heard::Nobody,
    }
}

async fn ask(http: &reqwest::Client, url: &str) -> Heard {
    let health = format!("{}/health", normalized(url));
    let Ok(answer) = http.get(health).send().await else {
        return Heard::NoAnswer;
    };
    match answer.json::<serde_json::Value>().await {
        Ok(body) => read_health(url, &body),
        Err(_) => Heard::NoAnswer,
    }
}

/// Every answer, each ask bounded by the client's timeout.
async fn ask_all(http: &reqwest::Client, urls: &[String]) -> Vec<Heard> {
    futures_util::future::join_all(urls.iter().map(|url| ask(http, url))).await
}

/// The leader under the highest epoch named in `heard`; at one epoch, the leader's own word
/// before another hub's.
fn newest(heard: &[Heard]) -> Option<Claim> {
    let mut best: Option<Claim> = None;
    for h in heard {
        let claim = match h {
            Heard::Leads { url, epoch } => Claim {
                url: url.clone(),
                epoch: *epoch,
                own_word: true,
            },
            Heard::Names { leader, epoch } => Claim {
                url: leader.clone(),
                epoch: *epoch,
                own_word: false,
            },
            Heard::Nobody | Heard::NoAnswer => continue,
        };
        let better = best.as_ref().is_none_or(|b| {
            claim.epoch > b.epoch || (claim.epoch == b.epoch && claim.own_word && !b.own_word)
        });
        if better {
            best = Some(claim);
        }
    }
    best
}

fn unconfirmed(url: String, epoch: i64) -> Aside {
    let reason = format!(
        "this hub cannot reach etcd to renew its lead, and another hub names {url} the leader \
         under epoch {epoch} (newer than this hub's), which this hub could not confirm with \
         {url} itself: work with a project key and cloud work are refused here until it can, \
         or etcd answers; send them to {url}, or here again in a few seconds"
    );
    Aside::Unconfirmed { url, epoch, reason }
}

fn isolated(heard: &[Heard]) -> Aside {
    let answered = heard.iter().filter(|h| **h == Heard::Nobody).count();
    let reason = if answered == 0 {
        format!(
            "this hub cannot reach etcd to renew its lead, nor any other hub of the store ({} \
             asked) to learn who leads: work with a project key and cloud work wait until it can",
            heard.len()
        )
    } else {
        format!(
            "this hub cannot reach etcd to renew its lead, and the other hubs that answered \
             ({answered} of {}) name no leader: work with a project key and cloud work wait \
             until one does, or etcd answers",
            heard.len()
        )
    };
    Aside::Isolated { reason }
}

/// What a fenced leader under epoch `own` does after a round that `heard` these answers,
/// having done `current` until now.
fn next(own: i64, current: Option<Aside>, heard: &[Heard]) -> Option<Aside> {
    let known = current
        .as_ref()
        .and_then(Aside::newer)
        .map(|(_, epoch)| epoch);
    match newest(heard) {
        // A leader newer than this hub and than any heard of before: followed once it said
        // so itself, else keyed work is refused naming it.
        Some(c) if c.epoch > own && known.is_none_or(|k| c.epoch > k) => Some(if c.own_word {
            Aside::Leader {
                url: c.url,
                epoch: c.epoch,
            }
        } else {
            unconfirmed(c.url, c.epoch)
        }),
        // The leader heard of before confirms it now.
        Some(c)
            if c.own_word
                && known == Some(c.epoch)
                && matches!(current, Some(Aside::Unconfirmed { .. })) =>
        {
            Some(Aside::Leader {
                url: c.url,
                epoch: c.epoch,
            })
        }
        // A newer epoch was heard: kept until etcd answers, whatever this round heard.
        _ if known.is_some() => current,
        // Hubs named leaders, none newer than this one: etcd is down for everyone.
        Some(_) => None,
        None => Some(isolated(heard)),
    }
}

/// One round: asks `peers` and the leader `current` follows or names who leads, then asks
/// directly the newest leader only another hub named; what this hub under epoch `own` does
/// next.
async fn round(
    http: &reqwest::Client,
    peers: &[String],
    own: i64,
    current: Option<Aside>,
) -> Option<Aside> {
    let mut asked: Vec<String> = Vec::new();
    let followed = current
        .as_ref()
        .and_then(Aside::newer)
        .map(|(url, _)| normalized(url));
    for url in peers
        .iter()
        .map(String::as_str)
        .map(normalized)
        .chain(followed)
    {
        if !asked.contains(&url) {
            asked.push(url);
        }
    }
    let mut heard = ask_all(http, &asked).await;
    for _ in 0..MAX_HOPS {
        match newest(&heard) {
            Some(c) if c.epoch > own && !c.own_word && !asked.contains(&c.url) => {
                heard.push(ask(http, &c.url).await);
                asked.push(c.url);
            }
            _ => break,
        }
    }
    next(own, current, &heard)
}

impl Hub {
    /// What a fenced leader learned from the other hubs (none while it leads unfenced).
    pub fn aside(&self) -> Option<Aside> {
        self.inner
            .aside
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sets what the other hubs said; what it means is acted on after `aside`'s lock is let
    /// go (the core's lock is never taken under it: status takes them the other way round).
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
                tracing::warn!(leader = %url, epoch, "cut off from etcd, and another hub leads under a newer epoch (it confirmed so itself): this hub steps aside (its agents go to the leader, clients are forwarded)");
                let reason = format!("this hub stepped aside: {url} leads under epoch {epoch}");
                let mut core = self.core();
                core.close_agents(&reason);
                core.fail_all();
            }
            Some(Aside::Unconfirmed { url, epoch, .. }) => {
                tracing::warn!(leader = %url, epoch, "cut off from etcd, and another hub names a leader under a newer epoch that this hub cannot confirm: keyed and cloud work are refused until it can, or etcd answers");
            }
            Some(Aside::Isolated { reason }) => {
                tracing::warn!(reason = %reason, "cut off from etcd, and no other hub says who leads: keyed and cloud work are refused until etcd answers");
            }
            None => tracing::info!(
                "etcd answers again, or the other hubs name no newer leader: this hub leads as before"
            ),
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

    /// What this hub trusts its peers' certificates by (the system's roots alone until
    /// [`Hub::spawn_aside_watch`] gave it the peers).
    pub fn peer_trust(&self) -> crate::hub::peer_http::PeerTrust {
        self.inner
            .peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|p| p.trust().clone())
            .unwrap_or_default()
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
        let http = peers.trust().client(Some(ASK_EVERY), ASK_EVERY);
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
                if !stale {
                    continue;
                }
                // Every round while fenced, stepped aside or not: a newer leader may have won
                // since, and the one followed may be gone.
                let next = round(&http, &peers.urls(), epoch, hub.aside()).await;
                // etcd may have answered while the round ran: the next turn clears the aside.
                if fence.check(Instant::now()).is_ok() {
                    continue;
                }
                hub.set_aside(next);
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use serde_json::{Value, json};

    use super::*;

    fn client() -> reqwest::Client {
        reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap()
    }

    /// A hub's `/health` on loopback answering what `body` holds at each ask; its URL.
    async fn hub_answering(body: Arc<Mutex<Value>>) -> (String, tokio::task::JoinHandle<()>) {
        let app = axum::Router::new().route(
            "/health",
            axum::routing::get(move || {
                let body = body.clone();
                async move { axum::Json(body.lock().unwrap().clone()) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (url, server)
    }

    /// A URL nothing listens on.
    fn nobody_there() -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("http://127.0.0.1:{port}")
    }

    fn leads(epoch: i64) -> Value {
        json!({"status": "ok", "agents": 0, "uptime_s": 1, "epoch": epoch})
    }

    fn names(leader: &str, epoch: i64) -> Value {
        json!({"status": "standby", "leader": leader, "epoch": epoch})
    }

    fn state(v: Value) -> Arc<Mutex<Value>> {
        Arc::new(Mutex::new(v))
    }

    #[test]
    fn the_highest_epoch_wins_whoever_answered_first_and_a_leader_s_own_word_confirms_it() {
        let heard = [
            Heard::Names {
                leader: "http://c".into(),
                epoch: 9,
            },
            Heard::NoAnswer,
            Heard::Leads {
                url: "http://d".into(),
                epoch: 12,
            },
            Heard::Names {
                leader: "http://e".into(),
                epoch: 11,
            },
            Heard::Nobody,
        ];
        assert_eq!(
            next(5, None, &heard),
            Some(Aside::Leader {
                url: "http://d".into(),
                epoch: 12
            })
        );
        // Named by another hub only: refused, naming it.
        let hearsay = [
            Heard::Names {
                leader: "http://d".into(),
                epoch: 12,
            },
            Heard::Leads {
                url: "http://b".into(),
                epoch: 4,
            },
        ];
        let refused = next(5, None, &hearsay).unwrap();
        assert!(
            matches!(&refused, Aside::Unconfirmed { url, epoch: 12, .. } if url == "http://d"),
            "{refused:?}"
        );
        assert!(refused.keyed_refusal().contains("http://d"), "{refused:?}");
        // At one epoch the leader's own word counts, whichever came first.
        let both = [
            Heard::Names {
                leader: "http://d".into(),
                epoch: 12,
            },
            Heard::Leads {
                url: "http://d".into(),
                epoch: 12,
            },
        ];
        assert!(matches!(next(5, None, &both), Some(Aside::Leader { .. })));
    }

    #[test]
    fn nothing_newer_is_a_fenced_leader_as_before_and_a_hub_naming_nobody_is_no_evidence() {
        let older = [
            Heard::Names {
                leader: "http://a".into(),
                epoch: 5,
            },
            Heard::Leads {
                url: "http://b".into(),
                epoch: 3,
            },
        ];
        assert_eq!(next(5, None, &older), None);
        let isolated = next(5, None, &[Heard::NoAnswer, Heard::NoAnswer]).unwrap();
        assert!(
            matches!(&isolated, Aside::Isolated { reason } if reason.contains("nor any other hub")),
            "{isolated:?}"
        );
        let blind = next(5, None, &[Heard::Nobody, Heard::NoAnswer]).unwrap();
        assert!(
            matches!(&blind, Aside::Isolated { reason } if reason.contains("name no leader")),
            "{blind:?}"
        );
        assert!(matches!(next(5, None, &[]), Some(Aside::Isolated { .. })));
    }

    #[test]
    fn a_newer_epoch_is_never_forgotten_while_fenced_and_a_still_newer_one_is_followed() {
        let following = Some(Aside::Leader {
            url: "http://c".into(),
            epoch: 9,
        });
        // Nobody answers, or nobody names anything newer: still following.
        let rounds: [&[Heard]; 4] = [
            &[Heard::NoAnswer],
            &[Heard::Nobody],
            &[Heard::Names {
                leader: "http://a".into(),
                epoch: 5,
            }],
            // The leader named only by hearsay this round: still followed, not unconfirmed.
            &[
                Heard::Names {
                    leader: "http://c".into(),
                    epoch: 9,
                },
                Heard::NoAnswer,
            ],
        ];
        for heard in rounds {
            assert_eq!(next(5, following.clone(), heard), following, "{heard:?}");
        }
        // A newer leader named by another hub: refused until it confirms, then followed.
        let newer = [Heard::Names {
            leader: "http://d".into(),
            epoch: 14,
        }];
        let waiting = next(5, following.clone(), &newer);
        assert!(
            matches!(&waiting, Some(Aside::Unconfirmed { epoch: 14, .. })),
            "{waiting:?}"
        );
        // Nothing heard: still refused (never back to the old key table).
        assert_eq!(next(5, waiting.clone(), &[Heard::NoAnswer]), waiting);
        assert_eq!(
            next(
                5,
                waiting.clone(),
                &[Heard::Leads {
                    url: "http://c".into(),
                    epoch: 9
                }]
            ),
            waiting,
            "an older leader's word does not undo a newer epoch"
        );
        assert_eq!(
            next(
                5,
                waiting,
                &[Heard::Leads {
                    url: "http://d".into(),
                    epoch: 14
                }]
            ),
            Some(Aside::Leader {
                url: "http://d".into(),
                epoch: 14
            })
        );
    }

    #[test]
    fn a_health_answer_reads_as_who_it_names() {
        assert_eq!(
            read_health("http://b/", &names("http://c/", 7)),
            Heard::Names {
                leader: "http://c".into(),
                epoch: 7
            }
        );
        assert_eq!(
            read_health("http://b/", &leads(7)),
            Heard::Leads {
                url: "http://b".into(),
                epoch: 7
            }
        );
        assert_eq!(
            read_health(
                "http://b",
                &json!({"status": "standby", "leader": null, "epoch": null})
            ),
            Heard::Nobody
        );
        assert_eq!(
            read_health("http://b", &json!({"something": "else"})),
            Heard::NoAnswer
        );
    }

    #[tokio::test]
    async fn peers_that_do_not_answer_are_isolation_and_none_listed_is_isolation_too() {
        let http = client();
        assert!(matches!(
            round(&http, &[], 3, None).await,
            Some(Aside::Isolated { .. })
        ));
        let peers = [nobody_there()];
        assert!(matches!(
            round(&http, &peers, 3, None).await,
            Some(Aside::Isolated { .. })
        ));
    }

    #[tokio::test]
    async fn a_leader_no_list_holds_is_asked_itself_and_followed_or_refused() {
        let http = client();
        // b is listed; c won after this hub's list was read: only b names it.
        let c_health = state(leads(9));
        let (c, _c) = hub_answering(c_health.clone()).await;
        let b_health = state(names(&c, 9));
        let (b, _b) = hub_answering(b_health.clone()).await;
        let peers = [b.clone()];
        assert_eq!(
            round(&http, &peers, 5, None).await,
            Some(Aside::Leader {
                url: c.clone(),
                epoch: 9
            }),
            "c confirmed it leads, asked directly"
        );
        // A leader b names that does not answer: refused, naming it.
        let gone = nobody_there();
        *b_health.lock().unwrap() = names(&gone, 10);
        let refused = round(&http, &peers, 5, None).await;
        assert!(
            matches!(&refused, Some(Aside::Unconfirmed { url, epoch: 10, .. }) if *url == gone),
            "{refused:?}"
        );
        // One that answers as a standby naming no leader confirms nothing either.
        *c_health.lock().unwrap() = json!({"status": "standby", "leader": null, "epoch": null});
        *b_health.lock().unwrap() = names(&c, 9);
        assert!(matches!(
            round(&http, &peers, 5, None).await,
            Some(Aside::Unconfirmed { epoch: 9, .. })
        ));
    }

    #[tokio::test]
    async fn the_hub_keeps_asking_while_aside_and_follows_the_newest_leader() {
        let http = client();
        let c_health = state(leads(9));
        let (c, _c) = hub_answering(c_health.clone()).await;
        let b_health = state(names(&c, 9));
        let (b, _b) = hub_answering(b_health.clone()).await;
        let peers = [b.clone()];
        let mut aside = round(&http, &peers, 5, None).await;
        assert_eq!(
            aside,
            Some(Aside::Leader {
                url: c.clone(),
                epoch: 9
            })
        );
        // c loses the lead to d, which only c knows of now (b still names c): the next round
        // asks c again (the leader it follows), then d itself.
        let d_health = state(leads(14));
        let (d, _d) = hub_answering(d_health.clone()).await;
        *c_health.lock().unwrap() = names(&d, 14);
        aside = round(&http, &peers, 5, aside).await;
        assert_eq!(
            aside,
            Some(Aside::Leader {
                url: d.clone(),
                epoch: 14
            })
        );
        // No hub says anything of who leads any more (d too: it lost its lead and no hub
        // leads yet): still following d, its epoch is not forgotten.
        let nobody = json!({"status": "standby", "leader": null, "epoch": null});
        for health in [&b_health, &c_health, &d_health] {
            *health.lock().unwrap() = nobody.clone();
        }
        assert_eq!(round(&http, &peers, 5, aside.clone()).await, aside);
        let gone = [nobody_there()];
        assert_eq!(round(&http, &gone, 5, aside.clone()).await, aside);
    }
}
