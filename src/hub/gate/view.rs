//! What `/admin/status` shows of the gate: its settings, every space with its coverage and
//! rows per provider, and every verdict with its evidence.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Gate, Verdict, VerdictEntry};
use crate::roles::Role;

impl Gate {
    /// What `/admin/status` shows.
    pub fn view(&self, serving: &BTreeMap<Role, Vec<String>>) -> GateView {
        let spaces = self
            .spaces
            .values()
            .map(|s| {
                let id = s.id();
                let live = self.which(s.role, &id);
                let current = live == Some(super::Live::Current);
                let passing: Vec<&VerdictEntry> = self
                    .verdicts
                    .values()
                    .filter(|e| e.space == id && e.verdict == Verdict::Pass)
                    .collect();
                let connected = serving.get(&s.role).map_or(0, Vec::len);
                SpaceView {
                    id: id.clone(),
                    role: s.role,
                    model: s.model.clone(),
                    dims: s.dims,
                    encoder: s.encoder.clone(),
                    current,
                    live,
                    passing: passing.iter().map(|e| e.provider.clone()).collect(),
                    projects: self
                        .project_rows(&id)
                        .into_iter()
                        .map(|(p, (rows, tokens))| (p, ProjectRows { rows, tokens }))
                        .collect(),
                    created_ms: s.created_ms,
                    generation: s.generation,
                    int8_scales: s.int8_scales.clone(),
                    int8_rule: s.int8_rule,
                    coverage: if s.cloud_reference && passing.len() <= 1 && connected <= 1 {
                        "reduced: a sole cloud provider, checked on dims and pin only".into()
                    } else if s.cloud_reference {
                        "cloud peers checked against the anchor (the anchor on dims and pin)".into()
                    } else {
                        "full: checked against a local reference".into()
                    },
                    rows: self
                        .rows
                        .iter()
                        .filter(|((sid, _), _)| *sid == id)
                        .map(|((_, p), n)| (p.clone(), *n))
                        .collect(),
                }
            })
            .collect();
        GateView {
            min_cosine: self.settings.min_cosine,
            sentinel_s: self.settings.sentinel.as_secs(),
            reference: self.settings.reference.clone(),
            spaces,
            verdicts: self.verdicts.values().cloned().collect(),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct GateView {
    pub min_cosine: f64,
    pub sentinel_s: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    pub spaces: Vec<SpaceView>,
    pub verdicts: Vec<VerdictEntry>,
}

/// Rows and tokens one project was served from a space.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ProjectRows {
    pub rows: u64,
    pub tokens: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct SpaceView {
    pub id: String,
    pub role: Role,
    pub model: String,
    pub dims: usize,
    pub encoder: String,
    /// The role's space now (what unpinned requests are served in).
    pub current: bool,
    /// Which of the role's live spaces it is (`current`, `next`, `previous`); absent for a
    /// stored space nothing is served from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<super::Live>,
    /// Providers whose verdict for it passes.
    pub passing: Vec<String>,
    /// Rows and tokens served from it, per project.
    pub projects: BTreeMap<String, ProjectRows>,
    pub created_ms: u64,
    /// Which founding of this id it is (a retired id fingerprinted again is a new one).
    pub generation: u64,
    pub coverage: String,
    /// Rows (vectors) returned from this space, per provider.
    pub rows: BTreeMap<String, u64>,
    /// Int8 scales stored per width (by older builds), each served as stored.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub int8_scales: BTreeMap<usize, crate::quantize::Int8Scale>,
    /// The rule every other width's int8 scale is derived by, once stored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub int8_rule: Option<crate::quantize::Int8Rule>,
}
