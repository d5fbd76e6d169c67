//! Frames to text and back: size limits, error classes, and the rule that the key never sits
//! in a frame's first 120 characters.
//!
//! Logs and proxies often keep the head of a frame; the config encoder therefore places the
//! `apiKey` member (always the last one) at or after [`KEY_OFFSET_MIN`], padding with JSON
//! whitespace when the frame's head is shorter.

use std::borrow::Cow;

use serde::Deserialize;

use super::{AgentFrame, HubFrame};
use crate::secret::Secret;

/// Frames that carry no vectors must stay under this.
pub const MAX_CONTROL_FRAME_BYTES: usize = 1 << 20;
/// Frames with vectors (`done`, `probe_result`) may grow to this by default.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 64 << 20;
/// The key starts at or after this character of a config frame.
pub const KEY_OFFSET_MIN: usize = 120;

/// Why a frame was refused; the text is what the peer is told in an `error` frame.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrameError {
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("a frame needs a string \"type\" field")]
    MissingType,
    #[error("unknown frame type '{0}'")]
    UnknownType(String),
    #[error("invalid '{kind}' frame: {message}")]
    Invalid { kind: String, message: String },
    #[error("a '{kind}' frame of {bytes} bytes is over the {limit}-byte limit")]
    TooLarge {
        kind: String,
        bytes: usize,
        limit: usize,
    },
    #[error("binary frames are not part of the protocol; send JSON text")]
    Binary,
}

#[derive(Deserialize)]
struct TypeOnly<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
}

const AGENT_TYPES: [&str; 11] = [
    "hello",
    "providers",
    "heartbeat",
    "pull",
    "chunk",
    "done",
    "failed",
    "config_ack",
    "probe_result",
    "limits",
    "kept",
];
const HUB_TYPES: [&str; 9] = [
    "welcome",
    "error",
    "config",
    "work",
    "probe",
    "cancel",
    "discover",
    "suspended",
    "delivered",
];

/// Decodes an agent's frame; `max_bytes` bounds frames with vectors.
pub fn decode_agent(text: &str, max_bytes: usize) -> Result<AgentFrame, FrameError> {
    // A kept answer is a chat completion, as large as its `done`.
    let carries_vectors = |kind: &str| matches!(kind, "done" | "probe_result" | "kept");
    decode(text, max_bytes, &AGENT_TYPES, carries_vectors)
}

/// Decodes a hub's frame (work frames carry texts: the large limit applies to them).
pub fn decode_hub(text: &str, max_bytes: usize) -> Result<HubFrame, FrameError> {
    decode(text, max_bytes, &HUB_TYPES, |kind| kind == "work")
}

fn decode<T: serde::de::DeserializeOwned>(
    text: &str,
    max_bytes: usize,
    known: &[&str],
    large: impl Fn(&str) -> bool,
) -> Result<T, FrameError> {
    if text.len() > MAX_CONTROL_FRAME_BYTES {
        let kind = frame_type(text)?;
        let limit = if large(&kind) {
            max_bytes
        } else {
            MAX_CONTROL_FRAME_BYTES
        };
        if text.len() > limit {
            return Err(FrameError::TooLarge {
                kind,
                bytes: text.len(),
                limit,
            });
        }
    }
    serde_json::from_str(text).map_err(|e| {
        let kind = match frame_type(text) {
            Ok(kind) => kind,
            Err(err) => return err,
        };
        if known.contains(&kind.as_str()) {
            FrameError::Invalid {
                kind,
                message: e.to_string(),
            }
        } else {
            FrameError::UnknownType(kind)
        }
    })
}

fn frame_type(text: &str) -> Result<String, FrameError> {
    let head: TypeOnly =
        serde_json::from_str(text).map_err(|e| FrameError::Malformed(e.to_string()))?;
    head.kind
        .map(Cow::into_owned)
        .ok_or(FrameError::MissingType)
}

/// What can still be read of an agent's frame that was refused: the lease a `done` answers,
/// the probe a `probe_result` answers. The hub fails that lease or probe at once, saying why,
/// rather than wait out its expiry for an answer that already came and cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unreadable {
    Done { lease: u64 },
    ProbeResult { probe: String, provider: String },
}

/// The lease or probe an agent's refused frame of `kind` answers, when its text says.
pub fn salvage(kind: &str, text: &str) -> Option<Unreadable> {
    #[derive(Deserialize)]
    struct Lease {
        lease: u64,
    }
    #[derive(Deserialize)]
    struct Probe {
        probe: String,
        provider: String,
    }
    match kind {
        "done" => serde_json::from_str::<Lease>(text)
            .ok()
            .map(|l| Unreadable::Done { lease: l.lease }),
        "probe_result" => {
            serde_json::from_str::<Probe>(text)
                .ok()
                .map(|p| Unreadable::ProbeResult {
                    probe: p.probe,
                    provider: p.provider,
                })
        }
        _ => None,
    }
}

/// Encodes a hub frame; a config frame's key starts at or after [`KEY_OFFSET_MIN`].
pub fn encode(frame: &HubFrame) -> String {
    // Frames are plain data (strings, numbers, maps with string keys): serialization cannot fail.
    let mut text = serde_json::to_string(frame).unwrap_or_default();
    if let HubFrame::Config(_) = frame {
        pad_key(&mut text);
    }
    text
}

/// Encodes an agent frame.
pub fn encode_agent(frame: &AgentFrame) -> String {
    serde_json::to_string(frame).unwrap_or_default()
}

/// Writes the key of a config push: only the config frame's encoder reaches this (the push
/// type is the one place a [`Secret`] is serialized, and only inside [`encode`]'s frames).
pub(crate) fn key_on_the_wire<S: serde::Serializer>(
    key: &Option<Secret>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match key {
        Some(key) => s.serialize_some(key.expose()),
        None => s.serialize_none(),
    }
}

/// Moves the `apiKey` member (the last one written) past the first [`KEY_OFFSET_MIN`]
/// characters by inserting whitespace before it.
fn pad_key(text: &mut String) {
    // Characters, not bytes: a multi-byte prefix (a non-ASCII domain) is shorter than it looks.
    if let Some(at) = text.rfind("\"apiKey\":") {
        let chars = text[..at].chars().count();
        if chars < KEY_OFFSET_MIN {
            text.insert_str(at, &" ".repeat(KEY_OFFSET_MIN - chars));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::push::OpenRouterPush;
    use crate::protocol::*;
    use crate::roles::Role;

    fn round_trip_agent(frame: AgentFrame) {
        let text = encode_agent(&frame);
        let kind = text
            .strip_prefix("{\"type\":\"")
            .and_then(|t| t.split('"').next());
        let back = decode_agent(&text, DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(encode_agent(&back), text, "round trip of {kind:?}");
        assert!(AGENT_TYPES.contains(&kind.unwrap()), "{text}");
    }

    fn round_trip_hub(frame: HubFrame) {
        let text = encode(&frame);
        assert!(text.starts_with("{\"type\":\""), "type first: {text}");
        let back = decode_hub(&text, DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(encode(&back), text);
    }

    fn provider() -> ProviderInfo {
        ProviderInfo {
            id: "embedding".into(),
            role: Role::Embedding,
            backend: Backend::Local,
            model: "all-minilm-l6-v2".into(),
            revision: Some("c9745ed1d9f207416be6d2e6f8de32d1f16199bf".into()),
            upstream: None,
            dims: Some(384),
            dtype: Some("f32".into()),
            device: Some("cpu".into()),
            max_input_tokens: None,
            pooling: None,
            max_batch_items: 64,
            max_batch_tokens: 16384,
            score_activation: None,
            server: None,
            attention: None,
        }
    }

    #[test]
    fn a_write_may_take_three_heartbeats_plus_its_size_at_the_slowest_link() {
        let beat = std::time::Duration::from_secs(5);
        assert_eq!(write_timeout(beat, 0).as_secs(), 15);
        assert_eq!(write_timeout(beat, 64 << 20).as_secs(), 15 + 256);
        assert_eq!(
            write_timeout(beat, usize::MAX).as_secs(),
            15 + u64::MAX / (256 * 1024)
        );
    }

    #[test]
    fn every_agent_frame_round_trips_with_type_first() {
        round_trip_agent(AgentFrame::Hello(Hello {
            agent_id: "gpu-1".into(),
            hostname: "host".into(),
            version: "0.1.0".into(),
            protocol_version: PROTOCOL_VERSION,
            providers: vec![provider()],
            devices: vec![DeviceInfo {
                id: "cpu".into(),
                memory_total_mb: Some(24000),
                memory_free_mb: None,
            }],
            instance: Some("0123abcd".into()),
            config: HeldConfig {
                config_revision: Some(3),
                key_generation: Some("kg-0123".into()),
            },
            suspensions: vec![Suspension {
                provider: "embedding".into(),
                key: "gpu-1/embedding|m@-|-|local|-|embedding:m:384".into(),
                space: "embedding:m:384".into(),
                generation: 7,
                reason: "canary at cosine 0.95".into(),
                at_ms: 1_700_000_000_000,
            }],
            answering: vec![AnsweringCall {
                tag: IdempotencyTag {
                    project: "alpha".into(),
                    key: "k-1".into(),
                    digest: "d".into(),
                },
                provider: "cloud:code-assistant:1".into(),
            }],
            keeps_answers: true,
        }));
        round_trip_agent(AgentFrame::Kept(KeptAnswer {
            tag: IdempotencyTag {
                project: "alpha".into(),
                key: "k-1".into(),
                digest: "d".into(),
            },
            provider: "code-assistant".into(),
            backend: Backend::Cloud,
            output: Some(WorkOutput::Chat(serde_json::json!({"id": "gen-1"}))),
            tokens: 12,
            cost_usd: Some(0.001),
            error: None,
            class: None,
        }));
        round_trip_agent(AgentFrame::Providers {
            providers: vec![provider()],
        });
        round_trip_agent(AgentFrame::Heartbeat(Heartbeat {
            providers: vec![ProviderStats {
                provider: "embedding".into(),
                in_flight: 1,
                served: 10,
                failures: 0,
                latency_ewma_ms: Some(12.5),
                latency_p50_ms: Some(11.0),
                latency_p95_ms: Some(20.0),
            }],
            devices: vec![],
            leases: vec![7, 9],
            config: HeldConfig::default(),
        }));
        round_trip_agent(AgentFrame::Chunk(Chunk {
            lease: 7,
            seq: 0,
            data: serde_json::json!({"object": "chat.completion.chunk", "choices": []}),
        }));
        round_trip_agent(AgentFrame::Pull(Pull {
            provider: "embedding".into(),
            credits: 2,
        }));
        round_trip_agent(AgentFrame::Done(Done {
            lease: 7,
            output: WorkOutput::Embeddings(vec![vec![0.25, -0.5]]),
            latency_ms: 3.5,
            tokens: 9,
            cost_usd: None,
        }));
        round_trip_agent(AgentFrame::Done(Done {
            lease: 8,
            output: WorkOutput::Scores(vec![Score {
                score: 1.5,
                probability: Some(0.8),
            }]),
            latency_ms: 3.5,
            tokens: 9,
            cost_usd: Some(0.000_25),
        }));
        round_trip_agent(AgentFrame::Failed(Failed {
            lease: 7,
            class: FailureClass::RateLimited,
            retry_after_ms: Some(2000),
            limit: Some(LimitKind::Upstream),
            refusal: None,
            defect: None,
            message: "429".into(),
        }));
        round_trip_agent(AgentFrame::Failed(Failed {
            lease: 8,
            class: FailureClass::Refused,
            retry_after_ms: None,
            limit: None,
            refusal: Some(Refusal::KeyRejected),
            defect: None,
            message: "401".into(),
        }));
        round_trip_agent(AgentFrame::ConfigAck(ConfigAck {
            id: "cfg-1".into(),
            applied: true,
            reason: None,
            roles: Default::default(),
            config: HeldConfig {
                config_revision: Some(3),
                key_generation: None,
            },
        }));
        round_trip_agent(AgentFrame::ProbeResult(ProbeResult {
            probe: "p1".into(),
            provider: "embedding".into(),
            vectors: Some(vec![vec![1.0]]),
            scores: None,
            error: None,
            defect: None,
        }));
        round_trip_agent(AgentFrame::ProbeResult(ProbeResult {
            probe: "scorer-1".into(),
            provider: "reranker".into(),
            vectors: None,
            scores: Some(vec![Score {
                score: 1.5,
                probability: Some(0.8),
            }]),
            error: None,
            defect: None,
        }));
    }

    #[test]
    fn every_hub_frame_round_trips_with_type_first() {
        round_trip_hub(HubFrame::Welcome(Welcome {
            session: 1,
            protocol_version: PROTOCOL_VERSION,
            heartbeat_interval_ms: 5000,
            lease_ms: 120_000,
            pings: true,
            epoch: Some(42),
            takes_answers: true,
        }));
        round_trip_hub(HubFrame::Suspended(Suspension {
            provider: "embedding".into(),
            key: "gpu-1/embedding|m@-|-|local|-|embedding:m:384".into(),
            space: "embedding:m:384".into(),
            generation: 7,
            reason: "canary at cosine 0.95".into(),
            at_ms: 1,
        }));
        round_trip_hub(HubFrame::Delivered(IdempotencyTag {
            project: "alpha".into(),
            key: "k-1".into(),
            digest: "d".into(),
        }));
        round_trip_hub(HubFrame::Error {
            message: "no".into(),
            code: Some(ErrorCode::AgentIdInUse),
        });
        round_trip_hub(HubFrame::Work(Work {
            lease: 1,
            provider: "embedding".into(),
            role: Role::Embedding,
            input: WorkInput::Embed(EmbedInput {
                texts: vec!["a".into()],
                dimensions: Some(128),
                is_query: true,
                instruction: None,
                truncate: false,
            }),
            deadline_ms: 1,
            call_timeout_ms: Some(60_000),
            class: WorkClass::Interactive,
            traces: vec!["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()],
            idempotency: None,
        }));
        round_trip_hub(HubFrame::Work(Work {
            lease: 4,
            provider: "code-assistant".into(),
            role: Role::CodeAssistant,
            input: WorkInput::Chat(serde_json::json!({"messages": []})),
            deadline_ms: 1,
            call_timeout_ms: Some(60_000),
            class: WorkClass::Interactive,
            traces: Vec::new(),
            idempotency: Some(IdempotencyTag {
                project: "default".into(),
                key: "k-2".into(),
                digest: "d".into(),
            }),
        }));
        round_trip_hub(HubFrame::Work(Work {
            lease: 2,
            provider: "reranker".into(),
            role: Role::Reranker,
            input: WorkInput::Rerank(RerankInput {
                query: "q".into(),
                documents: vec!["d".into()],
                instruction: None,
            }),
            deadline_ms: 1,
            call_timeout_ms: Some(60_000),
            class: WorkClass::Batch,
            traces: Vec::new(),
            idempotency: None,
        }));
        round_trip_hub(HubFrame::Probe(Probe {
            probe: "p".into(),
            provider: "embedding".into(),
            texts: vec!["x".into()],
            query: None,
        }));
        round_trip_hub(HubFrame::Probe(Probe {
            probe: "scorer-1".into(),
            provider: "reranker".into(),
            texts: vec!["d".into()],
            query: Some("q".into()),
        }));
        round_trip_hub(HubFrame::Cancel {
            lease: 3,
            reason: "expired".into(),
        });
        let work = encode(&HubFrame::Work(Work {
            lease: 1,
            provider: "p".into(),
            role: Role::Embedding,
            input: WorkInput::Embed(EmbedInput::default()),
            deadline_ms: 0,
            call_timeout_ms: None,
            class: WorkClass::Batch,
            traces: Vec::new(),
            idempotency: None,
        }));
        assert!(work.contains("\"op\":\"embed\",\"input\":{"), "{work}");
        assert!(
            !work.contains("class") && !work.contains("traces"),
            "batch is the default and is not sent, nor an empty trace list: {work}"
        );
    }

    #[test]
    fn the_key_never_sits_in_the_first_120_characters() {
        // A multi-byte domain: the key would start past byte 120 but before character 120.
        let wide = Some("é".repeat(30));
        for (models, domain) in [(None, None), (Some(Default::default()), None), (None, wide)] {
            let push = OpenRouterPush {
                allowed_models: models,
                domain,
                api_key: Some(Secret::new("sk-or-v1-0123456789")),
                ..Default::default()
            };
            let frame = HubFrame::Config(ConfigFrame {
                id: "c".into(),
                revision: Some(1),
                key_generation: Some("kg-1".into()),
                payload: ConfigPayload {
                    openrouter: Some(push),
                },
            });
            let text = encode(&frame);
            let head: String = text.chars().take(KEY_OFFSET_MIN).collect();
            assert!(!head.contains("sk-or"), "{text}");
            let at = text.find("sk-or-v1-0123456789").unwrap();
            assert!(text[..at].chars().count() >= KEY_OFFSET_MIN, "{text}");
            // Still valid JSON with the key intact.
            let back = decode_hub(&text, DEFAULT_MAX_FRAME_BYTES).unwrap();
            let HubFrame::Config(c) = back else { panic!() };
            let key = c.payload.openrouter.unwrap().api_key.unwrap();
            assert_eq!(key.expose(), "sk-or-v1-0123456789");
        }
    }

    #[test]
    fn bad_frames_are_classified() {
        let max = DEFAULT_MAX_FRAME_BYTES;
        assert!(matches!(
            decode_agent("{not json", max),
            Err(FrameError::Malformed(_))
        ));
        assert_eq!(
            decode_agent("{\"lease\":1}", max).unwrap_err(),
            FrameError::MissingType
        );
        assert_eq!(
            decode_agent("{\"type\":\"launch\"}", max).unwrap_err(),
            FrameError::UnknownType("launch".into())
        );
        let err = decode_agent("{\"type\":\"pull\",\"credits\":1}", max).unwrap_err();
        assert!(
            matches!(&err, FrameError::Invalid { kind, message } if kind == "pull" && message.contains("provider")),
            "{err}"
        );
        // Every frame type is known to the error path: a bad `limits` (or `discover`) is an
        // invalid frame of that type, not an unknown one.
        let err = decode_agent("{\"type\":\"limits\",\"rpm\":\"many\"}", max).unwrap_err();
        assert!(
            matches!(&err, FrameError::Invalid { kind, .. } if kind == "limits"),
            "{err}"
        );
        let err = decode_hub("{\"type\":\"cancel\",\"lease\":\"x\"}", max).unwrap_err();
        assert!(matches!(&err, FrameError::Invalid { kind, .. } if kind == "cancel"));
        assert!(matches!(
            decode_hub("{\"type\":\"discover\"}", max),
            Ok(HubFrame::Discover)
        ));
        let big = format!(
            "{{\"type\":\"pull\",\"provider\":\"{}\",\"credits\":1}}",
            "x".repeat(MAX_CONTROL_FRAME_BYTES)
        );
        assert!(matches!(
            decode_agent(&big, max),
            Err(FrameError::TooLarge { .. })
        ));
        let big_done = format!(
            "{{\"type\":\"done\",\"lease\":1,\"output\":{{\"embeddings\":[[{}0]]}},\"latency_ms\":1}}",
            "0,".repeat(MAX_CONTROL_FRAME_BYTES / 2)
        );
        assert!(decode_agent(&big_done, max).is_ok());
        assert!(matches!(
            decode_agent(&big_done, MAX_CONTROL_FRAME_BYTES),
            Err(FrameError::TooLarge { .. })
        ));
    }
}
