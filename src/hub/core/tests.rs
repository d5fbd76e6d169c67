//! The core's state machine driven frame by frame: bindings, dispatch and results.

use tokio::sync::mpsc;

use super::*;
use crate::hub::registry::Outgoing;
use crate::protocol::{Backend, ErrorCode, Hello, PROTOCOL_VERSION, ProviderInfo};
use crate::protocol::{Done, Pull, WorkOutput};

fn provider(id: &str, role: Role, model: &str, max_items: usize) -> ProviderInfo {
    ProviderInfo {
        id: id.into(),
        role,
        backend: Backend::Local,
        model: model.into(),
        revision: Some("r1".into()),
        upstream: None,
        dims: role.is_embedding().then_some(2),
        dtype: None,
        device: None,
        max_input_tokens: None,
        pooling: None,
        max_batch_items: max_items,
        max_batch_tokens: 1 << 20,
        score_activation: (role.op() == Op::Rerank)
            .then_some(crate::protocol::ScoreActivation::Sigmoid),
        server: None,
    }
}

/// An agent with one provider and credits; its frames arrive on the receiver.
fn connect(
    core: &mut Core,
    agent: &str,
    info: ProviderInfo,
    credits: u32,
) -> (u64, mpsc::UnboundedReceiver<Outgoing>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let pid = info.id.clone();
    let session = core
        .hello(
            Hello {
                agent_id: agent.into(),
                hostname: "h".into(),
                version: "0".into(),
                protocol_version: PROTOCOL_VERSION,
                providers: vec![info],
                devices: Vec::new(),
                instance: None,
            },
            tx,
        )
        .unwrap();
    let pull = Pull {
        provider: pid,
        credits,
    };
    core.pull(agent, session, &pull.provider, pull.credits)
        .unwrap();
    (session, rx)
}

/// The next work frame on `rx`, as JSON.
fn next_work(rx: &mut mpsc::UnboundedReceiver<Outgoing>) -> serde_json::Value {
    while let Ok(out) = rx.try_recv() {
        if let Outgoing::Frame(text) = out {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            if v["type"] == "work" {
                return v;
            }
        }
    }
    panic!("no work frame")
}

fn scores(work: &serde_json::Value, p: f32) -> WorkOutput {
    let n = work["input"]["documents"].as_array().unwrap().len();
    WorkOutput::Scores(vec![
        Score {
            score: (p / (1.0 - p)).ln(),
            probability: Some(p),
        };
        n
    ])
}

#[test]
fn a_rerank_request_is_scored_by_the_scorer_of_its_first_lease_only() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect(&mut core, "a", provider("r", Role::Reranker, "ma", 2), 1);
    let shape = Shape::Rerank {
        query: "q".into(),
        instruction: None,
    };
    let docs: Vec<String> = (0..4).map(|i| format!("d{i}")).collect();
    let (_, mut reply) = core.submit(Role::Reranker, shape, docs).unwrap();
    let first = next_work(&mut a);
    // b has more credits, but the request is a's now.
    let (_, mut b) = connect(&mut core, "b", provider("r", Role::Reranker, "mb", 8), 4);
    assert!(matches!(b.try_recv(), Ok(Outgoing::Frame(f)) if f.contains("welcome")));
    assert!(b.try_recv().is_err(), "b got nothing of a's request");
    let lease = first["lease"].as_u64().unwrap();
    core.done(
        "a",
        sa,
        Done {
            lease,
            output: scores(&first, 0.7),
            latency_ms: f64::NAN,
            tokens: u64::MAX,
        },
    )
    .unwrap();
    core.pull("a", sa, "r", 1).unwrap();
    let second = next_work(&mut a);
    core.done(
        "a",
        sa,
        Done {
            lease: second["lease"].as_u64().unwrap(),
            output: scores(&second, 0.6),
            latency_ms: 1.0,
            tokens: u64::MAX,
        },
    )
    .unwrap();
    let done = reply.try_recv().unwrap().unwrap();
    let scorer = done.scorer.expect("the response names its scorer");
    assert_eq!(scorer.id, "local ma@r1 sigmoid");
    assert!(done.items.iter().all(|s| s.provider.agent == "a"));
    assert_eq!(done.tokens, u64::MAX, "token counts saturate, never wrap");
}

/// Answers every probe waiting on `rx` with unit vectors along `axis` (of width 2).
fn answer_probes(
    core: &mut Core,
    agent: &str,
    session: u64,
    rx: &mut mpsc::UnboundedReceiver<Outgoing>,
    axis: usize,
) -> Vec<serde_json::Value> {
    let mut others = Vec::new();
    while let Ok(out) = rx.try_recv() {
        let Outgoing::Frame(text) = out else { continue };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if v["type"] != "probe" {
            others.push(v);
            continue;
        }
        let n = v["texts"].as_array().unwrap().len();
        let mut unit = vec![0.0f32; 2];
        unit[axis] = 1.0;
        let result = crate::protocol::ProbeResult {
            probe: v["probe"].as_str().unwrap().into(),
            provider: v["provider"].as_str().unwrap().into(),
            vectors: Some(vec![unit; n]),
            error: None,
        };
        core.probe_result(agent, session, result).unwrap();
    }
    others
}

#[test]
fn a_request_whose_space_is_replaced_and_unserved_fails_with_space_changed() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect(&mut core, "a", provider("e", Role::Embedding, "ma", 8), 1);
    answer_probes(&mut core, "a", sa, &mut a, 0);
    assert_eq!(
        core.gate.current_id(Role::Embedding),
        Some("embedding:ma:2")
    );
    let shape = Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    let wide = Shape::Embed {
        dimensions: Some(3),
        is_query: false,
        instruction: None,
    };
    assert!(matches!(
        core.submit(Role::Embedding, wide, vec!["x".into()]),
        Err(SubmitError::DimensionsTooLarge { width: 2, .. })
    ));
    let (_, mut reply) = core
        .submit(Role::Embedding, shape, vec!["x".into(), "y".into()])
        .unwrap();
    // The reference leaves with the lease; another model founds the role's new space.
    core.disconnect("a", sa);
    let (sb, mut b) = connect(&mut core, "b", provider("e", Role::Embedding, "mb", 8), 1);
    let frames = answer_probes(&mut core, "b", sb, &mut b, 1);
    assert_eq!(
        core.gate.current_id(Role::Embedding),
        Some("embedding:mb:2")
    );
    assert!(
        frames.iter().all(|f| f["type"] != "work"),
        "b never serves the old space"
    );
    assert!(
        reply.try_recv().is_err(),
        "a may come back within the grace"
    );
    core.reconcile(Instant::now() + core.settings.vanish_grace);
    let Err(RequestFailure::Unservable(u)) = reply.try_recv().unwrap() else {
        panic!("the request fails");
    };
    assert_eq!(u.code, UnservableCode::SpaceChanged);
    assert!(
        u.message.contains("from embedding:ma:2 to embedding:mb:2"),
        "{}",
        u.message
    );
}

#[test]
fn two_equal_chats_are_two_leases() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let mut info = provider("chat", Role::RlmSandbox, "m", 8);
    info.dims = None;
    let (_, mut rx) = connect(&mut core, "a", info, 4);
    let body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
    for _ in 0..2 {
        let shape = Shape::Chat { body: body.clone() };
        core.submit(Role::RlmSandbox, shape, vec![String::new()])
            .unwrap();
    }
    let (one, two) = (next_work(&mut rx), next_work(&mut rx));
    assert_ne!(one["lease"], two["lease"]);
}

#[test]
fn an_embedding_role_with_no_possible_reference_is_refused_at_once() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let mut cloud = provider("cloud:embedding:1", Role::Embedding, "m", 64);
    cloud.backend = Backend::Cloud;
    cloud.upstream = Some("deepinfra/bf16".into());
    let (_, _rx) = connect(&mut core, "c", cloud, 8);
    let shape = Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    // Under aggregate the reference is a local provider: with none, no space can be founded.
    let Err(SubmitError::Unservable(u)) = core.submit(Role::Embedding, shape, vec!["x".into()])
    else {
        panic!("refused at once, not left waiting");
    };
    assert_eq!(u.code, UnservableCode::GateRefused);
    assert!(
        u.message.contains("its reference is a local provider"),
        "{}",
        u.message
    );
}

fn hello_as(agent: &str, instance: Option<&str>) -> Hello {
    Hello {
        agent_id: agent.into(),
        hostname: format!("host-of-{}", instance.unwrap_or("none")),
        version: "0".into(),
        protocol_version: PROTOCOL_VERSION,
        providers: vec![provider("e", Role::Embedding, "m", 8)],
        devices: Vec::new(),
        instance: instance.map(str::to_string),
    }
}

#[test]
fn another_instance_claiming_a_live_id_is_refused_and_the_same_one_supersedes() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (tx, _rx) = mpsc::unbounded_channel();
    let first = core.hello(hello_as("twin", Some("a")), tx).unwrap();
    let (tx, _rx2) = mpsc::unbounded_channel();
    let refused = core.hello(hello_as("twin", Some("b")), tx).unwrap_err();
    assert_eq!(refused.code, Some(ErrorCode::AgentIdInUse));
    assert!(
        refused.message.contains("host-of-a") && refused.message.contains("agent_id"),
        "{}",
        refused.message
    );
    assert_eq!(
        core.agents()["twin"].session,
        first,
        "the live one keeps its session"
    );
    // The same process reconnecting supersedes its old socket, as does one that names none.
    let (tx, _rx3) = mpsc::unbounded_channel();
    let again = core.hello(hello_as("twin", Some("a")), tx).unwrap();
    assert_ne!(again, first);
    // An old session silent past three heartbeats may be taken over by another process.
    core.agents.get_mut("twin").unwrap().last_seen =
        Instant::now() - core.settings.heartbeat_interval * 4;
    let (tx, _rx4) = mpsc::unbounded_channel();
    let taken = core.hello(hello_as("twin", Some("b")), tx).unwrap();
    assert_eq!(core.agents()["twin"].session, taken);
    let (tx, _rx5) = mpsc::unbounded_channel();
    core.hello(hello_as("twin", None), tx).unwrap();
}

#[test]
fn a_heartbeat_renews_its_own_sessions_leases_only() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect(
        &mut core,
        "a",
        provider("c", Role::CodeAssistant, "m", 1),
        1,
    );
    let (sb, _b) = connect(
        &mut core,
        "b",
        provider("c", Role::CodeAssistant, "m", 1),
        0,
    );
    let shape = Shape::Chat {
        body: serde_json::json!({"messages": []}),
    };
    let _accepted = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    let work = next_work(&mut a);
    let lease = work["lease"].as_u64().unwrap();
    assert_eq!(
        work["call_timeout_ms"],
        serde_json::json!(600_000),
        "the role's call timeout travels with the work"
    );
    let beat = |leases: Vec<u64>| protocol::Heartbeat {
        leases,
        ..Default::default()
    };
    core.heartbeat("b", sb, beat(vec![lease])).unwrap();
    assert_eq!(core.counters.leases_renewed, 0, "b does not hold it");
    core.heartbeat("a", sa, beat(vec![lease, 999])).unwrap();
    assert_eq!(core.counters.leases_renewed, 1);
    // Renewed now: it lives a whole lease from now, and only then expires.
    let length = core.settings.timings(Role::CodeAssistant).lease;
    core.expire(Instant::now() + length - Duration::from_secs(1));
    assert_eq!(core.counters.leases_expired, 0);
    core.expire(Instant::now() + length + Duration::from_secs(1));
    assert_eq!(core.counters.leases_expired, 1);
}

#[test]
fn requests_past_the_inputs_characters_frame_or_held_bytes_are_refused_at_admission() {
    let settings = HubSettings {
        limits: RequestLimits {
            max_held_bytes: 100,
            max_inputs: 3,
            max_input_chars: 40,
        },
        max_frame_bytes: 1024 + 2 + 60,
        ..HubSettings::default()
    };
    let mut core = Core::new(settings, CloudSettings::default());
    let (s, mut rx) = connect(
        &mut core,
        "a",
        provider("c", Role::CodeAssistant, "m", 1),
        0,
    );
    let chat = |body: serde_json::Value| Shape::Chat { body };
    let texts = |n: usize, len: usize| vec!["é".repeat(len / 2); n];
    let submit = |core: &mut Core, n: usize, len: usize| {
        core.submit(
            Role::CodeAssistant,
            chat(serde_json::json!({})),
            texts(n, len),
        )
    };
    assert!(matches!(
        submit(&mut core, 4, 2),
        Err(SubmitError::TooManyInputs { items: 4, limit: 3 })
    ));
    // 42 bytes but 21 characters: the limit counts characters.
    assert!(submit(&mut core, 1, 42).is_ok());
    assert!(matches!(
        core.submit(
            Role::CodeAssistant,
            chat(serde_json::json!({})),
            vec!["x".repeat(41)]
        ),
        Err(SubmitError::InputTooLong {
            index: 0,
            chars: 41,
            limit: 40
        })
    ));
    // Control characters escape to six bytes each: 12 of them do not fit a 60-byte item.
    let escaped = core.submit(
        Role::CodeAssistant,
        chat(serde_json::json!({})),
        vec!["ok".into(), "\u{1}".repeat(12)],
    );
    assert!(
        matches!(
            escaped,
            Err(SubmitError::InputTooLargeForFrame { index: 1, .. })
        ),
        "{escaped:?}"
    );
    // Held: 42 + 2 bytes (the empty body) so far; 60 more passes 100.
    assert_eq!(core.held_bytes(), 44);
    let full = submit(&mut core, 2, 30);
    assert!(
        matches!(full, Err(SubmitError::HeldBytesFull { held: 44, .. })),
        "{full:?}"
    );
    // The held request is answered: its bytes are free again.
    core.pull("a", s, "c", 1).unwrap();
    let work = next_work(&mut rx);
    core.done(
        "a",
        s,
        Done {
            lease: work["lease"].as_u64().unwrap(),
            output: WorkOutput::Chat(serde_json::json!({"choices": []})),
            latency_ms: 1.0,
            tokens: 1,
        },
    )
    .unwrap();
    assert_eq!(core.held_bytes(), 0);
    assert!(submit(&mut core, 2, 30).is_ok());
}

/// A core with one local embedder `a/e` that fingerprinted its space, and a document shape.
fn one_gated_embedder() -> (Core, u64, mpsc::UnboundedReceiver<Outgoing>, Shape) {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect(&mut core, "a", provider("e", Role::Embedding, "ma", 8), 1);
    answer_probes(&mut core, "a", sa, &mut a, 0);
    let shape = Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    (core, sa, a, shape)
}

/// Where the canary sits among an embedding work frame's texts.
fn canary_at(work: &serde_json::Value) -> usize {
    let probes = crate::hub::gate::measure::probe_texts();
    sent_texts(work)
        .iter()
        .position(|t| probes.contains(t))
        .expect("a canary in the frame")
}

/// The texts of an embedding work frame.
fn sent_texts(work: &serde_json::Value) -> Vec<String> {
    work["input"]["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_canary_rides_in_each_embedding_frame_and_never_in_the_answer_or_its_usage() {
    let (mut core, sa, mut a, shape) = one_gated_embedder();
    let texts: Vec<String> = (0..3).map(|i| format!("t{i}")).collect();
    let (_, mut reply) = core.submit(Role::Embedding, shape, texts.clone()).unwrap();
    let work = next_work(&mut a);
    let mut sent = sent_texts(&work);
    assert_eq!(sent.len(), 4, "three texts and a canary");
    let at = canary_at(&work);
    sent.remove(at);
    assert_eq!(sent, texts, "the clients' texts in order around it");
    let out = vec![vec![1.0f32, 0.0]; 4];
    core.done(
        "a",
        sa,
        Done {
            lease: work["lease"].as_u64().unwrap(),
            output: WorkOutput::Embeddings(out),
            latency_ms: 1.0,
            tokens: 400,
        },
    )
    .unwrap();
    let done = reply.try_recv().unwrap().unwrap();
    assert_eq!(done.items.len(), 3);
    let canary = core.counters.canary_tokens["a/e"];
    assert!(canary > 0 && canary < 400, "{canary}");
    // The rest is split evenly over the three items (whole tokens).
    let accounted = done.tokens + canary;
    assert!(
        (398..=400).contains(&accounted),
        "the canary's share is not the client's: {accounted}"
    );
    assert_eq!(core.counters.canary_texts["a/e"], 1);
}

#[test]
fn a_drifted_canary_suspends_its_provider_at_once_and_its_lease_serves_nothing() {
    let (mut core, sa, mut a, shape) = one_gated_embedder();
    let (_, mut reply) = core
        .submit(Role::Embedding, shape, vec!["x".into(), "y".into()])
        .unwrap();
    let work = next_work(&mut a);
    let at = canary_at(&work);
    // The clients' vectors look fine; the canary says the encoder changed.
    let mut out = vec![vec![1.0f32, 0.0]; 3];
    out[at] = vec![0.6, 0.8];
    core.done(
        "a",
        sa,
        Done {
            lease: work["lease"].as_u64().unwrap(),
            output: WorkOutput::Embeddings(out),
            latency_ms: 1.0,
            tokens: 30,
        },
    )
    .unwrap();
    // Nothing of that lease is returned: the only provider is suspended, so the request fails
    // at once with the reason (with another passing provider its items would go there).
    assert!(
        matches!(
            reply.try_recv(),
            Ok(Err(RequestFailure::Unservable(_))) | Err(_)
        ),
        "no vector of a drifted lease is returned"
    );
    assert_eq!(core.counters.canary_failures["a/e"], 1);
    let view = core.gate.view(&Default::default());
    let v = view.verdicts.iter().find(|v| v.provider == "a/e").unwrap();
    assert!(
        matches!(&v.verdict, crate::hub::gate::Verdict::Suspended { reason } if reason.contains("0.6000")),
        "{:?}",
        v.verdict
    );
    assert_eq!(v.caught_by, Some("canary"));
}

#[test]
fn a_lease_that_carried_a_canary_and_came_back_one_short_is_refused() {
    let (mut core, sa, mut a, shape) = one_gated_embedder();
    let (_, mut reply) = core
        .submit(Role::Embedding, shape, vec!["x".into(), "y".into()])
        .unwrap();
    let work = next_work(&mut a);
    assert_eq!(sent_texts(&work).len(), 3);
    // Two vectors for three texts sent: the check must not be skipped.
    let err = core
        .done(
            "a",
            sa,
            Done {
                lease: work["lease"].as_u64().unwrap(),
                output: WorkOutput::Embeddings(vec![vec![1.0, 0.0]; 2]),
                latency_ms: 1.0,
                tokens: 10,
            },
        )
        .unwrap_err();
    assert!(err.contains("3 texts sent"), "{err}");
    assert!(reply.try_recv().is_err(), "nothing delivered");
    assert_eq!(core.queue_depth(Role::Embedding), 2, "requeued");
}
