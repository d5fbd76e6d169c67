//! `Idempotency-Key` for chats: the keys a hub has seen, and the answers it can replay.
//!
//! A chat sent with `Idempotency-Key` (as OpenAI's and Stripe's APIs take it, and the IETF's
//! `Idempotency-Key` draft describes) runs upstream at most once per project and key while
//! this hub or the agent that ran it remembers it:
//!
//! - a retry with the same key and body gets the first answer again (`Idempotent-Replayed`),
//!   and its cost is not counted again;
//! - the same key with another body is refused (422), and while the first still runs a retry
//!   is told so (409);
//! - an agent finishes a keyed chat even when its session ends, keeps the outcome and hands
//!   it to the next hub (`hello.answering` names the calls still running, a `kept` frame
//!   carries each outcome). A keyed chat that this hub has no record of waits while the
//!   agents come over ([`Replies::handover_until`], from the moment the hub began to serve),
//!   and for a call an agent reported running, before it may go upstream again.
//!
//! Answers are held [`KEEP_ANSWER`] within [`MAX_ANSWER_BYTES`]; a key is remembered
//! [`REMEMBER_KEY`] (at most [`MAX_KEYS`]): a retry after its answer went is refused with
//! the way to run it again (a new key). Nothing here is stored in the state store: a hub
//! that takes over learns the answers from the agents.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::hub::Hub;
use crate::protocol::IdempotencyTag;
use crate::roles::Role;

/// How long a replayable answer is held.
pub const KEEP_ANSWER: Duration = Duration::from_secs(600);
/// The most bytes of answers held (the oldest become keys without answers first).
pub const MAX_ANSWER_BYTES: usize = 16 << 20;
/// How long a key is remembered after its request.
pub const REMEMBER_KEY: Duration = Duration::from_secs(24 * 3600);
/// The most keys remembered (the oldest are forgotten first).
pub const MAX_KEYS: usize = 65_536;
/// The longest `Idempotency-Key` taken.
pub const MAX_KEY_CHARS: usize = 255;

/// A key as a project used it: the project, and a digest of the client's key ([`key_id`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReplyId {
    pub project: Arc<str>,
    pub key: String,
}

/// What stands for a client's `Idempotency-Key` everywhere past the request handler (the
/// table, work and `kept` frames, the agents' memory, log lines): 128 bits of its SHA-256. A
/// key typed into the wrong field (a token, say) is so never kept, sent or logged.
pub fn key_id(key: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"idempotency-key\0")
        .chain_update(key.as_bytes())
        .finalize();
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

impl ReplyId {
    pub fn of(tag: &IdempotencyTag) -> Self {
        Self {
            project: Arc::from(tag.project.as_str()),
            key: tag.key.clone(),
        }
    }

    pub fn tag(&self, digest: &str) -> IdempotencyTag {
        IdempotencyTag {
            project: self.project.to_string(),
            key: self.key.clone(),
            digest: digest.to_string(),
        }
    }
}

/// Checks a client's `Idempotency-Key`: 1 to [`MAX_KEY_CHARS`] visible ASCII characters.
/// The error never repeats the value.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > MAX_KEY_CHARS || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "Idempotency-Key must be 1 to {MAX_KEY_CHARS} visible ASCII characters (a UUID is a \
             good key)"
        ));
    }
    Ok(())
}

/// A digest of a chat as the hub forwards it: its role and its body, keys sorted, `stream`
/// left out (a retry may ask for the same answer streamed or whole).
pub fn digest(role: Role, body: &serde_json::Map<String, Value>) -> String {
    fn canonical(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    canonical(&m[k], out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut forwarded = body.clone();
    forwarded.remove("stream");
    let mut text = String::new();
    canonical(&Value::Object(forwarded), &mut text);
    let mut hash = Sha256::new();
    hash.update(role.as_str().as_bytes());
    hash.update([0u8]);
    hash.update(text.as_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// What a keyed request may do now.
#[derive(Debug)]
pub enum Claim {
    /// The answer given before (the completion with its provenance).
    Replay(Arc<Value>),
    /// The key was used with another request body.
    Reused,
    /// A request with this key is running on this hub.
    InUse,
    /// The key was answered and the answer is no longer held.
    Gone,
    /// An agent may still hand this key's answer over: ask again on the next change.
    Wait,
    /// Run it: the key is this request's until [`Replies::answered`] or
    /// [`Replies::abandoned`].
    Run,
}

enum State {
    Running,
    /// An agent reported the call running (its `hello`); it ends by `until` (the longest call
    /// timeout) at the latest.
    AtAgent {
        agent: String,
        until: Instant,
    },
    Answered {
        completion: Arc<Value>,
        bytes: usize,
    },
    Gone,
}

struct Entry {
    digest: String,
    state: State,
    at: Instant,
}

/// The keys this hub has seen.
pub struct Replies {
    entries: HashMap<ReplyId, Entry>,
    answer_bytes: usize,
    handover_until: Instant,
    /// Answers replayed to retries.
    pub replayed: u64,
    /// Answers agents handed over (new to this hub).
    pub handed_over: u64,
}

impl Replies {
    /// A hub that began to serve now: keyed requests it has no record of wait `handover`
    /// for the agents to come over.
    pub fn new(handover: Duration) -> Self {
        Self {
            entries: HashMap::new(),
            answer_bytes: 0,
            handover_until: Instant::now() + handover,
            replayed: 0,
            handed_over: 0,
        }
    }

    /// Until when a key this hub has no record of waits for the agents' handover.
    pub fn handover_until(&self) -> Instant {
        self.handover_until
    }

    pub fn claim(&mut self, id: &ReplyId, digest: &str, now: Instant) -> Claim {
        if let Some(e) = self.entries.get(id) {
            if e.digest != digest {
                return Claim::Reused;
            }
            return match &e.state {
                State::Running => Claim::InUse,
                State::AtAgent { until, .. } if *until > now => Claim::Wait,
                State::AtAgent { .. } => {
                    // Its agent never said how it ended: it is not waited for any more.
                    self.entries.remove(id);
                    return self.claim(id, digest, now);
                }
                State::Answered { completion, .. } => {
                    self.replayed += 1;
                    Claim::Replay(completion.clone())
                }
                State::Gone => Claim::Gone,
            };
        }
        if now < self.handover_until {
            return Claim::Wait;
        }
        self.insert(id.clone(), digest.to_string(), State::Running, now);
        Claim::Run
    }

    /// A running key was answered: the answer is held for retries.
    pub fn answered(&mut self, id: &ReplyId, digest: &str, completion: Value) {
        self.hold(id, digest, completion, Instant::now());
    }

    /// A running key ended without an answer: a retry may run it again.
    pub fn abandoned(&mut self, id: &ReplyId) {
        if self
            .entries
            .get(id)
            .is_some_and(|e| matches!(e.state, State::Running))
        {
            self.entries.remove(id);
        }
    }

    /// `agent` runs these keyed calls for an earlier session (all it runs: what it reported
    /// before and does not list now has ended), each until `until` at the latest.
    pub fn running_at(&mut self, agent: &str, tags: &[IdempotencyTag], until: Instant) {
        let now = Instant::now();
        self.agent_left(agent);
        for tag in tags {
            let id = ReplyId::of(tag);
            if !self.entries.contains_key(&id) {
                let state = State::AtAgent {
                    agent: agent.to_string(),
                    until,
                };
                self.insert(id, tag.digest.clone(), state, now);
            }
        }
    }

    /// `agent` left: the calls it reported are not waited for any more. Whether any were.
    pub fn agent_left(&mut self, agent: &str) -> bool {
        let before = self.entries.len();
        self.entries
            .retain(|_, e| !matches!(&e.state, State::AtAgent { agent: a, .. } if a == agent));
        self.entries.len() != before
    }

    /// An agent handed over a keyed call's outcome (`None`: the call failed). Whether it is
    /// an answer this hub did not hold: its cost is then counted here.
    pub fn handed_over(&mut self, tag: &IdempotencyTag, completion: Option<Value>) -> bool {
        let id = ReplyId::of(tag);
        let now = Instant::now();
        match self.entries.get(&id).map(|e| &e.state) {
            Some(State::Answered { .. } | State::Gone) => false,
            // A request of this key runs here (a parked chat, or a retry that did not wait
            // long enough): the answer is held now (its request may still fail), and the call
            // was made, so it counts.
            Some(State::Running) => match completion {
                Some(c) => {
                    self.handed_over += 1;
                    self.hold(&id, &tag.digest, c, now);
                    true
                }
                None => false,
            },
            Some(State::AtAgent { .. }) | None => match completion {
                Some(c) => {
                    self.handed_over += 1;
                    self.hold(&id, &tag.digest, c, now);
                    true
                }
                None => {
                    if matches!(
                        self.entries.get(&id).map(|e| &e.state),
                        Some(State::AtAgent { .. })
                    ) {
                        self.entries.remove(&id);
                    }
                    false
                }
            },
        }
    }

    fn hold(&mut self, id: &ReplyId, digest: &str, completion: Value, now: Instant) {
        let bytes = completion.to_string().len();
        if let Some(Entry {
            state: State::Answered { bytes: old, .. },
            ..
        }) = self.entries.get(id)
        {
            self.answer_bytes -= old;
        }
        if bytes > MAX_ANSWER_BYTES {
            // Larger than all the room: the key is remembered without its answer.
            self.insert(id.clone(), digest.to_string(), State::Gone, now);
            return;
        }
        let state = State::Answered {
            completion: Arc::new(completion),
            bytes,
        };
        self.answer_bytes += bytes;
        self.insert(id.clone(), digest.to_string(), state, now);
        // Over the bound: the oldest answers go (their keys stay).
        while self.answer_bytes > MAX_ANSWER_BYTES {
            let oldest = self
                .entries
                .iter()
                .filter(|(_, e)| matches!(e.state, State::Answered { .. }))
                .min_by_key(|(_, e)| e.at)
                .map(|(k, _)| k.clone());
            let Some(k) = oldest else { break };
            self.forget_answer(&k);
        }
    }

    fn forget_answer(&mut self, id: &ReplyId) {
        if let Some(e) = self.entries.get_mut(id)
            && let State::Answered { bytes, .. } = e.state
        {
            self.answer_bytes -= bytes;
            e.state = State::Gone;
        }
    }

    fn insert(&mut self, id: ReplyId, digest: String, state: State, now: Instant) {
        if !self.entries.contains_key(&id) && self.entries.len() >= MAX_KEYS {
            let oldest = self
                .entries
                .iter()
                .filter(|(_, e)| !matches!(e.state, State::Running | State::AtAgent { .. }))
                .min_by_key(|(_, e)| e.at)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.forget_answer(&k);
                self.entries.remove(&k);
            }
        }
        self.entries.insert(
            id,
            Entry {
                digest,
                state,
                at: now,
            },
        );
    }

    /// Answers past [`KEEP_ANSWER`] go; keys past [`REMEMBER_KEY`] are forgotten.
    pub fn expire(&mut self, now: Instant) {
        let old_answers: Vec<ReplyId> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                matches!(e.state, State::Answered { .. })
                    && now.saturating_duration_since(e.at) > KEEP_ANSWER
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in old_answers {
            self.forget_answer(&k);
        }
        self.entries
            .retain(|_, e| !matches!(e.state, State::AtAgent { until, .. } if until <= now));
        self.entries.retain(|_, e| {
            !matches!(e.state, State::Gone) || now.saturating_duration_since(e.at) <= REMEMBER_KEY
        });
    }

    /// Answers held and their bytes.
    pub fn held(&self) -> (usize, usize) {
        let n = self
            .entries
            .values()
            .filter(|e| matches!(e.state, State::Answered { .. }))
            .count();
        (n, self.answer_bytes)
    }
}

/// Why a keyed request may not run now.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyRefusal {
    /// The key was used with another request body.
    Reused,
    /// A request with the key runs (here, or at an agent that has not handed it over yet).
    InUse,
    /// The key was answered and its answer is no longer held.
    Gone,
}

/// A keyed request's hold on its key: [`KeyHold::answered`] keeps the answer for retries;
/// dropped without it (the request failed or was cancelled), a retry may run the key again.
pub struct KeyHold {
    hub: Hub,
    id: ReplyId,
    digest: String,
    done: bool,
}

impl KeyHold {
    /// What the work frame carries.
    pub fn tag(&self) -> IdempotencyTag {
        self.id.tag(&self.digest)
    }

    /// The request's answer (the completion with its provenance).
    pub fn answered(mut self, completion: &Value) {
        self.done = true;
        let mut core = self.hub.core();
        core.replies
            .answered(&self.id, &self.digest, completion.clone());
        core.note_change();
    }
}

impl Drop for KeyHold {
    fn drop(&mut self) {
        if !self.done {
            let mut core = self.hub.core();
            core.replies.abandoned(&self.id);
            core.note_change();
        }
    }
}

/// What a keyed request does.
pub enum Keyed {
    /// Answer with this (the first answer, given again).
    Replay(Arc<Value>),
    /// Run it under the hold.
    Run(KeyHold),
}

impl Hub {
    /// Claims `id` for a request whose body has `digest`: the answer to give again, the hold
    /// to run under, or why not. A key this hub has no record of waits while the agents come
    /// over after this hub began to serve, and a call an agent reported running is waited for
    /// (at most `wait_at_most`: then it is still running, and the client is told so).
    pub async fn claim_key(
        &self,
        id: ReplyId,
        digest: String,
        wait_at_most: Duration,
    ) -> Result<Keyed, KeyRefusal> {
        let give_up = tokio::time::Instant::now() + wait_at_most;
        let mut changes = self.core().watch_changes();
        loop {
            let now = Instant::now();
            let (claim, handover_until) = {
                let mut core = self.core();
                let claim = core.replies.claim(&id, &digest, now);
                (claim, core.replies.handover_until())
            };
            match claim {
                Claim::Replay(c) => return Ok(Keyed::Replay(c)),
                Claim::Run => {
                    return Ok(Keyed::Run(KeyHold {
                        hub: self.clone(),
                        id,
                        digest,
                        done: false,
                    }));
                }
                Claim::Reused => return Err(KeyRefusal::Reused),
                Claim::InUse => return Err(KeyRefusal::InUse),
                Claim::Gone => return Err(KeyRefusal::Gone),
                Claim::Wait => {}
            }
            if tokio::time::Instant::now() >= give_up {
                return Err(KeyRefusal::InUse);
            }
            let wake = if handover_until > now {
                give_up.min(tokio::time::Instant::from_std(handover_until))
            } else {
                give_up
            };
            tracing::debug!(key = %id.key, "a keyed chat waits for the agents' handover");
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn id(key: &str) -> ReplyId {
        ReplyId {
            project: Arc::from("alpha"),
            key: key.into(),
        }
    }

    fn served() -> Replies {
        Replies::new(Duration::ZERO)
    }

    #[test]
    fn a_key_runs_once_then_replays_and_refuses_another_body() {
        let mut r = served();
        let now = Instant::now();
        assert!(matches!(r.claim(&id("k"), "d1", now), Claim::Run));
        assert!(matches!(r.claim(&id("k"), "d1", now), Claim::InUse));
        assert!(matches!(r.claim(&id("k"), "d2", now), Claim::Reused));
        r.answered(&id("k"), "d1", json!({"id": "gen-1"}));
        match r.claim(&id("k"), "d1", now) {
            Claim::Replay(c) => assert_eq!(c["id"], "gen-1"),
            other => panic!("{other:?}"),
        }
        assert_eq!(r.replayed, 1);
        assert!(matches!(r.claim(&id("k"), "d2", now), Claim::Reused));
        // Another project's same key is its own.
        let other = ReplyId {
            project: Arc::from("beta"),
            key: "k".into(),
        };
        assert!(matches!(r.claim(&other, "d2", now), Claim::Run));
    }

    #[test]
    fn a_failed_request_frees_its_key() {
        let mut r = served();
        let now = Instant::now();
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::Run));
        r.abandoned(&id("k"));
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::Run));
    }

    #[test]
    fn a_new_hub_waits_for_the_handover_and_for_calls_an_agent_runs() {
        let mut r = Replies::new(Duration::from_secs(5));
        let now = Instant::now();
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::Wait));
        let tag = id("k").tag("d");
        let until = now + Duration::from_secs(600);
        r.running_at("cloud-1", std::slice::from_ref(&tag), until);
        let later = now + Duration::from_secs(6);
        assert!(matches!(r.claim(&id("k"), "d", later), Claim::Wait));
        assert!(matches!(r.claim(&id("k"), "other", later), Claim::Reused));
        // The agent hands the answer over: it is new here (its cost counts), then replayed.
        assert!(r.handed_over(&tag, Some(json!({"id": "gen-9"}))));
        assert!(!r.handed_over(&tag, Some(json!({"id": "gen-9"}))), "once");
        assert!(matches!(r.claim(&id("k"), "d", later), Claim::Replay(_)));
        assert_eq!(r.handed_over, 1);
        // A call that failed at the agent, or an agent that left, is not waited for.
        let t2 = id("k2").tag("d");
        r.running_at("cloud-1", std::slice::from_ref(&t2), until);
        assert!(!r.handed_over(&t2, None));
        assert!(matches!(r.claim(&id("k2"), "d", later), Claim::Run));
        let t3 = id("k3").tag("d");
        r.running_at("cloud-2", std::slice::from_ref(&t3), until);
        assert!(r.agent_left("cloud-2"));
        assert!(matches!(r.claim(&id("k3"), "d", later), Claim::Run));
        // A call its agent no longer lists, or one past its bound, is not waited for.
        let t4 = id("k4").tag("d");
        r.running_at("cloud-3", std::slice::from_ref(&t4), until);
        r.running_at("cloud-3", &[], until);
        assert!(matches!(r.claim(&id("k4"), "d", later), Claim::Run));
        let t5 = id("k5").tag("d");
        r.running_at("cloud-3", std::slice::from_ref(&t5), later);
        assert!(matches!(r.claim(&id("k5"), "d", later), Claim::Run));
    }

    #[test]
    fn answers_are_bounded_and_expire_but_their_keys_are_remembered() {
        let mut r = served();
        let now = Instant::now();
        let big = "x".repeat(MAX_ANSWER_BYTES / 3);
        for k in ["a", "b", "c", "d"] {
            assert!(matches!(r.claim(&id(k), "d", now), Claim::Run));
            r.answered(&id(k), "d", json!({"text": big}));
        }
        let (held, bytes) = r.held();
        assert!(bytes <= MAX_ANSWER_BYTES && held < 4, "{held} {bytes}");
        assert!(matches!(r.claim(&id("a"), "d", now), Claim::Gone));
        r.expire(now + KEEP_ANSWER + Duration::from_secs(1));
        assert_eq!(r.held(), (0, 0));
        assert!(matches!(r.claim(&id("d"), "d", now), Claim::Gone));
        r.expire(now + REMEMBER_KEY + Duration::from_secs(1));
        assert!(matches!(r.claim(&id("d"), "d", now), Claim::Run));
    }

    #[test]
    fn the_digest_ignores_key_order_and_stream_but_not_content_or_role() {
        let a = json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.2});
        let b = json!({"temperature": 0.2, "stream": true, "messages": [{"content": "hi", "role": "user"}]});
        let c = json!({"messages": [{"role": "user", "content": "hi!"}], "temperature": 0.2});
        let d = |v: &Value, role| digest(role, v.as_object().unwrap());
        assert_eq!(d(&a, Role::CodeAssistant), d(&b, Role::CodeAssistant));
        assert_ne!(d(&a, Role::CodeAssistant), d(&c, Role::CodeAssistant));
        assert_ne!(d(&a, Role::CodeAssistant), d(&a, Role::RlmSandbox));
    }

    #[test]
    fn a_key_is_known_by_its_digest_only() {
        let id = key_id("sk-or-v1-typed-into-the-wrong-field");
        assert_eq!(id.len(), 32);
        assert!(!id.contains("sk-or"));
        assert_eq!(id, key_id("sk-or-v1-typed-into-the-wrong-field"));
        assert_ne!(id, key_id("sk-or-v1-typed-into-the-wrong-field2"));
    }

    #[test]
    fn a_key_is_visible_ascii_of_bounded_length() {
        assert!(check_key("3f1c2a7e-0b7d-4c55-9d0e-7f1a2b3c4d5e").is_ok());
        for bad in ["", "has space", "tab\t", "ünïcode"] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert!(check_key(&"k".repeat(MAX_KEY_CHARS + 1)).is_err());
    }
}
