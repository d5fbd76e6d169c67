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
//!   agents come over ([`Replies::handover_until`], from the moment the hub began to serve);
//!   a key whose call may still run at an agent (one it reported running, or whose lease was
//!   lost while the call ran) is waited for, before it may go upstream again, while that
//!   agent is connected or within its return bound after it left, until the agent hands the
//!   outcome over or no longer lists the call.
//!
//! Each project has a table of its own, bounded by [`ReplyLimits`]: at most
//! `keys_per_project` keys (a new key forgets the project's oldest answered key; when every
//! key it holds is still under way, the new one is refused, [`Claim::Full`]) and
//! `answer_bytes_per_project` bytes of answers (the project's oldest answers go first, their
//! keys stay). A project's keys are only ever pushed out by its own: the whole table is at
//! most the projects (the operator makes them) times one project's bounds. An answer counts
//! by the memory it takes here ([`footprint`]), not its length as JSON. Each table keeps its
//! keys ordered by age and its waits by their end, so eviction and expiry take the oldest
//! entry at O(log n) and never walk the table.
//!
//! Answers are held [`KEEP_ANSWER`]; a key is remembered [`REMEMBER_KEY`]: a retry after its
//! answer went is refused with the way to run it again (a new key). A key pushed out by its
//! project's bound after this hub counted its cost is remembered as counted for
//! [`BILLED_MEMORY`] (longer than an agent keeps an outcome), so an agent that hands its
//! answer over late does not count it again. Nothing here is stored in the state store: a
//! hub that takes over learns the answers from the agents.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

pub use crate::config::hub::ReplyLimits;
use crate::hub::Hub;
use crate::protocol::IdempotencyTag;
use crate::roles::Role;

/// How long a replayable answer is held.
pub const KEEP_ANSWER: Duration = Duration::from_secs(600);
/// How long a key is remembered after its request.
pub const REMEMBER_KEY: Duration = Duration::from_secs(24 * 3600);
/// How long a key pushed out by its project's bound is remembered as counted (its answer's
/// cost counted here): longer than an agent keeps an outcome for the next hub (10 minutes,
/// `agent::kept_answers::KEEP_FOR`).
pub const BILLED_MEMORY: Duration = Duration::from_secs(15 * 60);
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

/// The memory an answer takes while it is held: the value and what its nodes own on the heap
/// (strings' and arrays' capacity, each map entry with its key), estimated from the types'
/// sizes. Its length as JSON says little of it: many small fields take several times that.
pub fn footprint(v: &Value) -> usize {
    size_of::<Value>() + owned(v)
}

/// One map entry besides what its key and value own: the key, the value, and the map's
/// structure around them.
const MAP_ENTRY: usize = size_of::<String>() + size_of::<Value>() + 2 * size_of::<usize>();

/// What `v` owns on the heap.
fn owned(v: &Value) -> usize {
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        Value::String(s) => s.capacity(),
        Value::Array(a) => a.capacity() * size_of::<Value>() + a.iter().map(owned).sum::<usize>(),
        Value::Object(m) => m
            .iter()
            .map(|(k, x)| MAP_ENTRY + k.capacity() + owned(x))
            .sum(),
    }
}

/// The key of `index`'s oldest entry, when `due` says its instant is due.
fn oldest_due(
    index: &BTreeMap<(Instant, u64), Arc<str>>,
    due: impl Fn(Instant) -> bool,
) -> Option<Arc<str>> {
    let ((at, _), key) = index.first_key_value()?;
    due(*at).then(|| key.clone())
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
    /// An agent may still hand this key's answer over: ask again on the next change, and by
    /// this instant at the latest.
    Wait(Instant),
    /// The project holds as many keys as it may ([`ReplyLimits::keys_per_project`]), each
    /// still under way: none can be forgotten for this one yet.
    Full,
    /// Run it: the key is this request's until [`Replies::answered`] or
    /// [`Replies::abandoned`].
    Run,
}

/// An agent whose call of a key may still run, and until when it is waited for.
#[derive(Clone, Debug)]
struct AtAgent {
    agent: String,
    until: Instant,
}

enum State {
    /// A request of this hub runs the key. `at_agent`: an agent whose call of it may run on
    /// past that request (its lease was lost while the call ran): when the request ends
    /// without an answer, the key waits for that call ([`State::AtAgent`]) rather than being
    /// free.
    Running {
        at_agent: Option<AtAgent>,
    },
    /// No request here runs it, but an agent's call may: one the agent reported running (its
    /// `hello`), or one whose lease was lost while it ran.
    AtAgent(AtAgent),
    Answered {
        completion: Arc<Value>,
        bytes: usize,
    },
    Gone,
}

/// A state's kind (what a decision reads before the entry changes).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Running,
    AtAgent,
    Answered,
    Gone,
}

impl State {
    fn kind(&self) -> Kind {
        match self {
            State::Running { .. } => Kind::Running,
            State::AtAgent(_) => Kind::AtAgent,
            State::Answered { .. } => Kind::Answered,
            State::Gone => Kind::Gone,
        }
    }

    /// The agent whose call of the key may still run.
    fn agent(&self) -> Option<&AtAgent> {
        match self {
            State::AtAgent(a) | State::Running { at_agent: Some(a) } => Some(a),
            _ => None,
        }
    }
}

struct Entry {
    digest: String,
    state: State,
    /// When it last changed state (claimed, answered, reported): its age for eviction and
    /// expiry.
    at: Instant,
    /// Its place among entries of the same instant in the table's indexes (unique).
    seq: u64,
}

/// One project's keys and their indexes: every answered or gone key in `finished`, every held
/// answer in `answers` (both by age), every key waited for at an agent in `waiting` (by the
/// wait's end).
#[derive(Default)]
struct Table {
    entries: HashMap<Arc<str>, Entry>,
    answers: BTreeMap<(Instant, u64), Arc<str>>,
    finished: BTreeMap<(Instant, u64), Arc<str>>,
    waiting: BTreeMap<(Instant, u64), Arc<str>>,
    answer_bytes: usize,
    /// Keys pushed out by the project's bound after their cost counted here (a digest of the
    /// key, and when), oldest first: for [`BILLED_MEMORY`], an agent's late handover of one
    /// counts nothing more.
    forgotten: HashMap<u64, Instant>,
    forgotten_order: VecDeque<(Instant, u64)>,
}

impl Table {
    fn index(&mut self, key: &Arc<str>, e: &Entry) {
        match &e.state {
            State::Answered { bytes, .. } => {
                self.answers.insert((e.at, e.seq), key.clone());
                self.finished.insert((e.at, e.seq), key.clone());
                self.answer_bytes += bytes;
            }
            State::Gone => {
                self.finished.insert((e.at, e.seq), key.clone());
            }
            State::AtAgent(a) => {
                self.waiting.insert((a.until, e.seq), key.clone());
            }
            State::Running { .. } => {}
        }
    }

    fn unindex(&mut self, e: &Entry) {
        match &e.state {
            State::Answered { bytes, .. } => {
                self.answers.remove(&(e.at, e.seq));
                self.finished.remove(&(e.at, e.seq));
                self.answer_bytes = self.answer_bytes.saturating_sub(*bytes);
            }
            State::Gone => {
                self.finished.remove(&(e.at, e.seq));
            }
            State::AtAgent(a) => {
                self.waiting.remove(&(a.until, e.seq));
            }
            State::Running { .. } => {}
        }
    }

    /// Remembers that `key` (its digest `h`) was counted here, within `bound` of them.
    fn remember_counted(&mut self, h: u64, now: Instant, bound: usize) {
        self.forgotten.insert(h, now);
        self.forgotten_order.push_back((now, h));
        while self.forgotten_order.len() > bound {
            self.drop_oldest_counted();
        }
    }

    fn drop_oldest_counted(&mut self) {
        if let Some((at, h)) = self.forgotten_order.pop_front()
            && self.forgotten.get(&h) == Some(&at)
        {
            self.forgotten.remove(&h);
        }
    }
}

/// The keys this hub has seen, one table per project.
pub struct Replies {
    limits: ReplyLimits,
    tables: HashMap<Arc<str>, Table>,
    /// The keys whose call an agent may still run ([`State::agent`]), by agent.
    by_agent: HashMap<String, HashSet<ReplyId>>,
    next_seq: u64,
    answers: usize,
    answer_bytes: usize,
    /// Digests of forgotten keys (per process: never stored or sent).
    hasher: RandomState,
    handover_until: Instant,
    /// Answers replayed to retries.
    pub replayed: u64,
    /// Answers agents handed over (new to this hub).
    pub handed_over: u64,
    /// Index entries eviction and expiry looked at (what they cost).
    #[cfg(test)]
    steps: u64,
}

impl Replies {
    /// A hub that began to serve now: keyed requests it has no record of wait `handover`
    /// for the agents to come over. Each project's table is bounded by `limits`.
    pub fn new(handover: Duration, limits: ReplyLimits) -> Self {
        Self {
            limits,
            tables: HashMap::new(),
            by_agent: HashMap::new(),
            next_seq: 0,
            answers: 0,
            answer_bytes: 0,
            hasher: RandomState::new(),
            handover_until: Instant::now() + handover,
            replayed: 0,
            handed_over: 0,
            #[cfg(test)]
            steps: 0,
        }
    }

    /// New bounds: each project's table meets them at its next key or answer.
    pub fn set_limits(&mut self, limits: ReplyLimits) {
        self.limits = limits;
    }

    pub fn limits(&self) -> ReplyLimits {
        self.limits
    }

    /// Until when a key this hub has no record of waits for the agents' handover.
    pub fn handover_until(&self) -> Instant {
        self.handover_until
    }

    fn entry(&self, id: &ReplyId) -> Option<&Entry> {
        self.tables.get(&id.project)?.entries.get(id.key.as_str())
    }

    fn kind(&self, id: &ReplyId) -> Option<Kind> {
        self.entry(id).map(|e| e.state.kind())
    }

    /// Puts `id` in `state` (replacing what it had), aged from `at`.
    fn put(&mut self, id: &ReplyId, digest: String, state: State, at: Instant) {
        self.remove(id);
        self.next_seq += 1;
        let entry = Entry {
            digest,
            state,
            at,
            seq: self.next_seq,
        };
        if let Some(a) = entry.state.agent() {
            self.by_agent
                .entry(a.agent.clone())
                .or_default()
                .insert(id.clone());
        }
        if let State::Answered { bytes, .. } = &entry.state {
            self.answers += 1;
            self.answer_bytes += bytes;
        }
        let table = self.tables.entry(id.project.clone()).or_default();
        let key: Arc<str> = Arc::from(id.key.as_str());
        table.index(&key, &entry);
        table.entries.insert(key, entry);
    }

    /// Takes `id` out of its table and the indexes.
    fn remove(&mut self, id: &ReplyId) -> Option<Entry> {
        let table = self.tables.get_mut(&id.project)?;
        let entry = table.entries.remove(id.key.as_str())?;
        table.unindex(&entry);
        if let State::Answered { bytes, .. } = &entry.state {
            self.answers = self.answers.saturating_sub(1);
            self.answer_bytes = self.answer_bytes.saturating_sub(*bytes);
        }
        if let Some(a) = entry.state.agent()
            && let Some(ids) = self.by_agent.get_mut(&a.agent)
        {
            ids.remove(id);
            if ids.is_empty() {
                self.by_agent.remove(&a.agent);
            }
        }
        Some(entry)
    }

    /// `id` in `state`, its digest and age kept.
    fn restate(&mut self, id: &ReplyId, state: State) {
        if let Some(e) = self.remove(id) {
            self.put(id, e.digest, state, e.at);
        }
    }

    pub fn claim(&mut self, id: &ReplyId, digest: &str, now: Instant) -> Claim {
        let seen = self.entry(id).map(|e| {
            if e.digest != digest {
                return Some(Claim::Reused);
            }
            match &e.state {
                State::Running { .. } => Some(Claim::InUse),
                State::AtAgent(a) if a.until > now => Some(Claim::Wait(a.until)),
                // Its agent never said how it ended: it is not waited for any more.
                State::AtAgent(_) => None,
                State::Answered { completion, .. } => Some(Claim::Replay(completion.clone())),
                State::Gone => Some(Claim::Gone),
            }
        });
        match seen {
            Some(Some(claim)) => {
                if matches!(claim, Claim::Replay(_)) {
                    self.replayed += 1;
                }
                return claim;
            }
            Some(None) => {
                self.remove(id);
            }
            None => {}
        }
        if now < self.handover_until {
            return Claim::Wait(self.handover_until);
        }
        if !self.make_room(&id.project, now) {
            return Claim::Full;
        }
        self.put(
            id,
            digest.to_string(),
            State::Running { at_agent: None },
            now,
        );
        Claim::Run
    }

    /// A running key was answered: the answer is held for retries.
    pub fn answered(&mut self, id: &ReplyId, digest: &str, completion: Value) {
        self.hold(id, digest, completion, Instant::now());
    }

    /// A running key's request ended without an answer: a retry may run it again, unless an
    /// agent's call of it may still run (its lease was lost while the call ran): then the key
    /// waits for that call's outcome.
    pub fn abandoned(&mut self, id: &ReplyId) {
        let now = Instant::now();
        let next = match self.entry(id).map(|e| &e.state) {
            Some(State::Running { at_agent: Some(a) }) if a.until > now => Some(Some(a.clone())),
            Some(State::Running { .. }) => Some(None),
            _ => None,
        };
        match next {
            Some(Some(a)) => self.restate(id, State::AtAgent(a)),
            Some(None) => {
                self.remove(id);
            }
            None => {}
        }
    }

    /// `agent`'s call of `tag` may run until `until`: its lease was lost while the call ran,
    /// or the agent reported it running. A retry waits for its outcome rather than going
    /// upstream again (a key this hub has no record of is remembered for it).
    pub fn call_at(&mut self, tag: &IdempotencyTag, agent: &str, until: Instant) {
        let id = ReplyId::of(tag);
        let a = AtAgent {
            agent: agent.to_string(),
            until,
        };
        match self.kind(&id) {
            Some(Kind::Answered | Kind::Gone) => {}
            Some(Kind::Running) => self.restate(&id, State::Running { at_agent: Some(a) }),
            Some(Kind::AtAgent) => self.restate(&id, State::AtAgent(a)),
            None => {
                let now = Instant::now();
                // A call under way is never refused a place: over the bound only by such.
                let _ = self.make_room(&id.project, now);
                self.put(&id, tag.digest.clone(), State::AtAgent(a), now);
            }
        }
    }

    /// `agent`'s call of `tag` ended (it failed, or its lease is live again) or is no longer
    /// waited for: the key waits for it no more.
    pub fn call_ended(&mut self, tag: &IdempotencyTag, agent: &str) {
        let id = ReplyId::of(tag);
        let Some(e) = self.entry(&id) else {
            return;
        };
        if e.state.agent().is_none_or(|a| a.agent != agent) {
            return;
        }
        match e.state.kind() {
            Kind::Running => self.restate(&id, State::Running { at_agent: None }),
            Kind::AtAgent => {
                self.remove(&id);
            }
            Kind::Answered | Kind::Gone => {}
        }
    }

    /// `agent` runs these keyed calls for an earlier session (all it runs: see `hello`),
    /// each until `until` at the latest. A call it reported before and does not list now has
    /// ended: its outcome follows this report at once (`kept`), so it is waited for until
    /// `unlisted_until` at the latest.
    pub fn running_at(
        &mut self,
        agent: &str,
        tags: &[IdempotencyTag],
        until: Instant,
        unlisted_until: Instant,
    ) {
        let listed: HashSet<ReplyId> = tags.iter().map(ReplyId::of).collect();
        let unlisted: Vec<ReplyId> = self
            .by_agent
            .get(agent)
            .map(|ids| ids.difference(&listed).cloned().collect())
            .unwrap_or_default();
        for id in &unlisted {
            self.wait_for(id, agent, |u| u.min(unlisted_until));
        }
        for tag in tags {
            self.call_at(tag, agent, until);
        }
    }

    /// `agent` left: every call of it a key waits for is waited for until `back_by` (its
    /// return bound: it comes back and reports the call, or the key is free). Whether any is.
    pub fn agent_left(&mut self, agent: &str, back_by: Instant) -> bool {
        let ids: Vec<ReplyId> = self
            .by_agent
            .get(agent)
            .map(|ids| ids.iter().cloned().collect())
            .unwrap_or_default();
        for id in &ids {
            self.wait_for(id, agent, |_| back_by);
        }
        !ids.is_empty()
    }

    /// The wait of `id` for `agent`'s call, until `until(old)`.
    fn wait_for(&mut self, id: &ReplyId, agent: &str, until: impl Fn(Instant) -> Instant) {
        let Some(e) = self.entry(id) else {
            return;
        };
        let Some(a) = e.state.agent().filter(|a| a.agent == agent) else {
            return;
        };
        let a = AtAgent {
            agent: a.agent.clone(),
            until: until(a.until),
        };
        let state = match e.state.kind() {
            Kind::Running => State::Running { at_agent: Some(a) },
            _ => State::AtAgent(a),
        };
        self.restate(id, state);
    }

    /// An agent handed over a keyed call's outcome (`None`: the call failed). Whether it is
    /// an answer this hub did not hold and never counted: its cost is then counted here.
    pub fn handed_over(&mut self, tag: &IdempotencyTag, completion: Option<Value>) -> bool {
        let id = ReplyId::of(tag);
        let now = Instant::now();
        match (self.kind(&id), completion) {
            (Some(Kind::Answered | Kind::Gone), _) => false,
            // A request of this key runs here (a parked chat, or a retry that did not wait
            // long enough): the answer is held now (its request may still fail), and the call
            // was made, so it counts.
            (Some(Kind::Running | Kind::AtAgent), Some(c)) => {
                self.handed_over += 1;
                self.hold(&id, &tag.digest, c, now);
                true
            }
            // The call failed: nothing runs at an agent for the key any more.
            (Some(Kind::Running), None) => {
                self.restate(&id, State::Running { at_agent: None });
                false
            }
            (Some(Kind::AtAgent), None) => {
                self.remove(&id);
                false
            }
            // Pushed out by its project's bound after this hub counted it (the agent missed
            // the `delivered`): it counts nothing more.
            (None, Some(_)) if self.was_counted(&id) => false,
            (None, Some(c)) => {
                self.handed_over += 1;
                self.hold(&id, &tag.digest, c, now);
                true
            }
            (None, None) => false,
        }
    }

    /// Whether `id` was pushed out by its project's bound, within [`BILLED_MEMORY`], after
    /// its cost counted here.
    fn was_counted(&self, id: &ReplyId) -> bool {
        let h = self.hasher.hash_one(id.key.as_str());
        self.tables
            .get(&id.project)
            .is_some_and(|t| t.forgotten.contains_key(&h))
    }

    fn hold(&mut self, id: &ReplyId, digest: &str, completion: Value, now: Instant) {
        let bytes = footprint(&completion);
        let state = if bytes > self.limits.answer_bytes_per_project {
            // Larger than all the project's room: the key is remembered without its answer.
            State::Gone
        } else {
            State::Answered {
                completion: Arc::new(completion),
                bytes,
            }
        };
        if self.entry(id).is_none() {
            // An answer is never refused a place: over the bound only while every other key
            // of the project is under way.
            let _ = self.make_room(&id.project, now);
        }
        self.put(id, digest.to_string(), state, now);
        self.trim_answers(&id.project);
    }

    /// Room for one more key of `project`: while it holds its bound, its oldest answered key
    /// is forgotten (remembered as counted, [`BILLED_MEMORY`]). Whether there is room (not
    /// when every key it holds is under way). Another project's keys are never touched.
    fn make_room(&mut self, project: &Arc<str>, now: Instant) -> bool {
        let bound = self.limits.keys_per_project.max(1);
        loop {
            let Some(table) = self.tables.get(project) else {
                return true;
            };
            if table.entries.len() < bound {
                return true;
            }
            #[cfg(test)]
            {
                self.steps += 1;
            }
            let Some((_, key)) = table.finished.first_key_value() else {
                return false;
            };
            let id = ReplyId {
                project: project.clone(),
                key: key.to_string(),
            };
            let h = self.hasher.hash_one(id.key.as_str());
            self.remove(&id);
            if let Some(table) = self.tables.get_mut(project) {
                table.remember_counted(h, now, bound);
            }
        }
    }

    /// While `project`'s answers take more than its bound, its oldest go (their keys stay).
    fn trim_answers(&mut self, project: &Arc<str>) {
        let bound = self.limits.answer_bytes_per_project;
        loop {
            let Some(table) = self.tables.get(project) else {
                return;
            };
            if table.answer_bytes <= bound {
                return;
            }
            #[cfg(test)]
            {
                self.steps += 1;
            }
            let Some((_, key)) = table.answers.first_key_value() else {
                return;
            };
            let id = ReplyId {
                project: project.clone(),
                key: key.to_string(),
            };
            self.forget_answer(&id);
        }
    }

    /// An answer goes; its key stays (gone), aged as it was.
    fn forget_answer(&mut self, id: &ReplyId) {
        if self.kind(id) == Some(Kind::Answered) {
            self.restate(id, State::Gone);
        }
    }

    /// Answers past [`KEEP_ANSWER`] go; keys past [`REMEMBER_KEY`] are forgotten; waits for
    /// agents past their end end; keys remembered as counted past [`BILLED_MEMORY`] go. Each
    /// table is read from its oldest entry on, and only as far as something is due.
    pub fn expire(&mut self, now: Instant) {
        let old = |age: Duration| move |at: Instant| now.saturating_duration_since(at) > age;
        let projects: Vec<Arc<str>> = self.tables.keys().cloned().collect();
        for project in projects {
            let id = |key: Arc<str>| ReplyId {
                project: project.clone(),
                key: key.to_string(),
            };
            loop {
                #[cfg(test)]
                {
                    self.steps += 1;
                }
                let due = self
                    .tables
                    .get(&project)
                    .and_then(|t| oldest_due(&t.answers, old(KEEP_ANSWER)));
                let Some(key) = due else {
                    break;
                };
                self.forget_answer(&id(key));
            }
            loop {
                #[cfg(test)]
                {
                    self.steps += 1;
                }
                let due = self
                    .tables
                    .get(&project)
                    .and_then(|t| oldest_due(&t.finished, old(REMEMBER_KEY)));
                let Some(key) = due else {
                    break;
                };
                self.remove(&id(key));
            }
            loop {
                #[cfg(test)]
                {
                    self.steps += 1;
                }
                let due = self
                    .tables
                    .get(&project)
                    .and_then(|t| oldest_due(&t.waiting, |until| until <= now));
                let Some(key) = due else {
                    break;
                };
                self.remove(&id(key));
            }
            let billed = old(BILLED_MEMORY);
            if let Some(table) = self.tables.get_mut(&project) {
                while table
                    .forgotten_order
                    .front()
                    .is_some_and(|(at, _)| billed(*at))
                {
                    table.drop_oldest_counted();
                }
                if table.entries.is_empty() && table.forgotten_order.is_empty() {
                    self.tables.remove(&project);
                }
            }
        }
    }

    /// Answers held and their bytes (their memory, [`footprint`]).
    pub fn held(&self) -> (usize, usize) {
        (self.answers, self.answer_bytes)
    }

    /// Keys held for `project`.
    pub fn keys_of(&self, project: &str) -> usize {
        self.tables.get(project).map_or(0, |t| t.entries.len())
    }

    /// Index entries eviction and expiry looked at so far.
    #[cfg(test)]
    fn steps(&self) -> u64 {
        self.steps
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
    /// The project holds as many keys as it may, each still under way.
    Full,
}

/// A keyed request's hold on its key: [`KeyHold::answered`] keeps the answer for retries;
/// dropped without it (the request failed or was cancelled), a retry may run the key again,
/// unless an agent's call of it may still run ([`Replies::abandoned`]).
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
    /// over after this hub began to serve, and a call an agent may still run is waited for
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
            let claim = self.core().replies.claim(&id, &digest, now);
            let wait_until = match claim {
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
                Claim::Full => return Err(KeyRefusal::Full),
                Claim::Wait(until) => until,
            };
            if tokio::time::Instant::now() >= give_up {
                return Err(KeyRefusal::InUse);
            }
            // Asked again on the next change, and when the wait ends (the handover window, or
            // the bound of an agent's call).
            let wake = give_up.min(tokio::time::Instant::from_std(wait_until.max(now)));
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
        in_project("alpha", key)
    }

    fn in_project(project: &str, key: &str) -> ReplyId {
        ReplyId {
            project: Arc::from(project),
            key: key.into(),
        }
    }

    fn served() -> Replies {
        Replies::new(Duration::ZERO, ReplyLimits::default())
    }

    fn bounded(keys_per_project: usize, answer_bytes_per_project: usize) -> Replies {
        Replies::new(
            Duration::ZERO,
            ReplyLimits {
                keys_per_project,
                answer_bytes_per_project,
            },
        )
    }

    /// Claims `id` and answers it with `completion`.
    fn answer(r: &mut Replies, id: &ReplyId, completion: Value) {
        assert!(matches!(r.claim(id, "d", Instant::now()), Claim::Run));
        r.answered(id, "d", completion);
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
        let other = in_project("beta", "k");
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
        let mut r = Replies::new(Duration::from_secs(5), ReplyLimits::default());
        let now = Instant::now();
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::Wait(_)));
        let tag = id("k").tag("d");
        let until = now + Duration::from_secs(600);
        r.running_at("cloud-1", std::slice::from_ref(&tag), until, until);
        let later = now + Duration::from_secs(6);
        assert!(matches!(r.claim(&id("k"), "d", later), Claim::Wait(u) if u == until));
        assert!(matches!(r.claim(&id("k"), "other", later), Claim::Reused));
        // The agent hands the answer over: it is new here (its cost counts), then replayed.
        assert!(r.handed_over(&tag, Some(json!({"id": "gen-9"}))));
        assert!(!r.handed_over(&tag, Some(json!({"id": "gen-9"}))), "once");
        assert!(matches!(r.claim(&id("k"), "d", later), Claim::Replay(_)));
        assert_eq!(r.handed_over, 1);
        // A call that failed at the agent is not waited for.
        let t2 = id("k2").tag("d");
        r.running_at("cloud-1", std::slice::from_ref(&t2), until, until);
        assert!(!r.handed_over(&t2, None));
        assert!(matches!(r.claim(&id("k2"), "d", later), Claim::Run));
        // An agent that left is waited for until its return bound: back by then and still
        // running the call, it is waited for again.
        let t3 = id("k3").tag("d");
        r.running_at("cloud-2", std::slice::from_ref(&t3), until, until);
        let back_by = later + Duration::from_secs(20);
        assert!(r.agent_left("cloud-2", back_by));
        assert!(matches!(r.claim(&id("k3"), "d", later), Claim::Wait(u) if u == back_by));
        r.running_at("cloud-2", std::slice::from_ref(&t3), until, until);
        assert!(matches!(r.claim(&id("k3"), "d", back_by), Claim::Wait(u) if u == until));
        assert!(r.agent_left("cloud-2", back_by));
        assert!(matches!(r.claim(&id("k3"), "d", back_by), Claim::Run));
        // A call its agent no longer lists ended: its outcome follows the report, and is
        // waited for until `unlisted_until`; one past its bound is not waited for.
        let t4 = id("k4").tag("d");
        r.running_at("cloud-3", std::slice::from_ref(&t4), until, until);
        let soon = later + Duration::from_secs(1);
        r.running_at("cloud-3", &[], until, soon);
        assert!(matches!(r.claim(&id("k4"), "d", later), Claim::Wait(u) if u == soon));
        assert!(matches!(r.claim(&id("k4"), "d", soon), Claim::Run));
        let t5 = id("k5").tag("d");
        r.running_at("cloud-3", std::slice::from_ref(&t5), later, later);
        assert!(matches!(r.claim(&id("k5"), "d", later), Claim::Run));
    }

    #[test]
    fn a_key_whose_call_may_still_run_at_an_agent_waits_for_it_after_its_request_ends() {
        let mut r = served();
        let now = Instant::now();
        let tag = id("k").tag("d");
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::Run));
        // Its lease was lost while agent a's call ran; then its request ended (a client gone,
        // a stream cut): the key waits for a's call, not for a second upstream call.
        let until = now + Duration::from_secs(20);
        r.call_at(&tag, "a", until);
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::InUse));
        r.abandoned(&id("k"));
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::Wait(u) if u == until));
        assert!(r.handed_over(&tag, Some(json!({"id": "gen-1"}))));
        assert!(matches!(r.claim(&id("k"), "d", now), Claim::Replay(_)));
        // The call failed at the agent: the key is free once its request ends.
        let t2 = id("k2").tag("d");
        assert!(matches!(r.claim(&id("k2"), "d", now), Claim::Run));
        r.call_at(&t2, "a", until);
        assert!(!r.handed_over(&t2, None));
        r.abandoned(&id("k2"));
        assert!(matches!(r.claim(&id("k2"), "d", now), Claim::Run));
        // Its lease is live again (or its call ended): likewise.
        let t3 = id("k3").tag("d");
        assert!(matches!(r.claim(&id("k3"), "d", now), Claim::Run));
        r.call_at(&t3, "a", until);
        r.call_ended(&t3, "b");
        r.call_ended(&t3, "a");
        r.abandoned(&id("k3"));
        assert!(matches!(r.claim(&id("k3"), "d", now), Claim::Run));
    }

    #[test]
    fn one_projects_keys_never_push_out_anothers() {
        let mut r = bounded(8, 1 << 20);
        let beta = in_project("beta", "b");
        answer(&mut r, &beta, json!({"id": "gen-beta"}));
        // Alpha sends a thousand cheap keyed chats: it pushes out only its own oldest keys.
        for i in 0..1000 {
            answer(&mut r, &id(&format!("a{i}")), json!({"id": i}));
        }
        assert_eq!(r.keys_of("alpha"), 8);
        assert_eq!(r.keys_of("beta"), 1);
        assert!(
            matches!(r.claim(&beta, "d", Instant::now()), Claim::Replay(c) if c["id"] == "gen-beta")
        );
        assert!(matches!(
            r.claim(&id("a999"), "d", Instant::now()),
            Claim::Replay(_)
        ));
        assert!(
            matches!(r.claim(&id("a0"), "d", Instant::now()), Claim::Run),
            "forgotten"
        );
        // Every key of a project under way: a new one of it is refused (there is nothing of
        // its own to forget), and another project's still runs.
        let mut r = bounded(2, 1 << 20);
        let now = Instant::now();
        assert!(matches!(r.claim(&id("r1"), "d", now), Claim::Run));
        assert!(matches!(r.claim(&id("r2"), "d", now), Claim::Run));
        assert!(matches!(r.claim(&id("r3"), "d", now), Claim::Full));
        assert!(matches!(r.claim(&beta, "d", now), Claim::Run));
        r.answered(&id("r1"), "d", json!({"id": 1}));
        assert!(
            matches!(r.claim(&id("r3"), "d", now), Claim::Run),
            "r1 was forgotten for it"
        );
        // Answers too: alpha's large answers push out alpha's own, never beta's.
        let mut r = bounded(100, 64 << 10);
        answer(&mut r, &beta, json!({"text": "x".repeat(40 << 10)}));
        for i in 0..10 {
            answer(
                &mut r,
                &id(&format!("big{i}")),
                json!({"text": "y".repeat(40 << 10)}),
            );
        }
        assert!(matches!(
            r.claim(&beta, "d", Instant::now()),
            Claim::Replay(_)
        ));
        assert!(matches!(
            r.claim(&id("big9"), "d", Instant::now()),
            Claim::Replay(_)
        ));
        assert!(matches!(
            r.claim(&id("big8"), "d", Instant::now()),
            Claim::Gone
        ));
    }

    #[test]
    fn eviction_and_expiry_take_the_oldest_entry_and_never_walk_the_table() {
        let mut r = bounded(1000, 16 << 20);
        for i in 0..100_000 {
            answer(&mut r, &id(&format!("k{i}")), json!({"id": i}));
        }
        assert_eq!(r.keys_of("alpha"), 1000);
        // One index entry looked at per key forgotten: none for the first thousand.
        assert_eq!(r.steps(), 99_000);
        // Nothing due: one look at the oldest entry of each index of the one table.
        let before = r.steps();
        r.expire(Instant::now());
        assert_eq!(r.steps() - before, 3);
        assert_eq!(r.held().0, 1000);
        // Every answer due: one look each, and one more per index.
        let before = r.steps();
        r.expire(Instant::now() + KEEP_ANSWER + Duration::from_secs(1));
        assert_eq!(r.held(), (0, 0));
        assert_eq!(r.steps() - before, 1000 + 3);
        assert_eq!(r.keys_of("alpha"), 1000, "their keys stay");
    }

    #[test]
    fn a_large_answer_after_many_small_ones_pushes_out_only_what_it_needs() {
        let small = json!({"id": "x".repeat(100)});
        let each = footprint(&small);
        let mut r = bounded(10_000, 1000 * each);
        for i in 0..1000 {
            answer(&mut r, &id(&format!("s{i}")), small.clone());
        }
        assert_eq!(r.held(), (1000, 1000 * each));
        let before = r.steps();
        let large = json!({"text": "y".repeat(100 * each)});
        answer(&mut r, &id("large"), large.clone());
        let (held, bytes) = r.held();
        assert!(bytes <= 1000 * each, "{bytes}");
        let gone = 1001 - held as u64;
        // Only the oldest answers needed for its room went, one look each.
        assert!(gone <= 102, "{gone}");
        assert_eq!(r.steps() - before, gone);
        assert!(matches!(
            r.claim(&id("s0"), "d", Instant::now()),
            Claim::Gone
        ));
        assert!(matches!(
            r.claim(&id("s999"), "d", Instant::now()),
            Claim::Replay(_)
        ));
        assert!(matches!(
            r.claim(&id("large"), "d", Instant::now()),
            Claim::Replay(_)
        ));
    }

    #[test]
    fn answers_count_by_their_memory_not_their_json() {
        // Many small fields: the value takes several times its JSON in memory.
        let fields: serde_json::Map<String, Value> =
            (0..2000).map(|i| (format!("{i}"), json!("v"))).collect();
        let many = Value::Object(fields);
        let json_len = many.to_string().len();
        let memory = footprint(&many);
        assert!(memory > 5 * json_len, "{memory} vs {json_len}");
        // One long string: about its length.
        let text = json!({"content": "z".repeat(100_000)});
        assert!(footprint(&text) >= 100_000 && footprint(&text) < 101_000);
        // A bound between the two: the small-field answer is not held (its key is), the
        // other is, counted by its memory.
        let mut r = bounded(100, 4 * json_len);
        answer(&mut r, &id("many"), many);
        assert_eq!(r.held(), (0, 0));
        assert!(matches!(
            r.claim(&id("many"), "d", Instant::now()),
            Claim::Gone
        ));
        let small = json!({"content": "z".repeat(json_len)});
        let bytes = footprint(&small);
        answer(&mut r, &id("text"), small);
        assert_eq!(r.held(), (1, bytes));
    }

    #[test]
    fn a_late_handover_of_a_key_pushed_out_after_it_was_counted_counts_nothing_more() {
        let mut r = bounded(2, 1 << 20);
        let tag = id("k").tag("d");
        answer(&mut r, &id("k"), json!({"id": "gen-k"}));
        answer(&mut r, &id("x"), json!({"id": "gen-x"}));
        answer(&mut r, &id("y"), json!({"id": "gen-y"}));
        assert_eq!(r.keys_of("alpha"), 2, "k was pushed out");
        // Its agent missed the `delivered` and hands it over again: counted here already.
        assert!(!r.handed_over(&tag, Some(json!({"id": "gen-k"}))));
        assert_eq!(r.handed_over, 0);
        // Another project's key of the same name was never counted here.
        let beta = in_project("beta", "k").tag("d");
        assert!(r.handed_over(&beta, Some(json!({"id": "gen-bk"}))));
        // Past the time an agent keeps an outcome, it is not remembered as counted.
        r.expire(Instant::now() + BILLED_MEMORY + Duration::from_secs(1));
        assert!(r.handed_over(&tag, Some(json!({"id": "gen-k"}))));
        const _: () =
            assert!(BILLED_MEMORY.as_secs() > crate::agent::kept_answers::KEEP_FOR.as_secs());
    }

    #[test]
    fn answers_are_bounded_and_expire_but_their_keys_are_remembered() {
        let limit = ReplyLimits::default().answer_bytes_per_project;
        let mut r = served();
        let now = Instant::now();
        let big = "x".repeat(limit / 3);
        for k in ["a", "b", "c", "d"] {
            assert!(matches!(r.claim(&id(k), "d", now), Claim::Run));
            r.answered(&id(k), "d", json!({"text": big}));
        }
        let (held, bytes) = r.held();
        assert!(bytes <= limit && held < 4, "{held} {bytes}");
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
