//! How a role's spaces are founded and judged each round of the gate: the reference of a
//! role's first space (by its policy), a retired space fingerprinted again under its id, a
//! migration's next space by its founder; and the probes every live space asks of every
//! candidate (a first verify, the sentinel, a retry after a failed probe).

use std::time::Instant;

use super::{
    Candidate, Gate, ProbeRequest, Purpose, Space, Verdict, refused_unprobed, space_id,
    unpinned_model, verdict_key,
};
use crate::protocol::Backend;
use crate::roles::{Policy, Role};

/// What founding a space came to.
pub(super) enum Founding {
    /// Its fingerprint is stored.
    Found(String),
    /// Its fingerprint is on the way (or asked now).
    Fingerprinting(String),
    /// No reference can answer now.
    Nothing,
}

impl Gate {
    /// The reference candidates of a role, in the order they are tried.
    pub(super) fn references<'a>(
        &self,
        policy: Policy,
        cands: &[&'a Candidate],
    ) -> Vec<&'a Candidate> {
        if policy == Policy::Cloud {
            return cands
                .iter()
                .copied()
                .filter(|c| c.backend == Backend::Cloud)
                .collect();
        }
        let locals = cands
            .iter()
            .copied()
            .filter(|c| c.backend == Backend::Local && c.healthy);
        match &self.settings.reference {
            Some(named) => locals.filter(|c| &c.provider == named).collect(),
            // A fronted server's bytes are not ours to pin: it is judged against a space,
            // never the one that founds it, unless the operator named it.
            None => locals.filter(|c| !c.fronted).collect(),
        }
    }

    /// Whether some candidate could found (or answer for) a role's space under `policy`:
    /// under `cloud` a cloud provider, else a healthy local one (the named reference, when one
    /// is configured).
    pub fn has_reference(&self, policy: Policy, candidates: &[&Candidate]) -> bool {
        !self.references(policy, candidates).is_empty()
    }

    /// Probes due for every candidate against `sid` (a live space), when it is founded.
    pub(super) fn judge_all(
        &mut self,
        now: Instant,
        sid: &str,
        cands: &[&Candidate],
        out: &mut Vec<ProbeRequest>,
    ) {
        let Some(s) = self.spaces.get(sid) else {
            return;
        };
        let (w, encoder) = (s.dims, s.encoder.clone());
        for c in cands.iter().copied() {
            let key = verdict_key(c, sid);
            let entry = self.verdicts.get(&key);
            let due = match entry {
                None => Some(Purpose::Verify),
                Some(e) if e.probe.is_some() => None,
                Some(e) => match &e.verdict {
                    Verdict::Pass if e.next_check.is_some_and(|t| t <= now) => {
                        Some(Purpose::Sentinel)
                    }
                    Verdict::ProbeFailed { .. } if e.next_check.is_none_or(|t| t <= now) => {
                        Some(Purpose::Verify)
                    }
                    Verdict::Probing => Some(Purpose::Verify),
                    _ => None,
                },
            };
            if due == Some(Purpose::Verify)
                && let Some(reason) = refused_unprobed(c, w)
            {
                tracing::warn!(provider = %c.provider, space = %sid, reason = %reason, "gate: refused");
                self.record(
                    c,
                    sid,
                    Verdict::Refused { reason },
                    None,
                    encoder.clone(),
                    None,
                );
                continue;
            }
            if let Some(purpose) = due {
                out.push(self.send(now, c, sid, purpose, Some(w), encoder.clone()));
            }
        }
    }

    /// Candidates that may fingerprint a space again under its own id: cloud routes, and
    /// healthy local providers (a fronted server only when named the reference).
    pub(super) fn refounders<'a>(&self, cands: &[&'a Candidate]) -> Vec<&'a Candidate> {
        cands
            .iter()
            .copied()
            .filter(|c| match c.backend {
                Backend::Cloud => true,
                Backend::Local => {
                    c.healthy
                        && (!c.fronted
                            || self.settings.reference.as_deref() == Some(c.provider.as_str()))
                }
            })
            .collect()
    }

    /// The first of `refs` that founds a space `accept` takes: found already, its fingerprint
    /// on the way, or asked now.
    pub(super) fn found(
        &mut self,
        now: Instant,
        refs: &[&Candidate],
        width: Option<usize>,
        accept: &dyn Fn(&str) -> bool,
        out: &mut Vec<ProbeRequest>,
    ) -> Founding {
        for r in refs {
            let Some(w) = width.or(r.dims) else { continue };
            let sid = self.reference_space(r, w);
            if !accept(&sid) {
                continue;
            }
            if self.spaces.contains_key(&sid) {
                return Founding::Found(sid);
            }
            // One fingerprint per space at a time, whoever it was asked of.
            if self
                .pending
                .values()
                .any(|p| p.purpose == Purpose::Fingerprint && p.space == sid)
            {
                return Founding::Fingerprinting(sid);
            }
            // Fingerprint with this reference, unless it cannot answer now.
            let key = verdict_key(r, &sid);
            match self
                .verdicts
                .get(&key)
                .map(|e| (&e.verdict, e.next_check, e.probe.is_some()))
            {
                Some((_, _, true)) => return Founding::Fingerprinting(sid),
                Some((Verdict::Refused { .. }, _, _)) => continue,
                Some((Verdict::ProbeFailed { .. }, Some(at), _)) if at > now => continue,
                _ => {}
            }
            if let Some(reason) = refused_unprobed(r, w) {
                self.record(r, &sid, Verdict::Refused { reason }, None, "-".into(), None);
                continue;
            }
            out.push(self.send(now, r, &sid, Purpose::Fingerprint, Some(w), "-".into()));
            return Founding::Fingerprinting(sid);
        }
        Founding::Nothing
    }

    /// A migration's next space: founded by its founder (its id named as soon as the founder
    /// is connected), never the current or previous space.
    pub(super) fn found_next(
        &mut self,
        now: Instant,
        role: Role,
        cands: &[&Candidate],
        out: &mut Vec<ProbeRequest>,
    ) {
        let Some(l) = self.live.get(&role) else {
            return;
        };
        let Some(m) = &l.next else {
            return;
        };
        if m.space
            .as_ref()
            .is_some_and(|s| self.spaces.contains_key(s))
        {
            return;
        }
        let (founder, want) = (m.founder.clone(), m.space.clone());
        let taken: Vec<String> = std::iter::once(l.current.clone())
            .chain(l.previous.as_ref().map(|p| p.space.clone()))
            .collect();
        let refs: Vec<&Candidate> = cands
            .iter()
            .copied()
            .filter(|c| founder.founds(c) && (c.backend == Backend::Cloud || c.healthy))
            .collect();
        let accept =
            |sid: &str| want.as_deref().is_none_or(|w| w == sid) && !taken.iter().any(|t| t == sid);
        let named = match self.found(now, &refs, founder.dims(), &accept, out) {
            Founding::Found(sid) | Founding::Fingerprinting(sid) => sid,
            Founding::Nothing => return,
        };
        if let Some(m) = self.live.get_mut(&role).and_then(|l| l.next.as_mut())
            && m.space.as_deref() != Some(named.as_str())
        {
            tracing::info!(role = %role, space = %named, "a migration's next space is named by its founder");
            m.space = Some(named);
            self.dirty = true;
        }
    }

    /// The space a reference answers for at width `w`: its model's; for an unpinned folder
    /// (named by its bytes), the role's newest stored space an unpinned folder founded at that
    /// width, so new bytes in the reference's folder are a new provider judged against the
    /// stored fingerprint, never a silently new space.
    pub(super) fn reference_space(&self, r: &Candidate, w: usize) -> String {
        let own = space_id(r.role, &r.model, w);
        if self.spaces.contains_key(&own)
            || r.backend != Backend::Local
            || !unpinned_model(&r.model)
        {
            return own;
        }
        self.spaces
            .values()
            .filter(|s| s.role == r.role && s.dims == w && s.unpinned_reference())
            .max_by_key(|s| s.created_ms)
            .map_or(own, Space::id)
    }

    /// The role's current space, else its newest stored one; either only as wide as the
    /// table (`width`) when one is configured.
    pub(super) fn fallback_space(&self, role: Role, width: Option<usize>) -> Option<String> {
        let fits = |s: &Space| width.is_none_or(|w| s.dims == w);
        if let Some(sid) = self.live.get(&role).map(|l| &l.current)
            && self.spaces.get(sid).is_some_and(fits)
        {
            return Some(sid.clone());
        }
        self.spaces
            .values()
            .filter(|s| s.role == role && fits(s))
            .max_by_key(|s| s.created_ms)
            .map(Space::id)
    }
}
