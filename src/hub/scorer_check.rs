//! The scorer check: the rerank analogue of the gate. A rerank request's scores all come from
//! one scorer identity ([`ScorerRef`]: backend, model, revision, quantization, activation), but
//! an identity is only a claim; for a fronted server it is what the operator declared. So
//! before a local reranker serves, the hub sends it a fixed query with fixed documents (the
//! probe pairs) and compares its scores with those of the identity's first provider: within
//! the tolerance it joins that scorer; beyond it, it is a different scorer (the claim with a
//! `~2`, `~3` suffix), and the two never share a ranking.
//!
//! The references live in memory: a ranking is answered whole within one request, so unlike a
//! vector space nothing stored depends on which variant got the bare name. Cloud rerankers are
//! not probed (a probe would be a paid call on each connect; a cloud identity names its
//! upstream).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::registry::ScorerRef;
use crate::protocol::{Score, ScoreActivation};

/// The probe pairs' query.
pub const PROBE_QUERY: &str = "How do I read a file line by line in Rust?";

/// The probe pairs' documents: relevant, partly relevant and unrelated, so two scorers that
/// disagree on scale or order show it.
pub const PROBE_DOCUMENTS: [&str; 6] = [
    "Use std::io::BufReader::new(File::open(path)?).lines() to iterate over the lines of a file.",
    "std::fs::read_to_string reads a whole file into a String.",
    "In Python, `for line in open(path):` iterates over a file's lines.",
    "The borrow checker ensures references do not outlive the data they point to.",
    "Preheat the oven to 180 degrees and butter the cake tin.",
    "The Treaty of Westphalia was signed in 1648.",
];

/// The most two providers of one scorer may differ on a probe pair, as probabilities.
pub const TOLERANCE_PROBABILITY: f32 = 0.02;
/// The same, for scorers that report logits only.
pub const TOLERANCE_LOGIT: f32 = 0.1;

/// A probe not answered in this long failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);
/// A failed probe is sent again after this long, doubled for each failure in a row...
const RETRY_AFTER: Duration = Duration::from_secs(10);
/// ...up to this.
const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);

/// A probe to send: `provider` is `agent/provider`.
#[derive(Debug)]
pub struct ScorerProbe {
    pub probe: String,
    pub provider: String,
}

/// Where one provider stands.
#[derive(Clone, Debug)]
enum Standing {
    Probing {
        probe: String,
        claimed: Arc<ScorerRef>,
        sent_at: Instant,
    },
    Failed {
        claimed: Arc<ScorerRef>,
        error: String,
        retry_at: Instant,
        /// Failures in a row (the retry's backoff).
        failures: u32,
    },
    Checked {
        claimed: Arc<ScorerRef>,
        scorer: Arc<ScorerRef>,
        /// The largest difference to the variant's reference (0 for its founder).
        max_delta: f32,
    },
}

impl Standing {
    fn claimed(&self) -> &Arc<ScorerRef> {
        match self {
            Standing::Probing { claimed, .. }
            | Standing::Failed { claimed, .. }
            | Standing::Checked { claimed, .. } => claimed,
        }
    }
}

/// One scorer of a claimed identity: whose scores founded it.
#[derive(Clone, Debug)]
struct Variant {
    founder: String,
    scores: Vec<f32>,
}

/// What `/admin/status` shows of one provider's check.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ScorerCheckView {
    pub provider: String,
    /// The identity the provider claims.
    pub claimed: String,
    /// `probing`, `failed` or `checked`.
    pub state: &'static str,
    /// The scorer it serves as (checked only): the claim, or a `~N` variant of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scorer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_delta: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Default)]
pub struct ScorerCheck {
    variants: BTreeMap<String, Vec<Variant>>,
    standings: BTreeMap<String, Standing>,
    /// Failed probes in a row per provider (kept across its standings; a pass clears it).
    failures: BTreeMap<String, u32>,
    next_probe: u64,
}

impl ScorerCheck {
    /// Probes for the local rerankers connected now (`provider`, claimed identity) that have no
    /// standing for their claim, or whose probe failed long enough ago; forgets those gone.
    pub fn tick(
        &mut self,
        now: Instant,
        candidates: &[(String, Arc<ScorerRef>)],
    ) -> Vec<ScorerProbe> {
        self.standings.retain(|p, s| {
            candidates
                .iter()
                .any(|(c, claim)| c == p && s.claimed().id == claim.id)
        });
        let mut out = Vec::new();
        for (provider, claimed) in candidates {
            let due = match self.standings.get(provider) {
                None => true,
                Some(Standing::Probing { sent_at, .. }) => {
                    if now.saturating_duration_since(*sent_at) >= PROBE_TIMEOUT {
                        self.fail(provider, "the probe was not answered in 30 s".into(), now);
                    }
                    false
                }
                Some(Standing::Failed { retry_at, .. }) => *retry_at <= now,
                Some(Standing::Checked { .. }) => false,
            };
            if due {
                self.next_probe += 1;
                let probe = format!("scorer-{}", self.next_probe);
                self.standings.insert(
                    provider.clone(),
                    Standing::Probing {
                        probe: probe.clone(),
                        claimed: claimed.clone(),
                        sent_at: now,
                    },
                );
                out.push(ScorerProbe {
                    probe,
                    provider: provider.clone(),
                });
            }
        }
        out
    }

    /// Whether `probe` is one of ours (a scorer probe, not the gate's).
    pub fn is_probe(probe: &str) -> bool {
        probe.starts_with("scorer-")
    }

    /// The answer to a probe from `from`; `false` when it was not asked of `from`.
    pub fn on_answer(
        &mut self,
        probe: &str,
        from: &str,
        answer: Result<Vec<Score>, String>,
        now: Instant,
    ) -> bool {
        let claimed = match self.standings.get(from) {
            Some(Standing::Probing {
                probe: asked,
                claimed,
                ..
            }) if asked == probe => claimed.clone(),
            _ => return false,
        };
        let values = answer.and_then(|scores| comparable(&claimed, &scores));
        let values = match values {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(provider = from, scorer = %claimed.id, error = %e, "a reranker's probe failed; it serves nothing until one passes");
                self.fail(from, e, now);
                return true;
            }
        };
        let tolerance = match claimed.activation {
            ScoreActivation::Sigmoid => TOLERANCE_PROBABILITY,
            ScoreActivation::None => TOLERANCE_LOGIT,
        };
        let variants = self.variants.entry(claimed.id.clone()).or_default();
        let matched = variants.iter().enumerate().find_map(|(i, v)| {
            let delta = max_delta(&v.scores, &values);
            (delta <= tolerance).then_some((i, delta))
        });
        let (index, delta) = match matched {
            Some(m) => m,
            None => {
                variants.push(Variant {
                    founder: from.to_string(),
                    scores: values.clone(),
                });
                (variants.len() - 1, 0.0)
            }
        };
        let closest = variants
            .first()
            .map_or(0.0, |first| max_delta(&first.scores, &values));
        let scorer = if index == 0 {
            claimed.clone()
        } else {
            let mut other = (*claimed).clone();
            other.id = format!("{} ~{}", claimed.id, index + 1);
            Arc::new(other)
        };
        if index == 0 {
            tracing::info!(provider = from, scorer = %scorer.id, max_delta = delta, "reranker checked on the probe pairs");
        } else {
            tracing::warn!(provider = from, claimed = %claimed.id, scorer = %scorer.id, max_delta_to_claim = closest, founder = %variants[index].founder,
                "a reranker disagrees with its claimed scorer on the probe pairs: it is a different scorer and never shares a ranking with it");
        }
        self.failures.remove(from);
        self.standings.insert(
            from.to_string(),
            Standing::Checked {
                claimed,
                scorer,
                max_delta: delta,
            },
        );
        true
    }

    fn fail(&mut self, provider: &str, error: String, now: Instant) {
        let before = self.failures.get(provider).copied().unwrap_or(0);
        let failures = before.saturating_add(1);
        self.failures.insert(provider.to_string(), failures);
        let backoff = RETRY_AFTER
            .saturating_mul(1 << before.min(5))
            .min(RETRY_AFTER_MAX);
        if let Some(s) = self.standings.get_mut(provider) {
            *s = Standing::Failed {
                claimed: s.claimed().clone(),
                error,
                retry_at: now + backoff,
                failures,
            };
        }
    }

    /// A failed provider's error and how long until its next probe.
    pub fn failed(&self, provider: &str, now: Instant) -> Option<(&str, Duration)> {
        match self.standings.get(provider)? {
            Standing::Failed {
                error, retry_at, ..
            } => Some((error, retry_at.saturating_duration_since(now))),
            _ => None,
        }
    }

    /// A new session of `agent` (its process restarted, or replaced a silent one): its
    /// providers are probed again (a probe out to the old socket will never be answered).
    pub fn agent_reconnected(&mut self, agent: &str) {
        let prefix = format!("{agent}/");
        self.standings.retain(|p, _| !p.starts_with(&prefix));
    }

    /// An agent gone for good (the hub's retention passed): its providers' failures and
    /// standings are forgotten, so ids that come and go leave nothing behind.
    pub fn forget_agent(&mut self, agent: &str) {
        let prefix = format!("{agent}/");
        self.standings.retain(|p, _| !p.starts_with(&prefix));
        self.failures.retain(|p, _| !p.starts_with(&prefix));
    }

    /// How many providers the check keeps state for (standings, failure counts).
    pub fn providers_kept(&self) -> usize {
        self.standings.len() + self.failures.len()
    }

    /// The scorer `provider` serves as, once checked.
    pub fn scorer_of(&self, provider: &str) -> Option<Arc<ScorerRef>> {
        match self.standings.get(provider)? {
            Standing::Checked { scorer, .. } => Some(scorer.clone()),
            _ => None,
        }
    }

    pub fn view(&self) -> Vec<ScorerCheckView> {
        self.standings
            .iter()
            .map(|(provider, s)| {
                let mut v = ScorerCheckView {
                    provider: provider.clone(),
                    claimed: s.claimed().id.clone(),
                    state: "probing",
                    scorer: None,
                    max_delta: None,
                    error: None,
                };
                match s {
                    Standing::Probing { .. } => {}
                    Standing::Failed {
                        error, failures, ..
                    } => {
                        v.state = "failed";
                        v.error = Some(format!("{error} ({failures} in a row)"));
                    }
                    Standing::Checked {
                        scorer, max_delta, ..
                    } => {
                        v.state = "checked";
                        v.scorer = Some(scorer.id.clone());
                        v.max_delta = Some(*max_delta);
                    }
                }
                v
            })
            .collect()
    }
}

/// The numbers two providers of `claimed` are compared on: probabilities for a scorer with a
/// sigmoid, else logits; one per probe document, finite.
fn comparable(claimed: &ScorerRef, scores: &[Score]) -> Result<Vec<f32>, String> {
    if scores.len() != PROBE_DOCUMENTS.len() {
        return Err(format!(
            "{} scores for {} probe documents",
            scores.len(),
            PROBE_DOCUMENTS.len()
        ));
    }
    scores
        .iter()
        .map(|s| {
            let x = match claimed.activation {
                ScoreActivation::Sigmoid => s.probability.ok_or("a probability is missing")?,
                ScoreActivation::None => s.score,
            };
            if x.is_finite() {
                Ok(x)
            } else {
                Err("a score is not finite".to_string())
            }
        })
        .collect()
}

fn max_delta(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::registry::ModelOrigin;
    use crate::protocol::Backend;

    fn claim() -> Arc<ScorerRef> {
        Arc::new(ScorerRef {
            id: "local m@r sigmoid".into(),
            origin: ModelOrigin {
                backend: Backend::Local,
                model: "m".into(),
                revision: Some("r".into()),
                upstream: None,
                server: None,
            },
            activation: ScoreActivation::Sigmoid,
        })
    }

    fn scores(shift: f32) -> Vec<Score> {
        (0..PROBE_DOCUMENTS.len())
            .map(|i| {
                let p = 0.9 - 0.15 * i as f32 + shift;
                Score {
                    score: 0.0,
                    probability: Some(p),
                }
            })
            .collect()
    }

    #[test]
    fn agreeing_providers_share_a_scorer_and_a_disagreeing_one_is_kept_apart() {
        let mut check = ScorerCheck::default();
        let now = Instant::now();
        let cands: Vec<_> = ["a/r", "b/r", "c/r", "d/r"]
            .iter()
            .map(|p| (p.to_string(), claim()))
            .collect();
        let probes = check.tick(now, &cands);
        assert_eq!(probes.len(), 4);
        assert!(check.scorer_of("a/r").is_none(), "nothing serves unchecked");
        let answer = |c: &mut ScorerCheck, i: usize, shift: f32| {
            assert!(c.on_answer(
                &probes[i].probe,
                &probes[i].provider,
                Ok(scores(shift)),
                now
            ));
        };
        answer(&mut check, 0, 0.0);
        answer(&mut check, 1, 0.01);
        answer(&mut check, 2, 0.2);
        answer(&mut check, 3, 0.19);
        let id = |p: &str| check.scorer_of(p).unwrap().id.clone();
        assert_eq!(id("a/r"), "local m@r sigmoid");
        assert_eq!(id("b/r"), "local m@r sigmoid");
        assert_eq!(id("c/r"), "local m@r sigmoid ~2");
        assert_eq!(
            id("d/r"),
            "local m@r sigmoid ~2",
            "the disagreeing pair agree"
        );
        assert!(check.tick(now, &cands).is_empty(), "checked once");
        // A wrong count or a probe asked of someone else is not a pass.
        let mut fresh = ScorerCheck::default();
        let p = fresh.tick(now, &cands[..1]);
        assert!(!fresh.on_answer(&p[0].probe, "b/r", Ok(scores(0.0)), now));
        assert!(fresh.on_answer(&p[0].probe, "a/r", Ok(vec![]), now));
        assert!(fresh.scorer_of("a/r").is_none());
        assert_eq!(fresh.view()[0].state, "failed");
        assert!(fresh.tick(now, &cands[..1]).is_empty());
        let (error, wait) = fresh.failed("a/r", now).unwrap();
        assert!(error.contains("0 scores"), "{error}");
        assert_eq!(wait, RETRY_AFTER);
        let again = fresh.tick(now + RETRY_AFTER, &cands[..1]);
        assert_eq!(again.len(), 1);
        // A second failure in a row waits twice as long.
        assert!(fresh.on_answer(&again[0].probe, "a/r", Err("down".into()), now));
        assert_eq!(fresh.failed("a/r", now).unwrap().1, RETRY_AFTER * 2);
        // A new session of the agent is probed again at once.
        fresh.agent_reconnected("a");
        assert_eq!(fresh.tick(now, &cands[..1]).len(), 1);
    }
}
