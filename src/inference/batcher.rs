//! Forming batches: a token budget, with length bucketing.
//!
//! With packed attention (the CPU, and CUDA in bf16/f16) a batch costs its real tokens. Where
//! attention runs padded (the fallback on a GPU), a batch costs `longest row × rows` tokens and
//! mixing a 10-token text with a 250-token one wastes 96% of the short row. The queue therefore
//! starts every batch with its **oldest** entry (nothing starves: every entry becomes the oldest
//! eventually) and fills it with the entries whose lengths are **nearest** to that one, until
//! the next would break `max_batch_tokens` (real or padded tokens, as the path pays) or
//! `max_batch_rows`. This is TEI's budget FIFO plus the length sorting that Infinity and
//! sentence-transformers use, without their unbounded reordering. Urgent entries (interactive
//! work: queries, reranks) start a batch before older batch entries, so a query waits at most
//! for the batches already formed.
//!
//! The queue is plain data (no threads, no tensors) so its policy is unit-tested directly.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;

/// The limits of one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchBudget {
    /// Tokens per batch: longest row × rows when `padded`, else the sum of the rows.
    pub max_tokens: usize,
    /// Rows per batch.
    pub max_rows: usize,
    /// Whether the model pays for padding (padded attention).
    pub padded: bool,
}

impl BatchBudget {
    /// What a batch of `rows` rows, the longest `longest` and `sum` tokens in all, costs.
    fn cost(&self, rows: usize, longest: usize, sum: usize) -> usize {
        if self.padded { longest * rows } else { sum }
    }
}

/// Entries waiting for the model, indexed by length and by age.
pub struct BatchQueue<T> {
    /// (length, sequence number) → entry; sequence numbers make keys unique and ordered by age.
    by_len: BTreeMap<(usize, u64), T>,
    /// Keys in arrival order; keys already taken are skipped lazily.
    by_age: VecDeque<(usize, u64)>,
    /// Keys of urgent entries (interactive work) in arrival order: the oldest of them starts
    /// the next batch before any older batch entry.
    urgent: VecDeque<(usize, u64)>,
    next_seq: u64,
}

impl<T> Default for BatchQueue<T> {
    fn default() -> Self {
        Self {
            by_len: BTreeMap::new(),
            by_age: VecDeque::new(),
            urgent: VecDeque::new(),
            next_seq: 0,
        }
    }
}

impl<T> BatchQueue<T> {
    pub fn push(&mut self, len: usize, item: T) {
        let key = (len, self.next_seq);
        self.next_seq += 1;
        self.by_len.insert(key, item);
        self.by_age.push_back(key);
    }

    /// Queues an urgent entry (a query, a rerank): it starts the next batch, ahead of batch
    /// work that arrived before it (its batch mates are still its nearest lengths).
    pub fn push_urgent(&mut self, len: usize, item: T) {
        let key = (len, self.next_seq);
        self.push(len, item);
        self.urgent.push_back(key);
    }

    pub fn len(&self) -> usize {
        self.by_len.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_len.is_empty()
    }

    /// Keeps only the entries for which `keep` holds (drops clients that went away).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        self.by_len.retain(|_, v| keep(v));
    }

    /// Takes the next batch: the oldest entry plus its nearest neighbours by length that fit.
    /// Returns (length, entry) pairs; empty only when the queue is empty.
    pub fn next_batch(&mut self, budget: BatchBudget) -> Vec<(usize, T)> {
        let urgent = loop {
            match self.urgent.pop_front() {
                None => break None,
                Some(key) if self.by_len.contains_key(&key) => break Some(key),
                Some(_) => continue,
            }
        };
        let oldest = match urgent {
            Some(key) => key,
            None => loop {
                match self.by_age.pop_front() {
                    None => return Vec::new(),
                    Some(key) if self.by_len.contains_key(&key) => break key,
                    Some(_) => continue,
                }
            },
        };
        let base_len = oldest.0;
        let mut keys = vec![oldest];
        let mut longest = base_len;
        let mut sum = base_len;
        {
            let mut down = self
                .by_len
                .range(..oldest)
                .rev()
                .map(|(k, _)| *k)
                .peekable();
            let mut up = self
                .by_len
                .range((Bound::Excluded(oldest), Bound::Unbounded))
                .map(|(k, _)| *k)
                .peekable();
            let mut up_open = true;
            while keys.len() < budget.max_rows.max(1) {
                let d = down.peek().copied();
                let u = if up_open { up.peek().copied() } else { None };
                let take_up = match (d, u) {
                    (None, None) => break,
                    (Some(_), None) => false,
                    (None, Some(_)) => true,
                    // Nearest length wins; a tie goes to the shorter one (it adds no padding).
                    (Some(d), Some(u)) => u.0 - base_len < base_len - d.0,
                };
                let key = if take_up { u } else { d }.expect("candidate exists");
                let cost = budget.cost(keys.len() + 1, longest.max(key.0), sum + key.0);
                if cost > budget.max_tokens {
                    if take_up {
                        // Every later `up` entry is longer still: stop looking up.
                        up_open = false;
                        continue;
                    }
                    // The shortest-remaining candidate does not fit, so nothing does.
                    break;
                }
                longest = longest.max(key.0);
                sum += key.0;
                keys.push(key);
                if take_up {
                    up.next();
                } else {
                    down.next();
                }
            }
        }
        keys.into_iter()
            .map(|k| (k.0, self.by_len.remove(&k).expect("key taken once")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max_tokens: usize, max_rows: usize) -> BatchBudget {
        BatchBudget {
            max_tokens,
            max_rows,
            padded: true,
        }
    }

    #[test]
    fn oldest_first_and_nearest_lengths() {
        let mut q = BatchQueue::default();
        for (i, len) in [100, 10, 12, 98, 11, 101, 200].into_iter().enumerate() {
            q.push(len, i);
        }
        let b = q.next_batch(budget(1000, 3));
        let ids: Vec<_> = b.iter().map(|(_, i)| *i).collect();
        assert_eq!(ids[0], 0, "the oldest entry leads");
        let mut lens: Vec<_> = b.iter().map(|(l, _)| *l).collect();
        lens.sort();
        assert_eq!(lens, [98, 100, 101], "neighbours by length, not by age");
        // Next batch starts with the oldest remaining (len 10) and groups the short ones.
        let b = q.next_batch(budget(1000, 3));
        let mut lens: Vec<_> = b.iter().map(|(l, _)| *l).collect();
        lens.sort();
        assert_eq!(lens, [10, 11, 12]);
        let b = q.next_batch(budget(1000, 3));
        assert_eq!(b.iter().map(|(l, _)| *l).collect::<Vec<_>>(), [200]);
        assert!(q.next_batch(budget(1000, 3)).is_empty());
        assert!(q.is_empty());
    }

    #[test]
    fn an_urgent_entry_starts_the_next_batch_ahead_of_older_work() {
        let mut q = BatchQueue::default();
        for i in 0..10 {
            q.push(50, i);
        }
        q.push_urgent(12, 100);
        let b = q.next_batch(budget(200, 4));
        assert_eq!(b[0].1, 100, "the query leads the next batch");
        // Its batch mates are its nearest lengths; then the old order resumes.
        assert!(b.iter().all(|(l, _)| *l == 12 || *l == 50));
        let next = q.next_batch(budget(200, 4));
        assert!(next.iter().all(|(_, i)| *i < 10));
        let mut left = 0;
        while !q.is_empty() {
            left += q.next_batch(budget(200, 4)).len();
        }
        assert_eq!(b.len() + next.len() + left, 11, "everything is served once");
    }

    #[test]
    fn padded_budget_is_respected() {
        let mut q = BatchQueue::default();
        for len in [50, 50, 50, 60, 10] {
            q.push(len, ());
        }
        // 60 × 3 = 180 > 160, so only the three 50s fit (50 × 3 = 150).
        let b = q.next_batch(budget(160, 10));
        assert_eq!(b.iter().map(|(l, _)| *l).collect::<Vec<_>>(), [50, 50, 50]);
        for (l, _) in &b {
            assert!(*l * b.len() <= 160);
        }
    }

    #[test]
    fn packed_budget_counts_real_tokens() {
        let mut q = BatchQueue::default();
        for len in [50, 10, 10, 10, 60] {
            q.push(len, ());
        }
        let packed = BatchBudget {
            max_tokens: 125,
            max_rows: 10,
            padded: false,
        };
        // Packed: 50 + 60 + 10 = 120 fits (one more 10 would not); padded it would cost
        // 60 × 3 = 180.
        let b = q.next_batch(packed);
        let mut lens: Vec<_> = b.iter().map(|(l, _)| *l).collect();
        lens.sort();
        assert_eq!(lens, [10, 50, 60]);
    }

    #[test]
    fn an_entry_over_budget_still_runs_alone() {
        let mut q = BatchQueue::default();
        q.push(500, 'a');
        q.push(5, 'b');
        let b = q.next_batch(budget(100, 8));
        assert_eq!(b.iter().map(|(_, c)| *c).collect::<Vec<_>>(), ['a']);
    }

    #[test]
    fn every_entry_is_served_exactly_once() {
        let mut q = BatchQueue::default();
        let mut x: u64 = 7;
        let n = 1000;
        for i in 0..n {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            q.push(1 + (x >> 33) as usize % 300, i);
        }
        let mut seen = vec![false; n];
        let mut batches = 0;
        while !q.is_empty() {
            let b = q.next_batch(budget(4096, 64));
            assert!(!b.is_empty());
            let longest = b.iter().map(|(l, _)| *l).max().unwrap();
            assert!(b.len() == 1 || longest * b.len() <= 4096);
            assert!(b.len() <= 64);
            for (_, i) in b {
                assert!(!seen[i]);
                seen[i] = true;
            }
            batches += 1;
        }
        assert!(seen.iter().all(|s| *s));
        assert!(
            batches < n / 8,
            "bucketing should pack rows: {batches} batches"
        );
    }

    #[test]
    fn retain_drops_entries_and_age_order_skips_them() {
        let mut q = BatchQueue::default();
        q.push(5, 1);
        q.push(5, 2);
        q.push(5, 3);
        q.retain(|v| *v != 1);
        let b = q.next_batch(budget(100, 1));
        assert_eq!(b[0].1, 2);
        assert_eq!(q.len(), 1);
    }
}
