//! Keyed chats' answers an agent keeps for the next hub.
//!
//! A client may send a chat with an `Idempotency-Key`; the hub tags its work frame with the
//! key. Such a call runs to its end even when the session that leased it ends (a frozen or
//! cut-off leader), and its outcome is kept here a short while, bounded in count and bytes.
//! When a session to a hub that takes them starts, the agent reports the keyed calls still
//! running (`hello.answering`) and sends every kept outcome of an earlier session (`kept`);
//! one that finishes later goes to the session of the moment. The hub answers a retry with
//! the same key from it, so the upstream is paid once.
//!
//! Why keep answers the old hub may have received: a write into a frozen hub's socket
//! succeeds (the kernel buffers it), so "sent" is not "delivered". The hub ignores an answer
//! it already holds, so handing one over twice costs nothing.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::protocol::{AnsweringCall, IdempotencyTag, KeptAnswer, MAX_KEPT_ANSWERS};

/// The most bytes of kept answers (their JSON) held at once: the oldest go first.
pub const MAX_KEPT_BYTES: usize = 8 << 20;

/// How long an answer is kept after its call ended.
pub const KEEP_FOR: Duration = Duration::from_secs(600);

struct Kept {
    answer: KeptAnswer,
    /// The session (the agent's socket count) whose work it was.
    socket: u64,
    bytes: usize,
    at: Instant,
}

#[derive(Default)]
struct Held {
    kept: VecDeque<Kept>,
    bytes: usize,
    /// Each keyed call under way: what `hello` reports, its session and its own number.
    running: Vec<(AnsweringCall, u64, u64)>,
    next_call: u64,
}

/// The keyed calls running and the outcomes kept; [`KeptAnswers::changes`] ticks when one is
/// added, so a running session sends it.
pub struct KeptAnswers {
    held: Mutex<Held>,
    changes: watch::Sender<u64>,
}

impl Default for KeptAnswers {
    fn default() -> Self {
        Self {
            held: Mutex::new(Held::default()),
            changes: watch::Sender::new(0),
        }
    }
}

/// A keyed call under way: dropped without [`Running::finish`] (the hub cancelled it), it is
/// no longer reported running.
pub struct Running {
    kept: Arc<KeptAnswers>,
    tag: IdempotencyTag,
    socket: u64,
    /// This call's own number (two calls of one key may overlap: a cancelled one ending late).
    call: u64,
    done: bool,
}

impl Running {
    /// The call ended: its outcome (made for this call's tag) is kept, and the running entry
    /// goes.
    pub fn finish(mut self, answer: impl FnOnce(IdempotencyTag) -> KeptAnswer) {
        self.done = true;
        let answer = answer(self.tag.clone());
        self.kept.finish(self.call, self.socket, answer);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            self.kept.lock().running.retain(|(_, _, n)| *n != self.call);
        }
    }
}

impl KeptAnswers {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A keyed call of session `socket` starts on `provider`.
    pub fn start(self: &Arc<Self>, tag: IdempotencyTag, provider: &str, socket: u64) -> Running {
        let mut held = self.lock();
        // A new call of the key: an outcome kept of an earlier one is stale (a failure the
        // hub already requeued), and must not reach a hub as this call's.
        if let Some(i) = held.kept.iter().position(|k| k.answer.tag == tag)
            && let Some(old) = held.kept.remove(i)
        {
            held.bytes -= old.bytes;
        }
        held.next_call += 1;
        let call = held.next_call;
        let report = AnsweringCall {
            tag: tag.clone(),
            provider: provider.to_string(),
        };
        held.running.push((report, socket, call));
        // Bounded like the kept ones: the oldest report goes (its call still runs).
        if held.running.len() > MAX_KEPT_ANSWERS {
            held.running.remove(0);
        }
        Running {
            kept: Arc::clone(self),
            tag,
            socket,
            call,
            done: false,
        }
    }

    fn finish(&self, call: u64, socket: u64, answer: KeptAnswer) {
        let bytes = serde_json::to_string(&answer).map_or(usize::MAX, |s| s.len());
        let tag = answer.tag.clone();
        let tag = &tag;
        {
            let mut held = self.lock();
            held.running.retain(|(_, _, n)| *n != call);
            if bytes > MAX_KEPT_BYTES {
                tracing::warn!(bytes, key = %tag.key, "a keyed answer larger than the agent keeps is not kept");
                return;
            }
            held.kept.retain(|k| k.answer.tag != *tag);
            held.bytes = held.kept.iter().map(|k| k.bytes).sum();
            while held.kept.len() >= MAX_KEPT_ANSWERS || held.bytes + bytes > MAX_KEPT_BYTES {
                let Some(old) = held.kept.pop_front() else {
                    break;
                };
                held.bytes -= old.bytes;
            }
            held.bytes += bytes;
            held.kept.push_back(Kept {
                answer,
                socket,
                bytes,
                at: Instant::now(),
            });
        }
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Drops what is past [`KEEP_FOR`].
    fn expire(held: &mut Held, now: Instant) {
        while held
            .kept
            .front()
            .is_some_and(|k| now.saturating_duration_since(k.at) > KEEP_FOR)
        {
            if let Some(old) = held.kept.pop_front() {
                held.bytes -= old.bytes;
            }
        }
    }

    /// Keyed calls still running for sessions other than `socket` (what `hello` reports).
    pub fn running_elsewhere(&self, socket: u64) -> Vec<AnsweringCall> {
        self.lock()
            .running
            .iter()
            .filter(|(_, s, _)| *s != socket)
            .map(|(c, _, _)| c.clone())
            .collect()
    }

    /// Kept outcomes of sessions other than `socket` that `sent` does not list yet; each one
    /// returned is added to `sent`.
    pub fn to_send(&self, socket: u64, sent: &mut Vec<IdempotencyTag>) -> Vec<KeptAnswer> {
        let mut held = self.lock();
        Self::expire(&mut held, Instant::now());
        let mut out = Vec::new();
        for k in &held.kept {
            if k.socket != socket && !sent.contains(&k.answer.tag) {
                sent.push(k.answer.tag.clone());
                out.push(k.answer.clone());
            }
        }
        out
    }

    /// A hub holds this answer: it is kept no longer.
    pub fn delivered(&self, tag: &IdempotencyTag) {
        let mut held = self.lock();
        if let Some(i) = held.kept.iter().position(|k| k.answer.tag == *tag)
            && let Some(k) = held.kept.remove(i)
        {
            held.bytes -= k.bytes;
        }
    }

    /// Ticks when an outcome is kept.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Outcomes held now and their bytes.
    pub fn held(&self) -> (usize, usize) {
        let held = self.lock();
        (held.kept.len(), held.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Backend, WorkOutput};

    fn tag(key: &str) -> IdempotencyTag {
        IdempotencyTag {
            project: "default".into(),
            key: key.into(),
            digest: "d".into(),
        }
    }

    fn answer(text: &str) -> impl FnOnce(IdempotencyTag) -> KeptAnswer {
        let text = text.to_string();
        move |tag| KeptAnswer {
            tag,
            provider: "code-assistant".into(),
            backend: Backend::Cloud,
            output: Some(WorkOutput::Chat(serde_json::json!({"text": text}))),
            tokens: 3,
            cost_usd: Some(0.5),
            error: None,
            class: None,
        }
    }

    #[test]
    fn a_running_call_is_reported_to_later_sessions_and_its_answer_sent_once_per_session() {
        let kept = Arc::new(KeptAnswers::default());
        let running = kept.start(tag("k"), "c", 1);
        assert!(
            kept.running_elsewhere(1).is_empty(),
            "its own session knows"
        );
        assert_eq!(kept.running_elsewhere(2)[0].tag, tag("k"));
        let changes = kept.changes();
        running.finish(answer("hi"));
        assert!(changes.has_changed().unwrap());
        assert!(kept.running_elsewhere(2).is_empty());
        // Not to the session that leased it; once to each other one.
        assert!(kept.to_send(1, &mut Vec::new()).is_empty());
        let mut sent = Vec::new();
        assert_eq!(kept.to_send(2, &mut sent).len(), 1);
        assert!(kept.to_send(2, &mut sent).is_empty());
        assert_eq!(kept.to_send(3, &mut Vec::new()).len(), 1);
    }

    #[test]
    fn an_answer_a_hub_holds_is_kept_no_longer() {
        let kept = Arc::new(KeptAnswers::default());
        kept.start(tag("k"), "c", 1).finish(answer("hi"));
        kept.delivered(&tag("other"));
        assert_eq!(kept.held().0, 1);
        kept.delivered(&tag("k"));
        assert_eq!(kept.held(), (0, 0));
        assert!(kept.to_send(2, &mut Vec::new()).is_empty());
    }

    #[test]
    fn a_new_call_of_a_key_drops_the_outcome_kept_of_an_earlier_one() {
        let kept = Arc::new(KeptAnswers::default());
        kept.start(tag("k"), "c", 1).finish(answer("failed before"));
        let again = kept.start(tag("k"), "c", 1);
        assert!(kept.to_send(2, &mut Vec::new()).is_empty());
        // A late end of an overlapping call of the key does not hide the one under way.
        let late = kept.start(tag("k"), "c", 1);
        drop(late);
        assert_eq!(kept.running_elsewhere(2).len(), 1);
        again.finish(answer("this one"));
        assert_eq!(kept.to_send(2, &mut Vec::new()).len(), 1);
    }

    #[test]
    fn a_cancelled_call_is_no_longer_reported_and_nothing_is_kept() {
        let kept = Arc::new(KeptAnswers::default());
        drop(kept.start(tag("k"), "c", 1));
        assert!(kept.running_elsewhere(2).is_empty());
        assert_eq!(kept.held(), (0, 0));
    }

    #[test]
    fn kept_answers_are_bounded_in_count_and_bytes_oldest_first() {
        let kept = Arc::new(KeptAnswers::default());
        for i in 0..MAX_KEPT_ANSWERS + 5 {
            kept.start(tag(&format!("k{i}")), "c", 1)
                .finish(answer("x"));
        }
        assert_eq!(kept.held().0, MAX_KEPT_ANSWERS);
        let sent = kept.to_send(2, &mut Vec::new());
        assert_eq!(sent[0].tag.key, "k5", "the oldest went first");
        // A few large answers push the rest out under the byte bound.
        let big = "y".repeat(MAX_KEPT_BYTES / 3);
        for i in 0..3 {
            kept.start(tag(&format!("big{i}")), "c", 1)
                .finish(answer(&big));
        }
        let (count, bytes) = kept.held();
        assert!(bytes <= MAX_KEPT_BYTES, "{bytes}");
        assert_eq!(count, 2, "two large answers fit, not three");
        // One past the bound on its own is not kept at all.
        kept.start(tag("huge"), "c", 1)
            .finish(answer(&"z".repeat(MAX_KEPT_BYTES)));
        assert!(
            kept.to_send(2, &mut Vec::new())
                .iter()
                .all(|a| a.tag.key != "huge")
        );
    }

    #[test]
    fn a_retried_key_keeps_only_its_last_answer() {
        let kept = Arc::new(KeptAnswers::default());
        kept.start(tag("k"), "c", 1).finish(answer("first"));
        kept.start(tag("k"), "c", 2).finish(answer("second"));
        let sent = kept.to_send(3, &mut Vec::new());
        assert_eq!(sent.len(), 1);
        assert_eq!(
            sent[0].output,
            Some(WorkOutput::Chat(serde_json::json!({"text": "second"})))
        );
    }
}
