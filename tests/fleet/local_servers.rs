//! Model servers the operator already runs, fronted by the agent (`[[local_server]]`): real
//! agent and hub processes, the in-repo test master ([`crate::fantom_master`]), and loopback
//! stand-ins for vLLM and Ollama ([`crate::model_servers`]).
//!
//! * the master's view: the RLM's vLLM and Ollama's completion appear as running containers on
//!   their own ports, an embedding server on the agent's port (answered through it), a server
//!   declared with a model it does not serve as `exited` (the agent's `/health` says why); `stop` on
//!   a server without a unit says it is managed elsewhere, one with a unit runs `systemctl`;
//!   the RLM container turns `exited` when its server stops answering;
//! * the hub: chat under `local` is served by the declared server (whole and streamed) with
//!   no cloud call, its latency in the provider's statistics; when the server dies the role
//!   fails at once with the reason;
//! * the gate: a declared embedding server (Ollama) at cosine 0.97 to the reference is refused
//!   and serves nothing; one with the reference's own vectors (TEI) passes and serves, until
//!   new weights behind the same name make it a new identity, judged again and refused;
//! * the scorer check: fronted rerankers (vLLM on `/v1/score` after `/v1/rerank`'s 404, TEI
//!   with `raw_scores`, vLLM on Cohere's `/v1/rerank`) claiming one identity are compared on
//!   the probe pairs; the one that disagrees is another scorer, and no ranking mixes the two.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::fantom_master::TestMaster;
use crate::gate::{minilm_embedder, verdict};
use crate::model_servers::{Kind, ModelServer, ModelServerConfig, RerankStandIn, stand_in_logit};
use crate::relay::{TRACE, opts};
use crate::support::*;
use crate::upstream::{Endpoint, EndpointKind, Upstream, UpstreamConfig};

const RLM_MODEL: &str = "mit-oasys/rlm-qwen3-8b";
const COMPLETION_MODEL: &str = "qwen3.5:9b";
const EMBED_MODEL: &str = "all-minilm";
const AGENT_URL: &str = "http://127.0.0.1:8098";

async fn server(kind: Kind, model: &str, api_key: Option<&str>) -> ModelServer {
    ModelServer::start(ModelServerConfig {
        kind,
        model: model.into(),
        embedder: None,
        cosine: None,
        api_key: api_key.map(str::to_string),
        rerank: None,
    })
    .await
}

/// One `[[local_server]]` table, checked every second.
fn table(role: &str, s: &ModelServer, model: &str, kind: &str, extra: &str) -> String {
    format!(
        "\n[[local_server]]\nrole = \"{role}\"\nurl = \"{}\"\nmodel = \"{model}\"\nkind = \"{kind}\"\nhealth_interval_s = 1\n{extra}\n",
        s.url
    )
}

fn role_payload(role: &str) -> Map<String, Value> {
    let mut p = Map::new();
    p.insert("role".into(), json!(role));
    p
}

/// A `systemctl` stand-in: appends its arguments (`--no-block <verb> <unit>`) to
/// `<dir>/systemctl.log`; `fail-*` units fail as systemctl does.
fn fake_systemctl(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("systemctl");
    let log = dir.join("systemctl.log");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\ncase \"$3\" in fail-*) echo \"Failed to $2 $3: Unit $3 not found.\" >&2; exit 5;; esac\n",
            log.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn container<'a>(heartbeat: &'a Value, role: &str) -> &'a Value {
    &heartbeat["statusData"]["containers"][role]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_sees_declared_servers_as_containers_that_follow_their_health() {
    let dir = tempfile::tempdir().unwrap();
    let master = TestMaster::start(opts()).await;
    let mut rlm = server(Kind::Vllm, RLM_MODEL, Some("vllm-secret-key-0123456789")).await;
    let completion = server(Kind::Ollama, COMPLETION_MODEL, None).await;
    let embedder = server(Kind::Ollama, EMBED_MODEL, None).await;
    let key_file = dir.path().join("vllm.key");
    std::fs::write(&key_file, "vllm-secret-key-0123456789\n").unwrap();
    let systemctl = fake_systemctl(dir.path());
    let body = format!(
        "agent_url = \"{AGENT_URL}\"\nsystemctl = \"{}\"\n\n[[fantom_master]]\nserver_url = \"{}\"\nws_port = {}\n{}{}{}{}",
        systemctl.display(),
        master.http_url,
        master.ws_port,
        table(
            "rlm",
            &rlm,
            RLM_MODEL,
            "vllm",
            &format!("api_key_file = \"{}\"", key_file.display())
        ),
        table(
            "completion",
            &completion,
            COMPLETION_MODEL,
            "ollama",
            "unit = \"ollama.service\""
        ),
        table("embedding", &embedder, EMBED_MODEL, "ollama", ""),
        // Declared with a model that server does not serve: never `running`.
        table(
            "ocr",
            &completion,
            "glm-ocr",
            "ollama",
            "unit = \"fail-ocr.service\""
        ),
    );
    let agent = start_relay_agent(dir.path(), "servers", &body, &[TRACE]);

    // The servers were checked before the first register: the master sees them at once.
    let register = master.wait_registered(AGENT_URL).await;
    let names: Vec<&str> = register["containers"]
        .as_array()
        .unwrap_or_else(|| panic!("{register}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for name in ["ss-rlm", "ss-completion", "ss-embedding"] {
        assert!(names.contains(&name), "{register}");
    }
    let beat = master
        .wait_running(&["rlm", "completion", "embedding"])
        .await;
    let beat = beat.value.unwrap();
    let rlm_c = container(&beat, "rlm");
    assert_eq!(rlm_c["name"], "ss-rlm", "{beat}");
    assert_eq!(
        rlm_c["config"]["port"], rlm.port,
        "the master calls vLLM itself"
    );
    assert_eq!(rlm_c["config"]["model"], RLM_MODEL);
    assert_eq!(rlm_c["type"], "vllm");
    let completion_c = container(&beat, "completion");
    assert_eq!(completion_c["config"]["port"], completion.port);
    assert_eq!(completion_c["type"], "ollama");
    // An embedding server is answered through the agent's port (its API is ours to speak).
    let embedding_c = container(&beat, "embedding");
    assert_eq!(embedding_c["config"]["port"], agent.addr.port(), "{beat}");
    assert_eq!(embedding_c["config"]["model"], EMBED_MODEL);
    assert_eq!(container(&beat, "ocr")["status"], "exited", "{beat}");
    let health: Value = reqwest::get(agent.url("/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ocr = health["local_servers"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["role"] == "ocr"))
        .unwrap_or_else(|| panic!("{health}"));
    assert_eq!(ocr["status"], "down", "{health}");
    assert!(
        ocr["reason"]
            .as_str()
            .is_some_and(|r| r.contains("not the declared model 'glm-ocr'")),
        "{health}"
    );
    let health_checks = rlm.count(|c| &c.health);
    assert!(health_checks >= 1);
    assert_eq!(
        rlm.count(|c| &c.unauthorized),
        0,
        "the key went as a bearer token"
    );

    // The master's embedding call on the agent's port reaches the declared server.
    let http = reqwest::Client::new();
    let r = http
        .post(agent.url("/api/embed"))
        .json(&json!({"model": EMBED_MODEL, "input": ["alpha", "beta gamma"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(
        answer["embeddings"].as_array().map(Vec::len),
        Some(2),
        "{answer}"
    );
    assert_eq!(embedder.count(|c| &c.embedded_texts), 2);

    // `stop` without a unit: managed elsewhere. With one: systemctl runs.
    let refused = master.command("stop", role_payload("rlm")).await;
    let error = refused["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{refused}"));
    assert!(error.contains("managed elsewhere"), "{refused}");
    let stopped = master.command("stop", role_payload("completion")).await;
    assert!(stopped.get("error").is_none(), "{stopped}");
    let log = std::fs::read_to_string(dir.path().join("systemctl.log")).unwrap();
    assert_eq!(log.trim(), "--no-block stop ollama.service");
    // A unit systemctl cannot start: the error says which and why.
    let failed = master.command("start", role_payload("ocr")).await;
    let error = failed["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{failed}"));
    assert!(
        error.contains("systemctl start fail-ocr.service failed") && error.contains("not found"),
        "{failed}"
    );
    // An acquire is timed as for our own models.
    let acquired = master.command("acquire", role_payload("rlm")).await;
    assert!(acquired.get("error").is_none(), "{acquired}");
    master
        .wait_frame("a heartbeat with the RLM's lastAcquire", |f| {
            f.kind() == Some("heartbeat")
                && f.value
                    .as_ref()
                    .is_some_and(|v| v["statusData"]["roles"]["rlm"]["lastAcquire"].is_u64())
        })
        .await;

    // The RLM's server dies: its container turns `exited`; the others stay running.
    let seq = master.seq();
    rlm.stop().await;
    let exited = master
        .wait_frame("a heartbeat with the RLM exited", |f| {
            f.seq > seq
                && f.kind() == Some("heartbeat")
                && f.value.as_ref().is_some_and(|v| {
                    container(v, "rlm")["status"] == "exited"
                        && container(v, "completion")["status"] == "running"
                })
        })
        .await;
    let exited = exited.value.unwrap();
    assert!(
        container(&exited, "rlm")["loadedModels"].is_null(),
        "{exited}"
    );
    assert_eq!(container(&exited, "rlm")["config"]["port"], rlm.port);
    let key_seen = files_containing(dir.path(), "vllm-secret-key-0123456789", &[&key_file]);
    assert!(
        key_seen.is_empty(),
        "the server's key leaked into {key_seen:?}"
    );
}

/// The OpenRouter stand-in with one chat model, to prove nothing is sent to it.
async fn cloud() -> Upstream {
    Upstream::start(UpstreamConfig {
        key: "sk-or-v1-local-servers-0123456789abcdef".into(),
        endpoints: vec![Endpoint {
            model: "deepseek/deepseek-v4-flash".into(),
            slug: "deepseek".into(),
            quantization: "unknown".into(),
            kind: EndpointKind::Chat,
        }],
        ..Default::default()
    })
    .await
}

/// The provider `agent/id` in the hub's status, once it exists (or, with `gone`, once not).
async fn provider(hub: &HubProc, id: &str, gone: bool) -> Option<Value> {
    eventually(&format!("provider {id} (gone: {gone})"), || async {
        let s = hub.status().await;
        let found = s["agents"].as_array()?.iter().find_map(|a| {
            a["providers"]
                .as_array()?
                .iter()
                .find(|p| p["provider"] == id)
                .cloned()
        });
        match (found, gone) {
            (None, true) => Some(None),
            (Some(p), false) => Some(Some(p)),
            _ => None,
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_under_local_is_served_by_the_declared_server_and_nothing_leaves_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let up = cloud().await;
    let mut rlm = server(Kind::Vllm, RLM_MODEL, None).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let body = format!(
        "openrouter_url = \"{}\"\n{}",
        up.base_url,
        table("rlm-sandbox", &rlm, RLM_MODEL, "vllm", "")
    );
    let _agent = start_agent_toml(
        dir.path(),
        &hub.ws_url(),
        &hub.fleet_file,
        "gpu",
        &body,
        &[],
    );
    // The key and a cloud model are pushed, but the role's policy is `local`.
    let (code, pushed) = hub
        .push(
            json!({"openrouter": {"apiKey": "sk-or-v1-local-servers-0123456789abcdef",
            "allowedModels": {"rlm-sandbox": {"model": "deepseek/deepseek-v4-flash"}},
            "modeByRole": {"rlm-sandbox": "local-only"}}}),
        )
        .await;
    assert_eq!(code, 200, "{pushed}");
    let p = provider(&hub, "gpu/server:rlm-sandbox", false)
        .await
        .unwrap();
    assert_eq!(p["backend"], "local", "{p}");
    assert_eq!(p["server"], "vllm", "{p}");
    assert_eq!(p["model"], RLM_MODEL);

    let chat = json!({"model": "rlm-sandbox", "messages": [{"role": "user", "content": "where is main?"}]});
    let (code, answer) = hub.post("/v1/chat/completions", &chat).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        format!("{RLM_MODEL} says: where is main?")
    );
    assert_eq!(answer["provenance"]["server"], "vllm", "{answer}");
    // The client's `model` (a role) became the server's own.
    let sent = rlm.state.last_chat.lock().unwrap().clone().unwrap();
    assert_eq!(sent["model"], RLM_MODEL);

    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let events = hub.post_events("/v1/chat/completions", &streamed).await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(
        streamed_content(&events),
        format!("{RLM_MODEL} says: where is main?")
    );
    assert_eq!((rlm.count(|c| &c.chats), rlm.count(|c| &c.streams)), (1, 1));
    assert_eq!(up.state.requests(), 0, "nothing went to the cloud");
    // Its latency feeds the same statistics as any provider's.
    let p = eventually("the server's served items and latency", || async {
        let p = provider(&hub, "gpu/server:rlm-sandbox", false).await?;
        (p["served_items"] == 2 && p["latency_ewma_ms"].as_f64().is_some_and(|l| l > 0.0))
            .then_some(p)
    })
    .await;
    assert_eq!(p["failures"], 0, "{p}");

    // The server dies: its provider leaves, and a chat fails at once with the reason.
    rlm.stop().await;
    provider(&hub, "gpu/server:rlm-sandbox", true).await;
    let started = std::time::Instant::now();
    let (code, refused) = hub.post("/v1/chat/completions", &chat).await;
    assert_eq!(code, 503, "{refused}");
    let reason = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        refused["error"]["code"] == "no_provider" && reason.contains("'rlm-sandbox'"),
        "the reason names the role: {refused}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(15),
        "no timeout waited out"
    );

    // It comes back on its port: the provider is announced again, with one pull of its depth.
    rlm.restart().await;
    let back = eventually("the server's provider back with its credits", || async {
        let p = provider(&hub, "gpu/server:rlm-sandbox", false).await?;
        (p["credits"] == 4).then_some(p)
    })
    .await;
    assert_eq!(back["in_flight"], 0, "{back}");
    let (code, answer) = hub.post("/v1/chat/completions", &chat).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(rlm.count(|c| &c.chats), 2);
    assert_eq!(up.state.requests(), 0, "nothing went to the cloud");
}

/// An agent fronting one embedding server of `kind`.
fn embedding_agent(dir: &Path, hub: &HubProc, id: &str, s: &ModelServer, kind: &str) -> Proc {
    let body = table("embedding", s, EMBED_MODEL, kind, "dims = 384");
    start_agent_toml(dir, &hub.ws_url(), &hub.fleet_file, id, &body, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_embedding_server_is_gated_like_any_provider() {
    let dir = tempfile::tempdir().unwrap();
    let minilm = minilm_embedder().await;
    let server_at = |kind: Kind, cosine: Option<f32>| {
        let embedder = Some(minilm.clone());
        async move {
            ModelServer::start(ModelServerConfig {
                kind,
                model: EMBED_MODEL.into(),
                embedder,
                cosine,
                api_key: None,
                rerank: None,
            })
            .await
        }
    };
    let drifted = server_at(Kind::Ollama, Some(0.97)).await;
    let faithful = server_at(Kind::Tei, None).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    // The reference: our own pinned MiniLM. A fronted server never founds the space.
    let mut gpu = start_agent(dir.path(), &hub, "gpu", &[]);
    let _a = embedding_agent(dir.path(), &hub, "drifted", &drifted, "ollama");
    let _b = embedding_agent(dir.path(), &hub, "faithful", &faithful, "tei");

    let refused = verdict(&hub, "drifted/server:embedding", &["refused"]).await;
    assert_eq!(
        refused["space"], "embedding:all-minilm-l6-v2:384",
        "{refused}"
    );
    let min = refused["evidence"]["min_cosine"].as_f64().unwrap();
    assert!((min - 0.97).abs() < 0.005, "{refused}");
    verdict(&hub, "faithful/server:embedding", &["pass"]).await;
    let probed_texts = drifted.count(|c| &c.embedded_texts);
    assert_eq!(drifted.count(|c| &c.embed_calls), 1, "one probe");

    let texts: Vec<String> = (0..48).map(|i| format!("doc {i}: lease renewal")).collect();
    let mut by = std::collections::BTreeMap::<String, usize>::new();
    for chunk in texts.chunks(16) {
        let (code, body) = hub
            .post(
                "/v1/embeddings",
                &json!({"model": "embedding", "input": chunk}),
            )
            .await;
        assert_eq!(code, 200, "{body}");
        for d in body["data"].as_array().unwrap() {
            let who = d["provenance"]["provider"]
                .as_str()
                .unwrap_or("?")
                .to_string();
            *by.entry(who).or_default() += 1;
        }
    }
    assert!(!by.contains_key("drifted/server:embedding"), "{by:?}");
    assert_eq!(by.values().sum::<usize>(), 48, "{by:?}");
    assert_eq!(
        drifted.count(|c| &c.embedded_texts),
        probed_texts,
        "the refused server embedded no production text"
    );
    // Hub status shows why.
    let s = hub.status().await;
    let shown = s["gate"]["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["provider"] == "drifted/server:embedding")
        .cloned()
        .unwrap();
    assert!(
        shown["reason"].as_str().is_some_and(|r| r.contains("0.97")),
        "{shown}"
    );

    // With our own model gone, the passing server serves the space it was judged against.
    gpu.kill();
    provider(&hub, "gpu/embedding", true).await;
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": ["one", "two"]}),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    for d in body["data"].as_array().unwrap() {
        assert_eq!(
            d["provenance"]["provider"], "faithful/server:embedding",
            "{body}"
        );
        assert_eq!(d["provenance"]["server"], "tei", "{body}");
    }
    assert_eq!(drifted.count(|c| &c.embedded_texts), probed_texts);

    // New weights behind the same name (TEI's model_sha moves): a new identity, judged again
    // before it serves, and refused; with nothing left to serve the space, a request fails.
    let before = provider(&hub, "faithful/server:embedding", false)
        .await
        .unwrap();
    assert!(
        before["revision"]
            .as_str()
            .is_some_and(|r| r.starts_with("tei:")),
        "{before}"
    );
    faithful.state.swap_weights("0123456789abcdef", Some(0.97));
    let judged = verdict(&hub, "faithful/server:embedding", &["refused"]).await;
    assert!(
        judged["reason"]
            .as_str()
            .is_some_and(|r| r.contains("0.97")),
        "{judged}"
    );
    let after = provider(&hub, "faithful/server:embedding", false)
        .await
        .unwrap();
    assert_eq!(after["revision"], "tei:0123456789abcdef", "{after}");
    let served = faithful.count(|c| &c.embedded_texts);
    let (code, body) = hub
        .post(
            "/v1/embeddings",
            &json!({"model": "embedding", "input": ["three"]}),
        )
        .await;
    assert_eq!(code, 503, "{body}");
    assert_eq!(
        faithful.count(|c| &c.embedded_texts),
        served,
        "refused: no text"
    );
}

const RERANK_MODEL: &str = "BAAI/bge-reranker-v2-m3";
/// What the TEI stand-in's `/info` answers as `model_sha`: the commit the vLLM tables declare.
const TEI_REVISION: &str = "8eeb52dfb3bb9aefdf9d1ef24b3bdbcfbf5e3b7c0d1a2f3e4d5c6b7a8f9e0d1c";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fronted_rerankers_claiming_one_scorer_are_checked_and_one_that_disagrees_is_kept_apart() {
    let dir = tempfile::tempdir().unwrap();
    let reranker = |kind: Kind, shift: f64, cohere_route: bool| async move {
        ModelServer::start(ModelServerConfig {
            kind,
            model: RERANK_MODEL.into(),
            embedder: None,
            cosine: None,
            api_key: None,
            rerank: Some(RerankStandIn {
                shift,
                cohere_route,
            }),
        })
        .await
    };
    // One claim, three servers: vLLM without Cohere's route, TEI, and a vLLM that disagrees.
    let score_only = reranker(Kind::Vllm, 0.0, false).await;
    let tei = reranker(Kind::Tei, 0.0, false).await;
    let other = reranker(Kind::Vllm, 1.5, true).await;
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    // Three documents a work frame, one frame at a time: a ranking takes several frames.
    let small = "max_items_per_work = 3\npipeline_depth = 1";
    let declared = format!("revision = \"{TEI_REVISION}\"\n{small}");
    let mut agents = [
        ("score-only", &score_only, "vllm", declared.as_str()),
        ("tei", &tei, "tei", small),
        ("other", &other, "vllm", declared.as_str()),
    ]
    .map(|(id, server, kind, extra)| {
        let body = table("reranker", server, RERANK_MODEL, kind, extra);
        start_agent_toml(dir.path(), &hub.ws_url(), &hub.fleet_file, id, &body, &[])
    });

    let scorers: Vec<Value> = eventually("three rerankers checked", || async {
        let s = hub.status().await;
        let list = s["scorers"].as_array()?.clone();
        (list.len() == 3 && list.iter().all(|v| v["state"] == "checked")).then_some(list)
    })
    .await;
    let of = |p: &str| {
        scorers
            .iter()
            .find(|v| v["provider"] == format!("{p}/server:reranker"))
            .unwrap_or_else(|| panic!("{p}: {scorers:?}"))
            .clone()
    };
    let claim = format!("local {RERANK_MODEL}@{TEI_REVISION} sigmoid");
    for p in ["score-only", "tei", "other"] {
        assert_eq!(of(p)["claimed"], claim.as_str(), "{scorers:?}");
    }
    assert_eq!(
        of("score-only")["scorer"],
        of("tei")["scorer"],
        "{scorers:?}"
    );
    assert_ne!(
        of("score-only")["scorer"],
        of("other")["scorer"],
        "{scorers:?}"
    );
    assert!(
        score_only.count(|c| &c.reranked_docs) >= 6 && other.count(|c| &c.reranked_docs) >= 6,
        "the probe pairs reached vLLM's /v1/score (after /v1/rerank's 404) and Cohere's /v1/rerank"
    );
    let shift_of = |provider: &str| {
        if provider.starts_with("other/") {
            1.5
        } else {
            0.0
        }
    };

    // Rankings spread over several work frames: each is one scorer's, scores on its scale.
    let query = "reading a file line by line in rust";
    let docs: Vec<String> = (0..12)
        .map(|i| match i % 4 {
            0 => format!("{i}: rust reads a file line by line"),
            1 => format!("{i}: reading the file"),
            2 => format!("{i}: a line of poetry"),
            _ => format!("{i}: the weather today"),
        })
        .collect();
    let rank = || async {
        let (code, body) = hub
            .post(
                "/v1/rerank",
                &json!({"model": "reranker", "query": query, "documents": docs}),
            )
            .await;
        assert_eq!(code, 200, "{body}");
        body
    };
    for _ in 0..8 {
        let body = rank().await;
        assert_eq!(body["scorer"]["activation"], "sigmoid", "{body}");
        let results = body["results"].as_array().unwrap();
        assert_eq!(results.len(), docs.len());
        let providers: std::collections::BTreeSet<&str> = results
            .iter()
            .map(|r| r["provenance"]["provider"].as_str().unwrap())
            .collect();
        let groups: std::collections::BTreeSet<bool> =
            providers.iter().map(|p| p.starts_with("other/")).collect();
        assert_eq!(groups.len(), 1, "one ranking, one scorer: {providers:?}");
        let agent = providers.iter().next().and_then(|p| p.split('/').next());
        assert_eq!(body["scorer"]["id"], of(agent.unwrap())["scorer"], "{body}");
        for r in results {
            let i = r["index"].as_u64().unwrap() as usize;
            let p = r["provenance"]["provider"].as_str().unwrap();
            let want = 1.0 / (1.0 + (-stand_in_logit(query, &docs[i], shift_of(p))).exp());
            let got = r["relevance_score"].as_f64().unwrap();
            assert!((got - want).abs() < 1e-4, "{p} doc {i}: {got} vs {want}");
        }
    }

    // Without the disagreeing one, the two that agree share the rankings: each is their
    // scorer's, and the frames of one ranking go to both (one frame at a time each).
    agents[2].kill();
    eventually(
        "the disagreeing reranker gone, the two others checked",
        || async {
            let s = hub.status().await;
            let list = s["scorers"].as_array()?.clone();
            (list.len() == 2 && list.iter().all(|v| v["state"] == "checked")).then_some(())
        },
    )
    .await;
    let mut shared = 0;
    for _ in 0..3 {
        let body = rank().await;
        assert_eq!(body["scorer"]["id"], of("tei")["scorer"], "{body}");
        let providers: std::collections::BTreeSet<&str> = body["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["provenance"]["provider"].as_str().unwrap())
            .collect();
        assert!(
            providers
                .iter()
                .all(|p| ["score-only/server:reranker", "tei/server:reranker"].contains(p)),
            "{providers:?}"
        );
        if providers.len() == 2 {
            shared += 1;
        }
    }
    assert!(shared > 0, "one scorer, two servers, one ranking");
}
