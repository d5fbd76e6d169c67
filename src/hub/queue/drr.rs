//! Deficit round robin (Shreedhar & Varghese, 1995) over flows that hold work, counting
//! tokens: each backlogged flow earns `quantum × weight` tokens per round and spends them on
//! the batches it is given, so over time every backlogged flow gets its weighted share of the
//! tokens dispatched, whatever its batches' sizes.
//!
//! Batches are sized by the puller, not by the deficit (cutting a frame to a flow's deficit
//! would cost the engine its batch), so a deficit may go negative: the flow then sits out the
//! rounds it borrowed. A flow whose waiting work the offered provider cannot take (bound to
//! another space or scorer, cloud work under `backup`, past its project's cloud share) is
//! skipped and keeps its deficit; a flow that empties leaves the ring and forgets it (idle
//! flows bank nothing). A flow that joins starts with one round's quantum, so a lone request
//! of an idle flow is served in this round, not the next. Work-conserving: a flow alone gets
//! everything.
//!
//! [`Drr::take_within_deficit`] serves, out of turn, the first flow in round order that still
//! has deficit and holds what the caller asks for (the queue's interactive work): charged to
//! that flow like any batch, so it moves nothing ahead of its share.
//!
//! The scheduler is generic over what a flow holds, so the same code shares a class among
//! projects and a project among its sub-projects.

use std::collections::{BTreeMap, VecDeque};

/// What a flow holds: items waiting, and a way to hand out a batch of them.
pub(super) trait Backlog: Default {
    /// Items waiting in this flow.
    fn len(&self) -> usize;
    /// Items waiting in this flow that their clients sent as `class`.
    fn waiting_of(&self, class: crate::protocol::WorkClass) -> usize;
    /// A batch for the offer, and its tokens, or `None` when nothing here fits it.
    fn take(&mut self, offer: &mut super::Offer<'_>) -> Option<(Vec<super::Item>, usize)>;
    /// Drops items `gone` says are dead; how many left.
    fn sweep(&mut self, gone: &mut dyn FnMut(&super::Item) -> bool) -> usize;
}

struct Flow<F> {
    weight: u32,
    deficit: i64,
    inner: F,
}

/// Flows keyed by `K`, served in weighted deficit round robin.
pub(super) struct Drr<K, F> {
    flows: BTreeMap<K, Flow<F>>,
    /// Backlogged flows in round order; the front one has the turn.
    ring: VecDeque<K>,
    /// Tokens a flow of weight 1 earns per round.
    quantum: i64,
}

impl<K: Ord + Clone, F: Backlog> Drr<K, F> {
    pub fn new(quantum_tokens: u32) -> Self {
        Self {
            flows: BTreeMap::new(),
            ring: VecDeque::new(),
            quantum: i64::from(quantum_tokens.max(1)),
        }
    }

    /// Items waiting in every flow.
    pub fn len(&self) -> usize {
        self.flows.values().map(|f| f.inner.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// The flows holding work, with their waiting items.
    pub fn backlog(&self) -> impl Iterator<Item = (&K, &F)> {
        self.flows.iter().map(|(k, f)| (k, &f.inner))
    }

    /// Adds work to flow `key` (created at the back of the ring, with no deficit, when it
    /// held none); `weight` is its weight from now on.
    pub fn push(&mut self, key: &K, weight: u32, add: impl FnOnce(&mut F)) {
        let quantum = self.quantum.saturating_mul(i64::from(weight.max(1)));
        let flow = self.flows.entry(key.clone()).or_insert_with(|| Flow {
            weight,
            deficit: quantum,
            inner: F::default(),
        });
        flow.weight = weight.max(1);
        let was_empty = flow.inner.len() == 0;
        add(&mut flow.inner);
        if was_empty && flow.inner.len() > 0 && !self.ring.contains(key) {
            self.ring.push_back(key.clone());
        }
    }

    /// The next batch for `offer`: the flow with the turn is served while its deficit lasts;
    /// a flow whose deficit is spent earns its quantum and passes the turn; a flow with
    /// nothing that fits is passed over with its deficit kept.
    pub fn take(&mut self, offer: &mut super::Offer<'_>) -> Option<(Vec<super::Item>, usize)> {
        // Rounds only pass when something is served: an offer nothing fits (a provider that
        // keeps its last credit for interactive work, a cloud provider past a project's share)
        // leaves every deficit and the ring as they were.
        let ring_before = self.ring.clone();
        let mut credited: Vec<(K, i64)> = Vec::new();
        let mut passed_over = 0;
        while passed_over < self.ring.len() {
            let Some(key) = self.ring.front().cloned() else {
                break;
            };
            let Some(flow) = self.flows.get_mut(&key) else {
                self.ring.pop_front();
                continue;
            };
            if flow.deficit <= 0 {
                // A new round for this flow (it may take several to repay a large batch).
                let quantum = self.quantum.saturating_mul(i64::from(flow.weight));
                flow.deficit = flow.deficit.saturating_add(quantum);
                credited.push((key, quantum));
                self.ring.rotate_left(1);
                // A flow with a new round is tried before the offer is given up.
                passed_over = 0;
                continue;
            }
            match flow.inner.take(offer) {
                Some((items, tokens)) => {
                    self.charge(&key, tokens);
                    return Some((items, tokens));
                }
                None if flow.inner.len() == 0 => {
                    // Only dead items were left: the flow is gone.
                    self.flows.remove(&key);
                    self.ring.pop_front();
                }
                None => {
                    passed_over += 1;
                    self.ring.rotate_left(1);
                }
            }
        }
        for (key, quantum) in credited {
            if let Some(flow) = self.flows.get_mut(&key) {
                flow.deficit = flow.deficit.saturating_sub(quantum);
            }
        }
        self.ring = ring_before;
        let flows = &self.flows;
        self.ring.retain(|k| flows.contains_key(k));
        None
    }

    /// Out of turn: the first flow in round order with deficit left that `wanted` says holds
    /// what the offer asks for, served and charged; no round passes, no turn moves.
    pub fn take_within_deficit(
        &mut self,
        offer: &mut super::Offer<'_>,
        wanted: &dyn Fn(&F) -> bool,
    ) -> Option<(Vec<super::Item>, usize)> {
        let candidates: Vec<K> = self
            .ring
            .iter()
            .filter(|k| {
                self.flows
                    .get(*k)
                    .is_some_and(|f| f.deficit > 0 && wanted(&f.inner))
            })
            .cloned()
            .collect();
        for key in candidates {
            let Some(flow) = self.flows.get_mut(&key) else {
                continue;
            };
            if let Some((items, tokens)) = flow.inner.take(offer) {
                self.charge(&key, tokens);
                return Some((items, tokens));
            }
            if flow.inner.len() == 0 {
                self.forget(&key);
            }
        }
        None
    }

    /// Drops dead items from every flow; flows left empty leave the ring. How many left.
    pub fn sweep(&mut self, gone: &mut dyn FnMut(&super::Item) -> bool) -> usize {
        let mut dropped = 0;
        let mut emptied = Vec::new();
        for (key, flow) in &mut self.flows {
            dropped += flow.inner.sweep(gone);
            if flow.inner.len() == 0 {
                emptied.push(key.clone());
            }
        }
        for key in emptied {
            self.forget(&key);
        }
        dropped
    }

    /// Charges a batch's tokens to flow `key`; it leaves the ring when it emptied.
    fn charge(&mut self, key: &K, tokens: usize) {
        if let Some(flow) = self.flows.get_mut(key) {
            flow.deficit = flow
                .deficit
                .saturating_sub(i64::try_from(tokens).unwrap_or(i64::MAX));
            if flow.inner.len() == 0 {
                self.forget(key);
            }
        }
    }

    fn forget(&mut self, key: &K) {
        self.flows.remove(key);
        self.ring.retain(|k| k != key);
    }
}

impl<K: Ord + Clone, F: Backlog> Default for Drr<K, F> {
    fn default() -> Self {
        Self::new(super::QUANTUM_TOKENS)
    }
}

/// A flow of flows: a project shares its turn among its sub-projects the same way.
impl<K: Ord + Clone, F: Backlog> Backlog for Drr<K, F> {
    fn len(&self) -> usize {
        Drr::len(self)
    }

    fn waiting_of(&self, class: crate::protocol::WorkClass) -> usize {
        self.flows.values().map(|f| f.inner.waiting_of(class)).sum()
    }

    fn take(&mut self, offer: &mut super::Offer<'_>) -> Option<(Vec<super::Item>, usize)> {
        Drr::take(self, offer)
    }

    fn sweep(&mut self, gone: &mut dyn FnMut(&super::Item) -> bool) -> usize {
        Drr::sweep(self, gone)
    }
}
