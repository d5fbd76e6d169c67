//! What one client request is served by, and whether anything still can serve it.
//!
//! A request is **bound**: an embedding request to the one vector space it was admitted under
//! (fixed at admission), a rerank request to one scorer identity (fixed when its first lease is
//! granted; several GPUs of one identity still share it), a chat to nothing in particular.
//! The dispatcher gives a request's items only to providers of its binding, and results are
//! accepted only from them, so no response mixes two spaces or two score scales.
//!
//! The [`Outlook`] of a binding says whether some connected provider may serve it now, may
//! soon (a gate probe under way, a provider that left moments ago), or never will, and why.
//! Admission refuses what can never be served at once; [`Core::reconcile`] fails (or, for a
//! rerank request whose scorer is gone, re-scores whole) what waits for nothing.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Core, RequestFailure, SpaceRef};
use crate::hub::gate::Standing;
use crate::hub::policy;
use crate::hub::queue::RequestId;
use crate::hub::registry::{ProviderEntry, ScorerRef};
use crate::protocol::Backend;
use crate::roles::Role;

/// What a request's items may be served by.
#[derive(Clone, Debug)]
pub enum Binding {
    /// Embeddings: the space fixed at admission.
    Space(Arc<SpaceRef>),
    /// Rerank: the scorer fixed by the first lease (`None` until then).
    Scorer(Option<Arc<ScorerRef>>),
    /// Chat: any provider of the role.
    Any,
}

impl Binding {
    /// A key for memoising outlooks (equal keys, equal outlooks).
    pub(super) fn key(&self) -> String {
        match self {
            Binding::Space(s) => format!("space {}", s.id),
            Binding::Scorer(Some(x)) => format!("scorer {}", x.id),
            Binding::Scorer(None) | Binding::Any => "-".into(),
        }
    }

    /// Whether provider `p` may serve items of this binding (the gate's verdict for a space).
    pub(super) fn admits(&self, p: &ProviderEntry, gate: &crate::hub::gate::Gate) -> bool {
        match self {
            Binding::Space(s) => {
                gate.generation(&s.id) == Some(s.generation)
                    && p.gate_candidate
                        .as_ref()
                        .is_some_and(|c| gate.standing(c, &s.id) == Standing::Pass)
            }
            Binding::Scorer(Some(x)) => p.scorer.as_ref().is_some_and(|mine| mine.id == x.id),
            // A reranker whose scores are still being checked serves nothing yet.
            Binding::Scorer(None) => p.scorer.is_some(),
            Binding::Any => true,
        }
    }
}

/// Why nothing serves a request, as a client is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnservableCode {
    /// No provider of the role is connected under its policy.
    NoProvider,
    /// The only hope is a gate verdict still being probed.
    Probing,
    /// Every embedding provider was refused (or suspended) by the gate for the space.
    GateRefused,
    /// Every provider is benched after failures.
    Benched,
    /// A hard 402 stopped cloud work (credits, key limit).
    CloudStopped,
    /// A leader on etcd cannot renew its lead: no cloud permit is granted until it can.
    StoreUnreachable,
    /// OpenRouter refused the key.
    CloudRefused,
    /// No endpoint matches the pinned upstream.
    NoEndpoint,
    /// The role's vector space changed and no provider passes the request's any more.
    SpaceChanged,
    /// The request is pinned to a space its role does not serve (not its current, next or
    /// previous space, or a retired generation of one).
    SpaceNotServed,
    /// The only providers hold an older config (a route or a key the hub replaced).
    ConfigStale,
    /// The only providers produced output wrong in itself (NaN or infinity): out of service
    /// until their agent announces them anew.
    Defective,
}

impl UnservableCode {
    pub fn as_str(self) -> &'static str {
        match self {
            UnservableCode::NoProvider => "no_provider",
            UnservableCode::Probing => "gate_probing",
            UnservableCode::GateRefused => "gate_refused",
            UnservableCode::Benched => "provider_benched",
            UnservableCode::CloudStopped => "cloud_stopped",
            UnservableCode::StoreUnreachable => "store_unreachable",
            UnservableCode::CloudRefused => "cloud_refused",
            UnservableCode::NoEndpoint => "no_endpoint",
            UnservableCode::SpaceChanged => "space_changed",
            UnservableCode::SpaceNotServed => "space_not_served",
            UnservableCode::ConfigStale => "config_stale",
            UnservableCode::Defective => "provider_defective",
        }
    }

    /// When several reasons hold, the one a client is told is the first in this order.
    fn rank(self) -> u8 {
        match self {
            UnservableCode::SpaceChanged | UnservableCode::SpaceNotServed => 0,
            UnservableCode::CloudStopped => 1,
            UnservableCode::CloudRefused => 2,
            UnservableCode::StoreUnreachable => 3,
            UnservableCode::NoEndpoint => 4,
            UnservableCode::Defective => 5,
            UnservableCode::GateRefused => 6,
            UnservableCode::Benched => 7,
            UnservableCode::ConfigStale => 8,
            UnservableCode::Probing => 9,
            UnservableCode::NoProvider => 10,
        }
    }
}

/// Nothing can serve a request: a code, the reasons in brief, and when to try again if that
/// can help.
#[derive(Clone, Debug, thiserror::Error)]
pub struct Unservable {
    pub code: UnservableCode,
    pub message: String,
    pub retry_after_s: Option<u64>,
}

impl fmt::Display for Unservable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

/// Whether a binding can be served.
#[derive(Clone, Debug)]
pub enum Outlook {
    /// Some connected provider may serve it (now, or when it has credits).
    Serve,
    /// Not now, but soon may: a probe under way, or a provider that just left.
    Soon(Unservable),
    /// Nothing connected will: the reasons.
    Never(Unservable),
}

/// The reasons gathered over a role's providers.
struct Reasons {
    role: Role,
    notes: Vec<String>,
    code: Option<UnservableCode>,
    retry_after: Option<Duration>,
    soon: bool,
}

/// At most this many providers are named in a reason (the rest are counted).
const NAMED: usize = 4;

impl Reasons {
    fn note(&mut self, code: UnservableCode, text: String) {
        if self.code.is_none_or(|c| code.rank() < c.rank()) {
            self.code = Some(code);
        }
        self.notes.push(text);
    }

    fn retry(&mut self, after: Duration) {
        self.retry_after = Some(self.retry_after.map_or(after, |a| a.min(after)));
    }

    fn into_unservable(self, fallback: String) -> Unservable {
        let message = if self.notes.is_empty() {
            fallback
        } else {
            let mut named: Vec<String> = self.notes.iter().take(NAMED).cloned().collect();
            if self.notes.len() > NAMED {
                named.push(format!("and {} more", self.notes.len() - NAMED));
            }
            format!(
                "nothing can serve role '{}': {}",
                self.role,
                named.join("; ")
            )
        };
        Unservable {
            code: self.code.unwrap_or(UnservableCode::NoProvider),
            message,
            retry_after_s: self.retry_after.map(|d| d.as_secs().max(1)),
        }
    }
}

impl Core {
    /// Whether `binding` of `role` can be served, and if not, why.
    pub(super) fn outlook(&self, role: Role, binding: &Binding, now: Instant) -> Outlook {
        let policy = self.policy_for(role, binding);
        let mut why = Reasons {
            role,
            notes: Vec::new(),
            code: None,
            retry_after: None,
            soon: false,
        };
        if let Binding::Space(space) = binding
            && self.gate.generation(&space.id) != Some(space.generation)
        {
            // Retired (and maybe founded again): nothing of its generation can come back.
            let now_current = match self.gate.generation(&space.id) {
                Some(g) => format!("generation {g}"),
                None => "no fingerprint yet".to_string(),
            };
            return Outlook::Never(Unservable {
                code: UnservableCode::SpaceChanged,
                message: format!(
                    "the vector space {} (generation {}) was retired while this request waited (now: {now_current}); vectors of two generations are never mixed: send the request again to have it served in the current one, and re-embed the rows of the old generation",
                    space.id, space.generation
                ),
                retry_after_s: None,
            });
        }
        let mut connected = false;
        for p in self.providers().filter(|p| p.role() == role) {
            if !policy::allows(policy, p.info.backend) {
                continue;
            }
            if let Binding::Scorer(Some(x)) = binding
                && p.scorer.as_ref().is_none_or(|mine| mine.id != x.id)
            {
                continue; // another scorer: not this request's
            }
            connected = true;
            let name = &p.reference.provider;
            if let Some(unfit) = self.unfit(p, now) {
                if let Some(after) = unfit.retry_after {
                    why.retry(after);
                }
                why.soon |= unfit.soon;
                why.note(unfit.code, format!("{name}: {}", unfit.text));
                continue;
            }
            let Binding::Space(space) = binding else {
                return Outlook::Serve;
            };
            let Some(c) = &p.gate_candidate else {
                continue;
            };
            match self.gate.standing(c, &space.id) {
                Standing::Pass => return Outlook::Serve,
                Standing::Probing => {
                    why.soon = true;
                    why.note(
                        UnservableCode::Probing,
                        format!("{name}: being probed by the gate"),
                    );
                }
                Standing::Unjudged if self.gate.which(role, &space.id).is_some() => {
                    // The gate's next round asks it.
                    why.soon = true;
                    why.note(
                        UnservableCode::Probing,
                        format!("{name}: about to be probed by the gate"),
                    );
                }
                Standing::Unjudged => why.note(
                    UnservableCode::GateRefused,
                    format!("{name}: never judged against space {}", space.id),
                ),
                Standing::ProbeFailed { error, retry_in } => {
                    why.retry(retry_in);
                    why.note(
                        UnservableCode::GateRefused,
                        format!(
                            "{name}: its gate probe failed ({error}); asked again in {} s",
                            retry_in.as_secs()
                        ),
                    );
                }
                Standing::Refused(reason) => why.note(
                    UnservableCode::GateRefused,
                    format!("{name}: refused by the gate for {} ({reason})", space.id),
                ),
                Standing::Suspended(reason) => why.note(
                    UnservableCode::GateRefused,
                    format!("{name}: suspended by the gate for {} ({reason})", space.id),
                ),
            }
        }
        if let Some(left) = self.vanished_recently(role, now) {
            // A provider of the role left moments ago: it may well come back (a restart, a
            // network blip). Wait a little before calling it gone.
            why.soon = true;
            why.retry(left);
            why.note(
                UnservableCode::NoProvider,
                format!(
                    "a provider of the role left {} s ago (waiting up to {} s for one to come back)",
                    self.settings
                        .vanish_grace
                        .saturating_sub(left)
                        .as_secs(),
                    self.settings.vanish_grace.as_secs()
                ),
            );
        }
        let on_the_way = self.config_on_the_way(role);
        if on_the_way > 0 && policy::allows(policy, Backend::Cloud) {
            // A push's config is on its way to agents that build cloud providers from it (a
            // route just pushed): the first requests after the push wait for them.
            why.soon = true;
            why.note(
                UnservableCode::NoProvider,
                format!(
                    "the config with role {role}'s cloud route is on its way to {on_the_way} agent(s)"
                ),
            );
        }
        let soon = why.soon;
        let fallback = if connected {
            format!("nothing can serve role '{role}'")
        } else {
            match binding {
                Binding::Scorer(Some(x)) => format!(
                    "no provider of scorer '{}' is connected for role '{role}'",
                    x.id
                ),
                _ => format!("no provider serves role '{role}' under policy '{policy}'"),
            }
        };
        let mut u = why.into_unservable(fallback);
        // The role's current space has no provider that passes it: it stays the role's
        // space (only an operator changes that), and the way to another encoder is said.
        if let Binding::Space(space) = binding
            && u.code == UnservableCode::GateRefused
            && self.gate.which(role, &space.id) == Some(crate::hub::gate::Live::Current)
        {
            u.message.push_str(&format!(
                ". The role's space stays {} until an operator changes it: serve it with a provider that passes, or move the role to another encoder with a migration (POST /admin/migrations, or `fantom-sidecar migration open`) and re-embed into the new space",
                space.id
            ));
        }
        if soon {
            if u.retry_after_s.is_none() {
                u.retry_after_s = Some(1);
            }
            Outlook::Soon(u)
        } else {
            if !connected && u.retry_after_s.is_none() {
                u.retry_after_s = Some(5);
            }
            Outlook::Never(u)
        }
    }

    /// Why a connected provider cannot serve anything now, whatever the binding.
    pub(super) fn unfit(&self, p: &ProviderEntry, now: Instant) -> Option<Unfit> {
        if let Some(stale) = &p.stale {
            let mut unfit = Unfit::new(UnservableCode::ConfigStale, stale.reason.clone());
            unfit.soon = stale.config_on_the_way;
            return Some(unfit);
        }
        if p.info.backend == Backend::Cloud {
            if let Some(why) = self.budget.stopped() {
                return Some(Unfit::new(
                    UnservableCode::CloudStopped,
                    format!("cloud work is stopped ({why})"),
                ));
            }
            if let Some(why) = self.budget.key_rejected() {
                return Some(Unfit::new(UnservableCode::CloudRefused, why.to_string()));
            }
            if let Err(fenced) = self.fence.check(now) {
                let mut unfit = Unfit::new(UnservableCode::StoreUnreachable, fenced.0);
                unfit.retry_after = Some(std::time::Duration::from_secs(5));
                return Some(unfit);
            }
        }
        if let Some(why) = &p.refused {
            return Some(Unfit::new(UnservableCode::NoEndpoint, why.clone()));
        }
        if let Some(why) = &p.defective {
            return Some(Unfit::new(UnservableCode::Defective, why.clone()));
        }
        if p.claimed_scorer.is_some() && p.scorer.is_none() {
            if let Some((error, wait)) = self.scorer_check.failed(&p.reference.provider, now) {
                let mut unfit = Unfit::new(
                    UnservableCode::Benched,
                    format!(
                        "its scorer check failed ({error}); probed again in {} s",
                        wait.as_secs().max(1)
                    ),
                );
                unfit.retry_after = Some(wait);
                return Some(unfit);
            }
            let mut unfit = Unfit::new(
                UnservableCode::Probing,
                "its scores are being checked on the probe pairs".into(),
            );
            unfit.soon = true;
            return Some(unfit);
        }

        if let Some(until) = p.benched_until.filter(|t| *t > now) {
            let left = until.saturating_duration_since(now);
            let mut unfit = Unfit::new(
                UnservableCode::Benched,
                format!(
                    "benched for {} s after two failures in a row",
                    left.as_secs().max(1)
                ),
            );
            unfit.retry_after = Some(left);
            return Some(unfit);
        }
        None
    }

    /// How long ago a provider of `role` left, if within the grace.
    fn vanished_recently(&self, role: Role, now: Instant) -> Option<Duration> {
        let at = self.vanished.get(&role)?;
        let ago = now.saturating_duration_since(*at);
        (ago < self.settings.vanish_grace).then_some(ago)
    }

    /// Fails (or re-binds) every waiting request whose binding nothing can serve any more;
    /// run after anything that may take a provider away (a disconnect, a verdict, a bench, a
    /// refusal, a push, the end of a grace).
    pub(super) fn reconcile(&mut self, now: Instant) {
        let mut memo: HashMap<(Role, String), Outlook> = HashMap::new();
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            let Some(pending) = self.requests.get(&id) else {
                continue;
            };
            // A keyed chat parked for its agent's handover waits out its own bound.
            if self.is_parked(id) {
                continue;
            }
            let (role, binding) = (pending.role, pending.binding.clone());
            let key = (role, binding.key());
            let outlook = match memo.get(&key) {
                Some(o) => o.clone(),
                None => {
                    let o = self.outlook(role, &binding, now);
                    memo.insert(key, o.clone());
                    o
                }
            };
            if let (Binding::Scorer(Some(gone)), Outlook::Soon(_) | Outlook::Never(_)) =
                (&binding, &outlook)
            {
                // No provider of its scorer can serve it now: another identity scores it
                // whole at once, if one can; else it waits (soon) or fails (never) below.
                let any = (role, Binding::Scorer(None).key());
                let again = match memo.get(&any) {
                    Some(o) => o.clone(),
                    None => {
                        let o = self.outlook(role, &Binding::Scorer(None), now);
                        memo.insert(any, o.clone());
                        o
                    }
                };
                // Another scorer serves now, or its scorer is gone for good and another will
                // soon (a reranker being checked): scored again whole, untied, rather than failed.
                let soon_elsewhere =
                    matches!(outlook, Outlook::Never(_)) && matches!(again, Outlook::Soon(_));
                if matches!(again, Outlook::Serve) || soon_elsewhere {
                    self.rescore_whole(id, &gone.id);
                    continue;
                }
            }
            let Outlook::Never(reason) = outlook else {
                continue;
            };
            match &binding {
                Binding::Space(space) if self.gate.which(role, &space.id).is_none() => {
                    let now_current = self.gate.current_id(role).unwrap_or("none yet");
                    let message = format!(
                        "the vector space {} is no longer served by role '{role}' (an operator's cutover, close or abort; its current space is {now_current}), and no provider passes it any more ({}); send the request again to have it served in the current space",
                        space.id, reason.message
                    );
                    self.fail_request(
                        id,
                        RequestFailure::Unservable(Unservable {
                            code: UnservableCode::SpaceChanged,
                            message,
                            retry_after_s: None,
                        }),
                    );
                }
                _ => self.fail_request(id, RequestFailure::Unservable(reason)),
            }
        }
    }

    /// Every provider of a rerank request's scorer is gone: its results so far are dropped and
    /// every item goes round again, to be scored whole by one other identity.
    fn rescore_whole(&mut self, id: RequestId, gone: &str) {
        let Some(pending) = self.requests.get_mut(&id) else {
            return;
        };
        pending.binding = Binding::Scorer(None);
        let role = pending.role;
        self.counters.rescored += 1;
        let mut again = pending.take_results();
        // Its leases still out with the old scorer (a benched provider's, say) come back too.
        again.extend(self.take_back_leases_of(id, "its request is scored by another scorer"));
        tracing::warn!(
            request = id,
            scorer = gone,
            items = again.len(),
            "every provider of the request's scorer is gone: it is scored again, whole, by another"
        );
        self.requeue(role, again, false, "its scorer is gone");
    }
}

/// Why one provider cannot serve now.
pub(super) struct Unfit {
    pub code: UnservableCode,
    pub text: String,
    pub retry_after: Option<Duration>,
    /// It may serve within a round trip (a config on its way to its agent): wait, not fail.
    pub soon: bool,
}

impl Unfit {
    fn new(code: UnservableCode, text: String) -> Self {
        Self {
            code,
            text,
            retry_after: None,
            soon: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_telling_reason_wins_and_providers_are_named_briefly() {
        let mut r = Reasons {
            role: Role::Embedding,
            notes: Vec::new(),
            code: None,
            retry_after: None,
            soon: false,
        };
        r.note(UnservableCode::Benched, "a: benched".into());
        r.note(UnservableCode::GateRefused, "b: refused".into());
        for i in 0..5 {
            r.note(UnservableCode::Probing, format!("p{i}: probing"));
        }
        r.retry(Duration::from_secs(20));
        r.retry(Duration::from_secs(3));
        let u = r.into_unservable(String::new());
        assert_eq!(u.code, UnservableCode::GateRefused);
        assert_eq!(u.retry_after_s, Some(3));
        assert!(
            u.message.contains("a: benched; b: refused"),
            "{}",
            u.message
        );
        assert!(u.message.ends_with("and 3 more"), "{}", u.message);
    }
}
