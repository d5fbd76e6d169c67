//! Finding the hub that leads, among the agent's `hub_urls` (hubs on etcd: one leads, the
//! others stand by).
//!
//! * **Dialling** ([`dial`]): every address at once, each upgrade bounded to about a second
//!   ([`UPGRADE_TIMEOUT`]; a frozen hub's kernel still accepts the TCP connection, it is the
//!   upgrade that hangs), doubling after dials that no hub answered in time ([`answer_timeout`]);
//!   one dial asks standbys for at most [`DIAL_FOR`], then every hub is dialled afresh. A leader answers the upgrade with its epoch (`X-Fantom-Epoch`); a
//!   standby refuses it with 503 naming the leader and its epoch. The agent says `hello` to one
//!   hub only: the leader with the highest epoch anyone named (a hub that sends no epoch, on a
//!   state file or of an older build, is taken as it answers: `welcome` is checked). One whose
//!   epoch is at least the
//!   highest this agent has seen is taken as soon as it answers; a fresh agent waits out the
//!   round for every answer. A leader under an older epoch than one a standby named (a deposed
//!   leader that has not noticed yet) is passed over. Standbys (and the leader they name, when
//!   it is one of `hub_urls`) are asked again every [`STANDBY_REDIAL`] while an election is
//!   under way; the fleet token never goes to an address outside `hub_urls`.
//! * **Watching** ([`probe_peers`]): while a session is silent, the agent asks its other
//!   addresses' `/health` who leads, at most once a heartbeat, and the session moves as soon as
//!   one names a leader under a higher epoch than the session's.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self};

use super::Agent;

pub type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How long one hub's upgrade may take when there are others to choose from.
pub const UPGRADE_TIMEOUT: Duration = Duration::from_secs(1);
/// With a single hub there is nothing else to try: it gets longer.
const SINGLE_HUB_UPGRADE_TIMEOUT: Duration = Duration::from_secs(10);
/// How soon a standby (or the leader it names) is asked again while an election is under way.
pub const STANDBY_REDIAL: Duration = Duration::from_millis(250);

/// How long the upgrade and then the welcome may take, for `hubs` addresses, after
/// `patience` dials in a row that no hub answered in time: a second to start with (a frozen hub
/// is passed over in it), doubling up to the single hub's 10 s, so a hub that is only slow (a
/// long link, a loaded leader) is reached all the same.
pub fn answer_timeout(hubs: usize, patience: u32) -> Duration {
    if hubs > 1 {
        UPGRADE_TIMEOUT
            .saturating_mul(1u32 << patience.min(4))
            .min(SINGLE_HUB_UPGRADE_TIMEOUT)
    } else {
        SINGLE_HUB_UPGRADE_TIMEOUT
    }
}

/// How long one dial may go on asking standbys before it returns (and the next dials every
/// hub again, the ones that failed too).
const DIAL_FOR: Duration = Duration::from_secs(5);

/// No hub welcomed the agent, but a standby answered: the hubs are up and one will lead
/// within seconds, so the agent dials again soon instead of backing off.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ElectionUnderWay(pub String);

enum DialError {
    /// A standby hub refused the upgrade, naming the leader (an `http(s)://` base) and its
    /// epoch, if any.
    Standby {
        leader: Option<String>,
        epoch: Option<i64>,
    },
    Other(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for DialError {
    fn from(e: E) -> Self {
        DialError::Other(e.into())
    }
}

/// One hub's answer: its index and the upgraded socket with the leader's epoch, or why not.
type Answer = (usize, Result<(WsStream, Option<i64>), DialError>);

/// Dials every hub of `hub_urls` at once and returns the socket of the leader with the
/// highest epoch (its index is stored in `agent.hub_at`); nothing else was said to any hub.
pub async fn dial(agent: &Agent) -> anyhow::Result<WsStream> {
    let hubs = &agent.opts.hub_urls;
    if hubs.is_empty() {
        anyhow::bail!("no hub_url configured");
    }
    let timeout = answer_timeout(hubs.len(), agent.dial_patience.load(Ordering::Relaxed));
    let give_up = tokio::time::Instant::now() + DIAL_FOR;
    let known = agent.hub_epoch.load(Ordering::SeqCst);
    let mut named = known;
    let mut inflight = FuturesUnordered::new();
    let mut asking = vec![true; hubs.len()];
    for i in 0..hubs.len() {
        inflight.push(attempt(agent, i, timeout, Duration::ZERO));
    }
    // A fresh agent (no epoch seen yet) takes the best leader once the round is out.
    let mut candidate: Option<(i64, usize, WsStream)> = None;
    let mut round_ends: Option<tokio::time::Instant> = None;
    let mut last: Option<anyhow::Error> = None;
    let mut standby_seen = false;
    loop {
        let wait = round_ends.unwrap_or(give_up).min(give_up);
        let next = tokio::select! {
            next = inflight.next() => next,
            () = tokio::time::sleep_until(wait) => None,
        };
        let Some((i, answer)) = next else {
            if let Some((_, i, ws)) = candidate {
                agent.hub_at.store(i, Ordering::Relaxed);
                agent.dial_patience.store(0, Ordering::Relaxed);
                return Ok(ws);
            }
            let last = last.unwrap_or_else(|| anyhow::anyhow!("no hub answered"));
            if standby_seen {
                return Err(ElectionUnderWay(last.to_string()).into());
            }
            // Nobody answered in time: the next dial waits longer.
            agent.dial_patience.fetch_add(1, Ordering::Relaxed);
            return Err(last);
        };
        asking[i] = false;
        match answer {
            Ok((ws, None)) => {
                // A hub on a state file, or of an older build: it says its epoch (if any) in
                // `welcome` only, where the session checks it.
                agent.hub_at.store(i, Ordering::Relaxed);
                agent.dial_patience.store(0, Ordering::Relaxed);
                return Ok(ws);
            }
            Ok((ws, Some(epoch))) => {
                if epoch < named {
                    tracing::warn!(hub = %hubs[i], epoch, newer = named, "a hub welcomed the upgrade as leader under an older epoch than one named since (a deposed leader); passing it over");
                    last = Some(anyhow::anyhow!(
                        "{} leads under epoch {epoch}, older than epoch {named}",
                        hubs[i]
                    ));
                    continue;
                }
                named = epoch;
                if known > 0 || hubs.len() == 1 {
                    agent.hub_at.store(i, Ordering::Relaxed);
                    agent.dial_patience.store(0, Ordering::Relaxed);
                    return Ok(ws);
                }
                if candidate.as_ref().is_none_or(|c| epoch > c.0) {
                    candidate = Some((epoch, i, ws));
                }
                round_ends.get_or_insert_with(|| tokio::time::Instant::now() + timeout);
            }
            Err(DialError::Standby { leader, epoch }) => {
                standby_seen = true;
                if let Some(e) = epoch {
                    named = named.max(e);
                    if candidate.as_ref().is_some_and(|c| c.0 < e) {
                        candidate = None;
                    }
                }
                let leader_at = leader.as_deref().and_then(|l| same_hub_in(hubs, l));
                if let (Some(l), None) = (&leader, leader_at) {
                    tracing::warn!(standby = %hubs[i], leader = %l, "a standby hub named a leader that is not in hub_urls; not following it");
                }
                last = Some(anyhow::anyhow!(
                    "{} is a standby (the leader: {})",
                    hubs[i],
                    leader.as_deref().unwrap_or("none yet")
                ));
                // Ask again soon: this standby may lead next, and the leader it names may be
                // one of ours that did not answer in time.
                for j in std::iter::once(i).chain(leader_at) {
                    if !asking[j] {
                        asking[j] = true;
                        inflight.push(attempt(agent, j, timeout, STANDBY_REDIAL));
                    }
                }
            }
            Err(DialError::Other(e)) => {
                if hubs.len() > 1 {
                    tracing::warn!(hub = %hubs[i], error = %e, "cannot connect to this hub; trying the others");
                }
                last = Some(e);
            }
        }
    }
}

/// One hub's upgrade after `delay`, bounded by `timeout`.
async fn attempt(agent: &Agent, i: usize, timeout: Duration, delay: Duration) -> Answer {
    tokio::time::sleep(delay).await;
    let url = &agent.opts.hub_urls[i];
    let answer = match tokio::time::timeout(timeout, dial_one(agent, url)).await {
        Ok(answer) => answer,
        Err(_) => Err(DialError::Other(anyhow::anyhow!(
            "no upgrade within {} ms (a stopped or overloaded hub)",
            timeout.as_millis()
        ))),
    };
    (i, answer)
}

/// The index of the hub in `hubs` that `leader` (`http(s)://host:port`) names: the same
/// host and port, `ws` for `http` and `wss` for `https`.
pub fn same_hub_in(hubs: &[String], leader: &str) -> Option<usize> {
    let leader = reqwest::Url::parse(leader).ok()?;
    let scheme = match leader.scheme() {
        "http" => "ws",
        "https" => "wss",
        _ => return None,
    };
    hubs.iter().position(|h| {
        reqwest::Url::parse(h).is_ok_and(|h| {
            h.scheme() == scheme
                && h.host_str() == leader.host_str()
                && h.port_or_known_default() == leader.port_or_known_default()
        })
    })
}

async fn dial_one(agent: &Agent, hub_url: &str) -> Result<(WsStream, Option<i64>), DialError> {
    let mut request = hub_url.into_client_request()?;
    let mut auth = HeaderValue::from_str(&format!("Bearer {}", agent.opts.fleet_token.expose()))?;
    auth.set_sensitive(true);
    request.headers_mut().insert("authorization", auth);
    let config = WebSocketConfig::default()
        .max_message_size(Some(agent.opts.max_frame_bytes))
        .max_frame_size(Some(agent.opts.max_frame_bytes));
    let connector = match &agent.opts.ca_file {
        Some(path) => Some(tokio_tungstenite::Connector::Rustls(Arc::new(client_tls(
            path,
        )?))),
        None => None,
    };
    crate::http::install_crypto_provider();
    let dial =
        tokio_tungstenite::connect_async_tls_with_config(request, Some(config), true, connector);
    match dial.await {
        Ok((ws, response)) => {
            let epoch = response
                .headers()
                .get(crate::protocol::EPOCH_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i64>().ok());
            Ok((ws, epoch))
        }
        Err(tungstenite::Error::Http(response)) => {
            let body: Option<serde_json::Value> = response
                .body()
                .as_deref()
                .and_then(|b| serde_json::from_slice(b).ok());
            if let Some(error) = body.as_ref().map(|b| &b["error"])
                && error["code"] == "standby"
            {
                return Err(DialError::Standby {
                    leader: error["leader"].as_str().map(String::from),
                    epoch: error["epoch"].as_i64(),
                });
            }
            Err(DialError::Other(anyhow::anyhow!(
                "the hub answered {} (is the fleet token right?)",
                response.status()
            )))
        }
        Err(e) => Err(e.into()),
    }
}

/// A rustls client that trusts the CA certificates in `path` (PEM).
fn client_tls(path: &std::path::Path) -> anyhow::Result<rustls::ClientConfig> {
    use anyhow::Context;
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    crate::http::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path)
        .with_context(|| format!("cannot read the CA file {}", path.display()))?
    {
        roots.add(
            cert.with_context(|| format!("a certificate in {} is invalid", path.display()))?,
        )?;
    }
    Ok(rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A `/health` URL for the hub at `ws_url` (`ws(s)://host:port/...`).
fn health_url(ws_url: &str) -> Option<String> {
    let mut url = reqwest::Url::parse(ws_url).ok()?;
    let scheme = match url.scheme() {
        "ws" => "http",
        "wss" => "https",
        _ => return None,
    };
    url.set_scheme(scheme).ok()?;
    url.set_path("/health");
    url.set_query(None);
    Some(url.to_string())
}

/// Asks every hub but `current` who leads (`/health`: a leader's own epoch, a standby's
/// leader's); the first that names an epoch higher than `epoch`, as a reason to move.
pub async fn probe_peers(agent: Arc<Agent>, current: usize, epoch: i64) -> Option<String> {
    let http = {
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .timeout(UPGRADE_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none());
        if let Some(path) = &agent.opts.ca_file
            && let Ok(pem) = std::fs::read(path)
            && let Ok(certs) = reqwest::Certificate::from_pem_bundle(&pem)
        {
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        b.build().ok()?
    };
    let mut asks: FuturesUnordered<_> = agent
        .opts
        .hub_urls
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != current)
        .filter_map(|(_, h)| Some((h.clone(), health_url(h)?)))
        .map(|(hub, url)| {
            let http = http.clone();
            async move {
                let body: serde_json::Value = http.get(url).send().await.ok()?.json().await.ok()?;
                Some((hub, body["epoch"].as_i64()?))
            }
        })
        .collect();
    while let Some(answer) = asks.next().await {
        if let Some((hub, named)) = answer
            && named > epoch
        {
            return Some(format!(
                "{hub} names a leader under epoch {named}, newer than this session's {epoch}"
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_named_by_a_standby_is_one_of_ours_only_by_host_port_and_scheme() {
        let hubs = vec![
            "ws://10.0.0.1:8090/v1/agent".to_string(),
            "wss://hub-2.example:8443/v1/agent".to_string(),
        ];
        assert_eq!(same_hub_in(&hubs, "http://10.0.0.1:8090"), Some(0));
        assert_eq!(same_hub_in(&hubs, "https://hub-2.example:8443/"), Some(1));
        assert_eq!(same_hub_in(&hubs, "http://hub-2.example:8443"), None);
        assert_eq!(same_hub_in(&hubs, "http://10.0.0.9:8090"), None);
        assert_eq!(answer_timeout(2, 0), Duration::from_secs(1));
        assert_eq!(answer_timeout(2, 2), Duration::from_secs(4));
        assert_eq!(answer_timeout(2, 9), Duration::from_secs(10));
        assert_eq!(answer_timeout(1, 0), Duration::from_secs(10));
        assert_eq!(
            health_url("wss://hub-2.example:8443/v1/agent?x=1").as_deref(),
            Some("https://hub-2.example:8443/health")
        );
    }
}
