//! One role's shared queue: the items of accepted client requests, waiting for a provider's
//! pull, shared fairly between projects.
//!
//! Each project is a flow served by weighted fair queuing in virtual time, counting tokens
//! ([`wfq`]), whatever the class of its work: a frame goes to the project whose next frame
//! finishes first on the virtual clock, so every backlogged project gets its weighted share of
//! the tokens, and a small request of a project that was idle goes with the next frame however
//! many projects flood. Interactive work ([`WorkClass`]) is for latency, not for share: a
//! project's interactive items go first while it is within its share (charged to it like any
//! other), and go as `interactive` to the agent; what it sends as interactive beyond its share
//! waits its turn with its batch work and goes as `batch`. So a lone query comes first, and a
//! flood marked interactive buys no more than its weight. Inside a project, its sub-projects
//! (named with `X-FantomMCP-Project`) share its turn the same way; inside a sub-project, its
//! requests share by deficit round robin, by tokens, and a frame fills across them in round
//! order ([`items`]). Items leave sized to the puller; items that come back (an expired lease,
//! a lost agent, a transient failure) go back to the **front** of their own request, in their
//! order.
//!
//! An item is one text to embed or one document to score. Items of a request share its
//! [`Shape`] (options, the rerank query) and its [`Caller`]; one work frame carries items of
//! one shape and one flow only (so a cloud call's cost and permit belong to one project).

mod items;
mod wfq;

use std::collections::BTreeMap;
use std::sync::Arc;

use self::items::ItemQueue;
use self::wfq::{Backlog, Wfq};
pub use crate::hub::projects::Caller;
use crate::protocol::{EmbedInput, RerankInput, WorkClass, WorkInput};
/// A client request's id (hub-local).
pub type RequestId = u64;

/// What every item of a request shares.
#[derive(Debug, PartialEq)]
pub enum Shape {
    Embed {
        dimensions: Option<usize>,
        is_query: bool,
        instruction: Option<String>,
    },
    Rerank {
        query: String,
        instruction: Option<String>,
    },
    /// One chat completion (the client's body; one item, whose text is empty), and the
    /// client's `Idempotency-Key` when it sent one.
    Chat {
        body: serde_json::Value,
        idempotency: Option<crate::protocol::IdempotencyTag>,
    },
}

impl Shape {
    /// The work input for `texts` of this shape.
    pub fn work_input(&self, texts: Vec<String>) -> WorkInput {
        match self {
            Shape::Embed {
                dimensions,
                is_query,
                instruction,
            } => WorkInput::Embed(EmbedInput {
                texts,
                dimensions: *dimensions,
                is_query: *is_query,
                instruction: instruction.clone(),
                truncate: false,
            }),
            Shape::Rerank { query, instruction } => WorkInput::Rerank(RerankInput {
                query: query.clone(),
                documents: texts,
                instruction: instruction.clone(),
            }),
            Shape::Chat { body, .. } => WorkInput::Chat(body.clone()),
        }
    }

    /// The client's `Idempotency-Key` of a chat, as the work frame carries it.
    pub fn idempotency(&self) -> Option<&crate::protocol::IdempotencyTag> {
        match self {
            Shape::Chat { idempotency, .. } => idempotency.as_ref(),
            _ => None,
        }
    }

    /// Bytes a work frame of this shape carries besides its items, as JSON (an upper bound
    /// of the instruction, the rerank query, the chat body).
    pub fn shared_json_bytes(&self) -> usize {
        let text = |t: &str| t.len().saturating_mul(6).saturating_add(2);
        match self {
            Shape::Embed { instruction, .. } => instruction.as_deref().map_or(0, text),
            Shape::Rerank { query, instruction } => {
                text(query).saturating_add(instruction.as_deref().map_or(0, text))
            }
            Shape::Chat { body, .. } => body.to_string().len(),
        }
    }

    /// Tokens a work frame pays once for all its items (the rerank query).
    pub(super) fn shared_tokens(&self) -> usize {
        match self {
            Shape::Embed { .. } => 0,
            Shape::Rerank { query, .. } => estimate_tokens(query),
            Shape::Chat { body, .. } => body.to_string().len() / 3 + 2,
        }
    }
}

/// One unit of work.
#[derive(Debug)]
pub struct Item {
    pub request: RequestId,
    /// Position in the request's input.
    pub index: u32,
    pub text: String,
    pub shape: Arc<Shape>,
    /// Whose it is, and its class: its flow in the queue.
    pub caller: Arc<Caller>,
    /// Leases this item has been on without a result.
    pub attempts: u32,
    /// Goes in a work frame of its own (it was in a batch that failed fatally: only the
    /// item at fault should fail its request).
    pub solo: bool,
    /// Failed on a local provider: under `backup`, the cloud may take it.
    pub failed_locally: bool,
}

/// A cheap upper estimate of a text's tokens (sub-word tokenizers average 3–4 bytes per token
/// on code and prose; counting 3 keeps a batch under the puller's budget).
pub fn estimate_tokens(text: &str) -> usize {
    text.len() / 3 + 2
}

/// Limits of one work frame (the puller's size hints).
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    pub max_items: usize,
    pub max_tokens: usize,
}

/// One provider's offer to take work: its limits, which requests are still alive, and which
/// items it may take (asked in queue order; it may remember what it accepted, e.g. the first
/// item's space).
pub struct Offer<'a> {
    pub limits: BatchLimits,
    pub alive: &'a dyn Fn(RequestId) -> bool,
    pub fits: &'a mut dyn FnMut(&Item) -> bool,
    /// Only items of this class lead or join the frame (`None`: any).
    pub only: Option<WorkClass>,
}

/// How far ahead of the virtual clock (the start of the project furthest behind), in tokens
/// per unit of weight, a project may be and still have its interactive work go first: about
/// one small frame, so a project's query goes at once while a flood marked interactive buys
/// no more than its weight.
pub const INTERACTIVE_LEAD_TOKENS: u32 = 512;

/// A project's flow: its sub-projects (`None`: the project's own requests).
type ProjectFlow = Wfq<Option<Arc<str>>, ItemQueue>;

/// A role's queue: the projects' flows, with a capacity in items.
pub struct RoleQueue {
    projects: Wfq<Arc<str>, ProjectFlow>,
    capacity: usize,
}

/// A frame's items and the class it goes to the agent as.
#[derive(Debug)]
pub struct Frame {
    pub items: Vec<Item>,
    pub class: WorkClass,
}

impl std::fmt::Debug for RoleQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoleQueue")
            .field("len", &self.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl RoleQueue {
    pub fn new(capacity: usize) -> Self {
        Self {
            projects: Wfq::default(),
            capacity,
        }
    }

    pub fn len(&self) -> usize {
        self.projects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.projects.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether `n` more items fit (a requeue always fits: those items were accepted).
    pub fn has_room(&self, n: usize) -> bool {
        self.len() + n <= self.capacity
    }

    fn put(&mut self, item: Item, front: bool) {
        let caller = item.caller.clone();
        self.projects
            .push(&caller.project, caller.weight, |project| {
                project.push(&caller.sub_project, 1, |flow| {
                    if front {
                        flow.push_front(item);
                    } else {
                        flow.push_back(item);
                    }
                });
            });
    }

    pub fn push_back(&mut self, items: impl IntoIterator<Item = Item>) {
        for item in items {
            self.put(item, false);
        }
    }

    /// Puts items back at the head of their flows, keeping their order.
    pub fn requeue_front(&mut self, items: Vec<Item>) {
        for item in items.into_iter().rev() {
            self.put(item, true);
        }
    }

    /// A frame of `caller`'s flow landed (its lease ended: answered, failed, expired, taken
    /// back or parked): the flow is idle once nothing of it waits and nothing is out.
    pub fn landed(&mut self, caller: &Caller) {
        self.projects.landed(&caller.project, |project| {
            project.landed(&caller.sub_project, |_| {});
        });
    }

    /// A frame of `caller`'s flow is out again (a parked lease resumed).
    pub fn resumed(&mut self, caller: &Caller) {
        self.projects.resumed(&caller.project, |project| {
            project.resumed(&caller.sub_project, |_| {});
        });
    }

    /// Drops every waiting item of a request (it was cancelled).
    pub fn remove_request(&mut self, id: RequestId) {
        self.sweep(&mut |i: &Item| i.request == id);
    }

    /// Drops every waiting item whose request is gone (one pass).
    pub fn retain_live(&mut self, alive: impl Fn(RequestId) -> bool) {
        self.sweep(&mut |i: &Item| !alive(i.request));
    }

    fn sweep(&mut self, gone: &mut dyn FnMut(&Item) -> bool) {
        self.projects.sweep(gone);
    }

    /// Items waiting per project (both classes).
    pub fn waiting_by_project(&self) -> BTreeMap<Arc<str>, usize> {
        self.projects
            .backlog()
            .map(|(project, flow)| (project.clone(), flow.len()))
            .collect()
    }

    /// Items waiting that their clients sent as `class`, per project (projects with none left
    /// out).
    pub fn waiting_in(&self, class: WorkClass) -> BTreeMap<Arc<str>, usize> {
        self.projects
            .backlog()
            .map(|(project, flow)| (project.clone(), flow.waiting_of(class)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// A frame for one puller, from one project: first the interactive items of a project
    /// within its share, the one whose next frame finishes first on the virtual clock (charged
    /// to it, sent as `interactive`); else the projects in weighted fair queuing (see [`wfq`]),
    /// any class, sent as `batch` — unless `interactive_only` (a local provider keeping its
    /// last credit for interactive work), when nothing else goes. Inside a project, its
    /// sub-projects share the same way and its requests by deficit round robin, and a frame
    /// fills across requests of one shape in round order ([`items`]), within the limits (the
    /// first item always goes, however long).
    /// A solo item and a chat go alone; items that failed locally go only with each other.
    /// Items of gone requests are dropped on the way.
    pub fn take_frame(
        &mut self,
        limits: BatchLimits,
        alive: impl Fn(RequestId) -> bool,
        mut fits: impl FnMut(&Item) -> bool,
        interactive_only: bool,
    ) -> Option<Frame> {
        let mut offer = Offer {
            limits,
            alive: &alive,
            fits: &mut fits,
            only: Some(WorkClass::Interactive),
        };
        let within_share = |flow: &ProjectFlow| flow.waiting_of(WorkClass::Interactive) > 0;
        if let Some((items, _)) = self.projects.take_within_share(&mut offer, &within_share) {
            return Some(Frame {
                items,
                class: WorkClass::Interactive,
            });
        }
        if interactive_only {
            return None;
        }
        offer.only = None;
        let (items, _) = self.projects.take(&mut offer)?;
        Some(Frame {
            items,
            class: WorkClass::Batch,
        })
    }

    /// [`RoleQueue::take_frame`]'s items, for a provider that keeps nothing back.
    pub fn take_batch(
        &mut self,
        limits: BatchLimits,
        alive: impl Fn(RequestId) -> bool,
        fits: impl FnMut(&Item) -> bool,
    ) -> Vec<Item> {
        self.take_frame(limits, alive, fits, false)
            .map_or_else(Vec::new, |f| f.items)
    }
}

/// How far past a flow's head a puller's first item is looked for (items bound to another
/// space or scorer wait there for their own providers).
pub const SCAN_LIMIT: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    fn items(request: RequestId, shape: &Arc<Shape>, n: u32) -> Vec<Item> {
        of(
            &Arc::new(Caller::default_project(WorkClass::Batch)),
            request,
            shape,
            n,
        )
    }

    fn of(caller: &Arc<Caller>, request: RequestId, shape: &Arc<Shape>, n: u32) -> Vec<Item> {
        (0..n)
            .map(|index| Item {
                request,
                index,
                text: format!("text {index}"),
                shape: shape.clone(),
                caller: caller.clone(),
                attempts: 0,
                solo: false,
                failed_locally: false,
            })
            .collect()
    }

    fn embed_shape(dimensions: Option<usize>) -> Arc<Shape> {
        Arc::new(Shape::Embed {
            dimensions,
            is_query: false,
            instruction: None,
        })
    }

    const WIDE: BatchLimits = BatchLimits {
        max_items: 64,
        max_tokens: 1 << 20,
    };

    #[test]
    fn batches_follow_the_head_shape_and_the_puller_limits() {
        let (a, b) = (embed_shape(None), embed_shape(Some(64)));
        let mut q = RoleQueue::new(100);
        q.push_back(items(1, &a, 5));
        q.push_back(items(2, &embed_shape(None), 2)); // equal shape, other request: merges
        q.push_back(items(3, &b, 3));
        let limits = BatchLimits {
            max_items: 4,
            max_tokens: 1 << 20,
        };
        let first = q.take_batch(limits, |_| true, |_| true);
        assert_eq!(
            first.iter().map(|i| i.index).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        let second = q.take_batch(WIDE, |_| true, |_| true);
        assert_eq!(
            second
                .iter()
                .map(|i| (i.request, i.index))
                .collect::<Vec<_>>(),
            [(1, 4), (2, 0), (2, 1)]
        );
        assert_eq!(q.take_batch(WIDE, |_| true, |_| true).len(), 3);
        assert!(q.take_batch(WIDE, |_| true, |_| true).is_empty());
    }

    #[test]
    fn requeued_items_go_back_to_the_front_in_order_and_dead_requests_are_skipped() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(10);
        q.push_back(items(1, &s, 6));
        let taken = q.take_batch(
            BatchLimits {
                max_items: 3,
                max_tokens: 1 << 20,
            },
            |_| true,
            |_| true,
        );
        q.requeue_front(taken);
        let order: Vec<u32> = q
            .take_batch(WIDE, |_| true, |_| true)
            .iter()
            .map(|i| i.index)
            .collect();
        assert_eq!(order, [0, 1, 2, 3, 4, 5]);

        q.push_back(items(7, &s, 2));
        q.push_back(items(8, &s, 2));
        let alive = q.take_batch(WIDE, |r| r != 7, |_| true);
        assert!(alive.iter().all(|i| i.request == 8) && alive.len() == 2);
        assert!(!q.has_room(11) && q.has_room(10));
    }

    #[test]
    fn solo_items_go_alone_and_local_failures_go_together() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(10);
        let mut batch = items(1, &s, 6);
        batch[1].solo = true;
        batch[3].failed_locally = true;
        batch[4].failed_locally = true;
        q.push_back(batch);
        let mut sizes = Vec::new();
        while !q.is_empty() {
            let b = q.take_batch(WIDE, |_| true, |_| true);
            let head_retry = b[0].failed_locally;
            assert!(b.iter().all(|i| i.failed_locally == head_retry));
            sizes.push(b.iter().map(|i| i.index).collect::<Vec<_>>());
        }
        assert_eq!(sizes, [vec![0], vec![1], vec![2], vec![3, 4], vec![5]]);
    }

    #[test]
    fn a_puller_takes_the_first_items_that_fit_it_and_chats_go_alone() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(20);
        q.push_back(items(1, &s, 3)); // bound elsewhere: not for this puller
        q.push_back(items(2, &s, 3));
        q.push_back(items(3, &s, 2));
        let mine = |i: &Item| i.request != 1;
        let b = q.take_batch(WIDE, |_| true, mine);
        assert_eq!(
            b.iter().map(|i| (i.request, i.index)).collect::<Vec<_>>(),
            [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1)],
            "request 1 waits at the head for its own providers"
        );
        assert_eq!(q.len(), 3);
        // The run behind the first item stops at an item that does not fit.
        q.push_back(items(4, &s, 2));
        let b = q.take_batch(WIDE, |_| true, |i| i.request == 1);
        assert_eq!(b.len(), 3);
        let chat = Arc::new(Shape::Chat {
            body: serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
            idempotency: None,
        });
        let mut q = RoleQueue::new(10);
        q.push_back(items(5, &chat, 1));
        q.push_back(items(6, &chat, 1));
        assert_eq!(q.take_batch(WIDE, |_| true, |_| true).len(), 1);
        assert_eq!(q.take_batch(WIDE, |_| true, |_| true).len(), 1);
    }

    #[test]
    fn the_token_budget_bounds_a_batch_but_one_long_item_still_goes() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(10);
        let mut long = items(1, &s, 3);
        long[0].text = "x".repeat(3000);
        q.push_back(long);
        let limits = BatchLimits {
            max_items: 64,
            max_tokens: 100,
        };
        assert_eq!(q.take_batch(limits, |_| true, |_| true).len(), 1);
        assert_eq!(q.take_batch(limits, |_| true, |_| true).len(), 2);
    }

    fn caller(project: &str, sub: Option<&str>, class: WorkClass, weight: u32) -> Arc<Caller> {
        Arc::new(Caller {
            project: Arc::from(project),
            sub_project: sub.map(Arc::from),
            class,
            weight,
        })
    }

    const FRAME: BatchLimits = BatchLimits {
        max_items: 8,
        max_tokens: 1 << 20,
    };

    /// Takes a frame for `limits` and lands it at once (its lease answered).
    fn take_landed(q: &mut RoleQueue, limits: BatchLimits) -> Vec<Item> {
        let b = q.take_batch(limits, |_| true, |_| true);
        if let Some(first) = b.first() {
            q.landed(&first.caller);
        }
        b
    }

    /// Items taken per project over `frames` frames, each landed at once.
    fn served(q: &mut RoleQueue, frames: usize) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for _ in 0..frames {
            let b = take_landed(q, FRAME);
            let first = b.first().expect("work waits");
            assert!(
                b.iter().all(|i| i.caller == first.caller),
                "a frame holds one flow"
            );
            *out.entry(first.caller.project.to_string()).or_default() += b.len();
        }
        out
    }

    #[test]
    fn projects_share_by_weight_and_a_lone_project_gets_everything() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(100_000);
        for (r, (name, weight)) in [("a", 1), ("b", 2), ("c", 4)].into_iter().enumerate() {
            q.push_back(of(
                &caller(name, None, WorkClass::Batch, weight),
                r as u64 + 1,
                &s,
                40_000,
            ));
        }
        let got = served(&mut q, 7_000);
        let total: usize = got.values().sum();
        for (name, weight) in [("a", 1.0), ("b", 2.0), ("c", 4.0)] {
            let share = got[name] as f64 / total as f64;
            assert!(
                (share - weight / 7.0).abs() < 0.05 * weight / 7.0,
                "{name}: {share} of {total} ({got:?})"
            );
        }
        let mut alone = RoleQueue::new(1000);
        alone.push_back(of(&caller("a", None, WorkClass::Batch, 1), 1, &s, 100));
        assert_eq!(served(&mut alone, 13)["a"], 100, "work-conserving");
        assert!(alone.is_empty());
    }

    #[test]
    fn a_project_that_cannot_be_served_keeps_its_turn() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(1000);
        q.push_back(of(&caller("a", None, WorkClass::Batch, 1), 1, &s, 64));
        q.push_back(of(&caller("b", None, WorkClass::Batch, 1), 2, &s, 64));
        q.push_back(of(&caller("a", None, WorkClass::Batch, 1), 3, &s, 1000));
        q.push_back(of(&caller("b", None, WorkClass::Batch, 1), 4, &s, 1000));
        // A puller that only takes b's items: a is skipped, b is served.
        for _ in 0..40 {
            let b = q.take_batch(FRAME, |_| true, |i| &*i.caller.project == "b");
            assert!(!b.is_empty() && b.iter().all(|i| &*i.caller.project == "b"));
        }
        // a kept its turn (never charged; passed over, it moved up with the project served in
        // its place): open pullers share evenly again, and a is not owed the frames it could
        // not take.
        let got = served(&mut q, 130);
        let a = got["a"] as f64 / (got["a"] + got["b"]) as f64;
        assert!((0.45..0.60).contains(&a), "{got:?}");
    }

    #[test]
    fn interactive_work_goes_first_within_its_share_and_cannot_buy_weight() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(1_000_000);
        // B (weight 10) floods batch; A's lone query comes first, sent as interactive.
        q.push_back(of(&caller("b", None, WorkClass::Batch, 10), 1, &s, 100_000));
        for _ in 0..3 {
            q.take_batch(FRAME, |_| true, |_| true);
        }
        q.push_back(of(&caller("a", None, WorkClass::Interactive, 1), 2, &s, 1));
        let first = q.take_frame(FRAME, |_| true, |_| true, false).unwrap();
        assert_eq!(
            first.items[0].request, 2,
            "the query waits behind no batch frame"
        );
        assert_eq!(first.class, WorkClass::Interactive);
        // A (weight 1) floods interactive: B keeps its weight's share, and what A sends beyond
        // its share goes as batch.
        q.push_back(of(
            &caller("a", None, WorkClass::Interactive, 1),
            3,
            &s,
            100_000,
        ));
        let mut tokens: BTreeMap<(&str, WorkClass), usize> = BTreeMap::new();
        for _ in 0..2_000 {
            let f = q.take_frame(FRAME, |_| true, |_| true, false).unwrap();
            let cost: usize = f.items.iter().map(|i| estimate_tokens(&i.text)).sum();
            let who = if f.items[0].request == 1 { "b" } else { "a" };
            *tokens.entry((who, f.class)).or_default() += cost;
        }
        let b = tokens[&("b", WorkClass::Batch)] as f64;
        let a_fast = tokens
            .get(&("a", WorkClass::Interactive))
            .copied()
            .unwrap_or(0) as f64;
        let a_slow = tokens.get(&("a", WorkClass::Batch)).copied().unwrap_or(0) as f64;
        let share = b / (a_fast + a_slow + b);
        assert!(share >= 0.85, "B's share {share:.3}: {tokens:?}");
        assert!(
            !tokens.contains_key(&("b", WorkClass::Interactive)),
            "{tokens:?}"
        );
        // A provider keeping its last credit for interactive work takes A's within its
        // share, or nothing.
        let kept = q.take_frame(FRAME, |_| true, |_| true, true);
        assert!(
            kept.as_ref().is_none_or(
                |f| f.class == WorkClass::Interactive && f.items.iter().all(|i| i.request == 3)
            ),
            "{kept:?}"
        );
        let waiting = q.waiting_in(WorkClass::Interactive);
        assert!(
            waiting["a"] > 0 && !waiting.contains_key("b"),
            "{waiting:?}"
        );
    }

    #[test]
    fn sub_projects_share_their_projects_turn() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(100_000);
        q.push_back(of(&caller("a", None, WorkClass::Batch, 1), 1, &s, 10_000));
        q.push_back(of(
            &caller("m", Some("repo-1"), WorkClass::Batch, 1),
            2,
            &s,
            10_000,
        ));
        q.push_back(of(
            &caller("m", Some("repo-2"), WorkClass::Batch, 1),
            3,
            &s,
            10_000,
        ));
        let mut per_request = [0usize; 4];
        for _ in 0..1_000 {
            let b = q.take_batch(FRAME, |_| true, |_| true);
            per_request[b[0].request as usize] += b.len();
        }
        let [_, a, r1, r2] = per_request;
        assert!(
            (a as f64 / (r1 + r2) as f64 - 1.0).abs() < 0.06,
            "{per_request:?}"
        );
        assert!(
            (r1 as f64 / r2 as f64 - 1.0).abs() < 0.06,
            "{per_request:?}"
        );
        assert_eq!(q.waiting_by_project()["m"], 20_000 - r1 - r2);
    }

    #[test]
    fn requests_of_one_project_share_its_turn_by_tokens_and_frames_still_fill_across_them() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(100_000);
        let one = caller("default", None, WorkClass::Batch, 1);
        // A flood of eight 250-text requests, then one text of the same project.
        let text = |mut items: Vec<Item>| {
            for item in &mut items {
                item.text = "y".repeat(114); // 40 tokens each
            }
            items
        };
        for r in 1..=8 {
            q.push_back(text(of(&one, r, &s, 250)));
        }
        q.push_back(text(of(&one, 9, &s, 1)));
        let mut frames = 0;
        let served_at = loop {
            let b = q.take_batch(FRAME, |_| true, |_| true);
            frames += 1;
            assert_eq!(b.len(), FRAME.max_items, "frames stay full across requests");
            if b.iter().any(|i| i.request == 9) {
                break frames;
            }
            assert!(frames < 20, "the one text waited behind the flood");
        };
        // One round of the eight before it (each its quantum and one text past it: 8 × 168
        // tokens, 34 texts, 5 frames of 8), not the flood's 2 000 texts.
        let round = 8 * (items::REQUEST_QUANTUM_TOKENS as usize + 40) / 40;
        assert!(
            served_at <= 1 + round.div_ceil(FRAME.max_items),
            "{served_at}"
        );

        // Two floods of unequal texts share by tokens, not items.
        let mut q = RoleQueue::new(100_000);
        let mut long = of(&one, 1, &s, 5_000);
        for item in &mut long {
            item.text = "x".repeat(300); // 102 tokens each
        }
        q.push_back(long);
        q.push_back(of(&one, 2, &s, 5_000)); // 4 tokens each
        let mut tokens = [0usize; 3];
        for _ in 0..200 {
            for i in q.take_batch(FRAME, |_| true, |_| true) {
                tokens[i.request as usize] += estimate_tokens(&i.text);
            }
        }
        let [_, long, short] = tokens;
        assert!(
            (long as f64 / short as f64 - 1.0).abs() < 0.15,
            "{tokens:?}"
        );
        // Items of a request still leave in their order.
        let mut q = RoleQueue::new(100);
        q.push_back(of(&one, 1, &s, 40));
        q.push_back(of(&one, 2, &s, 40));
        let mut last = [None::<u32>; 3];
        while !q.is_empty() {
            for i in q.take_batch(FRAME, |_| true, |_| true) {
                let r = i.request as usize;
                assert!(
                    last[r].is_none_or(|l| l + 1 == i.index),
                    "{r}: {:?} then {}",
                    last[r],
                    i.index
                );
                last[r] = Some(i.index);
            }
        }
    }

    #[test]
    fn an_offer_nothing_fits_changes_no_turn() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(100_000);
        let mut long = of(&caller("long", None, WorkClass::Batch, 1), 1, &s, 2_000);
        for item in &mut long {
            item.text = "x".repeat(300); // 102 tokens each
        }
        q.push_back(long);
        q.push_back(of(
            &caller("short", None, WorkClass::Batch, 1),
            2,
            &s,
            20_000,
        ));
        let mut tokens: BTreeMap<String, usize> = BTreeMap::new();
        for _ in 0..600 {
            // Every other offer takes nothing (a provider keeping its last credit).
            assert!(q.take_batch(FRAME, |_| true, |_| false).is_empty());
            let b = q.take_batch(FRAME, |_| true, |_| true);
            let cost: usize = b.iter().map(|i| estimate_tokens(&i.text)).sum();
            *tokens.entry(b[0].caller.project.to_string()).or_default() += cost;
        }
        let ratio = tokens["long"] as f64 / tokens["short"] as f64;
        assert!((0.95..1.05).contains(&ratio), "fair in tokens: {tokens:?}");
    }

    /// `items` with texts of `tokens` estimated tokens each.
    fn sized(mut items: Vec<Item>, tokens: usize) -> Vec<Item> {
        for item in &mut items {
            item.text = "y".repeat(3 * (tokens - 2));
        }
        items
    }

    #[test]
    fn a_small_request_of_an_idle_project_goes_with_the_next_frame_however_many_projects_flood() {
        let s = embed_shape(None);
        for floods in [2usize, 8, 32, 128] {
            // Each flooding project sends two requests of 100 full frames between them.
            let mut q = RoleQueue::new(1 << 20);
            let mut request = 0;
            for p in 0..floods {
                let flood = caller(&format!("flood-{p}"), None, WorkClass::Batch, 1);
                for _ in 0..2 {
                    request += 1;
                    q.push_back(sized(of(&flood, request, &s, 400), 40));
                }
            }
            let small = caller("small", None, WorkClass::Batch, 1);
            let mut worst = 0;
            for round in 0..40 {
                // The floods go on between the small project's requests, for a varying number
                // of frames (a round of the floods and more).
                for _ in 0..round % (floods + 3) {
                    let b = q.take_batch(FRAME, |_| true, |_| true);
                    assert_eq!(b.len(), FRAME.max_items, "the floods' frames stay full");
                }
                request += 1;
                q.push_back(sized(of(&small, request, &s, 1), 10));
                let mut frames = 0;
                loop {
                    frames += 1;
                    let b = q.take_batch(FRAME, |_| true, |_| true);
                    if b.iter().any(|i| i.request == request) {
                        break;
                    }
                    assert_eq!(b.len(), FRAME.max_items, "the floods' frames stay full");
                    assert!(
                        frames <= 4 * floods,
                        "{floods} floods: the small request starved"
                    );
                }
                worst = worst.max(frames);
            }
            assert!(
                worst <= 2,
                "{floods} floods: the small request went with frame {worst}, not the next"
            );
        }
    }

    #[test]
    fn weights_hold_over_many_frames_beside_small_requests() {
        let s = embed_shape(None);
        let mut q = RoleQueue::new(1 << 20);
        q.push_back(sized(
            of(&caller("heavy", None, WorkClass::Batch, 10), 1, &s, 100_000),
            40,
        ));
        q.push_back(sized(
            of(&caller("light", None, WorkClass::Batch, 1), 2, &s, 100_000),
            40,
        ));
        let small = caller("small", None, WorkClass::Batch, 1);
        let mut tokens: BTreeMap<String, usize> = BTreeMap::new();
        for frame in 0..2_200u64 {
            if frame % 50 == 0 {
                q.push_back(sized(of(&small, 3 + frame, &s, 1), 10));
            }
            let b = q.take_batch(FRAME, |_| true, |_| true);
            let cost: usize = b.iter().map(|i| estimate_tokens(&i.text)).sum();
            *tokens.entry(b[0].caller.project.to_string()).or_default() += cost;
        }
        let ratio = tokens["heavy"] as f64 / tokens["light"] as f64;
        assert!((9.5..10.5).contains(&ratio), "{ratio:.2}: {tokens:?}");
        assert_eq!(tokens["small"], 44 * 10, "every small request went");
    }

    #[test]
    fn an_idle_project_banks_nothing_and_one_that_comes_straight_back_owes_what_it_took() {
        let s = embed_shape(None);
        let (a, b) = (
            caller("a", None, WorkClass::Batch, 1),
            caller("b", None, WorkClass::Batch, 1),
        );
        let mut q = RoleQueue::new(1 << 20);
        q.push_back(sized(of(&a, 1, &s, 40), 40)); // five frames, then a is idle
        q.push_back(sized(of(&b, 2, &s, 100_000), 40));
        let got = served(&mut q, 400);
        assert_eq!(got["a"], 40);
        // a comes back with a flood of its own: the two share from now on; a does not catch up
        // on the frames b took alone.
        q.push_back(sized(of(&a, 3, &s, 100_000), 40));
        let got = served(&mut q, 40);
        let frames = got["a"] / FRAME.max_items;
        assert!((19..=21).contains(&frames), "{got:?}");

        // a sends one text at a time, again as soon as it went: it is served at once each time,
        // and yet b keeps its half of the tokens.
        let mut q = RoleQueue::new(1 << 20);
        q.push_back(sized(of(&b, 1, &s, 100_000), 40));
        let mut tokens: BTreeMap<String, usize> = BTreeMap::new();
        for r in 0..2_000u64 {
            if !q.waiting_by_project().contains_key("a") {
                q.push_back(sized(of(&a, 2 + r, &s, 1), 5));
            }
            let batch = take_landed(&mut q, FRAME);
            let cost: usize = batch.iter().map(|i| estimate_tokens(&i.text)).sum();
            *tokens
                .entry(batch[0].caller.project.to_string())
                .or_default() += cost;
        }
        let b_share = tokens["b"] as f64 / (tokens["a"] + tokens["b"]) as f64;
        assert!(b_share >= 0.45, "{tokens:?}");
    }

    #[test]
    fn a_project_whose_work_is_all_out_keeps_its_turn_until_it_lands() {
        let s = embed_shape(None);
        let (a, b) = (
            caller("a", None, WorkClass::Batch, 1),
            caller("b", None, WorkClass::Batch, 1),
        );
        let mut q = RoleQueue::new(1 << 20);
        q.push_back(sized(of(&a, 1, &s, 16), 40)); // two frames, then a waits for them
        q.push_back(sized(of(&b, 2, &s, 100_000), 40));
        // a's two frames and b's first go out, in turn; a has nothing left waiting.
        let out: Vec<Vec<Item>> = (0..3)
            .map(|_| q.take_batch(FRAME, |_| true, |_| true))
            .collect();
        assert_eq!(out.iter().filter(|f| f[0].caller == a).count(), 2);
        // While a's frames are out, b takes everything (work-conserving).
        let got = served(&mut q, 8);
        assert_eq!(got.get("a"), None);
        // One of a's frames lands and its client sends more while the other is still out: a
        // was never idle, so it has its turn back, the frames b took beyond its share in the
        // meantime counted.
        q.landed(&a);
        q.push_back(sized(of(&a, 3, &s, 100_000), 40));
        q.landed(&a);
        let got = served(&mut q, 10);
        assert!(got["a"] >= 7 * FRAME.max_items, "{got:?}");
    }
}
