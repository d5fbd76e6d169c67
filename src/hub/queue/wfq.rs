//! Weighted fair queuing in virtual time over flows that hold work, counting tokens: start tags
//! on a virtual clock and the earliest virtual finish first, as weighted fair queuing and
//! Kubernetes' API Priority and Fairness do.
//!
//! The virtual clock counts tokens served per unit of weight. Each backlogged flow has a start
//! tag: where on that clock its next frame starts, advanced by `tokens / weight` for every frame
//! it is given. A puller is offered the flows in the order of the virtual finish of the frame
//! each would give it next (its start tag plus that frame's estimated tokens over its weight),
//! so over time every backlogged flow gets its weighted share of the tokens dispatched, whatever
//! its frames' sizes, and a flow with little to send finishes early on the clock and goes
//! first. Frames are sized by the puller, not cut to a share (cutting a frame would cost the
//! engine its batch); a large frame only moves its flow's start tag further on.
//!
//! A flow stays a flow while it has work waiting or frames in flight: a closed-loop client
//! whose whole request is out is not idle, it waits for those answers before it sends more. The
//! clock is the least start tag of those flows and of the flows that left in the last
//! [`RETURN_FRAMES`] frames (they may be back at once: the gap is no one's share). A flow that
//! becomes backlogged starts at the clock, or at its own finish tag when it left a moment ago
//! and that tag is still ahead of the clock or it left within [`RETURN_FRAMES`] frames: a flow
//! that went idle banks nothing, one that empties and comes straight back still owes what it
//! took, and keeps its place. So a request of a project that was idle goes with
//! the next frame, however many projects flood: each of them is at or past the clock and its
//! next frame finishes later than a small one starting there. A flow whose waiting work the
//! offered provider cannot take (bound to another space or scorer, cloud work under `backup`,
//! past its project's cloud share) is passed over and keeps its tag; when another flow is
//! served in its place its tag moves up to the served flow's start (it keeps its turn, and is
//! owed nothing for the frames it could not take). An offer that takes nothing changes no tag.
//! Work-conserving: a flow alone gets everything. Finish tags are remembered for at most
//! [`REMEMBERED`] flows, and forgotten when no flow is backlogged (nobody is owed anything
//! then).
//!
//! [`Wfq::take_within_share`] serves, out of turn, a flow no more than
//! [`INTERACTIVE_LEAD_TOKENS`](super::INTERACTIVE_LEAD_TOKENS) per unit of weight ahead of the
//! clock that holds what the caller asks for (the queue's interactive work): charged to that
//! flow like any frame, so it moves nothing ahead of its share.
//!
//! The scheduler is generic over what a flow holds, so the same code shares a role among
//! projects and a project among its sub-projects.

use std::collections::BTreeMap;

use super::{BatchLimits, Item, Offer};
use crate::protocol::WorkClass;

/// A point on the virtual clock: tokens per unit of weight, in `1 / SCALE` of a token.
type VirtualTime = u128;

const SCALE: VirtualTime = 1 << 16;

/// Finish tags of flows that emptied, remembered at most (beyond it a returning flow starts at
/// the clock: at most one frame early).
const REMEMBERED: usize = 4096;

/// A flow that ran dry and is back before this many frames were taken keeps its place: its
/// last frames are still being answered when its client sends the next request, so it was
/// never idle (without this, the frames others take in that gap would be its loss each time).
/// What it can be owed is bounded by those frames.
const RETURN_FRAMES: u64 = 4;

/// Where `tokens` served to a flow of `weight` move its start tag.
fn span(tokens: usize, weight: u32) -> VirtualTime {
    (tokens as VirtualTime).saturating_mul(SCALE) / VirtualTime::from(weight.max(1))
}

/// What a flow holds: items waiting, and a way to hand out a batch of them.
pub(super) trait Backlog: Default {
    /// Items waiting in this flow.
    fn len(&self) -> usize;
    /// Items waiting in this flow that their clients sent as `class`.
    fn waiting_of(&self, class: WorkClass) -> usize;
    /// The tokens of the frame this flow would give a puller of `limits` next: an estimate
    /// that orders the flows (what a frame is charged is what it holds).
    fn next_tokens(&self, limits: BatchLimits) -> usize;
    /// A batch for the offer, and its tokens, or `None` when nothing here fits it.
    fn take(&mut self, offer: &mut Offer<'_>) -> Option<(Vec<Item>, usize)>;
    /// Drops items `gone` says are dead; how many left.
    fn sweep(&mut self, gone: &mut dyn FnMut(&Item) -> bool) -> usize;
}

struct Flow<F> {
    weight: u32,
    /// Its start tag: where on the virtual clock its next frame starts.
    start: VirtualTime,
    /// When it became backlogged (of two equal tags, the earlier goes first).
    joined: u64,
    /// Frames of it still out (taken, not yet landed): a flow with nothing waiting but work
    /// in flight is not idle (a client waits for those answers before it sends more), so it
    /// keeps its tag and holds the clock back until they land.
    in_flight: u32,
    inner: F,
}

impl<F: Backlog> Flow<F> {
    /// The virtual finish of the frame it would give a puller of `limits` next.
    fn finish(&self, limits: BatchLimits) -> VirtualTime {
        self.start
            .saturating_add(span(self.inner.next_tokens(limits), self.weight))
    }
}

/// Flows keyed by `K`, served in weighted fair queuing by virtual time.
pub(super) struct Wfq<K, F> {
    /// The backlogged flows (each holds work).
    flows: BTreeMap<K, Flow<F>>,
    /// The virtual clock: the least start tag of the backlogged flows (kept while none is).
    clock: VirtualTime,
    /// Finish tags of flows that left, and when (in frames taken): remembered while ahead of
    /// the clock, or for [`RETURN_FRAMES`] frames.
    finished: BTreeMap<K, (VirtualTime, u64)>,
    /// Frames taken so far.
    taken: u64,
    /// Flows that became backlogged so far.
    joins: u64,
}

impl<K, F> Default for Wfq<K, F> {
    fn default() -> Self {
        Self {
            flows: BTreeMap::new(),
            clock: 0,
            finished: BTreeMap::new(),
            taken: 0,
            joins: 0,
        }
    }
}

impl<K: Ord + Clone, F: Backlog> Wfq<K, F> {
    /// Items waiting in every flow.
    pub fn len(&self) -> usize {
        self.flows.values().map(|f| f.inner.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.flows.values().all(|f| f.inner.len() == 0)
    }

    /// The flows holding work, with their waiting items.
    pub fn backlog(&self) -> impl Iterator<Item = (&K, &F)> {
        self.flows
            .iter()
            .filter(|(_, f)| f.inner.len() > 0)
            .map(|(k, f)| (k, &f.inner))
    }

    /// Adds work to flow `key` (backlogged from now on, starting at the clock or at its own
    /// finish tag, the later, when it held none); `weight` is its weight from now on.
    pub fn push(&mut self, key: &K, weight: u32, add: impl FnOnce(&mut F)) {
        let weight = weight.max(1);
        if let Some(flow) = self.flows.get_mut(key) {
            // Backlogged, or only waiting for its work in flight: it keeps its tag.
            flow.weight = weight;
            add(&mut flow.inner);
            return;
        }
        let mut inner = F::default();
        add(&mut inner);
        if inner.len() == 0 {
            return;
        }
        let start = match self.finished.remove(key) {
            // Back within a few frames of running dry (a client that sends its next request
            // when the last is answered): its place kept, as if it had never left.
            Some((finish, at)) if self.taken.saturating_sub(at) <= RETURN_FRAMES => finish,
            Some((finish, _)) => finish.max(self.clock),
            None => self.clock,
        };
        self.joins += 1;
        self.flows.insert(
            key.clone(),
            Flow {
                weight,
                start,
                joined: self.joins,
                in_flight: 0,
                inner,
            },
        );
    }

    /// The keys of the flows `wanted` picks, in the order a puller of `limits` is offered them:
    /// earliest virtual finish of their next frame, then earliest start, then the first to
    /// join.
    fn order(&self, limits: BatchLimits, wanted: impl Fn(&Flow<F>) -> bool) -> Vec<K> {
        let mut order: Vec<((VirtualTime, VirtualTime, u64), &K)> = self
            .flows
            .iter()
            .filter(|&(_, f)| f.inner.len() > 0 && wanted(f))
            .map(|(k, f)| ((f.finish(limits), f.start, f.joined), k))
            .collect();
        order.sort_unstable_by_key(|(rank, _)| *rank);
        order.into_iter().map(|(_, k)| k.clone()).collect()
    }

    /// The next batch for `offer`: from the first flow in virtual-finish order that has
    /// something that fits it. The flows passed over on the way move up to the served flow's
    /// start; an offer nothing fits changes no tag.
    pub fn take(&mut self, offer: &mut Offer<'_>) -> Option<(Vec<Item>, usize)> {
        let mut passed: Vec<K> = Vec::new();
        for key in self.order(offer.limits, |_| true) {
            let Some(flow) = self.flows.get_mut(&key) else {
                continue;
            };
            if let Some((items, tokens)) = flow.inner.take(offer) {
                let start = flow.start;
                for k in &passed {
                    if let Some(f) = self.flows.get_mut(k) {
                        f.start = f.start.max(start);
                    }
                }
                self.charge(&key, tokens);
                return Some((items, tokens));
            }
            if flow.inner.len() == 0 {
                // Only dead items were left: nothing waits in it now.
                self.leave_if_idle(&key);
            } else {
                passed.push(key);
            }
        }
        self.settle();
        None
    }

    /// Out of turn: the first flow in virtual-finish order that is within its share (its start
    /// at most [`INTERACTIVE_LEAD_TOKENS`](super::INTERACTIVE_LEAD_TOKENS) per unit of weight
    /// past the clock) and that `wanted` says holds what the offer asks for, served and
    /// charged; no other tag moves.
    pub fn take_within_share(
        &mut self,
        offer: &mut Offer<'_>,
        wanted: &dyn Fn(&F) -> bool,
    ) -> Option<(Vec<Item>, usize)> {
        let lead = VirtualTime::from(super::INTERACTIVE_LEAD_TOKENS).saturating_mul(SCALE);
        let within = self.clock.saturating_add(lead);
        for key in self.order(offer.limits, |f| f.start <= within && wanted(&f.inner)) {
            let Some(flow) = self.flows.get_mut(&key) else {
                continue;
            };
            if let Some((items, tokens)) = flow.inner.take(offer) {
                self.charge(&key, tokens);
                return Some((items, tokens));
            }
            if flow.inner.len() == 0 {
                self.leave_if_idle(&key);
            }
        }
        self.settle();
        None
    }

    /// Drops dead items from every flow; flows left empty leave. How many left.
    pub fn sweep(&mut self, gone: &mut dyn FnMut(&Item) -> bool) -> usize {
        let mut dropped = 0;
        let mut emptied = Vec::new();
        for (key, flow) in &mut self.flows {
            dropped += flow.inner.sweep(gone);
            if flow.inner.len() == 0 {
                emptied.push(key.clone());
            }
        }
        for key in emptied {
            self.leave_if_idle(&key);
        }
        self.settle();
        dropped
    }

    /// Charges a frame's tokens to flow `key`: the frame is in flight until [`Wfq::landed`].
    fn charge(&mut self, key: &K, tokens: usize) {
        if let Some(flow) = self.flows.get_mut(key) {
            flow.start = flow.start.saturating_add(span(tokens, flow.weight));
            flow.in_flight = flow.in_flight.saturating_add(1);
        }
        self.taken = self.taken.saturating_add(1);
        self.settle();
    }

    /// A frame of flow `key` landed (answered, failed, taken back); `inner` hears of it too
    /// (a project's sub-project). A flow with nothing waiting and nothing in flight leaves.
    pub fn landed(&mut self, key: &K, inner: impl FnOnce(&mut F)) {
        if let Some(flow) = self.flows.get_mut(key) {
            flow.in_flight = flow.in_flight.saturating_sub(1);
            inner(&mut flow.inner);
            self.leave_if_idle(key);
        }
        self.settle();
    }

    /// A frame of flow `key` went out again (a lease parked and resumed): in flight once more,
    /// if the flow is still known (else nothing waits for it).
    pub fn resumed(&mut self, key: &K, inner: impl FnOnce(&mut F)) {
        if let Some(flow) = self.flows.get_mut(key) {
            flow.in_flight = flow.in_flight.saturating_add(1);
            inner(&mut flow.inner);
        }
    }

    /// Flow `key` leaves when nothing of it waits and nothing is in flight.
    fn leave_if_idle(&mut self, key: &K) {
        if self
            .flows
            .get(key)
            .is_some_and(|f| f.inner.len() == 0 && f.in_flight == 0)
        {
            self.leave(key);
        }
    }

    /// Flow `key` is no longer backlogged; its finish tag is remembered while it is ahead of
    /// the clock (it owes that), and for [`RETURN_FRAMES`] frames either way.
    fn leave(&mut self, key: &K) {
        let Some(flow) = self.flows.remove(key) else {
            return;
        };
        if self.finished.len() >= REMEMBERED {
            let (clock, taken) = (self.clock, self.taken);
            self.finished.retain(|_, (finish, at)| {
                *finish > clock || taken.saturating_sub(*at) <= RETURN_FRAMES
            });
        }
        if self.finished.len() < REMEMBERED {
            self.finished.insert(key.clone(), (flow.start, self.taken));
        }
    }

    /// The clock moves up to the least start tag of the flows (backlogged, or waiting for
    /// their work in flight) and of those that ran dry in the last [`RETURN_FRAMES`] frames
    /// (they may be back at once: the gap is no one's share); with none of either, no flow is
    /// owed or owes anything.
    fn settle(&mut self) {
        let taken = self.taken;
        let recent = self
            .finished
            .values()
            .filter(|(_, at)| taken.saturating_sub(*at) <= RETURN_FRAMES)
            .map(|(finish, _)| *finish);
        match self.flows.values().map(|f| f.start).chain(recent).min() {
            Some(least) => self.clock = self.clock.max(least),
            None => self.finished.clear(),
        }
    }
}

/// A flow of flows: a project shares its turn among its sub-projects the same way.
impl<K: Ord + Clone, F: Backlog> Backlog for Wfq<K, F> {
    fn len(&self) -> usize {
        Wfq::len(self)
    }

    fn waiting_of(&self, class: WorkClass) -> usize {
        self.flows.values().map(|f| f.inner.waiting_of(class)).sum()
    }

    /// The next frame of the flow it would serve first.
    fn next_tokens(&self, limits: BatchLimits) -> usize {
        self.flows
            .values()
            .filter(|f| f.inner.len() > 0)
            .min_by_key(|f| (f.finish(limits), f.start, f.joined))
            .map_or(0, |f| f.inner.next_tokens(limits))
    }

    fn take(&mut self, offer: &mut Offer<'_>) -> Option<(Vec<Item>, usize)> {
        Wfq::take(self, offer)
    }

    fn sweep(&mut self, gone: &mut dyn FnMut(&Item) -> bool) -> usize {
        Wfq::sweep(self, gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_is_tokens_over_weight_on_the_clock() {
        assert_eq!(span(10, 1), 10 * SCALE);
        assert_eq!(span(10, 10), SCALE);
        assert!(span(2, crate::hub::projects::MAX_WEIGHT) > 0);
        assert_eq!(span(usize::MAX, 1), (usize::MAX as VirtualTime) * SCALE);
    }
}
