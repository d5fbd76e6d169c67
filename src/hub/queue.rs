//! One role's shared queue: the items of accepted client requests, waiting for a provider's
//! pull. Items leave from the head, sized to the puller; items that come back (an expired
//! lease, a lost agent, a transient failure) go back to the **front**, in their order.
//!
//! An item is one text to embed or one document to score. Items of a request share its
//! [`Shape`] (options, the rerank query); one work frame carries items of one shape only.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::protocol::{EmbedInput, RerankInput, WorkInput};

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
    /// One chat completion (the client's body; one item, whose text is empty).
    Chat { body: serde_json::Value },
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
            Shape::Chat { body } => WorkInput::Chat(body.clone()),
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
            Shape::Chat { body } => body.to_string().len(),
        }
    }

    /// Tokens a work frame pays once for all its items (the rerank query).
    fn shared_tokens(&self) -> usize {
        match self {
            Shape::Embed { .. } => 0,
            Shape::Rerank { query, .. } => estimate_tokens(query),
            Shape::Chat { body } => body.to_string().len() / 3 + 2,
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

/// A role's FIFO with a capacity in items.
#[derive(Debug)]
pub struct RoleQueue {
    items: VecDeque<Item>,
    capacity: usize,
}

/// Limits of one work frame (the puller's size hints).
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    pub max_items: usize,
    pub max_tokens: usize,
}

impl RoleQueue {
    pub fn new(capacity: usize) -> Self {
        Self {
            items: VecDeque::new(),
            capacity,
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether `n` more items fit (a requeue always fits: those items were accepted).
    pub fn has_room(&self, n: usize) -> bool {
        self.items.len() + n <= self.capacity
    }

    pub fn push_back(&mut self, items: impl IntoIterator<Item = Item>) {
        self.items.extend(items);
    }

    /// Puts items back at the head, keeping their order.
    pub fn requeue_front(&mut self, items: Vec<Item>) {
        for item in items.into_iter().rev() {
            self.items.push_front(item);
        }
    }

    /// Drops every waiting item of a request (it was cancelled).
    pub fn remove_request(&mut self, id: RequestId) {
        self.items.retain(|i| i.request != id);
    }

    /// Drops every waiting item whose request is gone (one pass).
    pub fn retain_live(&mut self, alive: impl Fn(RequestId) -> bool) {
        self.items.retain(|i| alive(i.request));
    }

    /// Drops items at the head whose request is gone.
    pub fn drop_dead_head(&mut self, alive: impl Fn(RequestId) -> bool) {
        while self.items.front().is_some_and(|i| !alive(i.request)) {
            self.items.pop_front();
        }
    }

    /// Whether the head item already failed on a local provider.
    pub fn head_failed_locally(&self) -> bool {
        self.items.front().is_some_and(|i| i.failed_locally)
    }

    /// Takes a batch for one puller: the first live item that `fits` it (looking at most
    /// [`SCAN_LIMIT`] items from the head), then the live items right behind that one, of its
    /// shape, that `fits` also accepts, while they fit the limits (the first item always goes,
    /// however long). `fits` is asked in queue order. Items of gone requests at the head are
    /// dropped; a solo item and a chat go alone; items that failed locally go only with each
    /// other.
    pub fn take_batch(
        &mut self,
        limits: BatchLimits,
        alive: impl Fn(RequestId) -> bool,
        mut fits: impl FnMut(&Item) -> bool,
    ) -> Vec<Item> {
        self.drop_dead_head(&alive);
        let scan = self.items.len().min(SCAN_LIMIT);
        let Some(start) = (0..scan).find(|&i| alive(self.items[i].request) && fits(&self.items[i]))
        else {
            return Vec::new();
        };
        let first = &self.items[start];
        // A chat is one completion: two equal bodies from two clients are two answers.
        if first.solo || matches!(*first.shape, Shape::Chat { .. }) {
            return self.items.remove(start).into_iter().collect();
        }
        let shape = first.shape.clone();
        let retry = first.failed_locally;
        let mut tokens = shape.shared_tokens() + estimate_tokens(&first.text);
        let (mut count, mut end) = (1, start + 1);
        while count < limits.max_items && end < self.items.len() {
            let next = &self.items[end];
            if !alive(next.request) {
                end += 1; // swept out with the batch
                continue;
            }
            if next.solo || next.failed_locally != retry {
                break;
            }
            if !(Arc::ptr_eq(&next.shape, &shape) || *next.shape == *shape) || !fits(next) {
                break;
            }
            let cost = estimate_tokens(&next.text);
            if tokens + cost > limits.max_tokens {
                break;
            }
            tokens += cost;
            count += 1;
            end += 1;
        }
        self.items
            .drain(start..end)
            .filter(|i| alive(i.request))
            .collect()
    }
}

/// How far past the head a puller's first item is looked for (items bound to another space
/// or scorer wait there for their own providers).
pub const SCAN_LIMIT: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    fn items(request: RequestId, shape: &Arc<Shape>, n: u32) -> Vec<Item> {
        (0..n)
            .map(|index| Item {
                request,
                index,
                text: format!("text {index}"),
                shape: shape.clone(),
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
            let head_retry = q.head_failed_locally();
            let b = q.take_batch(WIDE, |_| true, |_| true);
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
}
