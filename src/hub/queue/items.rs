//! One flow's items (a sub-project's, or a project's own), shared between its requests by
//! deficit round robin counting tokens: a one-text request never waits behind the whole of a
//! 2 000-text request of the same flow, only behind a round.
//!
//! A frame still fills across requests: its first item is the first that fits, in round
//! order, and the requests of that item's shape follow in round order, each taking items
//! while its deficit lasts (it earns [`REQUEST_QUANTUM_TOKENS`] a round), until the puller's
//! limits are reached or no request has anything that fits. The next frame starts where this
//! one stopped. Inside a request, items leave in their order; items that come back (an
//! expired lease, a lost agent, a transient failure) go to the front of their request, and
//! their request to the front of the round.
//!
//! The flow tells the fair queue above it ([`super::wfq`]) what its next frame would weigh:
//! the puller's limits over its waiting texts' average, or its head item alone when that goes
//! alone.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::wfq::Backlog;
use super::{BatchLimits, Item, Offer, RequestId, SCAN_LIMIT, Shape, estimate_tokens};
use crate::protocol::WorkClass;

/// Tokens a request earns per round: about two typical texts, so requests interleave finely
/// inside a frame (a round of eight requests is about one frame of a local engine).
pub const REQUEST_QUANTUM_TOKENS: i64 = 128;

#[derive(Debug, Default)]
struct RequestFlow {
    deficit: i64,
    items: VecDeque<Item>,
}

#[derive(Debug, Default)]
pub(super) struct ItemQueue {
    requests: HashMap<RequestId, RequestFlow>,
    /// Requests holding items, in round order; the front one has the turn.
    ring: VecDeque<RequestId>,
    /// Items in every request.
    len: usize,
    /// Of those, the items their clients sent as interactive.
    interactive: usize,
    /// The estimated tokens of every item's text.
    tokens: usize,
    /// Requests the last frame looked at.
    walked: usize,
}

fn is_interactive(item: &Item) -> bool {
    item.caller.class == WorkClass::Interactive
}

impl ItemQueue {
    pub fn push_back(&mut self, item: Item) {
        let id = item.request;
        let flow = self.requests.entry(id).or_default();
        if flow.items.is_empty() {
            self.ring.push_back(id);
        }
        self.interactive += usize::from(is_interactive(&item));
        self.tokens += estimate_tokens(&item.text);
        flow.items.push_back(item);
        self.len += 1;
    }

    /// An item that came back: first in its request, and its request first in the round.
    pub fn push_front(&mut self, item: Item) {
        let id = item.request;
        let flow = self.requests.entry(id).or_default();
        if flow.items.is_empty() {
            self.ring.push_front(id);
        }
        self.interactive += usize::from(is_interactive(&item));
        self.tokens += estimate_tokens(&item.text);
        flow.items.push_front(item);
        self.len += 1;
    }

    /// Drops request `id` with its items (its client is gone).
    fn drop_request(&mut self, id: RequestId) {
        if let Some(flow) = self.requests.remove(&id) {
            self.len -= flow.items.len();
            self.interactive -= flow.items.iter().filter(|i| is_interactive(i)).count();
            self.tokens = self.tokens.saturating_sub(
                flow.items
                    .iter()
                    .map(|i| estimate_tokens(&i.text))
                    .sum::<usize>(),
            );
        }
    }

    /// Takes the head item of request `id`.
    fn pop(&mut self, id: RequestId) -> Option<Item> {
        let flow = self.requests.get_mut(&id)?;
        let item = flow.items.pop_front()?;
        self.len -= 1;
        self.interactive -= usize::from(is_interactive(&item));
        self.tokens = self.tokens.saturating_sub(estimate_tokens(&item.text));
        Some(item)
    }

    fn is_empty_request(&self, id: RequestId) -> bool {
        self.requests.get(&id).is_none_or(|f| f.items.is_empty())
    }

    /// The first [`SCAN_LIMIT`] requests of the round, taken off the ring, those `alive` says
    /// are gone dropped with their items: what one frame looks at. [`ItemQueue::put_back`]
    /// returns them.
    fn window(&mut self, alive: &dyn Fn(RequestId) -> bool) -> Vec<RequestId> {
        let n = self.ring.len().min(SCAN_LIMIT);
        let mut window: Vec<RequestId> = self.ring.drain(..n).collect();
        window.retain(|id| {
            let keep = alive(*id);
            if !keep {
                self.drop_request(*id);
            }
            keep
        });
        self.walked = window.len();
        window
    }

    /// Returns a window to the ring: from `resume` on at the front (in order), the ones before
    /// it at the back (they had their turn); requests that emptied leave (they bank no
    /// deficit).
    fn put_back(&mut self, mut window: Vec<RequestId>, resume: usize) {
        let behind: Vec<RequestId> = window.drain(..resume.min(window.len())).collect();
        for id in window.into_iter().rev() {
            if self.is_empty_request(id) {
                self.requests.remove(&id);
            } else {
                self.ring.push_front(id);
            }
        }
        for id in behind {
            if self.is_empty_request(id) {
                self.requests.remove(&id);
            } else {
                self.ring.push_back(id);
            }
        }
    }

    /// How many requests the last frame looked at (at most [`SCAN_LIMIT`], whatever the
    /// queue holds).
    #[cfg(test)]
    pub(super) fn walked(&self) -> usize {
        self.walked
    }

    /// Forgets requests that emptied (they bank no deficit).
    fn forget_empty(&mut self) {
        let requests = &mut self.requests;
        self.ring.retain(|id| {
            let keep = requests.get(id).is_some_and(|f| !f.items.is_empty());
            if !keep {
                requests.remove(id);
            }
            keep
        });
    }
}

/// Whether `item` may join a frame led by an item of `shape` (and its `retry` flag), for an
/// offer of `only` that class.
fn joins(item: &Item, shape: &Arc<Shape>, retry: bool, only: Option<WorkClass>) -> bool {
    !item.solo
        && item.failed_locally == retry
        && only.is_none_or(|c| item.caller.class == c)
        && (Arc::ptr_eq(&item.shape, shape) || *item.shape == **shape)
}

impl Backlog for ItemQueue {
    fn len(&self) -> usize {
        self.len
    }

    fn waiting_of(&self, class: WorkClass) -> usize {
        match class {
            WorkClass::Interactive => self.interactive,
            WorkClass::Batch => self.len - self.interactive,
        }
    }

    /// The head item alone when it goes alone (a solo item, a chat); else as many texts of the
    /// flow's average as the puller's limits take, at most all it holds. The rerank query counts
    /// once (a chat's body is left out: reading it costs more than the order it would change).
    fn next_tokens(&self, limits: BatchLimits) -> usize {
        let Some(head) = self
            .ring
            .front()
            .and_then(|id| self.requests.get(id))
            .and_then(|f| f.items.front())
        else {
            return 0;
        };
        let shared = match &*head.shape {
            Shape::Rerank { query, .. } => estimate_tokens(query),
            _ => 0,
        };
        if head.solo || matches!(*head.shape, Shape::Chat { .. }) {
            return shared + estimate_tokens(&head.text);
        }
        let mean = self.tokens.div_ceil(self.len.max(1));
        let frame = self
            .tokens
            .min(limits.max_tokens)
            .min(limits.max_items.saturating_mul(mean));
        shared.saturating_add(frame)
    }

    /// The first request in round order whose head item fits the offer leads the frame (looking
    /// at most [`SCAN_LIMIT`] requests: the window one frame walks, whatever the requests'
    /// shapes); then, from it on in round order, each request of the window whose head is of
    /// the lead's shape takes items while its deficit lasts and they fit the offer and the
    /// puller's limits (the first item always goes, however long). After the first round only
    /// those requests are visited again. A solo item and a chat go alone; items that failed
    /// locally go only with each other.
    fn take(&mut self, offer: &mut Offer<'_>) -> Option<(Vec<Item>, usize)> {
        let window = self.window(offer.alive);
        let lead = window.iter().position(|id| {
            self.requests
                .get(id)
                .and_then(|f| f.items.front())
                .is_some_and(|i| offer.only.is_none_or(|c| i.caller.class == c) && (offer.fits)(i))
        });
        let Some(lead) = lead else {
            self.put_back(window, 0);
            return None;
        };
        let lead_id = window[lead];
        let Some(first) = self.requests.get(&lead_id).and_then(|f| f.items.front()) else {
            self.put_back(window, 0);
            return None;
        };
        // A chat is one completion: two equal bodies from two clients are two answers.
        if first.solo || matches!(*first.shape, Shape::Chat { .. }) {
            let Some(item) = self.pop(lead_id) else {
                self.put_back(window, 0);
                return None;
            };
            let tokens = item.shape.shared_tokens() + estimate_tokens(&item.text);
            if let Some(flow) = self.requests.get_mut(&lead_id) {
                flow.deficit = flow.deficit.saturating_sub(tokens as i64);
            }
            // It had its turn: the round goes on behind it.
            let mut window = window;
            window.remove(lead);
            self.put_back(window, 0);
            if self.is_empty_request(lead_id) {
                self.requests.remove(&lead_id);
            } else {
                self.ring.push_back(lead_id);
            }
            return Some((vec![item], tokens));
        }
        let (shape, retry, only) = (first.shape.clone(), first.failed_locally, offer.only);
        let mut tokens = shape.shared_tokens();
        let mut batch: Vec<Item> = Vec::new();
        let n = window.len();
        // The window's requests whose head may join, in round order from the lead: the only
        // ones the rounds after the first visit again.
        let mut joining: Vec<usize> = (0..n)
            .map(|step| (lead + step) % n)
            .filter(|&pos| {
                self.requests
                    .get(&window[pos])
                    .and_then(|f| f.items.front())
                    .is_some_and(|i| joins(i, &shape, retry, only))
            })
            .collect();
        // Where the next frame starts: the request after the last that took an item, or that
        // request itself while its deficit lasts.
        let mut resume = lead;
        let full = |batch: &Vec<Item>, tokens: usize| {
            batch.len() >= offer.limits.max_items || tokens >= offer.limits.max_tokens
        };
        // Rounds over the joining requests. One whose deficit is spent waits for the round's
        // end to earn its quantum; when none took anything in a round, the waiting earn at
        // once the rounds the first of them needs.
        'rounds: loop {
            let mut took_any = false;
            let mut waiting: Vec<RequestId> = Vec::new();
            let mut still: Vec<usize> = Vec::with_capacity(joining.len());
            for &pos in &joining {
                let id = window[pos];
                let Some(flow) = self.requests.get_mut(&id) else {
                    continue;
                };
                if !flow
                    .items
                    .front()
                    .is_some_and(|i| joins(i, &shape, retry, only))
                {
                    continue;
                }
                still.push(pos);
                if flow.deficit <= 0 {
                    waiting.push(id);
                    continue;
                }
                let mut took = false;
                while flow.deficit > 0 && !full(&batch, tokens) {
                    let Some(next) = flow.items.front() else {
                        break;
                    };
                    if !joins(next, &shape, retry, only) || !(offer.fits)(next) {
                        break;
                    }
                    let cost = estimate_tokens(&next.text);
                    if !batch.is_empty() && tokens + cost > offer.limits.max_tokens {
                        break;
                    }
                    let Some(item) = flow.items.pop_front() else {
                        break;
                    };
                    self.len -= 1;
                    self.interactive -= usize::from(is_interactive(&item));
                    self.tokens = self.tokens.saturating_sub(cost);
                    flow.deficit = flow.deficit.saturating_sub(cost as i64);
                    tokens += cost;
                    batch.push(item);
                    took = true;
                }
                if took {
                    took_any = true;
                    resume = if flow.deficit > 0 && !flow.items.is_empty() {
                        pos
                    } else {
                        (pos + 1) % n
                    };
                }
                if full(&batch, tokens) {
                    break 'rounds;
                }
            }
            joining = still;
            if waiting.is_empty() {
                // Every request that could join took what fits, or none could.
                if !took_any {
                    break;
                }
                continue;
            }
            let rounds = if took_any {
                1
            } else {
                waiting
                    .iter()
                    .filter_map(|id| self.requests.get(id))
                    .map(|f| {
                        (1i64.saturating_sub(f.deficit) as u64)
                            .div_ceil(REQUEST_QUANTUM_TOKENS as u64) as i64
                    })
                    .min()
                    .unwrap_or(1)
                    .max(1)
            };
            for id in &waiting {
                if let Some(f) = self.requests.get_mut(id) {
                    f.deficit = f
                        .deficit
                        .saturating_add(rounds.saturating_mul(REQUEST_QUANTUM_TOKENS));
                }
            }
        }
        if batch.is_empty() {
            self.put_back(window, 0);
            return None;
        }
        self.put_back(window, resume);
        Some((batch, tokens))
    }

    fn sweep(&mut self, gone: &mut dyn FnMut(&Item) -> bool) -> usize {
        let mut dropped = 0;
        let mut interactive = 0;
        let mut tokens = 0;
        for flow in self.requests.values_mut() {
            let before = flow.items.len();
            flow.items.retain(|i| {
                let drop = gone(i);
                if drop {
                    interactive += usize::from(is_interactive(i));
                    tokens += estimate_tokens(&i.text);
                }
                !drop
            });
            dropped += before - flow.items.len();
        }
        self.len -= dropped;
        self.interactive -= interactive;
        self.tokens = self.tokens.saturating_sub(tokens);
        self.forget_empty();
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::queue::Caller;

    fn item(request: RequestId, dimensions: Option<usize>) -> Item {
        Item {
            request,
            index: 0,
            text: format!("text of request {request}"),
            shape: Arc::new(Shape::Embed {
                dimensions,
                is_query: false,
                instruction: None,
            }),
            caller: Arc::new(Caller::default_project(WorkClass::Batch)),
            attempts: 0,
            solo: false,
            failed_locally: false,
        }
    }

    fn take(q: &mut ItemQueue) -> Vec<Item> {
        let mut fits = |_: &Item| true;
        let mut offer = Offer {
            limits: BatchLimits {
                max_items: 64,
                max_tokens: 1 << 20,
            },
            alive: &|_| true,
            fits: &mut fits,
            only: None,
        };
        q.take(&mut offer).map_or_else(Vec::new, |(items, _)| items)
    }

    #[test]
    fn one_frame_walks_a_bounded_window_whatever_the_mix_of_shapes() {
        // 10 000 requests, each of its own width but every 1 000th, which share one shape.
        let mut q = ItemQueue::default();
        let n = 10_000;
        for r in 0..n {
            let dims = (r % 1_000 != 0).then_some(r as usize + 1);
            q.push_back(item(r, dims));
        }
        let first = take(&mut q);
        assert!(q.walked() <= SCAN_LIMIT, "{}", q.walked());
        // The lead's shape within the window joins; the rest waits for its own turn.
        let joined: Vec<RequestId> = first.iter().map(|i| i.request).collect();
        assert_eq!(joined, [0, 1_000, 2_000, 3_000, 4_000]);
        // Every item is served in the end, each frame walking at most the window.
        let mut served = first.len();
        let mut frames = 1;
        while !q.ring.is_empty() {
            let frame = take(&mut q);
            assert!(!frame.is_empty(), "a frame at every offer");
            assert!(q.walked() <= SCAN_LIMIT);
            served += frame.len();
            frames += 1;
        }
        assert_eq!(served, n as usize);
        assert_eq!(q.len, 0);
        assert!(q.requests.is_empty(), "emptied requests leave");
        assert!(frames <= n as usize);
    }
}
