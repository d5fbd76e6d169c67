//! The gate's measure (DESIGN §6): the probe texts and the comparison of two
//! encoders' probe vectors. Vectors from two serving stacks share a table only if, on these
//! texts, they have the same count, exactly the table's width, and a minimum pairwise cosine
//! of at least 0.99. The hub's verdicts ([`super`]) and the `gate` command
//! both judge with [`judge`].

use serde::Serialize;

/// No threshold below this is accepted: 0.99 already admits quantised variants.
pub const MIN_COSINE_FLOOR: f64 = 0.99;

/// The narrowest Matryoshka width whose work frames carry a canary. At every width from here
/// up the canary is judged at the space's own minimum cosine (never under the floor) on the
/// fingerprint's first entries: measured honest numerics (f32 packed and padded, bf16, f16,
/// batches of 1, 8 and 32; `tests/local_inference/half.rs`) stay within a fifth of the floor's
/// allowance of 1 there ([`HONEST_MARGIN`]), so an honest provider is never suspended on noise.
/// A cut narrower than this says too little to judge on; such frames are watched by the
/// sentinel alone (as queries are: they are not stored).
pub const MIN_CANARY_DIMS: usize = 8;

/// The share of the floor's allowance (`1 − MIN_COSINE_FLOOR`) honest numerics may use at a
/// width that carries canaries: their lowest cosine is at least `1 − 0.01 × HONEST_MARGIN`.
pub const HONEST_MARGIN: f64 = 0.2;

/// Probe text `i` (the canary of a work frame is one of them), empty past the set.
pub fn probe_text(i: usize) -> &'static str {
    static PROBES: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(probe_texts);
    PROBES.get(i).map_or("", String::as_str)
}

/// Whether probe text `i` reaches a model of `max_input_tokens` whole (a bound that holds for
/// every tokenizer we run: at most one token per byte, plus special tokens). A canary is only
/// ever a text that fits whole: a provider that refuses long inputs (`no_truncate`) must not
/// fail a frame for its canary, and a cut canary would say nothing the fingerprint knows.
pub fn fits_whole(i: usize, max_input_tokens: Option<usize>) -> bool {
    const SPECIAL_TOKENS: usize = 8;
    max_input_tokens.is_none_or(|max| probe_text(i).len() + SPECIAL_TOKENS <= max)
}

/// How many probe texts there are.
pub fn probe_count() -> usize {
    static N: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| probe_texts().len());
    *N
}

/// The probe set: code in several languages, prose, very short, long, non-ASCII. Sent as
/// documents (no query template, no `dimensions`), the way stored vectors are made.
pub fn probe_texts() -> Vec<String> {
    let long = [
        "The hub keeps one queue per role. Accepted items wait there until a provider pulls;",
        "a lease that expires, or whose agent disconnects, puts its items back at the front,",
        "so nothing a client was told was accepted is ever lost. Cloud providers also hold a",
        "permit of the global budget while their lease runs, because every agent shares one",
        "key and OpenRouter limits per key. Local GPUs never touch the budget: a rate limit",
        "slows the cloud and never the GPUs. Embedding providers must pass the compatibility",
        "gate before they serve a single text, since vectors from two encoders only share a",
        "table when they are interchangeable: same width, and nearly the same direction for",
        "every probe text, short or long, code or prose, ASCII or not.",
    ]
    .join(" ");
    let long = format!("{long} {long} {long}");
    [
        "fn main() {\n    let v: Vec<u32> = (1..=10).filter(|n| n % 2 == 0).collect();\n    println!(\"{v:?}\");\n}",
        "def retry(fn, attempts=3):\n    for i in range(attempts):\n        try:\n            return fn()\n        except TimeoutError:\n            continue\n    raise RuntimeError('gave up')",
        "export async function fetchJson(url) {\n  const r = await fetch(url);\n  if (!r.ok) throw new Error(`HTTP ${r.status}`);\n  return r.json();\n}",
        "func (q *Queue) Pop() (Item, bool) {\n\tq.mu.Lock()\n\tdefer q.mu.Unlock()\n\tif len(q.items) == 0 {\n\t\treturn Item{}, false\n\t}\n\tit := q.items[0]\n\tq.items = q.items[1:]\n\treturn it, true\n}",
        "SELECT role, count(*) AS rows FROM vectors WHERE space_id = $1 GROUP BY role ORDER BY rows DESC;",
        "Retrieval quality degrades silently when two encoders disagree: nearest neighbours stop being comparable across the table.",
        "ok",
        "Grüße aus Köln: die Straße ist naß, aber schön.",
        "東京の天気は晴れです。コードを検索します。",
        "Привет, мир! Это проверка кодировки 🚀 ✓",
        "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
        long.as_str(),
    ]
    .into_iter()
    .map(str::to_string)
    .collect()
}

/// A short id of the probe set (a fingerprint answers exactly one).
pub fn probe_set_id() -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for t in probe_texts() {
        h.update(t.as_bytes());
        h.update([0u8]);
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// How two encoders compare on the probe set.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Evidence {
    /// Cosine of each probe's two vectors, in probe order.
    pub cosines: Vec<f64>,
    pub min_cosine: f64,
    pub mean_cosine: f64,
    /// The candidate's vector width.
    pub dims: usize,
}

/// The gate's answer for one candidate.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Judgement {
    Pass {
        #[serde(flatten)]
        evidence: Evidence,
    },
    Refused {
        reason: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        evidence: Option<Evidence>,
    },
}

impl Judgement {
    pub fn passed(&self) -> bool {
        matches!(self, Judgement::Pass { .. })
    }

    fn refused(reason: impl Into<String>) -> Self {
        Judgement::Refused {
            reason: reason.into(),
            evidence: None,
        }
    }
}

/// Checks a vector set on its own: the count and every vector's width (what an anchor, which
/// has no peer, is checked on).
pub fn check_shape(vectors: &[Vec<f32>], count: usize, width: usize) -> Result<(), String> {
    if count == 0 || width == 0 {
        return Err(format!(
            "{count} probe texts of width {width}: nothing to compare"
        ));
    }
    if vectors.len() != count {
        return Err(format!("{} vectors for {count} probe texts", vectors.len()));
    }
    if let Some(v) = vectors.iter().find(|v| v.len() != width) {
        return Err(format!("dims {} where the table is {width} wide", v.len()));
    }
    if vectors.iter().flatten().any(|x| !x.is_finite()) {
        return Err("a probe vector has a non-finite number".into());
    }
    if vectors
        .iter()
        .any(|v| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() < 1e-12)
    {
        return Err("a probe vector is all zeros".into());
    }
    Ok(())
}

/// Judges `candidate` against `reference` (both answers to [`probe_texts`]) for a table of
/// `width` dims; `min_cosine` is raised to [`MIN_COSINE_FLOOR`] if lower.
pub fn judge(
    reference: &[Vec<f32>],
    candidate: &[Vec<f32>],
    width: usize,
    min_cosine: f64,
) -> Judgement {
    let threshold = min_cosine.max(MIN_COSINE_FLOOR);
    if let Err(why) = check_shape(candidate, reference.len(), width) {
        return Judgement::refused(why);
    }
    if let Err(why) = check_shape(reference, reference.len(), width) {
        return Judgement::refused(format!("the reference is unusable: {why}"));
    }
    let cosines: Vec<f64> = reference
        .iter()
        .zip(candidate)
        .map(|(a, b)| cosine(a, b))
        .collect();
    let min_cosine = cosines.iter().copied().fold(f64::INFINITY, f64::min);
    let mean_cosine = cosines.iter().sum::<f64>() / cosines.len().max(1) as f64;
    let evidence = Evidence {
        cosines,
        min_cosine,
        mean_cosine,
        dims: width,
    };
    if min_cosine >= threshold {
        Judgement::Pass { evidence }
    } else {
        Judgement::Refused {
            reason: format!("minimum cosine {min_cosine:.4} is under {threshold}"),
            evidence: Some(evidence),
        }
    }
}

/// Cosine similarity in f64 (0 when either vector is all zeros).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    dot / (na.sqrt() * nb.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(v: &[f32]) -> Vec<f32> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect()
    }

    #[test]
    fn the_probe_set_covers_what_the_design_asks() {
        let p = probe_texts();
        assert!(p.len() >= 10);
        assert!(p.iter().any(|t| t.len() < 5), "very short");
        assert!(p.iter().any(|t| t.len() > 1500), "long");
        assert!(p.iter().any(|t| !t.is_ascii()), "non-ASCII");
        assert!(
            p.iter()
                .filter(|t| t.contains('{') || t.contains("def "))
                .count()
                >= 4,
            "code"
        );
    }

    #[test]
    fn judgement_needs_count_width_and_the_threshold() {
        let reference = vec![unit(&[1.0, 0.0, 0.0]), unit(&[0.0, 1.0, 0.0])];
        let same = reference.clone();
        assert!(judge(&reference, &same, 3, 0.99).passed());
        // 0.976 on one probe: refused, with the evidence.
        let c = 0.976f32;
        let off = vec![vec![c, (1.0 - c * c).sqrt(), 0.0], reference[1].clone()];
        match judge(&reference, &off, 3, 0.99) {
            Judgement::Refused {
                reason,
                evidence: Some(e),
            } => {
                assert!((e.min_cosine - 0.976).abs() < 1e-6, "{e:?}");
                assert!(reason.contains("0.9760"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // A lower threshold is raised to the floor.
        assert!(!judge(&reference, &off, 3, 0.5).passed());
        // Width and count.
        let narrow: Vec<Vec<f32>> = reference.iter().map(|v| v[..2].to_vec()).collect();
        assert!(
            matches!(judge(&reference, &narrow, 3, 0.99), Judgement::Refused { reason, .. } if reason.contains("dims 2"))
        );
        assert!(!judge(&reference, &reference[..1], 3, 0.99).passed());
        assert!(
            !judge(
                &reference,
                &[vec![f32::NAN, 0.0, 0.0], reference[1].clone()],
                3,
                0.99
            )
            .passed()
        );
    }
}
