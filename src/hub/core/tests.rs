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
        attention: None,
    }
}

/// An agent with one provider and credits; its frames arrive on the receiver (a local
/// reranker's scorer-check probe answered alike for every provider).
fn connect(
    core: &mut Core,
    agent: &str,
    info: ProviderInfo,
    credits: u32,
) -> (u64, mpsc::UnboundedReceiver<Outgoing>) {
    connect_with(core, agent, info, credits, true)
}

fn connect_with(
    core: &mut Core,
    agent: &str,
    info: ProviderInfo,
    credits: u32,
    answer_scorer_probe: bool,
) -> (u64, mpsc::UnboundedReceiver<Outgoing>) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let pid = info.id.clone();
    let reranks =
        answer_scorer_probe && info.role == Role::Reranker && info.backend == Backend::Local;
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
                // It holds the hub's config (the key and routes of the last push).
                config: crate::protocol::HeldConfig {
                    config_revision: Some(core.config_revision().revision),
                    key_generation: core.config_revision().key_generation.clone(),
                },
                suspensions: Vec::new(),
                answering: Vec::new(),
                keeps_answers: false,
            },
            tx,
        )
        .unwrap();
    // A local reranker is checked on the probe pairs before it serves.
    if reranks {
        answer_probes(core, agent, session, &mut rx, 0);
    }
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
    // Its welcome went with the probe pairs' answer: nothing is left for it.
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
            cost_usd: None,
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
            cost_usd: None,
        },
    )
    .unwrap();
    let done = reply.try_recv().unwrap().unwrap();
    let scorer = done.scorer.expect("the response names its scorer");
    assert_eq!(scorer.id, "local ma@r1 sigmoid");
    assert!(done.items.iter().all(|s| s.provider.agent == "a"));
    // Each frame's count is bounded per item where it enters (two items each): never wraps.
    assert_eq!(
        done.tokens,
        4 * crate::hub::measured::MAX_TOKENS_PER_ITEM,
        "token counts are bounded, never wrap"
    );
}

/// Every frame of type `kind` waiting on `rx`, as JSON; the others are dropped.
fn frames_of(rx: &mut mpsc::UnboundedReceiver<Outgoing>, kind: &str) -> Vec<serde_json::Value> {
    let mut frames = Vec::new();
    while let Ok(out) = rx.try_recv() {
        if let Outgoing::Frame(text) = out {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            if v["type"] == kind {
                frames.push(v);
            }
        }
    }
    frames
}

/// The ids of the gate's probes waiting on `rx`.
fn probe_ids(rx: &mut mpsc::UnboundedReceiver<Outgoing>) -> Vec<String> {
    frames_of(rx, "probe")
        .iter()
        .map(|v| v["probe"].as_str().unwrap().to_string())
        .collect()
}

/// Answers a rerank work frame with scores of probability `p`.
fn done_scoring(core: &mut Core, agent: &str, session: u64, work: &serde_json::Value, p: f32) {
    let done = Done {
        lease: work["lease"].as_u64().unwrap(),
        output: scores(work, p),
        latency_ms: 1.0,
        tokens: 1,
        cost_usd: None,
    };
    core.done(agent, session, done).unwrap();
}

/// A cloud embedder's answer to `probe`: an upstream error.
fn probe_failed(probe: &str) -> crate::protocol::ProbeResult {
    crate::protocol::ProbeResult {
        probe: probe.into(),
        provider: "cloud:embedding:1".into(),
        vectors: None,
        scores: None,
        error: Some("upstream 502".into()),
        defect: None,
    }
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
        // A reranker's probe pairs: the same scores from every provider (one scorer).
        let scores = v["query"].is_string().then(|| {
            (0..n)
                .map(|i| crate::protocol::Score {
                    score: -(i as f32),
                    probability: Some(1.0 / (1.0 + i as f32)),
                })
                .collect()
        });
        let result = crate::protocol::ProbeResult {
            probe: v["probe"].as_str().unwrap().into(),
            provider: v["provider"].as_str().unwrap().into(),
            vectors: scores.is_none().then(|| vec![unit; n]),
            scores,
            error: None,
            defect: None,
        };
        core.probe_result(agent, session, result).unwrap();
    }
    others
}

#[test]
fn losing_the_reference_host_never_makes_another_model_the_roles_space() {
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
    // The reference leaves with the lease; a host of another model is judged against the
    // role's space, refused, and never promoted.
    core.disconnect("a", sa);
    let (sb, mut b) = connect(&mut core, "b", provider("e", Role::Embedding, "mb", 8), 1);
    let frames = answer_probes(&mut core, "b", sb, &mut b, 1);
    assert_eq!(
        core.gate.current_id(Role::Embedding),
        Some("embedding:ma:2"),
        "the space is the operator's, not whoever is connected"
    );
    assert!(core.gate.space("embedding:mb:2").is_none(), "no new space");
    assert!(
        frames.iter().all(|f| f["type"] != "work"),
        "b never serves the role's space"
    );
    assert!(
        reply.try_recv().is_err(),
        "a may come back within the grace"
    );
    core.reconcile(Instant::now() + core.settings.vanish_grace);
    let Err(RequestFailure::Unservable(u)) = reply.try_recv().unwrap() else {
        panic!("the request fails");
    };
    assert_eq!(u.code, UnservableCode::GateRefused);
    for said in ["embedding:ma:2", "refused", "migration"] {
        assert!(u.message.contains(said), "{said}: {}", u.message);
    }
    // A new request is refused, naming the space and the way to another encoder (it would
    // wait out the grace a departed provider has to come back, then hear the same).
    let shape = Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    let Err(SubmitError::Unservable(u) | SubmitError::NotYet(u)) =
        core.submit(Role::Embedding, shape, vec!["x".into()])
    else {
        panic!("refused");
    };
    assert_eq!(u.code, UnservableCode::GateRefused, "{}", u.message);
    assert!(
        u.message.contains("POST /admin/migrations"),
        "{}",
        u.message
    );
}

/// Serves the next work frame on `rx` with unit vectors along `axis`; the lease's texts.
fn serve_embeddings(
    core: &mut Core,
    agent: &str,
    session: u64,
    rx: &mut mpsc::UnboundedReceiver<Outgoing>,
    axis: usize,
) -> usize {
    let work = next_work(rx);
    let n = sent_texts(&work).len();
    let mut unit = vec![0.0f32; 2];
    unit[axis] = 1.0;
    core.done(
        agent,
        session,
        Done {
            lease: work["lease"].as_u64().unwrap(),
            output: WorkOutput::Embeddings(vec![unit; n]),
            latency_ms: 1.0,
            tokens: n as u64,
            cost_usd: None,
        },
    )
    .unwrap();
    core.pull(agent, session, "e", 1).unwrap();
    n
}

#[test]
fn a_migration_serves_pinned_requests_in_the_next_space_and_a_cutover_swaps_them() {
    use crate::hub::gate::{Founder, SpacePin, Step};
    let e = Role::Embedding;
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect(&mut core, "a", provider("e", e, "ma", 8), 1);
    answer_probes(&mut core, "a", sa, &mut a, 0);
    let (sb, mut b) = connect(&mut core, "b", provider("e", e, "mb", 8), 1);
    answer_probes(&mut core, "b", sb, &mut b, 1);
    let open = Step::Open {
        founder: Founder::Local {
            model: "mb".into(),
            dims: None,
        },
        policy: Policy::Local,
    };
    let now = core.role_now(e);
    core.gate.migrated(e, &open, &now).unwrap();
    core.gate_tick(Instant::now());
    // b fingerprints the next space; a is judged against it (and refused).
    answer_probes(&mut core, "b", sb, &mut b, 1);
    answer_probes(&mut core, "a", sa, &mut a, 0);
    core.gate_tick(Instant::now());
    answer_probes(&mut core, "b", sb, &mut b, 1);
    answer_probes(&mut core, "a", sa, &mut a, 0);
    assert_eq!(core.passing_next(e), ["b/e"]);
    let shape = || Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    let pin = |id: &str| SpacePin::parse(id).unwrap();
    let ask = |core: &mut Core, pinned: Option<SpacePin>| {
        let binding = core.admit_in(e, &shape(), pinned.as_ref())?;
        core.enqueue(
            Caller::default_project(crate::protocol::WorkClass::Batch),
            e,
            binding,
            shape(),
            vec!["t".into()],
            Origin::default(),
        )
    };
    let space_of = |reply: &mut oneshot::Receiver<Result<Completed, RequestFailure>>| {
        let done = reply.try_recv().unwrap().unwrap();
        done.items[0].space.as_ref().unwrap().id.clone()
    };
    // Unpinned: the current space, served by a; pinned to next: b.
    let (_, mut r) = ask(&mut core, None).unwrap();
    serve_embeddings(&mut core, "a", sa, &mut a, 0);
    assert_eq!(space_of(&mut r), "embedding:ma:2");
    let (_, mut r) = ask(&mut core, Some(pin("embedding:mb:2"))).unwrap();
    serve_embeddings(&mut core, "b", sb, &mut b, 1);
    assert_eq!(space_of(&mut r), "embedding:mb:2");
    // A pin to a space the role does not serve, or to a retired generation: 409 at once.
    for bad in ["embedding:mc:2", "embedding:ma:3", "embedding:ma:2@1"] {
        let Err(SubmitError::Unservable(u)) = ask(&mut core, Some(pin(bad))) else {
            panic!("{bad} is refused");
        };
        assert_eq!(u.code, UnservableCode::SpaceNotServed, "{bad}");
    }
    let Err(SubmitError::Unservable(u)) = ask(&mut core, Some(pin("embedding:mc:2"))) else {
        unreachable!()
    };
    assert!(
        u.message
            .contains("current embedding:ma:2, next embedding:mb:2"),
        "{}",
        u.message
    );
    assert!(matches!(
        core.admit_in(Role::Reranker, &shape(), Some(&pin("embedding:ma:2"))),
        Err(SubmitError::PinNotEmbedding(Role::Reranker))
    ));
    // Cutover: next is current, the old space previous (still served when pinned).
    let now = core.role_now(e);
    let applied = core.gate.migrated(e, &Step::Cutover, &now).unwrap();
    assert!(applied.cut.is_some());
    let (_, mut r) = ask(&mut core, None).unwrap();
    serve_embeddings(&mut core, "b", sb, &mut b, 1);
    assert_eq!(space_of(&mut r), "embedding:mb:2");
    let (_, mut r) = ask(&mut core, Some(pin("embedding:ma:2"))).unwrap();
    serve_embeddings(&mut core, "a", sa, &mut a, 0);
    assert_eq!(space_of(&mut r), "embedding:ma:2");
    // Progress per space and project.
    let view = core.migration_view(e).unwrap();
    assert_eq!(view.current.id.as_deref(), Some("embedding:mb:2"));
    assert_eq!(view.current.rows_by_project["default"], 2);
    assert_eq!(view.previous.as_ref().unwrap().rows_by_provider["a/e"], 2);
    // Close: the previous space is no longer served.
    let now = core.role_now(e);
    core.gate.migrated(e, &Step::Close, &now).unwrap();
    let Err(SubmitError::Unservable(u)) = ask(&mut core, Some(pin("embedding:ma:2"))) else {
        panic!("closed");
    };
    assert_eq!(u.code, UnservableCode::SpaceNotServed);
}

#[test]
fn two_equal_chats_are_two_leases() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let mut info = provider("chat", Role::RlmSandbox, "m", 8);
    info.dims = None;
    let (_, mut rx) = connect(&mut core, "a", info, 4);
    let body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
    for _ in 0..2 {
        let shape = Shape::Chat {
            body: body.clone(),
            idempotency: None,
        };
        core.submit(Role::RlmSandbox, shape, vec![String::new()])
            .unwrap();
    }
    let (one, two) = (next_work(&mut rx), next_work(&mut rx));
    assert_ne!(one["lease"], two["lease"]);
}

/// The cloud embedding route of the tests: `m`, pinned to `deepinfra/bf16`, two wide.
fn cloud_embedding_route() -> crate::config::push::AllowedModel {
    crate::config::push::AllowedModel {
        model: "m".into(),
        provider: Some("deepinfra/bf16".into()),
        dims: Some(2),
        quantization: None,
        note: None,
    }
}

/// A core holding a cloud embedding route (`m`, pinned to `deepinfra/bf16`, two wide) under
/// `policy`, with key generation `kg-1`.
fn cloud_embedding_core(policy: Policy) -> Core {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let route = cloud_embedding_route();
    core.set_config(
        CloudSettings {
            allowed_models: [(Role::Embedding, route)].into(),
            policies: [(Role::Embedding, policy)].into(),
            ..Default::default()
        },
        ConfigRevision {
            revision: 1,
            key_generation: Some("kg-1".into()),
        },
    );
    core
}

/// The cloud embedder an agent announces for [`cloud_embedding_core`]'s route.
fn cloud_embedder() -> ProviderInfo {
    let mut info = provider("cloud:embedding:1", Role::Embedding, "m", 64);
    info.backend = Backend::Cloud;
    info.upstream = Some("deepinfra/bf16".into());
    info
}

#[test]
fn an_embedding_role_with_no_possible_reference_is_refused_at_once() {
    let mut core = cloud_embedding_core(Policy::Aggregate);
    let (_, _rx) = connect(&mut core, "c", cloud_embedder(), 8);
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
        config: Default::default(),
        suspensions: Vec::new(),
        answering: Vec::new(),
        keeps_answers: false,
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
        idempotency: None,
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
    let chat = |body: serde_json::Value| Shape::Chat {
        body,
        idempotency: None,
    };
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
            cost_usd: None,
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
            cost_usd: None,
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
            cost_usd: None,
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
    // The suspension is an event in time, with its reason.
    let events: Vec<_> = core.gate.events().iter().collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = events[0];
    assert_eq!(e.kind, crate::hub::events::EventKind::Suspended);
    assert_eq!(e.subject, "a/e");
    assert!(
        e.detail.contains("caught by canary") && e.detail.contains("0.6000"),
        "{e:?}"
    );
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
                cost_usd: None,
            },
        )
        .unwrap_err();
    assert!(err.contains("3 texts sent"), "{err}");
    assert!(reply.try_recv().is_err(), "nothing delivered");
    assert_eq!(core.queue_depth(Role::Embedding), 2, "requeued");
}

/// A cloud reranker route, as a push maps it and an agent announces it.
fn cloud_reranker(model: &str) -> (crate::config::push::AllowedModel, ProviderInfo) {
    let allowed = crate::config::push::AllowedModel {
        model: model.into(),
        provider: None,
        dims: None,
        quantization: None,
        note: None,
    };
    let mut info = provider(&format!("cloud:reranker:{model}"), Role::Reranker, model, 8);
    info.backend = Backend::Cloud;
    info.revision = None;
    (allowed, info)
}

fn rerank_shape() -> Shape {
    Shape::Rerank {
        query: "q".into(),
        instruction: None,
    }
}

#[test]
fn a_stale_agent_serves_nothing_is_sent_the_config_and_its_old_key_stops_nothing() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (old_route, old_info) = cloud_reranker("old-model");
    let (new_route, new_info) = cloud_reranker("new-model");
    let settings = |route| CloudSettings {
        allowed_models: [(Role::Reranker, route)].into(),
        policies: [(Role::Reranker, Policy::Cloud)].into(),
        ..Default::default()
    };
    core.set_config(
        settings(old_route),
        ConfigRevision {
            revision: 1,
            key_generation: Some("kg-old".into()),
        },
    );
    // The stale agent holds revision 1 and the old key; its lease is out when the push lands.
    let (s_stale, mut stale) = connect(&mut core, "stale", old_info.clone(), 4);
    let (_, mut reply) = core
        .submit(Role::Reranker, rerank_shape(), vec!["d".into()])
        .unwrap();
    let old_lease = next_work(&mut stale)["lease"].as_u64().unwrap();
    core.set_config(
        settings(new_route),
        ConfigRevision {
            revision: 2,
            key_generation: Some("kg-new".into()),
        },
    );
    let (_, mut fresh) = connect(&mut core, "fresh", new_info, 4);
    // The old key's refusal comes back: it stops nothing current.
    core.failed(
        "stale",
        s_stale,
        crate::protocol::Failed {
            lease: old_lease,
            class: crate::protocol::FailureClass::Refused,
            retry_after_ms: None,
            limit: None,
            refusal: Some(crate::protocol::Refusal::KeyRejected),
            defect: None,
            message: "401 from the old key".into(),
        },
    )
    .unwrap();
    assert!(
        core.budget.key_rejected().is_none(),
        "the current key is not stopped"
    );
    let work = next_work(&mut fresh);
    assert_eq!(work["provider"], "cloud:reranker:new-model");
    // The stale agent's heartbeat says what it holds: it is sent the whole config (no key),
    // once, and gets no work.
    core.heartbeat(
        "stale",
        s_stale,
        crate::protocol::Heartbeat {
            config: crate::protocol::HeldConfig {
                config_revision: Some(1),
                key_generation: Some("kg-old".into()),
            },
            ..Default::default()
        },
    )
    .unwrap();
    core.heartbeat("stale", s_stale, Default::default())
        .unwrap();
    let mut configs = Vec::new();
    while let Ok(Outgoing::Frame(text)) = stale.try_recv() {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_ne!(v["type"], "work", "the stale agent serves nothing: {v}");
        if v["type"] == "config" {
            configs.push(v);
        }
    }
    assert_eq!(configs.len(), 1, "sent once per revision");
    let config = &configs[0];
    assert_eq!(config["revision"], 2);
    assert_eq!(config["key_generation"], "kg-new");
    assert!(config["payload"]["openrouter"].get("apiKey").is_none());
    assert_eq!(
        config["payload"]["openrouter"]["allowedModels"]["reranker"]["model"],
        "new-model"
    );
    assert_eq!(core.agents_needing_key(), vec!["stale".to_string()]);
    let stale_provider = &core.agents()["stale"].providers["cloud:reranker:old-model"];
    assert!(stale_provider.stale.is_some());
    core.done(
        "fresh",
        core.agents()["fresh"].session,
        Done {
            lease: work["lease"].as_u64().unwrap(),
            output: scores(&work, 0.7),
            latency_ms: 1.0,
            tokens: 1,
            cost_usd: None,
        },
    )
    .unwrap();
    let done = reply.try_recv().unwrap().unwrap();
    assert_eq!(done.items[0].provider.agent, "fresh");
}

#[test]
fn a_limit_or_refusal_on_a_local_lease_counts_its_attempt_and_fails_at_the_cap() {
    // No bench (two failures in a row would bench the only provider): the attempts decide.
    let settings = HubSettings {
        bench: std::time::Duration::ZERO,
        ..HubSettings::default()
    };
    let mut core = Core::new(settings, CloudSettings::default());
    let (sa, mut a) = connect(&mut core, "a", provider("r", Role::Reranker, "m", 8), 64);
    let (_, mut reply) = core
        .submit(Role::Reranker, rerank_shape(), vec!["d".into()])
        .unwrap();
    let cap = core.settings.max_attempts;
    for attempt in 0..cap {
        let work = next_work(&mut a);
        core.failed(
            "a",
            sa,
            crate::protocol::Failed {
                lease: work["lease"].as_u64().unwrap(),
                class: crate::protocol::FailureClass::RateLimited,
                retry_after_ms: Some(1),
                limit: (attempt % 2 == 0).then_some(crate::protocol::LimitKind::Platform),
                refusal: (attempt % 2 == 1).then_some(crate::protocol::Refusal::KeyRejected),
                defect: None,
                message: "a faulty local agent says limit".into(),
            },
        )
        .unwrap();
    }
    let Err(RequestFailure::TooManyAttempts { attempts, last }) = reply.try_recv().unwrap() else {
        panic!("fails at the attempt cap");
    };
    assert_eq!(attempts, cap);
    assert!(last.contains("says limit"), "{last}");
    assert!(
        core.budget.key_rejected().is_none(),
        "a local lease never stops the cloud"
    );
}

#[test]
fn a_request_of_a_retired_generation_never_completes_with_the_new_one() {
    let (mut core, sa, mut a, shape) = one_gated_embedder();
    let first = core.gate.generation("embedding:ma:2").unwrap();
    let (_, mut reply) = core
        .submit(Role::Embedding, shape, vec!["x".into(), "y".into()])
        .unwrap();
    let work = next_work(&mut a);
    // The space is retired and its reference fingerprints it again (a new stack).
    assert!(core.gate.retire("embedding:ma:2"));
    core.gate_tick(Instant::now());
    answer_probes(&mut core, "a", sa, &mut a, 1);
    let second = core.gate.generation("embedding:ma:2").unwrap();
    assert!(second > first, "{second} after {first}");
    // The old lease's vectors come back: not one is delivered as the new generation.
    core.done(
        "a",
        sa,
        Done {
            lease: work["lease"].as_u64().unwrap(),
            output: WorkOutput::Embeddings(vec![vec![1.0, 0.0]; 3]),
            latency_ms: 1.0,
            tokens: 3,
            cost_usd: None,
        },
    )
    .unwrap();
    let Err(RequestFailure::Unservable(u)) = reply.try_recv().unwrap() else {
        panic!("the request of the retired generation fails");
    };
    assert_eq!(u.code, UnservableCode::SpaceChanged);
    // A new request is served, and says its generation.
    let shape = Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    let (_, mut again) = core
        .submit(Role::Embedding, shape, vec!["x".into()])
        .unwrap();
    core.pull("a", sa, "e", 1).unwrap();
    let work = next_work(&mut a);
    let n = sent_texts(&work).len();
    core.done(
        "a",
        sa,
        Done {
            lease: work["lease"].as_u64().unwrap(),
            output: WorkOutput::Embeddings(vec![vec![0.0, 1.0]; n]),
            latency_ms: 1.0,
            tokens: 3,
            cost_usd: None,
        },
    )
    .unwrap();
    let done = again.try_recv().unwrap().unwrap();
    assert_eq!(done.items[0].space.as_ref().unwrap().generation, second);
}

#[test]
fn a_reference_that_leaves_mid_fingerprint_hands_the_space_to_the_next_at_once() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, _a) = connect(&mut core, "a", provider("e", Role::Embedding, "m", 8), 1);
    let (sb, mut b) = connect(&mut core, "b", provider("e", Role::Embedding, "m", 8), 1);
    assert!(
        core.gate.founding(Role::Embedding),
        "a's fingerprint probe is out"
    );
    while let Ok(Outgoing::Frame(text)) = b.try_recv() {
        assert!(
            !text.contains("\"probe\""),
            "b is not asked while a fingerprints"
        );
    }
    core.disconnect("a", sa);
    // b is asked now, not after the probe timeout.
    answer_probes(&mut core, "b", sb, &mut b, 0);
    assert_eq!(core.gate.current_id(Role::Embedding), Some("embedding:m:2"));
}

/// A hub whose config (revision `revision`, key generation `kg`) routes the reranker role to
/// the cloud reranker "m"; the provider an agent announces for it.
fn cloud_reranker_configured(core: &mut Core, revision: u64, kg: &str) -> ProviderInfo {
    let (route, info) = cloud_reranker("m");
    core.set_config(
        CloudSettings {
            allowed_models: [(Role::Reranker, route)].into(),
            policies: [(Role::Reranker, Policy::Cloud)].into(),
            ..Default::default()
        },
        ConfigRevision {
            revision,
            key_generation: Some(kg.into()),
        },
    );
    info
}

#[test]
fn a_stale_route_waits_for_its_config_only_until_the_agent_answers() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let info = cloud_reranker_configured(&mut core, 3, "kg-3");
    // An agent of an older build: it says nothing of what it holds.
    let (tx, _rx) = mpsc::unbounded_channel();
    let hello = Hello {
        providers: vec![info],
        ..hello_as("old", None)
    };
    let session = core.hello(hello, tx).unwrap();
    // The config is on its way to it: a request may wait for the answer.
    let soon = core.admit(Role::Reranker, &rerank_shape());
    assert!(matches!(soon, Err(SubmitError::NotYet(_))), "{soon:?}");
    // It answers without taking the revision: nothing is on its way any more.
    let ack = crate::protocol::ConfigAck {
        id: "cfg-sync-3".into(),
        applied: true,
        reason: None,
        roles: Default::default(),
        config: Default::default(),
    };
    core.config_ack("old", session, ack).unwrap();
    let Err(SubmitError::Unservable(u)) = core.admit(Role::Reranker, &rerank_shape()) else {
        panic!("refused at once, not left waiting");
    };
    assert_eq!(u.code, UnservableCode::ConfigStale, "{}", u.message);
}

#[test]
fn a_request_right_after_a_push_waits_for_the_cloud_providers_the_config_builds() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    // An agent with no provider yet (a cloud-only host before its first push).
    let (tx, _rx) = mpsc::unbounded_channel();
    let hello = Hello {
        providers: Vec::new(),
        ..hello_as("cloud", None)
    };
    let session = core.hello(hello, tx).unwrap();
    let admitted = core.admit(Role::Reranker, &rerank_shape());
    assert!(
        matches!(admitted, Err(SubmitError::Unservable(_))),
        "nothing pushed, nothing on its way: refused at once: {admitted:?}"
    );
    // A push routes the role to the cloud: the config is on its way to the agent, which will
    // build the provider from it; a request now waits rather than fail `no_provider`.
    let info = cloud_reranker_configured(&mut core, 3, "kg-3");
    assert_eq!(core.broadcast_config("cfg-3", None), ["cloud"]);
    let soon = core.admit(Role::Reranker, &rerank_shape());
    assert!(matches!(soon, Err(SubmitError::NotYet(_))), "{soon:?}");
    // The agent announces the provider, then acknowledges the config: it serves.
    core.set_providers("cloud", session, vec![info]).unwrap();
    let ack = crate::protocol::ConfigAck {
        id: "cfg-3".into(),
        applied: true,
        reason: None,
        roles: Default::default(),
        config: crate::protocol::HeldConfig {
            config_revision: Some(3),
            key_generation: Some("kg-3".into()),
        },
    };
    core.config_ack("cloud", session, ack).unwrap();
    assert!(core.admit(Role::Reranker, &rerank_shape()).is_ok());
}

/// The scorer-check probe waiting on `rx`: its id.
fn scorer_probe(rx: &mut mpsc::UnboundedReceiver<Outgoing>) -> String {
    while let Ok(out) = rx.try_recv() {
        if let Outgoing::Frame(text) = out {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            if v["type"] == "probe" && v["query"].is_string() {
                return v["probe"].as_str().unwrap().to_string();
            }
        }
    }
    panic!("no scorer probe")
}

#[test]
fn a_reranker_that_fails_its_scorer_check_is_refused_at_once_with_the_reason() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect_with(
        &mut core,
        "a",
        provider("r", Role::Reranker, "m", 8),
        4,
        false,
    );
    let probe = scorer_probe(&mut a);
    let err = core.submit(Role::Reranker, rerank_shape(), vec!["d".into()]);
    assert!(
        matches!(&err, Err(SubmitError::NotYet(u)) if u.code == UnservableCode::Probing),
        "being checked: wait ({err:?})"
    );
    let failed = crate::protocol::ProbeResult {
        probe,
        provider: "r".into(),
        vectors: None,
        scores: None,
        error: Some("the server is out of memory".into()),
        defect: None,
    };
    core.probe_result("a", sa, failed).unwrap();
    match core.submit(Role::Reranker, rerank_shape(), vec!["d".into()]) {
        Err(SubmitError::Unservable(u)) => {
            assert_eq!(u.code, UnservableCode::Benched);
            assert!(u.message.contains("out of memory"), "{}", u.message);
            assert!(u.retry_after_s.is_some());
        }
        other => panic!("a failed check is no reason to wait: {other:?}"),
    }
}

#[test]
fn a_request_whose_scorer_leaves_waits_for_a_reranker_being_checked_rather_than_failing() {
    let settings = HubSettings {
        vanish_grace: std::time::Duration::ZERO,
        ..HubSettings::default()
    };
    let mut core = Core::new(settings, CloudSettings::default());
    let (sa, mut a) = connect(&mut core, "a", provider("r", Role::Reranker, "ma", 1), 1);
    let docs: Vec<String> = (0..2).map(|i| format!("d{i}")).collect();
    let (_, mut reply) = core.submit(Role::Reranker, rerank_shape(), docs).unwrap();
    next_work(&mut a);
    // Another scorer arrives, not checked yet; then the request's scorer leaves.
    let (sb, mut b) = connect_with(
        &mut core,
        "b",
        provider("r", Role::Reranker, "mb", 8),
        4,
        false,
    );
    let probe = scorer_probe(&mut b);
    core.disconnect("a", sa);
    assert!(
        reply.try_recv().is_err(),
        "not failed: it waits for b's check"
    );
    let checked = crate::protocol::ProbeResult {
        probe,
        provider: "r".into(),
        vectors: None,
        scores: Some(vec![
            Score {
                score: 0.0,
                probability: Some(0.5),
            };
            crate::hub::scorer_check::PROBE_DOCUMENTS.len()
        ]),
        error: None,
        defect: None,
    };
    core.probe_result("b", sb, checked).unwrap();
    // The request, whole, in b's frames (one per credit it took).
    let frames = frames_of(&mut b, "work");
    assert!(!frames.is_empty(), "b took the request once checked");
    for work in frames {
        done_scoring(&mut core, "b", sb, &work, 0.6);
    }
    let done = reply.try_recv().unwrap().unwrap();
    assert!(done.items.iter().all(|s| s.provider.agent == "b"));
    assert!(done.scorer.unwrap().id.contains("mb"));
}

#[test]
fn a_probe_to_a_cloud_embedder_holds_a_budget_permit_and_waits_for_one() {
    use crate::hub::budget::Outcome;
    let mut core = cloud_embedding_core(Policy::Cloud);
    let now = Instant::now();
    core.budget.set_override(Some(1), now);
    // The one permit is held by other work when the cloud embedder arrives.
    let budget_route = "embedding:m@deepinfra/bf16";
    assert!(core.budget.try_acquire(budget_route, now));
    let (session, mut rx) = connect(&mut core, "c", cloud_embedder(), 8);
    let entry = &core.agents()["c"].providers["cloud:embedding:1"];
    assert_eq!(entry.route.as_deref(), Some(budget_route));
    core.gate_tick(Instant::now());
    assert!(
        probe_ids(&mut rx).is_empty(),
        "no permit free: the probe waits"
    );
    assert_eq!(core.budget.in_flight(), 1);
    // The permit comes back: the next round sends the probe, holding it.
    core.budget
        .release(budget_route, Outcome::Other, Instant::now());
    core.gate_tick(Instant::now());
    let sent = probe_ids(&mut rx);
    assert_eq!(sent.len(), 1, "the probe goes out once a permit is free");
    assert_eq!(core.budget.in_flight(), 1, "the probe holds the permit");
    assert_eq!(core.probe_permits.held(), 1);
    core.gate_tick(Instant::now());
    assert!(
        probe_ids(&mut rx).is_empty(),
        "one probe, not one per round"
    );
    // Answered (an upstream error here): the permit comes back with the answer.
    core.probe_result("c", session, probe_failed(&sent[0]))
        .unwrap();
    assert_eq!(
        core.budget.in_flight(),
        0,
        "an answered probe returns its permit"
    );
    // Another agent with the route is asked next. While its fingerprint waits for a permit,
    // a client is told the space is being founded (not refused for the first one's failure).
    assert!(core.budget.try_acquire(budget_route, Instant::now()));
    let (s_other, mut rx_other) = connect(&mut core, "d", cloud_embedder(), 8);
    assert!(probe_ids(&mut rx_other).is_empty());
    let shape = Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    match core.admit(Role::Embedding, &shape) {
        Err(SubmitError::NotYet(u)) => assert_eq!(u.code, UnservableCode::Probing),
        other => panic!("told to wait, not {other:?}"),
    }
    core.budget
        .release(budget_route, Outcome::Other, Instant::now());
    core.gate_tick(Instant::now());
    // It leaves before answering: the permit is returned with its probe.
    assert_eq!(probe_ids(&mut rx_other).len(), 1);
    assert_eq!(core.budget.in_flight(), 1, "the probe holds the permit");
    core.disconnect("d", s_other);
    assert_eq!(
        core.budget.in_flight(),
        0,
        "a probe that ends returns its permit"
    );
}

#[test]
fn a_probe_waiting_on_a_full_budget_gets_the_next_permit_before_work_does() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let embedding = cloud_embedding_route();
    let (rerank_route, rerank_info) = cloud_reranker("rm");
    core.set_config(
        CloudSettings {
            allowed_models: [(Role::Embedding, embedding), (Role::Reranker, rerank_route)].into(),
            policies: [
                (Role::Embedding, Policy::Cloud),
                (Role::Reranker, Policy::Cloud),
            ]
            .into(),
            ..Default::default()
        },
        ConfigRevision {
            revision: 1,
            key_generation: Some("kg-1".into()),
        },
    );
    core.budget.set_override(Some(1), Instant::now());
    // Cloud rerank work holds the one permit.
    let (s_rerank, mut reranker) = connect(&mut core, "r", rerank_info, 4);
    let (_, mut first) = core
        .submit(Role::Reranker, rerank_shape(), vec!["d".into()])
        .unwrap();
    let work = next_work(&mut reranker);
    // The cloud embedder's probe finds the budget full and claims its next permit.
    let (s_embed, mut embedder) = connect(&mut core, "c", cloud_embedder(), 8);
    assert!(probe_ids(&mut embedder).is_empty());
    assert!(core.probe_permits.claims("reranker:rm", Instant::now()));
    let (_, mut second) = core
        .submit(Role::Reranker, rerank_shape(), vec!["e".into()])
        .unwrap();
    // The rerank lease ends: its permit is left to the probe, not granted to the next request.
    done_scoring(&mut core, "r", s_rerank, &work, 0.7);
    assert!(first.try_recv().unwrap().is_ok());
    // The agent pulls again, as it does after each result.
    core.pull("r", s_rerank, "cloud:reranker:rm", 1).unwrap();
    assert!(
        reranker.try_recv().is_err(),
        "no work while a probe claims the permit"
    );
    assert_eq!(core.budget.in_flight(), 0);
    // The gate's next round sends the probe on it.
    core.gate_tick(Instant::now());
    let sent = probe_ids(&mut embedder);
    assert_eq!(sent.len(), 1, "the probe goes out on the freed permit");
    assert_eq!(core.budget.in_flight(), 1);
    // Answered: the permit goes to the waiting rerank request.
    core.probe_result("c", s_embed, probe_failed(&sent[0]))
        .unwrap();
    let work = next_work(&mut reranker);
    assert_eq!(work["input"]["documents"][0], "e");
    assert!(second.try_recv().is_err(), "served, not yet answered");
    assert_eq!(core.budget.in_flight(), 1, "the rerank lease holds it now");
}

/// An agent that keeps keyed chats' answers (`hello.keeps_answers`), reporting `answering`.
fn connect_keeping(
    core: &mut Core,
    agent: &str,
    credits: u32,
    answering: Vec<crate::protocol::AnsweringCall>,
) -> (u64, mpsc::UnboundedReceiver<Outgoing>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let hello = Hello {
        providers: vec![provider("c", Role::CodeAssistant, "m", 1)],
        keeps_answers: true,
        answering,
        ..hello_as(agent, None)
    };
    let session = core.hello(hello, tx).unwrap();
    core.pull(agent, session, "c", credits).unwrap();
    (session, rx)
}

fn keyed_chat(key: &str) -> (Shape, crate::protocol::IdempotencyTag) {
    let tag = crate::protocol::IdempotencyTag {
        project: "default".into(),
        key: key.into(),
        digest: "d".into(),
    };
    let shape = Shape::Chat {
        body: serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
        idempotency: Some(tag.clone()),
    };
    (shape, tag)
}

#[test]
fn a_keyed_chat_whose_agent_left_waits_for_its_handover_not_for_another_provider() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect_keeping(&mut core, "a", 1, Vec::new());
    let (_sb, mut b) = connect_keeping(&mut core, "b", 0, Vec::new());
    let (shape, tag) = keyed_chat("k");
    let (_, mut reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    let work = next_work(&mut a);
    assert_eq!(
        work["idempotency"]["key"], "k",
        "the key travels with the work"
    );

    // Agent a's socket drops while the call runs: the chat is parked, not offered to b.
    core.disconnect("a", sa);
    core.pull("b", _sb, "c", 1).unwrap();
    assert!(
        std::iter::from_fn(|| b.try_recv().ok())
            .all(|o| !matches!(&o, Outgoing::Frame(t) if t.contains("\"work\""))),
        "no second call while a may hand the answer over"
    );
    assert_eq!(core.parked_chats(), 1);
    // It comes back still running it: the wait grows to the call timeout.
    let call = crate::protocol::AnsweringCall {
        tag: tag.clone(),
        provider: "c".into(),
    };
    let (sa, _a) = connect_keeping(&mut core, "a", 0, vec![call]);
    core.expire(Instant::now() + Duration::from_secs(30));
    assert_eq!(
        core.parked_chats(),
        1,
        "a call its agent runs is waited for"
    );
    // Its answer comes over: the request completes with it, once.
    core.kept(
        "a",
        sa,
        crate::protocol::KeptAnswer {
            tag: tag.clone(),
            provider: "c".into(),
            backend: Backend::Local,
            output: Some(WorkOutput::Chat(serde_json::json!({"id": "gen-1"}))),
            tokens: 5,
            cost_usd: None,
            error: None,
            class: None,
        },
    )
    .unwrap();
    let done = reply.try_recv().unwrap().unwrap();
    assert_eq!(done.items[0].provider.agent, "a");
    assert!(matches!(&done.items[0].output, ItemOutput::Chat(c) if c["id"] == "gen-1"));
    assert_eq!(core.parked_chats(), 0);
}

#[test]
fn a_parked_chat_goes_round_again_when_its_agent_does_not_come_back_or_its_call_failed() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, mut a) = connect_keeping(&mut core, "a", 1, Vec::new());
    let (sb, mut b) = connect_keeping(&mut core, "b", 0, Vec::new());
    let (shape, _) = keyed_chat("k1");
    let (_, _reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    next_work(&mut a);
    core.disconnect("a", sa);
    core.pull("b", sb, "c", 1).unwrap();
    assert_eq!(core.parked_chats(), 1);
    // Past three heartbeats and the dial bound, with no word from a: b serves it.
    let bound = core.settings.heartbeat_interval * 3 + Duration::from_secs(5);
    core.expire(Instant::now() + bound + Duration::from_secs(1));
    assert_eq!(core.parked_chats(), 0);
    let work = next_work(&mut b);
    assert_eq!(work["idempotency"]["key"], "k1");

    // An agent that says its call failed: the chat goes round again at once.
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sb, mut b) = connect_keeping(&mut core, "b", 1, Vec::new());
    let (shape, tag) = keyed_chat("k2");
    let (_, _reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    next_work(&mut b);
    core.disconnect("b", sb);
    assert_eq!(core.parked_chats(), 1);
    let (sb, mut b) = connect_keeping(&mut core, "b", 1, Vec::new());
    core.kept(
        "b",
        sb,
        crate::protocol::KeptAnswer {
            tag,
            provider: "c".into(),
            backend: Backend::Local,
            output: None,
            tokens: 0,
            cost_usd: None,
            error: Some("upstream 500".into()),
            class: None,
        },
    )
    .unwrap();
    assert_eq!(core.parked_chats(), 0);
    assert_eq!(next_work(&mut b)["idempotency"]["key"], "k2");

    // A fatal failure (the call timeout) fails the request, as a `failed` would: a retry would
    // bill a stuck upstream again.
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sb, mut b) = connect_keeping(&mut core, "b", 1, Vec::new());
    let (shape, tag) = keyed_chat("k3");
    let (_, mut reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    next_work(&mut b);
    core.disconnect("b", sb);
    let (sb, _b) = connect_keeping(&mut core, "b", 1, Vec::new());
    core.kept(
        "b",
        sb,
        crate::protocol::KeptAnswer {
            tag,
            provider: "c".into(),
            backend: Backend::Local,
            output: None,
            tokens: 0,
            cost_usd: None,
            error: Some("the call took longer than the role's call timeout".into()),
            class: Some(crate::protocol::FailureClass::Fatal),
        },
    )
    .unwrap();
    assert!(matches!(
        reply.try_recv().unwrap(),
        Err(RequestFailure::Fatal { .. })
    ));
    assert_eq!(core.queue_depth(Role::CodeAssistant), 0);
}

#[test]
fn a_cloud_call_an_agent_still_runs_for_an_earlier_hub_holds_a_permit_and_its_cost_counts_once() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let info = cloud_reranker_configured(&mut core, 1, "kg");
    let (_, tag) = keyed_chat("k");
    let (tx, _rx) = mpsc::unbounded_channel();
    let hello = Hello {
        providers: vec![info.clone()],
        keeps_answers: true,
        answering: vec![crate::protocol::AnsweringCall {
            tag: tag.clone(),
            provider: info.id.clone(),
        }],
        config: crate::protocol::HeldConfig {
            config_revision: Some(1),
            key_generation: Some("kg".into()),
        },
        ..hello_as("cloudy", None)
    };
    let session = core.hello(hello, tx).unwrap();
    assert_eq!(
        core.budget.in_flight(),
        1,
        "the call under way counts in flight"
    );
    let kept = crate::protocol::KeptAnswer {
        tag,
        provider: info.id.clone(),
        backend: Backend::Cloud,
        output: Some(WorkOutput::Chat(serde_json::json!({"id": "gen-1"}))),
        tokens: 7,
        cost_usd: Some(0.25),
        error: None,
        class: None,
    };
    core.kept("cloudy", session, kept.clone()).unwrap();
    assert_eq!(core.budget.in_flight(), 0, "its permit came back");
    let day = |core: &Core| {
        let u = &core.projects.usage[crate::hub::projects::DEFAULT_PROJECT];
        (u.cloud_calls, u.day.cloud_usd)
    };
    assert_eq!(day(&core), (1, 0.25));
    // Handed over again (the agent missed the `delivered`): counted once.
    core.kept("cloudy", session, kept).unwrap();
    assert_eq!(day(&core), (1, 0.25));
    assert_eq!(core.replies.handed_over, 1);
}

/// A hub past its handover window (a key it has no record of runs at once).
fn keyed_core(replies: ReplyLimits) -> Core {
    let settings = HubSettings {
        handover_window: Duration::ZERO,
        replies,
        ..HubSettings::default()
    };
    Core::new(settings, CloudSettings::default())
}

/// Whether no work frame waits on `rx` (the others are dropped).
fn no_work(rx: &mut mpsc::UnboundedReceiver<Outgoing>) -> bool {
    frames_of(rx, "work").is_empty()
}

fn claim(core: &mut Core, tag: &crate::protocol::IdempotencyTag) -> crate::hub::replies::Claim {
    let id = crate::hub::replies::ReplyId::of(tag);
    core.replies.claim(&id, &tag.digest, Instant::now())
}

fn kept_chat(tag: &crate::protocol::IdempotencyTag, id: &str) -> crate::protocol::KeptAnswer {
    crate::protocol::KeptAnswer {
        tag: tag.clone(),
        provider: "c".into(),
        backend: Backend::Local,
        output: Some(WorkOutput::Chat(serde_json::json!({"id": id}))),
        tokens: 5,
        cost_usd: None,
        error: None,
        class: None,
    }
}

#[test]
fn a_streamed_keyed_chat_whose_lease_expires_unrenewed_waits_for_its_agent_not_another_provider() {
    use crate::hub::replies::Claim;
    let mut core = keyed_core(ReplyLimits::default());
    let (sa, mut a) = connect_keeping(&mut core, "a", 1, Vec::new());
    let (sb, mut b) = connect_keeping(&mut core, "b", 0, Vec::new());
    let (shape, tag) = keyed_chat("k");
    assert!(matches!(claim(&mut core, &tag), Claim::Run));
    let (request, mut reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    let (chunks_tx, mut chunks) = mpsc::unbounded_channel();
    core.stream_to(request, chunks_tx);
    let work = next_work(&mut a);
    let lease = work["lease"].as_u64().unwrap();

    // a goes silent before the first chunk: its lease expires unrenewed. Its call may still
    // run: the chat is not offered to b, and a is not told to stop.
    let length = core.settings.timings(Role::CodeAssistant).lease;
    core.expire(Instant::now() + length + Duration::from_secs(1));
    core.pull("b", sb, "c", 1).unwrap();
    assert!(no_work(&mut b), "no second upstream call while a's may run");
    assert!(frames_of(&mut a, "cancel").is_empty());
    assert_eq!(core.parked_chats(), 1);
    assert!(matches!(claim(&mut core, &tag), Claim::InUse));

    // a was slow, not gone: its chunks and its done on the same session serve the request.
    let data = serde_json::json!({"choices": [{"delta": {"content": "hi"}}]});
    core.chunk(
        "a",
        sa,
        crate::protocol::Chunk {
            lease,
            seq: 0,
            data: data.clone(),
        },
    )
    .unwrap();
    assert_eq!(chunks.try_recv().unwrap(), data);
    assert_eq!(core.parked_chats(), 0, "live again");
    core.done(
        "a",
        sa,
        Done {
            lease,
            output: WorkOutput::Chat(serde_json::json!({"id": "gen-1"})),
            latency_ms: 5.0,
            tokens: 3,
            cost_usd: None,
        },
    )
    .unwrap();
    let done = reply.try_recv().unwrap().unwrap();
    assert!(matches!(&done.items[0].output, ItemOutput::Chat(c) if c["id"] == "gen-1"));
    assert_eq!(core.counters.late_results, 0);
    assert!(no_work(&mut b));
}

#[test]
fn a_streamed_keyed_chat_lost_before_its_first_chunk_keeps_its_key_for_the_agents_call() {
    use crate::hub::replies::Claim;
    let mut core = keyed_core(ReplyLimits::default());
    let (sa, mut a) = connect_keeping(&mut core, "a", 1, Vec::new());
    let (shape, tag) = keyed_chat("k");
    assert!(matches!(claim(&mut core, &tag), Claim::Run));
    let (request, _reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    let (chunks_tx, _chunks) = mpsc::unbounded_channel();
    core.stream_to(request, chunks_tx);
    next_work(&mut a);
    core.disconnect("a", sa);
    assert_eq!(core.parked_chats(), 1);
    // Its client gives up (nothing streamed yet): the request is cancelled and its hold on
    // the key dropped. a's call still runs: the retry waits for it, never calls again.
    core.cancel_request(request);
    core.replies
        .abandoned(&crate::hub::replies::ReplyId::of(&tag));
    assert!(matches!(claim(&mut core, &tag), Claim::Wait(_)));
    // a comes back still running it, then hands the answer over: the retry gets it, and its
    // cost counts once.
    let call = crate::protocol::AnsweringCall {
        tag: tag.clone(),
        provider: "c".into(),
    };
    let (sa, _a) = connect_keeping(&mut core, "a", 0, vec![call]);
    assert!(matches!(claim(&mut core, &tag), Claim::Wait(_)));
    core.kept("a", sa, kept_chat(&tag, "gen-1")).unwrap();
    assert!(matches!(claim(&mut core, &tag), Claim::Replay(c) if c["id"] == "gen-1"));
    assert_eq!(core.replies.handed_over, 1);
    assert_eq!(core.parked_chats(), 0);
}

#[test]
fn a_streamed_keyed_chat_cut_by_a_lost_agent_is_answered_whole_to_the_retry() {
    use crate::hub::replies::Claim;
    let mut core = keyed_core(ReplyLimits::default());
    let (sa, mut a) = connect_keeping(&mut core, "a", 1, Vec::new());
    let (sb, mut b) = connect_keeping(&mut core, "b", 0, Vec::new());
    let (shape, tag) = keyed_chat("k");
    assert!(matches!(claim(&mut core, &tag), Claim::Run));
    let (request, mut reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    let (chunks_tx, _chunks) = mpsc::unbounded_channel();
    core.stream_to(request, chunks_tx);
    let lease = next_work(&mut a)["lease"].as_u64().unwrap();
    core.chunk(
        "a",
        sa,
        crate::protocol::Chunk {
            lease,
            seq: 0,
            data: serde_json::json!({}),
        },
    )
    .unwrap();
    // The agent is lost after the first chunk: the stream is cut (part of it is out), but
    // the agent's call runs on and the key waits for it.
    core.disconnect("a", sa);
    assert!(matches!(
        reply.try_recv().unwrap(),
        Err(RequestFailure::StreamCut { chunks: 1, .. })
    ));
    core.replies
        .abandoned(&crate::hub::replies::ReplyId::of(&tag));
    assert!(matches!(claim(&mut core, &tag), Claim::Wait(_)));
    core.pull("b", sb, "c", 1).unwrap();
    assert!(no_work(&mut b));
    let (sa, _a) = connect_keeping(&mut core, "a", 0, Vec::new());
    core.kept("a", sa, kept_chat(&tag, "gen-1")).unwrap();
    assert!(matches!(claim(&mut core, &tag), Claim::Replay(c) if c["id"] == "gen-1"));
    assert_eq!(core.replies.handed_over, 1);
}

#[test]
fn a_call_an_agent_reported_running_is_still_waited_for_when_the_agent_blinks() {
    use crate::hub::replies::Claim;
    let mut core = keyed_core(ReplyLimits::default());
    let (_, tag) = keyed_chat("k");
    let call = crate::protocol::AnsweringCall {
        tag: tag.clone(),
        provider: "c".into(),
    };
    let (sa, _a) = connect_keeping(&mut core, "a", 0, vec![call.clone()]);
    assert!(matches!(claim(&mut core, &tag), Claim::Wait(_)));
    // Its socket drops (a blink): the call still runs there, so a retry still waits.
    core.disconnect("a", sa);
    assert!(matches!(claim(&mut core, &tag), Claim::Wait(_)));
    // Back and still running it: waited for up to the call timeout again.
    let (sa, _a) = connect_keeping(&mut core, "a", 0, vec![call]);
    let bound = core.settings.heartbeat_interval * 3 + Duration::from_secs(5);
    let id = crate::hub::replies::ReplyId::of(&tag);
    let later = Instant::now() + bound + Duration::from_secs(1);
    assert!(matches!(
        core.replies.claim(&id, "d", later),
        Claim::Wait(_)
    ));
    // Blinks again and comes back no longer listing it (the call ended meanwhile): its kept
    // outcome follows the hello, and is waited for.
    core.disconnect("a", sa);
    let (sa, _a) = connect_keeping(&mut core, "a", 0, Vec::new());
    assert!(matches!(claim(&mut core, &tag), Claim::Wait(_)));
    core.kept("a", sa, kept_chat(&tag, "gen-1")).unwrap();
    assert!(matches!(claim(&mut core, &tag), Claim::Replay(_)));
    assert_eq!(core.replies.handed_over, 1);
    // An agent that does not come back within its bound: its call is not waited for.
    let (_, t2) = keyed_chat("k2");
    let call = crate::protocol::AnsweringCall {
        tag: t2.clone(),
        provider: "c".into(),
    };
    let (sb, _b) = connect_keeping(&mut core, "b", 0, vec![call]);
    core.disconnect("b", sb);
    let id2 = crate::hub::replies::ReplyId::of(&t2);
    assert!(matches!(claim(&mut core, &t2), Claim::Wait(_)));
    let later = Instant::now() + bound + Duration::from_secs(1);
    assert!(matches!(core.replies.claim(&id2, "d", later), Claim::Run));

    // A cloud call reported running keeps its permit across the blink: it still runs
    // upstream, and the hub counts it in flight once.
    let mut core = keyed_core(ReplyLimits::default());
    let info = cloud_reranker_configured(&mut core, 1, "kg");
    let hello = |answering| Hello {
        providers: vec![info.clone()],
        keeps_answers: true,
        answering,
        config: crate::protocol::HeldConfig {
            config_revision: Some(1),
            key_generation: Some("kg".into()),
        },
        ..hello_as("cloudy", None)
    };
    let call = crate::protocol::AnsweringCall {
        tag: tag.clone(),
        provider: info.id.clone(),
    };
    let (tx, _rx) = mpsc::unbounded_channel();
    let session = core.hello(hello(vec![call.clone()]), tx).unwrap();
    assert_eq!(core.budget.in_flight(), 1);
    core.disconnect("cloudy", session);
    assert_eq!(core.budget.in_flight(), 1, "the call still runs upstream");
    let (tx, _rx) = mpsc::unbounded_channel();
    core.hello(hello(vec![call]), tx).unwrap();
    assert_eq!(core.budget.in_flight(), 1, "one permit for the call");
}

#[test]
fn a_late_handover_of_an_answer_counted_here_counts_nothing_more_after_its_key_was_pushed_out() {
    use crate::hub::replies::Claim;
    let limits = ReplyLimits {
        keys_per_project: 2,
        ..ReplyLimits::default()
    };
    let mut core = keyed_core(limits);
    let (sa, mut a) = connect_keeping(&mut core, "a", 1, Vec::new());
    let (shape, tag) = keyed_chat("k");
    assert!(matches!(claim(&mut core, &tag), Claim::Run));
    let (_, mut reply) = core
        .submit(Role::CodeAssistant, shape, vec![String::new()])
        .unwrap();
    let lease = next_work(&mut a)["lease"].as_u64().unwrap();
    // The done reaches this hub (its cost counts here); the `delivered` to the agent is lost.
    core.done(
        "a",
        sa,
        Done {
            lease,
            output: WorkOutput::Chat(serde_json::json!({"id": "gen-1"})),
            latency_ms: 5.0,
            tokens: 3,
            cost_usd: None,
        },
    )
    .unwrap();
    reply.try_recv().unwrap().unwrap();
    assert_eq!(frames_of(&mut a, "delivered").len(), 1);
    // The project's own later keys push k out of its table.
    for key in ["x", "y"] {
        let (_, t) = keyed_chat(key);
        assert!(matches!(claim(&mut core, &t), Claim::Run));
        core.replies.answered(
            &crate::hub::replies::ReplyId::of(&t),
            "d",
            serde_json::json!({"id": key}),
        );
    }
    assert_eq!(
        core.replies.keys_of(crate::hub::projects::DEFAULT_PROJECT),
        2
    );
    // The agent, back, hands k's answer over again: counted here already, never twice.
    let mut late = kept_chat(&tag, "gen-1");
    late.backend = Backend::Cloud;
    late.cost_usd = Some(0.25);
    core.kept("a", sa, late).unwrap();
    let u = &core.projects.usage[crate::hub::projects::DEFAULT_PROJECT];
    assert_eq!((u.cloud_calls, u.day.cloud_usd), (0, 0.0));
    assert_eq!(core.replies.handed_over, 0);
    assert_eq!(
        frames_of(&mut a, "delivered").len(),
        1,
        "the agent lets it go"
    );
}

#[test]
fn status_sees_the_queue_per_class_and_project_and_the_waits_of_the_last_minute() {
    let (mut core, sa, mut a, shape) = one_gated_embedder();
    // The one credit goes to the first request; what comes after waits.
    let texts = |n: usize| (0..n).map(|i| format!("t{i}")).collect::<Vec<_>>();
    core.submit(Role::Embedding, shape, texts(1)).unwrap();
    let work = next_work(&mut a);
    let caller = |project: &str, class| Caller {
        project: Arc::from(project),
        sub_project: None,
        class,
        weight: 1,
    };
    let embed = || Shape::Embed {
        dimensions: None,
        is_query: false,
        instruction: None,
    };
    let interactive = crate::protocol::WorkClass::Interactive;
    let batch = crate::protocol::WorkClass::Batch;
    core.submit_as(
        caller("alpha", interactive),
        Role::Embedding,
        embed(),
        texts(2),
    )
    .unwrap();
    core.submit_as(caller("beta", batch), Role::Embedding, embed(), texts(3))
        .unwrap();
    core.submit_as(caller("alpha", batch), Role::Embedding, embed(), texts(4))
        .unwrap();
    let waiting = core.waiting(Role::Embedding);
    assert_eq!(
        waiting[&interactive],
        BTreeMap::from([("alpha".to_string(), 2)])
    );
    assert_eq!(
        waiting[&batch],
        BTreeMap::from([("alpha".to_string(), 4), ("beta".to_string(), 3)])
    );
    assert!(core.waiting(Role::Reranker).is_empty());
    // One request was leased: one wait in the last minute, none for the other roles.
    let now = Instant::now();
    let q = core
        .counters
        .recent_waits_ms
        .get_mut(&Role::Embedding)
        .and_then(|r| r.quantiles(now))
        .unwrap();
    assert_eq!(q.count, 1);
    assert!(q.p50 >= 0.0 && q.p99 == q.p50, "{q:?}");
    assert!(!core.counters.recent_waits_ms.contains_key(&Role::Reranker));
    let _ = (sa, work);
}

#[test]
fn an_agent_that_withdraws_every_provider_is_draining_and_one_that_never_had_any_is_idle() {
    let mut core = Core::new(HubSettings::default(), CloudSettings::default());
    let (sa, _a) = connect(&mut core, "a", provider("e", Role::Embedding, "ma", 8), 1);
    assert!(!core.agents()["a"].draining);
    core.set_providers("a", sa, Vec::new()).unwrap();
    assert!(core.agents()["a"].draining);
    // Providers again (a push put a route back): serving, not draining.
    core.set_providers("a", sa, vec![provider("e", Role::Embedding, "ma", 8)])
        .unwrap();
    assert!(!core.agents()["a"].draining);
    // Said twice, still draining.
    core.set_providers("a", sa, Vec::new()).unwrap();
    core.set_providers("a", sa, Vec::new()).unwrap();
    assert!(core.agents()["a"].draining);
    // An agent that announced nothing from its hello on is idle.
    let (tx, _b) = mpsc::unbounded_channel();
    let mut hello = hello_as("b", None);
    hello.providers.clear();
    let sb = core.hello(hello, tx).unwrap();
    core.set_providers("b", sb, Vec::new()).unwrap();
    assert!(!core.agents()["b"].draining);
}

#[test]
fn a_thousand_agents_that_come_and_go_leave_the_state_the_stored_verdicts_and_metrics_bounded() {
    use crate::hub::{Hub, gate::GateSettings};
    let dir = tempfile::tempdir().unwrap();
    let gate = GateSettings {
        forget_departed: Duration::ZERO,
        ..GateSettings::default()
    };
    let hub = Hub::open_for_tests(dir.path(), None, false, gate);
    let mut registry = crate::metrics::registry("hub");
    let scraped = hub.clone();
    registry.register_collector(Box::new(crate::metrics::Scrape::new(
        move |f: &mut crate::metrics::Families| scraped.encode_metrics(f),
    )));
    let scrape = || crate::metrics::render(&registry, None).1;
    let space = "embedding:ma:2";
    let mut sizes = Vec::new();
    {
        let mut core = hub.core();
        let core = &mut *core;
        // The space's reference stays; a provider judged again and refused keeps its verdict
        // (and its rows) after it left, as a suspended one does.
        let (s0, mut a0) = connect(core, "stays", provider("e", Role::Embedding, "ma", 8), 1);
        answer_probes(core, "stays", s0, &mut a0, 0);
        let (sd, mut d) = connect(core, "drifted", provider("e", Role::Embedding, "ma", 8), 1);
        answer_probes(core, "drifted", sd, &mut d, 0);
        core.gate.count_rows(space, "drifted/e", 5);
        assert_eq!(core.gate.reverify(Some("drifted/e")), 1);
        core.gate_tick(Instant::now());
        answer_probes(core, "drifted", sd, &mut d, 1);
        core.disconnect("drifted", sd);
        core.forget_departed();
    }
    let before = scrape().len();
    for i in 0..1000 {
        let mut core = hub.core();
        let core = &mut *core;
        let id = format!("autoscaled-{i}");
        let (s, mut rx) = connect(core, &id, provider("e", Role::Embedding, "ma", 8), 1);
        answer_probes(core, &id, s, &mut rx, 0);
        core.gate.count_rows(space, &format!("{id}/e"), 3);
        *core
            .counters
            .canary_texts
            .entry(format!("{id}/e"))
            .or_default() += 1;
        core.disconnect(&id, s);
        core.forget_departed();
        if i % 250 == 249 {
            sizes.push((core.gate.sizes(), core.sockets().len()));
        }
    }
    // Every size is what it was after the first quarter: nothing grows with the ids.
    assert!(sizes.windows(2).all(|w| w[0] == w[1]), "{sizes:?}");
    let core = hub.core();
    let ((departed, verdicts, rows), sockets) = (core.gate.sizes(), core.sockets().len());
    assert_eq!(departed, 1, "only the refused agent, whose verdict stays");
    assert!(
        verdicts <= 3 && rows <= 3 && sockets <= 2,
        "{verdicts} {rows} {sockets}"
    );
    assert!(core.counters.canary_texts.is_empty());
    let view = core.gate.view(&Default::default());
    let totals = &view.spaces.iter().find(|s| s.id == space).unwrap().rows;
    assert_eq!(
        totals[crate::hub::gate::DEPARTED_ROWS],
        3000,
        "the space's totals stay"
    );
    assert_eq!(totals["drifted/e"], 5, "a refused provider keeps its rows");
    let stored = core.gate.stored_verdicts();
    assert!(stored.len() <= 3, "{}", stored.len());
    let suspended = stored
        .values()
        .find(|v| v.provider == "drifted/e")
        .expect("the refusal is stored");
    assert!(matches!(
        suspended.verdict,
        crate::hub::gate::Verdict::Suspended { .. } | crate::hub::gate::Verdict::Refused { .. }
    ));
    assert!(suspended.left_at_ms.is_some(), "with when its agent left");
    drop(core);
    let after = scrape();
    assert!(
        !after.contains("autoscaled-"),
        "no series of a forgotten agent"
    );
    assert!(after.len() <= before + 200, "{} -> {}", before, after.len());
}
