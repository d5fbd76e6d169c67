//! The relay's wire types against the reference's own JSON examples (§2.1.2, §2.1.4, §2.1.6,
//! §2.1.10, §2.2, §3.1), copied verbatim.

use serde_json::{Value, json};

use super::frames::*;
use super::status::*;
use crate::config::push::{self, CloudSettings, Outcome, PushRefused};
use crate::roles::Role;

const REGISTER: &str = r#"{"type":"register","agentUrl":"http://10.0.0.5:8098","hostname":"gpu-01","containers":["ss-embedding","ss-code-embedding","ss-reranker"]}"#;
const HEARTBEAT: &str = r#"{"type":"heartbeat","activeRequests":1,"statusData":{
  "agentUrl":"http://10.0.0.5:8098","hostname":"gpu-01","mode":"auto","version":"2.4.3",
  "agent":{"version":"2.4.3","uptime":8123},
  "containers":{
    "code-embedding":{"name":"ss-code-embedding","status":"running","type":"ollama",
      "config":{"model":"qwen3-embedding:4b","port":11437,"type":"ollama","gpuOnly":true},
      "loadedModels":[{"name":"qwen3-embedding:4b","gpuPercent":100,"processor":"GPU","size":"3.1 GB"}]},
    "reranker":{"name":"ss-reranker","status":"running","type":"vllm",
      "config":{"model":"Qwen/Qwen3-Reranker-8B","port":8099,"type":"vllm"}}
  },
  "roles":{"code-embedding":{"activeRequests":1,"idleTimerActive":false},"reranker":{"activeRequests":0}},
  "gpus":[{"index":0,"name":"RTX 4090","memoryMb":24564,"tempC":61}],
  "vram":{"totalMb":24564,"freeMb":9000,"usedMb":15564},
  "masters":[{"serverUrl":"http://10.0.0.2:3848","wsPort":3003,"connectionMode":"websocket"},
             {"serverUrl":"http://10.0.0.2:3000","wsPort":3002,"connectionMode":"websocket"}]
}}"#;
const EMBED_RESULT: &str = r#"{"type":"result","id":"cmd-mfz3k2p1-a9x0qe","source":"openrouter","model":"qwen/qwen3-embedding-8b","dims":4096,"embeddings":[[0.0123,-0.0441]],"totalTokens":18}"#;
const UNKNOWN_RESULT: &str =
    r#"{"type":"result","id":"cmd-mfz3k2p1-77hh2b","error":"Unknown action: virtual-chat"}"#;
const KEY_INFO_RESULT: &str = r#"{"type":"result","id":"cmd-mfz3kq00-k2k2k2","data":{"usage":3.5,"limit":null,"is_free_tier":false,
 "rate_limit":{"requests":100,"interval":"10s"},"total_credits":25,"total_usage":3.5}}"#;
const EMBED_COMMAND: &str = r#"{"type":"command","id":"cmd-mfz3k2p1-a9x0qe","action":"virtual-embed","role":"code-embedding",
 "texts":["function add(a,b){return a+b}"],"localAvailable":false,
 "localErrorReason":"fantom fan-out: this provider is the cloud peer, not a local fallback",
 "model":"qwen/qwen3-embedding-8b"}"#;
const RERANK_COMMAND: &str = r#"{"type":"command","id":"cmd-mfz3k9aa-0p2k1z","action":"virtual-rerank","role":"reranker",
 "query":"open sax file","documents":["doc A","doc B"],"topN":2,"localAvailable":false,
 "localErrorReason":"fantom: no healthy local reranker, or the local request failed"}"#;
const CONFIG: &str = r#"{"type":"config","id":"cfg-mfz4a0b2","payload":{"openrouter":{
  "apiKey":"sk-or-v1-…only-on-first-push…",
  "allowedModels":{
    "embedding":{"model":"qwen/qwen3-embedding-8b","provider":"Nebius","dims":4096},
    "code-embedding":{"model":"qwen/qwen3-embedding-8b","provider":"Nebius","dims":4096},
    "reranker":{"model":"qwen/qwen3-reranker-8b","provider":"Fireworks"},
    "code-assistant":{"model":"poolside/laguna-s-2.1"},
    "rlm-sandbox":{"model":"deepseek/deepseek-v4-flash"}},
  "modeByRole":{"embedding":"cloud-only","code-embedding":"cloud-only","reranker":"cloud-only",
    "code-assistant":"cloud-only","rlm":"local-only","rlm-sandbox":"local-only"},
  "domain":"code"}}}"#;
const STATUS: &str = r#"{"hostname":"7a531233e3e0","containers":{},"masters":[
  {"serverUrl":"http://10.0.0.2:3000","wsPort":3002,
   "virtualInference":{"openrouter":"configured","modeByRole":{"reranker":"local-first"}},
   "virtualContainers":[{"role":"reranker","model":"qwen/qwen3-reranker-8b","provider":"Fireworks","mode":"local-first","state":"idle"}]},
  {"serverUrl":"http://10.0.0.2:3848","wsPort":3003,
   "virtualInference":{"openrouter":"configured","modeByRole":{"code-embedding":"cloud-only"}},
   "virtualContainers":[{"role":"code-embedding","model":"qwen/qwen3-embedding-8b","provider":"Nebius","dims":4096,
      "mode":"cloud-only","served":1204,"lastServedAt":1759300000000,"failures":2,
      "lastError":null,"lastDurationMs":840,"state":"idle"}]}]}"#;

fn parsed(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

/// Equal as the master reads JSON: numbers by value (`25` = `25.0`), absent = `null`.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Value::Object(x), Value::Object(y)) => x.keys().chain(y.keys()).all(|k| {
            same(
                x.get(k).unwrap_or(&Value::Null),
                y.get(k).unwrap_or(&Value::Null),
            )
        }),
        _ => a == b,
    }
}

/// Encodes `frame`: `type` first as the master's prefix check wants, the reference's JSON,
/// no key anywhere, and it decodes back to itself.
fn check_sidecar(frame: &SidecarFrame, example: &str) {
    let text = encode_sidecar(frame);
    let kind = parsed(example)["type"].as_str().unwrap().to_string();
    assert!(
        text.starts_with(&format!("{{\"type\":\"{kind}\"")),
        "{text}"
    );
    assert!(same(&parsed(&text), &parsed(example)), "{text}\n{example}");
    assert!(
        !text.contains("apiKey") && !text.contains("sk-or"),
        "{text}"
    );
    assert_eq!(&serde_json::from_str::<SidecarFrame>(&text).unwrap(), frame);
}

#[test]
fn sidecar_frames_match_the_reference_with_type_first_and_no_key() {
    let register = SidecarFrame::Register(Register {
        agent_url: "http://10.0.0.5:8098".into(),
        hostname: Some("gpu-01".into()),
        containers: vec![
            "ss-embedding".into(),
            "ss-code-embedding".into(),
            "ss-reranker".into(),
        ],
    });
    check_sidecar(&register, REGISTER);

    let heartbeat: SidecarFrame = serde_json::from_str(HEARTBEAT).unwrap();
    check_sidecar(&heartbeat, HEARTBEAT);
    let SidecarFrame::Heartbeat(hb) = &heartbeat else {
        panic!("{heartbeat:?}")
    };
    let status = hb.status_data.as_ref().unwrap();
    let code = &status.containers["code-embedding"];
    assert_eq!((code.status.as_str(), code.config.port), ("running", 11437));
    assert_eq!(code.loaded_models[0].gpu_percent, Some(100));
    assert_eq!(status.agent.as_ref().unwrap().version, "2.4.3");
    assert_eq!(status.masters[0].ws_port, Some(FANTOM_WS_PORT));
    assert!(status.roles.contains_key("reranker"));

    let embed = EmbedResult {
        source: Source::Openrouter,
        embeddings: vec![vec![0.0123, -0.0441]],
        model: "qwen/qwen3-embedding-8b".into(),
        dims: 4096,
        total_tokens: Some(18),
    };
    let ok = CommandResult::ok("cmd-mfz3k2p1-a9x0qe", &embed);
    check_sidecar(&SidecarFrame::Result(ok), EMBED_RESULT);
    let unknown = CommandResult::unknown_action("cmd-mfz3k2p1-77hh2b", "virtual-chat");
    check_sidecar(&SidecarFrame::Result(unknown), UNKNOWN_RESULT);
    let info = KeyInfo {
        rate_limit: Some(RateLimit {
            requests: 100,
            interval: Interval::Text("10s".into()),
        }),
        total_credits: Some(25.0),
        total_usage: Some(3.5),
        usage: Some(3.5),
        is_free_tier: Some(false),
        ..Default::default()
    };
    let key_info = CommandResult::ok("cmd-mfz3kq00-k2k2k2", &json!({ "data": info }));
    check_sidecar(&SidecarFrame::Result(key_info), KEY_INFO_RESULT);

    // A result body cannot smuggle a key or clobber the frame's own members.
    let leaky = json!({"apiKey": "sk-or-v1-x", "id": "other", "type": "register", "ok": true});
    let text = encode_sidecar(&SidecarFrame::Result(CommandResult::ok("c1", &leaky)));
    assert_eq!(
        parsed(&text),
        json!({"type": "result", "id": "c1", "ok": true})
    );

    // The HTTP fallback's body: the same heartbeat plus agentUrl, still prefixed.
    let fallback = SidecarFrame::Heartbeat(Heartbeat {
        agent_url: Some("http://10.0.0.5:8098".into()),
        ..Default::default()
    });
    let text = encode_sidecar(&fallback);
    assert!(text.starts_with(r#"{"type":"heartbeat""#), "{text}");
    assert_eq!(parsed(&text)["agentUrl"], "http://10.0.0.5:8098");
}

#[test]
fn the_status_snapshot_reads_and_writes_the_reference_rows() {
    let status: StatusData = serde_json::from_str(STATUS).unwrap();
    let text = serde_json::to_string(&status).unwrap();
    assert!(same(&parsed(&text), &parsed(STATUS)), "{text}");
    let fantom = &status.masters[1];
    let inference = fantom.virtual_inference.as_ref().unwrap();
    assert_eq!(
        inference.mode_by_role["code-embedding"],
        WireMode::CloudOnly
    );
    let row = &fantom.virtual_containers.as_ref().unwrap()[0];
    assert_eq!(
        (row.dims, row.served, row.state),
        (Some(4096), Some(1204), VirtualState::Idle)
    );
    assert_eq!(WireMode::from_wire(Some("aggregate")), WireMode::LocalOnly);
    assert_eq!(WireMode::from_wire(None), WireMode::LocalOnly);
}

#[test]
fn master_frames_decode_from_the_reference() {
    let frame = decode_master(r#"{"type":"registered","ok":true}"#).unwrap();
    assert!(
        matches!(frame, MasterFrame::Registered { ok: true }),
        "{frame:?}"
    );
    for message in [
        "invalid JSON",
        "missing type",
        "register: missing agentUrl",
        "heartbeat before register",
    ] {
        let text = json!({"type": "error", "message": message}).to_string();
        let MasterFrame::Error { message: got } = decode_master(&text).unwrap() else {
            panic!("{text}")
        };
        assert_eq!(got, message);
    }
    let identity =
        r#"{"type":"master-identity","canonicalUrl":"http://10.0.0.2:3848","wsPort":3003}"#;
    let MasterFrame::MasterIdentity(id) = decode_master(identity).unwrap() else {
        panic!()
    };
    assert_eq!(
        (id.canonical_url.as_str(), id.ws_port),
        ("http://10.0.0.2:3848", 3003)
    );
    let text = encode_master(&MasterFrame::MasterIdentity(id));
    assert!(text.starts_with(r#"{"type":"master-identity""#), "{text}");
    assert!(same(&parsed(&text), &parsed(identity)));
}

#[test]
fn commands_keep_their_flat_payload_and_parse_per_action() {
    let MasterFrame::Command(cmd) = decode_master(EMBED_COMMAND).unwrap() else {
        panic!()
    };
    assert_eq!(
        (cmd.id.as_str(), cmd.action.as_str()),
        ("cmd-mfz3k2p1-a9x0qe", "virtual-embed")
    );
    assert!(
        !["type", "id", "action"]
            .iter()
            .any(|k| cmd.payload.contains_key(*k))
    );
    let Ok(Action::VirtualEmbed(embed)) = cmd.parse() else {
        panic!("{cmd:?}")
    };
    assert_eq!(embed.role, Role::CodeEmbedding);
    assert_eq!(embed.texts.len(), 1);
    assert_eq!(embed.common.local_available, Some(false));
    assert_eq!(
        embed.common.model.as_deref(),
        Some("qwen/qwen3-embedding-8b")
    );
    // The test master's writer puts the payload back flat.
    let text = encode_master(&MasterFrame::Command(cmd));
    assert!(text.starts_with(r#"{"type":"command""#), "{text}");
    assert!(same(&parsed(&text), &parsed(EMBED_COMMAND)), "{text}");

    let MasterFrame::Command(cmd) = decode_master(RERANK_COMMAND).unwrap() else {
        panic!()
    };
    let Ok(Action::VirtualRerank(rerank)) = cmd.parse() else {
        panic!("{cmd:?}")
    };
    assert_eq!(
        (rerank.role, rerank.top_n, rerank.common.model),
        (Some(Role::Reranker), Some(2), None)
    );
    assert_eq!(rerank.documents, ["doc A", "doc B"]);

    let parse = |text: &str| {
        let MasterFrame::Command(cmd) = decode_master(text).unwrap() else {
            panic!("{text}")
        };
        cmd.parse()
    };
    let start = parse(
        r#"{"type":"command","id":"c","action":"start","role":"embedding","model":"qwen3-embedding:0.6b"}"#,
    );
    assert!(
        matches!(start, Ok(Action::Container(ContainerVerb::Start, ContainerAction { ref role, model: Some(_) })) if role == "embedding")
    );
    assert!(matches!(
        parse(r#"{"type":"command","id":"c","action":"release","role":"rlm"}"#),
        Ok(Action::Container(ContainerVerb::Release, _))
    ));
    assert_eq!(
        parse(r#"{"type":"command","id":"c","action":"virtual-key-info"}"#).unwrap(),
        Action::VirtualKeyInfo
    );
    let chat = parse(r#"{"type":"command","id":"c","action":"virtual-chat"}"#).unwrap();
    assert_eq!(chat, Action::Unknown("virtual-chat".into()));
    assert!(
        parse(r#"{"type":"command","id":"c","action":"virtual-embed","role":"code-embedding"}"#)
            .is_err()
    );
}

#[test]
fn config_frames_carry_the_push_the_hub_merge_reads() {
    let MasterFrame::Config(frame) = decode_master(CONFIG).unwrap() else {
        panic!()
    };
    assert_eq!(frame.id.as_deref(), Some("cfg-mfz4a0b2"));
    let openrouter = frame.payload.openrouter.as_ref().unwrap();
    assert!(
        !format!("{frame:?}").contains("sk-or"),
        "Debug never shows the key"
    );
    let mut held = CloudSettings::default();
    let report = push::merge(&mut held, false, openrouter).unwrap();
    assert!(report.key_included);
    assert_eq!(held.domain.as_deref(), Some("code"));
    assert_eq!(held.allowed_models.len(), 5, "rlm-sandbox included");
    assert!(matches!(
        report.roles["rlm"].mode,
        Some(Outcome::Ignored { .. })
    ));

    let keyless = r#"{"type":"config-push","id":"cfg-2","payload":{"openrouter":{"modeByRole":{"reranker":"local-only"}},"minOnline":1}}"#;
    let MasterFrame::ConfigPush(frame) = decode_master(keyless).unwrap() else {
        panic!()
    };
    let openrouter = frame.payload.openrouter.as_ref().unwrap();
    let refused = push::merge(&mut CloudSettings::default(), false, openrouter);
    assert_eq!(refused.unwrap_err(), PushRefused::FirstPushWithoutKey);
}

#[test]
fn bad_master_frames_are_errors_not_panics() {
    assert!(matches!(
        decode_master("{not json"),
        Err(RelayFrameError::Malformed(_))
    ));
    assert_eq!(
        decode_master(r#"{"ok":true}"#).unwrap_err(),
        RelayFrameError::MissingType
    );
    assert_eq!(
        decode_master("[1]").unwrap_err(),
        RelayFrameError::MissingType
    );
    assert_eq!(
        decode_master(r#"{"type":"ping"}"#).unwrap_err(),
        RelayFrameError::UnknownType("ping".into())
    );
    let err = decode_master(r#"{"type":"command","action":"start"}"#).unwrap_err();
    assert!(
        matches!(&err, RelayFrameError::Invalid { kind, message } if kind == "command" && message.contains("id")),
        "{err}"
    );
    // A malformed config frame's error never quotes its values.
    let bad = r#"{"type":"config","payload":{"openrouter":{"apiKey":"sk-or-v1-secret","domain":"sk-or-v1-secret","allowedModels":{"embedding":{"model":"m","dims":"sk-or-v1-secret"}}}}}"#;
    let err = decode_master(bad).unwrap_err();
    assert!(matches!(&err, RelayFrameError::Invalid { kind, .. } if kind == "config"));
    assert!(!err.to_string().contains("sk-or") && !format!("{err:?}").contains("sk-or"));
    assert_eq!(
        decode_master_bytes(&[0xff, 0xfe]).unwrap_err(),
        RelayFrameError::NotUtf8
    );
    assert!(matches!(
        decode_master_bytes(br#"{"type":"registered","ok":true}"#),
        Ok(MasterFrame::Registered { ok: true })
    ));
}
