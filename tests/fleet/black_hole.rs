//! A loopback TCP proxy that can turn into a black hole: every connection open at that moment
//! stops forwarding in both directions without closing (as a dropped NAT mapping or a
//! firewall that eats packets does), while new connections forward normally.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::support::{HubProc, Proc, start_agent_toml};
use crate::upstream::Upstream;

/// A cloud-only agent `id` (its routes calling `up`) whose socket to `hub` runs through a
/// proxy the test can black-hole.
pub async fn cloud_agent_behind_proxy(
    dir: &std::path::Path,
    hub: &HubProc,
    id: &str,
    up: &Upstream,
) -> (BlackHoleProxy, Proc) {
    let proxy = BlackHoleProxy::start(hub.proc.addr).await;
    let body = format!(
        "openrouter_url = \"{}\"\ncloud_pipeline_depth = 8",
        up.base_url
    );
    let proxied = format!("ws://{}/v1/agent", proxy.addr);
    let agent = start_agent_toml(dir, &proxied, &hub.fleet_file, id, &body, &[]);
    (proxy, agent)
}

pub struct BlackHoleProxy {
    pub addr: SocketAddr,
    /// One switch per connection accepted so far.
    switches: Arc<Mutex<Vec<watch::Sender<bool>>>>,
    tasks: Arc<Mutex<JoinSet<()>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl BlackHoleProxy {
    /// Forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> BlackHoleProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let switches: Arc<Mutex<Vec<watch::Sender<bool>>>> = Arc::default();
        let tasks: Arc<Mutex<JoinSet<()>>> = Arc::default();
        let (sw, ts) = (switches.clone(), tasks.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let (stall, stalled) = watch::channel(false);
                sw.lock().unwrap().push(stall);
                let (cr, cw) = client.into_split();
                let (sr, swr) = server.into_split();
                let mut set = ts.lock().unwrap();
                set.spawn(forward(cr, swr, stalled.clone()));
                set.spawn(forward(sr, cw, stalled));
            }
        });
        BlackHoleProxy {
            addr,
            switches,
            tasks,
            accept,
        }
    }

    /// Every connection open now stops forwarding (and never closes); later ones forward.
    pub fn black_hole(&self) {
        for s in self.switches.lock().unwrap().iter() {
            s.send_replace(true);
        }
    }
}

impl Drop for BlackHoleProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.tasks.lock().unwrap().abort_all();
    }
}

/// Copies `from` to `to` until either ends; once stalled, holds both open and moves nothing.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = stalled.wait_for(|s| *s) => break,
        };
        if *stalled.borrow() || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    // A black hole: the sockets stay open, nothing moves, until the proxy is dropped.
    std::future::pending::<()>().await;
    drop((from, to));
}
