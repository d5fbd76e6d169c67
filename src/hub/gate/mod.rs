//! The compatibility gate in the hub (DESIGN §6): an embedding provider serves no text until
//! it has a passing verdict for its role's vector space; "never verified" counts as refused.
//!
//! * A **space** is one role's table: the encoder that built it (the reference), its width,
//!   and the reference's probe vectors as its **fingerprint** (persisted). A new reference
//!   model for a role is a new space, never a silent mix.
//! * The **reference** that founds a role's first space follows the policy: under `local`,
//!   `aggregate` and `backup` the configured reference provider, else the first healthy local
//!   provider in a stable order; under `cloud` the first cloud provider (the anchor), checked
//!   on dims and pin only, with the next one as the fallback when it cannot answer
//!   ([`founding`]). That space is the role's **current** one until an operator cuts over to a
//!   migration's next space ([`live`]): no reference lost, push or policy change replaces it.
//! * Every other provider is probed with [`measure::probe_texts`] and judged against the
//!   fingerprint ([`measure::judge`]). Vector verdicts never expire; probe failures are
//!   transient and retried with backoff (30 s doubling to 15 min), cleared on reconnect.
//! * The **sentinel** re-probes every passing provider (default every 10 minutes) against the
//!   fingerprint; one that drifted below the threshold is suspended at once.
//! * A **canary** (one probe text) rides in every embedding work frame of documents; the core
//!   asks [`Gate::check_canary`] before it accepts the lease's vectors, and a drifted one
//!   suspends the provider through the same path as the sentinel (`caught_by` says which).
//!
//! This module decides; [`crate::hub::core`] sends the probes it asks for and asks it before
//! every embedding lease.

mod founding;
mod live;
pub mod measure;
mod reported;
mod stored;
mod view;

use self::founding::Founding;
pub use self::live::{
    Applied, CutOver, Founder, Live, Migration, MigrationRefused, Previous, RoleNow, RoleSpaces,
    SpacePin, Step, describe,
};
pub use self::stored::StoredVerdict;
pub use self::view::{GateView, ProjectRows, SpaceView};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use self::measure::{Evidence, Judgement, check_shape, judge, probe_texts};
use super::events::{EventKind, EventRing};
use super::now_ms;
use crate::protocol::{Backend, Suspension};
use crate::roles::{Policy, Role};

/// The gate's settings.
#[derive(Clone, Debug)]
pub struct GateSettings {
    /// Never below [`measure::MIN_COSINE_FLOOR`].
    pub min_cosine: f64,
    /// How often a passing provider is re-probed.
    pub sentinel: Duration,
    /// `agent/provider` of the reference for local policies, when the operator names one.
    pub reference: Option<String>,
    pub probe_timeout: Duration,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// Local providers (`agent/provider`) whose work frames carry no canary (cloud ones
    /// always do).
    pub no_canary: std::collections::BTreeSet<String>,
    /// How long after its agent left a provider's passing or probe-failed verdicts and its
    /// rows are kept ([`Gate::forget_departed`]).
    pub forget_departed: Duration,
}

impl Default for GateSettings {
    fn default() -> Self {
        Self {
            min_cosine: measure::MIN_COSINE_FLOOR,
            sentinel: Duration::from_secs(600),
            reference: None,
            probe_timeout: Duration::from_secs(60),
            retry_initial: Duration::from_secs(30),
            retry_max: Duration::from_secs(900),
            no_canary: Default::default(),
            forget_departed: Duration::from_secs(86_400),
        }
    }
}

impl GateSettings {
    /// The gate's settings from the hub's: the minimum cosine never under the floor, the
    /// sentinel at least 1 s.
    pub fn from_config(c: &crate::config::hub::HubConfig) -> Self {
        Self {
            min_cosine: c.gate_min_cosine.max(measure::MIN_COSINE_FLOOR),
            sentinel: Duration::from_secs(c.gate_sentinel_s.max(1)),
            reference: c.gate_reference.clone(),
            no_canary: c.gate_no_canary.iter().cloned().collect(),
            forget_departed: Duration::from_secs(c.forget_departed_s),
            ..Default::default()
        }
    }
}

/// One role's vector table and the encoder that built it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Space {
    pub role: Role,
    /// The reference encoder's model.
    pub model: String,
    pub dims: usize,
    /// Which provider built it: `agent/provider`, model, revision or pinned upstream.
    pub encoder: String,
    /// Whether the reference was a cloud provider (its own check: dims and pin only).
    pub cloud_reference: bool,
    /// The reference's probe vectors.
    pub fingerprint: Vec<Vec<f32>>,
    pub created_ms: u64,
    /// Which probe set the fingerprint answers ([`measure::probe_set_id`]); a fingerprint of
    /// another probe set cannot judge anyone.
    #[serde(default)]
    pub probe_set: String,
    /// Which founding of this id it is: a space retired and fingerprinted again under the
    /// same id is a new generation (ms since the Unix epoch at its founding, rising), and
    /// nothing of an older generation is ever delivered as this one. (0 in a state written
    /// before generations existed: read as its `created_ms`.)
    #[serde(default)]
    pub generation: u64,
    /// Int8 scales stored one per width (by builds before [`Space::int8_rule`]): each is
    /// served as stored, never changed while the space lives.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub int8_scales: BTreeMap<usize, crate::quantize::Int8Scale>,
    /// The rule every other width's int8 scale is derived by from [`Space::fingerprint`]
    /// (`crate::quantize::Int8Rule`): stored once, when a client first asks for `int8` or
    /// `uint8`, never changed while the space lives (a new generation starts without).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub int8_rule: Option<crate::quantize::Int8Rule>,
}

impl Space {
    pub fn id(&self) -> String {
        space_id(self.role, &self.model, self.dims)
    }

    /// Whether an unpinned folder founded it (named by its digest, or by its path in a state
    /// written before unpinned models were named by their bytes).
    fn unpinned_reference(&self) -> bool {
        !self.cloud_reference && unpinned_model(&self.model)
    }
}

/// Whether a model name is an unpinned folder's: `sha256:` and the digest of its files (or the
/// `folder:` path older builds sent).
fn unpinned_model(model: &str) -> bool {
    model.starts_with("sha256:") || model.starts_with("folder:")
}

fn space_id(role: Role, model: &str, dims: usize) -> String {
    format!("{role}:{model}:{dims}")
}

/// An embedding provider as the gate sees it.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// `agent/provider`.
    pub provider: String,
    pub role: Role,
    pub backend: Backend,
    pub model: String,
    pub revision: Option<String>,
    pub upstream: Option<String>,
    /// dtype and device kind (local), or `cloud`.
    pub regime: String,
    pub dims: Option<usize>,
    /// A model server the agent fronts: never the reference unless the operator names it.
    pub fronted: bool,
    pub healthy: bool,
}

impl Candidate {
    fn encoder(&self) -> String {
        match (&self.upstream, &self.revision) {
            (Some(up), _) => format!("{} {}@{up}", self.provider, self.model),
            (None, Some(rev)) => format!("{} {}@{rev}", self.provider, self.model),
            (None, None) => format!("{} {}", self.provider, self.model),
        }
    }
}

/// A refusal that needs no probe: a cloud embedding route without a pin, or a provider that
/// says its vectors are not as wide as the table.
fn refused_unprobed(c: &Candidate, width: usize) -> Option<String> {
    if c.backend == Backend::Cloud && c.upstream.is_none() {
        return Some("a cloud embedding route needs a pinned upstream".into());
    }
    match c.dims {
        Some(d) if d != width => Some(format!("dims {d} where the table is {width} wide")),
        _ => None,
    }
}

/// Where one candidate stands for one space.
#[derive(Clone, Debug, PartialEq)]
pub enum Standing {
    Pass,
    /// A probe is out (or about to be sent).
    Probing,
    /// No verdict for this space.
    Unjudged,
    ProbeFailed {
        error: String,
        retry_in: Duration,
    },
    Refused(String),
    Suspended(String),
}

/// A verdict key: provider, model (with its revision: a new revision is checked again),
/// upstream, regime, the width it says it makes (a route pushed with new `dims` is judged
/// again), and the space it is for.
pub fn verdict_key(c: &Candidate, space: &str) -> String {
    format!(
        "{}|{}@{}|{}|{}|{}|{space}",
        c.provider,
        c.model,
        c.revision.as_deref().unwrap_or("-"),
        c.upstream.as_deref().unwrap_or("-"),
        c.regime,
        c.dims.map_or_else(|| "-".to_string(), |d| d.to_string()),
    )
}

/// Where a provider stands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Verdict {
    /// No answer yet (refused until it passes).
    Probing,
    Pass,
    /// Never serves this space (vector verdicts do not expire).
    Refused {
        reason: String,
    },
    /// Passed once, then drifted (a canary or the sentinel caught it).
    Suspended {
        reason: String,
    },
    /// The probe did not come back; tried again after a backoff.
    ProbeFailed {
        error: String,
        failures: u32,
    },
}

/// A verdict with its evidence.
#[derive(Clone, Debug, Serialize)]
pub struct VerdictEntry {
    pub provider: String,
    pub role: Role,
    pub space: String,
    #[serde(flatten)]
    pub verdict: Verdict,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence: Option<Evidence>,
    /// What the candidate was compared with.
    pub reference: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checked_at_ms: Option<u64>,
    /// Probe answers judged for this verdict (the first check and every sentinel re-probe;
    /// probes that did not come back are not counted).
    pub checks: u64,
    /// What caught a suspended provider: `sentinel` (a re-probe), `canary` (a probe text
    /// inside its work) or `agent` (an earlier leader's suspension its agent reported).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caught_by: Option<&'static str>,
    #[serde(skip)]
    next_check: Option<Instant>,
    /// Sentinel probes in a row that did not come back (the verdict stays; the retry backs off).
    #[serde(skip)]
    sentinel_failures: u32,
    #[serde(skip)]
    probe: Option<(String, Instant)>,
    /// Suspended since the agent was last told ([`Gate::take_suspensions`]).
    #[serde(skip)]
    untold: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Purpose {
    /// The reference's answer becomes the space's fingerprint.
    Fingerprint,
    Verify,
    Sentinel,
}

struct Pending {
    key: String,
    space: String,
    candidate: Candidate,
    purpose: Purpose,
    /// The width the space has (or will have).
    width: Option<usize>,
    /// When it was sent: it times out from then, even if its verdict let go of it (a
    /// suspension while a sentinel's probe was out).
    sent: Instant,
}

/// A probe the hub should send now.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeRequest {
    pub probe: String,
    /// `agent/provider`.
    pub provider: String,
    pub texts: Vec<String>,
}

/// The gate's state.
pub struct Gate {
    pub settings: GateSettings,
    spaces: BTreeMap<String, Space>,
    /// Each embedding role's live spaces: current, and around a migration next and previous
    /// (persisted: the current one changes only by an operator's cutover).
    live: BTreeMap<Role, RoleSpaces>,
    verdicts: BTreeMap<String, VerdictEntry>,
    pending: HashMap<String, Pending>,
    next_probe: u64,
    dirty: bool,
    rows: BTreeMap<(String, String), u64>,
    /// Rows and tokens served per (space, project).
    project_rows: BTreeMap<(String, String), (u64, u64)>,
    /// Each role's configured table width, as of the last tick.
    widths: BTreeMap<Role, usize>,
    /// The generation each retired space id had: its next founding is a later one.
    retired: BTreeMap<String, u64>,
    /// Roles whose fingerprint probe this round waits for a budget permit
    /// ([`Gate::withdraw`]): still being founded, as far as a client is concerned.
    fingerprint_waits: BTreeSet<Role>,
    /// Suspensions agents reported (an earlier leader's) for verdicts this gate has not
    /// judged yet, by verdict key: the first judgement of that key is a suspension.
    reported: BTreeMap<String, Suspension>,
    /// When an operator last asked each provider to be judged again (ms since the epoch): a
    /// suspension an agent reports from before that is not honoured.
    verified_at_ms: BTreeMap<String, u64>,
    /// A suspension since the verdicts were last stored: they are stored now, not at the next
    /// checkpoint ([`Gate::take_urgent`]).
    urgent: bool,
    /// Suspensions, refusals and verifies, in time (for the console).
    events: EventRing,
    /// Agents gone, and since when (ms since the epoch): their providers' forgettable state
    /// goes [`GateSettings::forget_departed`] later ([`Gate::forget_departed`]).
    departed: BTreeMap<String, u64>,
}

/// Where the rows of forgotten providers are counted, per space (every provider id has a
/// `/`; this has none).
pub const DEPARTED_ROWS: &str = "departed";

/// What [`Gate::forget_departed`] let go of.
#[derive(Debug, Default)]
pub struct Forgotten {
    /// Agents gone past the retention with nothing of theirs kept.
    pub agents: Vec<String>,
    /// Providers whose verdicts and rows went.
    pub providers: BTreeSet<String>,
}

impl Gate {
    pub fn new(mut settings: GateSettings, mut spaces: BTreeMap<String, Space>) -> Self {
        settings.min_cosine = settings.min_cosine.max(measure::MIN_COSINE_FLOOR);
        let current_set = measure::probe_set_id();
        spaces.retain(|id, s| {
            let usable = s.probe_set == current_set;
            if !usable {
                tracing::warn!(space = %id, "a stored fingerprint answers another probe set: the space is fingerprinted again");
            }
            usable
        });
        for s in spaces.values_mut() {
            if s.generation == 0 {
                s.generation = s.created_ms.max(1);
            }
        }
        Self {
            settings,
            spaces,
            live: BTreeMap::new(),
            verdicts: BTreeMap::new(),
            pending: HashMap::new(),
            next_probe: 1,
            dirty: false,
            rows: BTreeMap::new(),
            project_rows: BTreeMap::new(),
            widths: BTreeMap::new(),
            retired: BTreeMap::new(),
            fingerprint_waits: BTreeSet::new(),
            reported: BTreeMap::new(),
            verified_at_ms: BTreeMap::new(),
            urgent: false,
            events: EventRing::default(),
            departed: BTreeMap::new(),
        }
    }

    /// Decides which probes to send now. `width`: the role's configured table width, if any.
    pub fn tick(
        &mut self,
        now: Instant,
        candidates: &[Candidate],
        policy: impl Fn(Role) -> Policy,
        width: impl Fn(Role) -> Option<usize>,
    ) -> Vec<ProbeRequest> {
        self.expire_probes(now);
        self.fingerprint_waits.clear();
        let mut out = Vec::new();
        for role in [Role::Embedding, Role::CodeEmbedding] {
            let mut cands: Vec<&Candidate> = candidates.iter().filter(|c| c.role == role).collect();
            cands.sort_by(|a, b| a.provider.cmp(&b.provider));
            if cands.is_empty() {
                continue;
            }
            let configured = width(role);
            match configured {
                Some(w) => self.widths.insert(role, w),
                None => self.widths.remove(&role),
            };
            // The current space: the operator's (or the one the role's first reference
            // founded); never another one because of who is connected now.
            let current = match self.live.get(&role).map(|l| l.current.clone()) {
                Some(cur) => {
                    if !self.spaces.contains_key(&cur) {
                        // Retired, or its fingerprint answers an older probe set: fingerprinted
                        // again by a reference that answers for this very id.
                        let refs = self.refounders(&cands);
                        let w = live::id_dims(&cur);
                        let _ = self.found(now, &refs, w, &|sid| sid == cur, &mut out);
                    }
                    Some(cur)
                }
                None => {
                    let references = self.references(policy(role), &cands);
                    match self.found(now, &references, configured, &|_| true, &mut out) {
                        Founding::Found(sid) => Some(sid),
                        Founding::Fingerprinting(_) => None,
                        // No reference can answer now (the GPUs are down under `backup`, say):
                        // the role's newest stored space, as wide as the table.
                        Founding::Nothing => self.fallback_space(role, configured),
                    }
                    .inspect(|sid| {
                        tracing::info!(role = %role, space = %sid, "the role's vector space");
                        self.live.insert(role, RoleSpaces::new(sid.clone()));
                        self.dirty = true;
                    })
                }
            };
            if current.is_none() {
                continue;
            }
            self.found_next(now, role, &cands, &mut out);
            let live: Vec<String> = self
                .live
                .get(&role)
                .map(|l| l.ids().map(str::to_string).collect())
                .unwrap_or_default();
            for sid in live {
                self.judge_all(now, &sid, &cands, &mut out);
            }
        }
        out
    }

    fn send(
        &mut self,
        now: Instant,
        c: &Candidate,
        space: &str,
        purpose: Purpose,
        width: Option<usize>,
        reference: String,
    ) -> ProbeRequest {
        // Not guessable: only the agent that was asked can answer.
        let probe = format!("p-{}-{:016x}", self.next_probe, rand::random::<u64>());
        self.next_probe += 1;
        let key = verdict_key(c, space);
        let entry = self
            .verdicts
            .entry(key.clone())
            .or_insert_with(|| VerdictEntry {
                provider: c.provider.clone(),
                role: c.role,
                space: space.to_string(),
                verdict: Verdict::Probing,
                evidence: None,
                reference,
                checked_at_ms: None,
                checks: 0,
                caught_by: None,
                next_check: None,
                sentinel_failures: 0,
                probe: None,
                untold: false,
            });
        entry.probe = Some((probe.clone(), now));
        self.pending.insert(
            probe.clone(),
            Pending {
                key,
                space: space.to_string(),
                candidate: c.clone(),
                purpose,
                width,
                sent: now,
            },
        );
        ProbeRequest {
            probe,
            provider: c.provider.clone(),
            texts: probe_texts(),
        }
    }

    fn record(
        &mut self,
        c: &Candidate,
        space: &str,
        verdict: Verdict,
        evidence: Option<Evidence>,
        reference: String,
        next_check: Option<Instant>,
    ) {
        let key = verdict_key(c, space);
        let before = verdict.clone();
        let verdict = self.unless_reported(&key, verdict);
        let reported = verdict != before;
        let entry = VerdictEntry {
            provider: c.provider.clone(),
            role: c.role,
            space: space.to_string(),
            verdict,
            evidence,
            reference,
            checked_at_ms: Some(now_ms()),
            checks: 1,
            caught_by: reported.then_some("agent"),
            next_check: if reported { None } else { next_check },
            sentinel_failures: 0,
            probe: None,
            untold: false,
        };
        if let Verdict::Refused { reason } = &entry.verdict {
            self.events.push(
                EventKind::Refused,
                c.provider.clone(),
                format!("for {space}: {reason}"),
            );
        }
        self.verdicts.insert(key, entry);
    }

    /// Probes out longer than the timeout failed (one whose verdict let go of it, after a
    /// suspension, is only forgotten: [`Gate::on_result`] ignores it).
    fn expire_probes(&mut self, now: Instant) {
        let timeout = self.settings.probe_timeout;
        let late: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.sent) >= timeout)
            .map(|(probe, _)| probe.clone())
            .collect();
        for probe in late {
            self.on_result(
                &probe,
                Err("the probe was not answered in time".into()),
                now,
            );
        }
    }

    /// An agent's answer to a probe; `from` is the answering `agent/provider`. An answer from
    /// anyone but the provider that was asked is ignored.
    pub fn on_answer(
        &mut self,
        probe: &str,
        from: &str,
        answer: Result<Vec<Vec<f32>>, String>,
        now: Instant,
    ) -> bool {
        if self
            .pending
            .get(probe)
            .is_none_or(|p| p.candidate.provider != from)
        {
            return false;
        }
        let answer = answer.map_err(|e| crate::cloud::error::truncate_chars(&e, 500));
        self.on_result(probe, answer, now);
        true
    }

    /// Whether `probe` is out and not yet judged (answered, failed or timed out).
    pub fn is_pending(&self, probe: &str) -> bool {
        self.pending.contains_key(probe)
    }

    /// A probe the hub could not send (a cloud provider's, with no budget permit free now):
    /// forgotten as if never asked, so the next round asks again. Not a failure: waiting for
    /// the budget says nothing about the provider.
    pub fn withdraw(&mut self, probe: &str) {
        let Some(p) = self.pending.remove(probe) else {
            return;
        };
        if p.purpose == Purpose::Fingerprint {
            self.fingerprint_waits.insert(p.candidate.role);
        }
        if let Some(entry) = self.verdicts.get_mut(&p.key)
            && entry.probe.as_ref().is_some_and(|(id, _)| id == probe)
        {
            entry.probe = None;
        }
    }

    /// Whether `probe` is a sentinel's re-probe: its answer can keep a verdict or suspend it,
    /// never found a space or pass anyone new.
    pub fn only_keeps_or_suspends(&self, probe: &str) -> bool {
        self.pending
            .get(probe)
            .is_some_and(|p| p.purpose == Purpose::Sentinel)
    }

    /// The outcome of a probe (vectors, or why there are none).
    pub fn on_result(&mut self, probe: &str, answer: Result<Vec<Vec<f32>>, String>, now: Instant) {
        let Some(mut p) = self.pending.remove(probe) else {
            return;
        };
        // Another reference fingerprinted the space first: this answer is judged against it.
        if p.purpose == Purpose::Fingerprint && self.spaces.contains_key(&p.space) {
            p.purpose = Purpose::Verify;
        }
        let Some(entry) = self.verdicts.get_mut(&p.key) else {
            return;
        };
        if entry.probe.as_ref().is_none_or(|(id, _)| id != probe) {
            return;
        }
        entry.probe = None;
        let space = entry.space.clone();
        let c = &p.candidate;
        let vectors = match answer {
            Ok(v) => v,
            Err(error) => {
                let failures = match &entry.verdict {
                    Verdict::ProbeFailed { failures, .. } => failures + 1,
                    _ if p.purpose == Purpose::Sentinel => {
                        entry.sentinel_failures += 1;
                        entry.sentinel_failures
                    }
                    _ => 1,
                };
                let wait = self
                    .settings
                    .retry_initial
                    .saturating_mul(1 << (failures - 1).min(10))
                    .min(self.settings.retry_max);
                tracing::warn!(provider = %c.provider, space = %space, error = %error, retry_s = wait.as_secs(), "gate probe failed");
                if p.purpose == Purpose::Sentinel {
                    // Still the verdict it had; asked again after the backoff.
                    entry.next_check = Some(now + wait);
                } else {
                    entry.verdict = Verdict::ProbeFailed { error, failures };
                    entry.next_check = Some(now + wait);
                }
                return;
            }
        };
        let n = probe_texts().len();
        match p.purpose {
            Purpose::Fingerprint => {
                let width = p
                    .width
                    .unwrap_or_else(|| vectors.first().map_or(0, Vec::len));
                if let Err(why) = check_shape(&vectors, n, width) {
                    tracing::warn!(provider = %c.provider, reason = %why, "the reference is refused");
                    self.events.push(
                        EventKind::Refused,
                        c.provider.clone(),
                        format!("as the reference of {}: {why}", p.space),
                    );
                    entry.verdict = Verdict::Refused { reason: why };
                    entry.checked_at_ms = Some(now_ms());
                    entry.checks += 1;
                    return;
                }
                let created_ms = now_ms();
                let after = self.retired.get(&p.space).copied().unwrap_or(0);
                let s = Space {
                    role: c.role,
                    model: c.model.clone(),
                    dims: width,
                    encoder: c.encoder(),
                    cloud_reference: c.backend == Backend::Cloud,
                    fingerprint: vectors,
                    created_ms,
                    probe_set: measure::probe_set_id(),
                    generation: created_ms.max(after.saturating_add(1)),
                    int8_scales: BTreeMap::new(),
                    int8_rule: None,
                };
                tracing::info!(space = %s.id(), encoder = %s.encoder, "a new vector space: its fingerprint is stored");
                entry.verdict = Verdict::Pass;
                entry.evidence = Some(Evidence {
                    cosines: vec![1.0; n],
                    min_cosine: 1.0,
                    mean_cosine: 1.0,
                    dims: width,
                });
                entry.reference = "itself: the anchor of the space (dims and pin)".into();
                entry.checked_at_ms = Some(now_ms());
                entry.checks += 1;
                entry.next_check = Some(now + self.settings.sentinel);
                // A role's first space is its current one (later foundings are the current
                // space again after a retire, or a migration's next). The table's width may
                // have changed while the probe was out: a space of another width is stored,
                // but never the role's current one.
                if !self.live.contains_key(&s.role)
                    && self.widths.get(&s.role).is_none_or(|w| *w == s.dims)
                {
                    tracing::info!(role = %s.role, space = %s.id(), "the role's vector space");
                    self.live.insert(s.role, RoleSpaces::new(s.id()));
                }
                self.spaces.insert(s.id(), s);
                self.dirty = true;
            }
            Purpose::Verify | Purpose::Sentinel => {
                let Some(s) = self.spaces.get(&space) else {
                    return;
                };
                let judgement = if c.backend == Backend::Cloud && c.upstream.is_none() {
                    Judgement::Refused {
                        reason: "a cloud embedding route needs a pinned upstream".into(),
                        evidence: None,
                    }
                } else {
                    judge(&s.fingerprint, &vectors, s.dims, self.settings.min_cosine)
                };
                entry.checked_at_ms = Some(now_ms());
                entry.checks += 1;
                let generation = s.generation;
                match judgement {
                    Judgement::Pass { evidence }
                        if self
                            .reported
                            .get(&p.key)
                            .is_some_and(|r| r.generation == generation) =>
                    {
                        // An earlier leader suspended it and could not store that: its agent
                        // said so. Only an operator's verify lifts it.
                        let r = self.reported.remove(&p.key).map(|r| r.reason);
                        suspend(
                            &mut self.events,
                            entry,
                            format!(
                                "suspended by an earlier leader (reported by its agent): {}",
                                r.unwrap_or_default()
                            ),
                            "agent",
                        );
                        entry.untold = false;
                        entry.evidence = Some(evidence);
                    }
                    Judgement::Pass { evidence } => {
                        entry.sentinel_failures = 0;
                        if entry.verdict != Verdict::Pass {
                            tracing::info!(provider = %c.provider, space = %space, min_cosine = evidence.min_cosine, "gate: pass");
                        }
                        entry.verdict = Verdict::Pass;
                        entry.caught_by = None;
                        entry.evidence = Some(evidence);
                        entry.next_check = Some(now + self.settings.sentinel);
                    }
                    Judgement::Refused { reason, evidence } => {
                        if p.purpose == Purpose::Sentinel {
                            suspend(&mut self.events, entry, reason, "sentinel");
                        } else {
                            tracing::warn!(provider = %c.provider, space = %space, reason = %reason, "gate: refused");
                            self.events.push(
                                EventKind::Refused,
                                c.provider.clone(),
                                format!("for {space}: {reason}"),
                            );
                            entry.verdict = Verdict::Refused { reason };
                        }
                        if evidence.is_some() {
                            entry.evidence = evidence;
                        }
                        entry.next_check = None;
                    }
                }
            }
        }
    }

    /// Whether `c`'s embedding work frames carry a canary: cloud providers always, local ones
    /// unless the operator turned it off for them.
    pub fn carries_canary(&self, c: &Candidate) -> bool {
        c.backend == Backend::Cloud || !self.settings.no_canary.contains(&c.provider)
    }

    /// Judges a canary that came back in a lease granted under verdict `key`: the vector of
    /// probe text `probe`, made with `dimensions` (the first entries of the fingerprint's,
    /// re-normalised). Under the threshold, or of another width, the provider is suspended at
    /// once, as the sentinel does; the reason is returned.
    pub fn check_canary(
        &mut self,
        key: &str,
        probe: usize,
        vector: &[f32],
        dimensions: Option<usize>,
    ) -> Option<String> {
        let min = self.settings.min_cosine;
        let entry = self.verdicts.get_mut(key)?;
        if entry.verdict != Verdict::Pass {
            return None;
        }
        let space = self.spaces.get(&entry.space)?;
        let fingerprint = space.fingerprint.get(probe)?;
        let width = dimensions.map_or(space.dims, |d| d.min(space.dims));
        let text = measure::probe_text(probe);
        let preview: String = text.chars().take(24).collect();
        let reason = if vector.len() != width {
            format!(
                "canary (probe {probe}, {preview:?}…) came back with {} dims where the space has {width}",
                vector.len()
            )
        } else {
            let cos = measure::cosine(&fingerprint[..width.min(fingerprint.len())], vector);
            if cos >= min {
                return None;
            }
            format!(
                "canary (probe {probe}, {preview:?}…) at cosine {cos:.4} to the space's fingerprint, under {min}"
            )
        };
        suspend(&mut self.events, entry, reason.clone(), "canary");
        Some(reason)
    }

    /// Suspends the passing verdict `key` for `reason` (`by`: what caught it), as a drift is;
    /// whether there was one to suspend.
    pub fn suspend(&mut self, key: &str, reason: String, by: &'static str) -> bool {
        match self.verdicts.get_mut(key) {
            Some(entry) if entry.verdict == Verdict::Pass => {
                suspend(&mut self.events, entry, reason, by);
                true
            }
            _ => false,
        }
    }

    /// A probe answered with output wrong in itself (NaN or infinity): the provider is broken,
    /// not unreachable. A sentinel's re-probe suspends the verdict it checks; any other probe
    /// fails at once with `reason`. Whether `probe` was asked of `from`.
    pub fn on_defect(&mut self, probe: &str, from: &str, reason: &str, now: Instant) -> bool {
        let Some(p) = self
            .pending
            .get(probe)
            .filter(|p| p.candidate.provider == from)
        else {
            return false;
        };
        if p.purpose == Purpose::Sentinel {
            let key = p.key.clone();
            self.pending.remove(probe);
            if let Some(entry) = self.verdicts.get_mut(&key) {
                entry.probe = None;
                if entry.verdict == Verdict::Pass {
                    let reason = crate::cloud::error::truncate_chars(reason, 500);
                    suspend(&mut self.events, entry, reason, "sentinel");
                }
            }
            return true;
        }
        self.on_answer(probe, from, Err(reason.to_string()), now)
    }

    /// Where a candidate stands for `space` (any space, current or not).
    pub fn standing(&self, c: &Candidate, space: &str) -> Standing {
        let Some(e) = self.verdicts.get(&verdict_key(c, space)) else {
            return Standing::Unjudged;
        };
        match &e.verdict {
            Verdict::Pass => Standing::Pass,
            _ if e.probe.is_some() => Standing::Probing,
            Verdict::Probing => Standing::Probing,
            Verdict::Refused { reason } => Standing::Refused(reason.clone()),
            Verdict::Suspended { reason } => Standing::Suspended(reason.clone()),
            Verdict::ProbeFailed { error, .. } => Standing::ProbeFailed {
                error: error.clone(),
                retry_in: e.next_check.map_or(Duration::ZERO, |t| {
                    t.saturating_duration_since(Instant::now())
                }),
            },
        }
    }

    /// The id of the role's current space (the one new requests are admitted under).
    pub fn current_id(&self, role: Role) -> Option<&str> {
        self.live.get(&role).map(|l| l.current.as_str())
    }

    /// Whether the role's space is being founded now (a reference's fingerprint probe is out,
    /// or waits for a budget permit).
    pub fn founding(&self, role: Role) -> bool {
        self.fingerprint_waits.contains(&role)
            || self
                .pending
                .values()
                .any(|p| p.purpose == Purpose::Fingerprint && p.candidate.role == role)
    }

    /// Why the role has no space, briefly: each provider's newest verdict that did not pass,
    /// among spaces as wide as the table (when its width is configured).
    pub fn refusals(&self, role: Role, providers: &[&str]) -> Vec<String> {
        let width = self.widths.get(&role).map(|w| format!(":{w}"));
        let mut latest: BTreeMap<&str, &VerdictEntry> = BTreeMap::new();
        for e in self.verdicts.values() {
            if e.role != role
                || !providers.contains(&e.provider.as_str())
                || e.verdict == Verdict::Pass
                || e.verdict == Verdict::Probing
                || width
                    .as_ref()
                    .is_some_and(|w| !e.space.ends_with(w.as_str()))
            {
                continue;
            }
            let newer = latest
                .get(e.provider.as_str())
                .is_none_or(|old| e.checked_at_ms >= old.checked_at_ms);
            if newer {
                latest.insert(e.provider.as_str(), e);
            }
        }
        latest
            .values()
            .filter_map(|e| {
                let why = match &e.verdict {
                    Verdict::Refused { reason } => format!("refused for {} ({reason})", e.space),
                    Verdict::Suspended { reason } => {
                        format!("suspended for {} ({reason})", e.space)
                    }
                    Verdict::ProbeFailed { error, .. } => {
                        format!("its probe for {} failed ({error})", e.space)
                    }
                    Verdict::Pass | Verdict::Probing => return None,
                };
                Some(format!("{}: {why}", e.provider))
            })
            .collect()
    }

    /// The space a provider may serve now (its verdict for its role's space passed).
    pub fn serving_space(&self, c: &Candidate) -> Option<&str> {
        let sid = &self.live.get(&c.role)?.current;
        let e = self.verdicts.get(&verdict_key(c, sid))?;
        (e.verdict == Verdict::Pass).then_some(sid.as_str())
    }

    /// Whether the verdict `key` still passes (results of a lease granted under it count).
    pub fn passes(&self, key: &str) -> bool {
        self.verdicts
            .get(key)
            .is_some_and(|e| e.verdict == Verdict::Pass)
    }

    /// An agent reconnected: its probe failures and probes in flight are forgotten.
    pub fn agent_reconnected(&mut self, agent: &str) {
        self.departed.remove(agent);
        let prefix = format!("{agent}/");
        self.verdicts.retain(|_, e| {
            !(e.provider.starts_with(&prefix)
                && (matches!(e.verdict, Verdict::ProbeFailed { .. }) || e.probe.is_some()))
        });
        self.pending
            .retain(|_, p| !p.candidate.provider.starts_with(&prefix));
    }

    /// An agent's socket ended: its probes in flight fail now, as unsendable ones do (a space
    /// it was fingerprinting goes to the next reference at once, never after the probe
    /// timeout).
    pub fn agent_left(&mut self, agent: &str, now: Instant) {
        self.departed.insert(agent.to_string(), now_ms());
        let prefix = format!("{agent}/");
        let probes: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| p.candidate.provider.starts_with(&prefix))
            .map(|(id, _)| id.clone())
            .collect();
        for probe in probes {
            self.on_result(&probe, Err("the agent disconnected".into()), now);
        }
    }

    /// Forgets verdicts (all, or one provider's) so they are checked again.
    pub fn reverify(&mut self, provider: Option<&str>) -> usize {
        let before = self.verdicts.len();
        self.verdicts
            .retain(|_, e| provider.is_some_and(|p| p != e.provider) || e.probe.is_some());
        // An operator's verify is what lifts a suspension an agent reported, too: one reported
        // later, from before the verify, is not honoured.
        self.reported
            .retain(|key, _| provider.is_some_and(|p| !key.starts_with(&format!("{p}|"))));
        let now = now_ms();
        self.events.push(
            EventKind::Verify,
            provider.unwrap_or("every provider"),
            format!(
                "an operator asked for a new judgement ({} verdicts forgotten)",
                before - self.verdicts.len()
            ),
        );
        match provider {
            Some(p) => {
                self.verified_at_ms.insert(p.to_string(), now);
            }
            None => {
                let all: Vec<String> = self.verdicts.values().map(|e| e.provider.clone()).collect();
                self.verified_at_ms.insert(String::new(), now);
                for p in all {
                    self.verified_at_ms.insert(p, now);
                }
            }
        }
        before - self.verdicts.len()
    }

    /// Suspensions, refusals and verifies, oldest first.
    pub fn events(&self) -> &EventRing {
        &self.events
    }

    /// When `provider`'s agent left, if it is gone.
    pub fn departed_at_ms(&self, provider: &str) -> Option<u64> {
        let agent = provider.split('/').next()?;
        self.departed.get(agent).copied()
    }

    /// Forgets what the gate keeps of the providers of agents gone longer than
    /// [`GateSettings::forget_departed`] (and not in `connected`): their passing, probing and
    /// probe-failed verdicts, and their rows (added to the space's [`DEPARTED_ROWS`], so each
    /// space's totals stay). A suspended or refused verdict stays, with its rows, until an
    /// operator's verify: a suspension never lifts on its own. Returns what was forgotten, for
    /// the hub to drop its own counters and series of them.
    pub fn forget_departed(&mut self, now_ms: u64, connected: &dyn Fn(&str) -> bool) -> Forgotten {
        let after_ms = u64::try_from(self.settings.forget_departed.as_millis()).unwrap_or(u64::MAX);
        let due: Vec<String> = self
            .departed
            .iter()
            .filter(|(agent, at)| now_ms.saturating_sub(**at) >= after_ms || connected(agent))
            .map(|(agent, _)| agent.clone())
            .collect();
        let mut forgotten = BTreeSet::new();
        let mut agents = Vec::new();
        for agent in due {
            if connected(&agent) {
                self.departed.remove(&agent);
                continue;
            }
            let prefix = format!("{agent}/");
            self.forget_reported(&agent);
            let mut kept = BTreeSet::new();
            self.verdicts.retain(|_, e| {
                if !e.provider.starts_with(&prefix) {
                    return true;
                }
                let keep = matches!(
                    e.verdict,
                    Verdict::Suspended { .. } | Verdict::Refused { .. }
                ) || e.probe.is_some();
                if keep {
                    kept.insert(e.provider.clone());
                } else {
                    forgotten.insert(e.provider.clone());
                }
                keep
            });
            let gone: Vec<(String, String)> = self
                .rows
                .keys()
                .filter(|(_, p)| p.starts_with(&prefix) && !kept.contains(p))
                .cloned()
                .collect();
            for key in gone {
                if let Some(n) = self.rows.remove(&key) {
                    *self
                        .rows
                        .entry((key.0, DEPARTED_ROWS.to_string()))
                        .or_default() += n;
                }
                forgotten.insert(key.1);
            }
            self.verified_at_ms
                .retain(|p, _| !p.starts_with(&prefix) || kept.contains(p));
            if kept.is_empty() {
                self.departed.remove(&agent);
                agents.push(agent);
            }
        }
        forgotten.retain(|p| !self.verdicts.values().any(|e| e.provider == *p));
        Forgotten {
            agents,
            providers: forgotten,
        }
    }

    /// How many agents the gate counts as gone, and its verdicts and rows (for tests of the
    /// bounds).
    pub fn sizes(&self) -> (usize, usize, usize) {
        (self.departed.len(), self.verdicts.len(), self.rows.len())
    }

    pub fn count_rows(&mut self, space: &str, provider: &str, rows: u64) {
        *self
            .rows
            .entry((space.to_string(), provider.to_string()))
            .or_default() += rows;
    }

    /// Rows and tokens a project was served from a space (a migration's progress).
    pub fn count_project_rows(&mut self, space: &str, project: &str, rows: u64, tokens: u64) {
        let counted = self
            .project_rows
            .entry((space.to_string(), project.to_string()))
            .or_default();
        counted.0 = counted.0.saturating_add(rows);
        counted.1 = counted.1.saturating_add(tokens);
    }

    /// Rows served from `space`, per provider.
    pub fn rows_of(&self, space: &str) -> BTreeMap<String, u64> {
        self.rows
            .iter()
            .filter(|((sid, _), _)| sid == space)
            .map(|((_, p), n)| (p.clone(), *n))
            .collect()
    }

    /// Rows and tokens served from `space`, per project.
    pub fn project_rows(&self, space: &str) -> BTreeMap<String, (u64, u64)> {
        self.project_rows
            .iter()
            .filter(|((sid, _), _)| sid == space)
            .map(|((_, p), n)| (p.clone(), *n))
            .collect()
    }

    pub fn space(&self, id: &str) -> Option<&Space> {
        self.spaces.get(id)
    }

    /// The generation of space `id` now (`None`: no such space, e.g. retired).
    pub fn generation(&self, id: &str) -> Option<u64> {
        self.spaces.get(id).map(|s| s.generation)
    }

    /// Forgets a space (its fingerprint and verdicts): the role's reference fingerprints it
    /// again. For a fingerprint that is wrong (a bad reference), never for routine checks.
    pub fn retire(&mut self, space: &str) -> bool {
        let Some(gone) = self.spaces.remove(space) else {
            return false;
        };
        self.retired.insert(space.to_string(), gone.generation);
        // Its verdicts go, probes out included: an answer that comes later is ignored.
        self.verdicts.retain(|_, e| e.space != space);
        self.pending.retain(|_, p| p.space != space);
        // A retired current or next space is fingerprinted again under its id; a previous one
        // has no founder left: it is closed.
        for l in self.live.values_mut() {
            if l.previous.as_ref().is_some_and(|p| p.space == space) {
                l.previous = None;
            }
        }
        self.dirty = true;
        tracing::warn!(space, "space retired: it is fingerprinted again");
        true
    }

    /// The spaces must be written again (the last write failed).
    pub fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// Whether the spaces changed since the last call (to persist them: [`Gate::spaces`]).
    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    /// Every space, as held now.
    pub fn spaces(&self) -> &BTreeMap<String, Space> {
        &self.spaces
    }

    /// The int8 scale of space `id` at `width`, if it is that generation and holds one: a
    /// scale stored for that width, or the one its stored rule derives.
    pub fn int8_scale(
        &self,
        id: &str,
        generation: u64,
        width: usize,
    ) -> Option<crate::quantize::Int8Scale> {
        let space = self.spaces.get(id).filter(|s| s.generation == generation)?;
        space.int8_scales.get(&width).copied().or_else(|| {
            space
                .int8_rule
                .and_then(|rule| rule.scale(&space.fingerprint, width))
        })
    }

    /// Keeps a rule that was stored (the space must still be that generation; a rule it holds
    /// already stays).
    pub fn set_int8_rule(
        &mut self,
        id: &str,
        generation: u64,
        rule: crate::quantize::Int8Rule,
    ) -> bool {
        match self
            .spaces
            .get_mut(id)
            .filter(|s| s.generation == generation)
        {
            Some(space) => {
                space.int8_rule.get_or_insert(rule);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests;

/// Suspends a provider that passed and drifted: the one path of the sentinel and the canary.
fn suspend(events: &mut EventRing, entry: &mut VerdictEntry, reason: String, by: &'static str) {
    tracing::error!(provider = %entry.provider, space = %entry.space, caught_by = by, reason = %reason, "drift: the provider is suspended");
    events.push(
        EventKind::Suspended,
        entry.provider.clone(),
        format!("in {} (caught by {by}): {reason}", entry.space),
    );
    entry.verdict = Verdict::Suspended { reason };
    entry.caught_by = Some(by);
    entry.checked_at_ms = Some(now_ms());
    entry.next_check = None;
    // A sentinel probe still out must not lift it when it comes back clean.
    entry.probe = None;
    entry.untold = true;
}
