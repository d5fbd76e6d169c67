//! One flow's items in arrival order (a sub-project's, or a project's own): batches leave
//! from the head, sized to the puller; items that come back go to the front, in their order.

use std::collections::VecDeque;
use std::sync::Arc;

use super::drr::Backlog;
use super::{Item, Offer, SCAN_LIMIT, Shape, estimate_tokens};

#[derive(Debug, Default)]
pub(super) struct ItemQueue {
    items: VecDeque<Item>,
}

impl ItemQueue {
    pub fn push_back(&mut self, item: Item) {
        self.items.push_back(item);
    }

    pub fn push_front(&mut self, item: Item) {
        self.items.push_front(item);
    }
}

impl Backlog for ItemQueue {
    fn len(&self) -> usize {
        self.items.len()
    }

    /// The first live item that fits the offer (looking at most [`SCAN_LIMIT`] items from the
    /// head), then the live items right behind it, of its shape, that fit too, while they fit
    /// the puller's limits (the first item always goes, however long). A solo item and a chat
    /// go alone; items that failed locally go only with each other.
    fn take(&mut self, offer: &mut Offer<'_>) -> Option<(Vec<Item>, usize)> {
        let alive = offer.alive;
        while self.items.front().is_some_and(|i| !alive(i.request)) {
            self.items.pop_front();
        }
        let scan = self.items.len().min(SCAN_LIMIT);
        let start =
            (0..scan).find(|&i| alive(self.items[i].request) && (offer.fits)(&self.items[i]))?;
        let first = &self.items[start];
        // A chat is one completion: two equal bodies from two clients are two answers.
        if first.solo || matches!(*first.shape, Shape::Chat { .. }) {
            let item = self.items.remove(start)?;
            let tokens = item.shape.shared_tokens() + estimate_tokens(&item.text);
            return Some((vec![item], tokens));
        }
        let shape = first.shape.clone();
        let retry = first.failed_locally;
        let mut tokens = shape.shared_tokens() + estimate_tokens(&first.text);
        let (mut count, mut end) = (1, start + 1);
        while count < offer.limits.max_items && end < self.items.len() {
            let next = &self.items[end];
            if !alive(next.request) {
                end += 1; // swept out with the batch
                continue;
            }
            if next.solo || next.failed_locally != retry {
                break;
            }
            if !(Arc::ptr_eq(&next.shape, &shape) || *next.shape == *shape) || !(offer.fits)(next) {
                break;
            }
            let cost = estimate_tokens(&next.text);
            if tokens + cost > offer.limits.max_tokens {
                break;
            }
            tokens += cost;
            count += 1;
            end += 1;
        }
        let batch: Vec<Item> = self
            .items
            .drain(start..end)
            .filter(|i| alive(i.request))
            .collect();
        Some((batch, tokens))
    }

    fn sweep(&mut self, gone: &mut dyn FnMut(&Item) -> bool) -> usize {
        let before = self.items.len();
        self.items.retain(|i| !gone(i));
        before - self.items.len()
    }
}
