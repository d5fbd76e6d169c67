//! The HTTP client one hub reaches another with: a standby forwarding to the leader, a fenced
//! leader asking who leads, a leader that stepped aside forwarding to the new one. No proxy
//! (hubs of a store reach each other directly), no redirects (a request is forwarded to one
//! hub, never wherever it points), and the CA bundle the operator gave with `--peer-ca-file`
//! trusted beside the system's roots, so hubs served with certificates of a private CA
//! (`--tls-cert`) reach each other.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The certificates a hub trusts for its peers beside the system's roots.
#[derive(Clone, Debug, Default)]
pub struct PeerTrust(Arc<Vec<reqwest::Certificate>>);

impl PeerTrust {
    /// The CA bundle (PEM) at `path`, read once at start (none: the system's roots only). A
    /// file that cannot be read, or holds no certificate, is refused at start, naming it.
    pub fn from_file(path: Option<&Path>) -> Result<PeerTrust, String> {
        let Some(path) = path else {
            return Ok(PeerTrust::default());
        };
        let pem = std::fs::read(path)
            .map_err(|e| format!("cannot read the peer CA file {}: {e}", path.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
            format!(
                "the peer CA file {} is not a PEM bundle: {e}",
                path.display()
            )
        })?;
        if certs.is_empty() {
            return Err(format!(
                "the peer CA file {} holds no certificate",
                path.display()
            ));
        }
        Ok(PeerTrust(Arc::new(certs)))
    }

    /// A client for peers: each request bounded by `timeout` (none: by the caller), each
    /// connection by `connect_timeout`.
    pub fn client(&self, timeout: Option<Duration>, connect_timeout: Duration) -> reqwest::Client {
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(connect_timeout)
            .redirect(reqwest::redirect::Policy::none());
        if let Some(t) = timeout {
            b = b.timeout(t);
        }
        for cert in self.0.iter() {
            b = b.add_root_certificate(cert.clone());
        }
        // Building fails only for a TLS backend that cannot start, which every other client
        // of the process would meet too; the default client then says why at each request.
        b.build().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_ca_file_is_refused_at_start_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let none = dir.path().join("none.pem");
        let refused = PeerTrust::from_file(Some(&none)).unwrap_err();
        assert!(refused.contains("none.pem"), "{refused}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no certificate here\n").unwrap();
        let refused = PeerTrust::from_file(Some(&empty)).unwrap_err();
        assert!(refused.contains("empty.pem"), "{refused}");
        assert!(PeerTrust::from_file(None).unwrap().0.is_empty());
    }

    #[tokio::test]
    async fn a_peer_served_with_a_private_cas_certificate_is_reached_with_its_bundle() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("peer-ca.pem");
        std::fs::write(&ca, cert.cert.pem()).unwrap();
        let config = axum_server::tls_rustls::RustlsConfig::from_pem(
            cert.cert.pem().into_bytes(),
            cert.signing_key.serialize_pem().into_bytes(),
        )
        .await
        .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
        let server = tokio::spawn(
            axum_server::from_tcp_rustls(listener, config)
                .unwrap()
                .serve(app.into_make_service()),
        );
        let url = format!("https://localhost:{port}/health");
        let plain =
            PeerTrust::default().client(Some(Duration::from_secs(5)), Duration::from_secs(5));
        assert!(
            plain.get(&url).send().await.is_err(),
            "a private CA is not trusted by default"
        );
        let trusted = PeerTrust::from_file(Some(&ca))
            .unwrap()
            .client(Some(Duration::from_secs(5)), Duration::from_secs(5));
        let answer = trusted.get(&url).send().await.unwrap();
        assert_eq!(answer.text().await.unwrap(), "ok");
        server.abort();
    }
}
