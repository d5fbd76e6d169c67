//! Projects: who a client request belongs to, and what each may use of the shared fleet and
//! account.
//!
//! A project has a name, a weight (its share of the role queues and of the cloud permits
//! while others wait), optional limits ([`ProjectLimits`]) and a key. The key is shown once,
//! when it is made; the hub keeps only its SHA-256 (the key is 256 random bits, so a plain
//! digest cannot be reversed or guessed) and compares a presented key against every
//! project's digest in constant time. `default` always exists: it holds requests that carry
//! no key (or the old client token), has no key of its own, and can be given a weight and
//! limits like any other.
//!
//! * this file: the settings, the records persisted with the hub's state, keys, and the
//!   registry the hub asks who a request is ([`Projects::authenticate`]);
//! * [`usage`]: the live accounting per project (requests, tokens, cloud calls and cost, what
//!   it holds, the day's cloud allowance) and the rules that share the hub's room and the
//!   cloud permits between projects.

pub mod usage;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::protocol::WorkClass;
use crate::secret::Secret;

pub use usage::{AdmitRefusal, CloudShare, ProjectUsage, QuotaHit};

/// The project of requests that present no project key.
pub const DEFAULT_PROJECT: &str = "default";

/// Key prefix: says what a key is wherever it turns up (and makes it key-shaped for the
/// redaction of anything typed into the wrong field).
pub const KEY_PREFIX: &str = "fsp-";

/// Who a request belongs to and how urgent it is: its flow in the role queues.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub project: Arc<str>,
    /// A sub-project named by `X-FantomMCP-Project` (only for keys allowed to).
    pub sub_project: Option<Arc<str>>,
    pub class: WorkClass,
    /// The project's weight when the request was admitted.
    pub weight: u32,
}

impl Caller {
    /// A request of `default` (in-process callers, tests).
    pub fn default_project(class: WorkClass) -> Self {
        Self {
            project: Arc::from(DEFAULT_PROJECT),
            sub_project: None,
            class,
            weight: 1,
        }
    }
}

/// A project's limits; each is optional (unset: no limit of its own).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProjectLimits {
    /// Items the project may have accepted and not yet answered, over every role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued_items: Option<u64>,
    /// Cloud calls the project may hold at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cloud_in_flight: Option<u32>,
    /// Cloud tokens per UTC day (from the usage each call reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_tokens_per_day: Option<u64>,
    /// Cloud cost per UTC day, in US dollars (from the cost each call reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_usd_per_day: Option<f64>,
}

impl ProjectLimits {
    fn check(&self) -> Result<(), ProjectError> {
        if self.max_cloud_in_flight == Some(0) {
            return Err(ProjectError::Invalid(
                "limits.max_cloud_in_flight must be at least 1 (to keep a project off the cloud, leave its roles local)".into(),
            ));
        }
        if let Some(usd) = self.cloud_usd_per_day
            && !(usd.is_finite() && usd >= 0.0)
        {
            return Err(ProjectError::Invalid(
                "limits.cloud_usd_per_day must be a number of dollars, 0 or more".into(),
            ));
        }
        Ok(())
    }
}

/// A project's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProjectSettings {
    /// Its share of each role's dispatch and of the cloud permits while others wait.
    pub weight: u32,
    #[serde(default)]
    pub limits: ProjectLimits,
    /// Whether its key may name sub-projects with `X-FantomMCP-Project` (they share the
    /// project's turn fairly among themselves).
    #[serde(default)]
    pub sub_projects: bool,
}

impl Default for ProjectSettings {
    fn default() -> Self {
        Self {
            weight: 1,
            limits: ProjectLimits::default(),
            sub_projects: false,
        }
    }
}

/// The most a weight may be (shares stay meaningful).
pub const MAX_WEIGHT: u32 = 1000;

impl ProjectSettings {
    pub fn check(&self) -> Result<(), ProjectError> {
        if !(1..=MAX_WEIGHT).contains(&self.weight) {
            return Err(ProjectError::Invalid(format!(
                "weight must be 1..={MAX_WEIGHT}"
            )));
        }
        self.limits.check()
    }
}

/// What the hub persists of a project: its settings and its key's digest, never the key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProjectRecord {
    #[serde(flatten)]
    pub settings: ProjectSettings,
    /// SHA-256 of the key, hex (`None` for `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_sha256: Option<String>,
    pub created_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_rotated_ms: Option<u64>,
}

/// Why a project operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    #[error("{0}")]
    Invalid(String),
    #[error("project '{0}' exists already; rotate its key or change its settings instead")]
    Exists(String),
    #[error("no project '{0}' (GET /admin/projects lists them)")]
    NotFound(String),
    #[error(
        "'default' holds requests without a key and has no key of its own: it cannot be {0}; give it a weight or limits with PATCH"
    )]
    Default(&'static str),
    #[error(transparent)]
    State(#[from] crate::hub::state::StateError),
}

/// Checks a project or sub-project name: 1–64 characters of `a-z A-Z 0-9 . _ - : /`,
/// not key-shaped (a key typed as a name is refused without being echoed).
pub fn check_name(name: &str, what: &str) -> Result<(), ProjectError> {
    if crate::secret::looks_like_key(name) {
        return Err(ProjectError::Invalid(format!(
            "the {what} looks like a key; it was not kept or shown. Names are 1-64 characters of letters, digits and . _ - : /"
        )));
    }
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:/".contains(&b));
    if !ok {
        return Err(ProjectError::Invalid(format!(
            "a {what} is 1-64 characters of letters, digits and . _ - : /"
        )));
    }
    Ok(())
}

/// A new project key and its digest.
pub fn new_key() -> (Secret, String) {
    let random = Secret::generate();
    let key = Secret::new(format!("{KEY_PREFIX}{}", random.expose()));
    let digest = key_digest(key.expose());
    (key, digest)
}

fn key_digest(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether two digests are equal, in time independent of where they differ.
fn same_digest(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The projects the hub knows, with their live accounting.
#[derive(Debug, Default)]
pub struct Projects {
    records: BTreeMap<Arc<str>, ProjectRecord>,
    pub usage: BTreeMap<Arc<str>, ProjectUsage>,
}

impl Projects {
    /// The registry from the persisted records and the day's usage (`default` is added when
    /// the state has none).
    pub fn new(
        mut records: BTreeMap<String, ProjectRecord>,
        days: &BTreeMap<String, usage::DayUsage>,
    ) -> Self {
        records
            .entry(DEFAULT_PROJECT.to_string())
            .or_insert_with(|| ProjectRecord {
                settings: ProjectSettings::default(),
                key_sha256: None,
                created_ms: 0,
                key_rotated_ms: None,
            });
        let mut out = Self::default();
        for (name, record) in records {
            let name: Arc<str> = Arc::from(name);
            let mut live = ProjectUsage::default();
            if let Some(day) = days.get(&*name) {
                live.day = day.clone();
            }
            out.usage.insert(name.clone(), live);
            out.records.insert(name, record);
        }
        out
    }

    /// The project whose key `presented` is, compared against every key in constant time.
    pub fn authenticate(&self, presented: &str) -> Option<Arc<str>> {
        let digest = Sha256::digest(presented.as_bytes());
        let mut found = None;
        for (name, record) in &self.records {
            let Some(hex) = &record.key_sha256 else {
                continue;
            };
            let stored: Vec<u8> = (0..hex.len() / 2)
                .filter_map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
                .collect();
            if same_digest(&stored, &digest) {
                found = Some(name.clone());
            }
        }
        found
    }

    pub fn get(&self, name: &str) -> Option<&ProjectRecord> {
        self.records.get(name)
    }

    /// The shared name of a project (`None` when it is gone).
    pub fn name(&self, name: &str) -> Option<Arc<str>> {
        self.records.get_key_value(name).map(|(k, _)| k.clone())
    }

    pub fn records(&self) -> impl Iterator<Item = (&Arc<str>, &ProjectRecord)> {
        self.records.iter()
    }

    /// The weight of `project` (1 when it is gone).
    pub fn weight(&self, project: &str) -> u32 {
        self.records
            .get(project)
            .map_or(1, |r| r.settings.weight.max(1))
    }

    /// The caller of a request of `project`.
    pub fn caller(
        &self,
        project: Arc<str>,
        sub_project: Option<Arc<str>>,
        class: WorkClass,
    ) -> Caller {
        let weight = self.weight(&project);
        Caller {
            project,
            sub_project,
            class,
            weight,
        }
    }

    /// Takes the persisted records as they now stand (a create, change, rotation or removal
    /// was written); a removed project's accounting goes with it.
    pub fn replace(&mut self, records: &BTreeMap<String, ProjectRecord>) {
        let mut next = BTreeMap::new();
        for (name, record) in records {
            let name = self.name(name).unwrap_or_else(|| Arc::from(name.as_str()));
            self.usage.entry(name.clone()).or_default();
            next.insert(name, record.clone());
        }
        self.records = next;
        // A removed project's accounting stays while work it accepted is still held (its
        // requests end against it; a project made again under the name continues it).
        let records = &self.records;
        self.usage.retain(|name, u| {
            records.contains_key(name) || u.held_items > 0 || u.cloud_in_flight > 0
        });
    }

    /// The day's cloud usage of every project (checkpointed with the hub's state).
    pub fn days(&self) -> BTreeMap<String, usage::DayUsage> {
        self.usage
            .iter()
            .filter(|(_, u)| !u.day.is_empty())
            .map(|(name, u)| (name.to_string(), u.day.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_found_by_its_digest_and_never_kept() {
        let (key, digest) = new_key();
        assert!(key.expose().starts_with(KEY_PREFIX));
        assert!(crate::secret::looks_like_key(key.expose()));
        assert!(!digest.contains(key.expose()));
        let mut records = BTreeMap::new();
        records.insert(
            "payments".to_string(),
            ProjectRecord {
                settings: ProjectSettings::default(),
                key_sha256: Some(digest),
                created_ms: 1,
                key_rotated_ms: None,
            },
        );
        let projects = Projects::new(records, &BTreeMap::new());
        assert_eq!(
            projects.authenticate(key.expose()).as_deref(),
            Some("payments")
        );
        assert_eq!(projects.authenticate("fsp-0000"), None);
        assert_eq!(projects.authenticate(""), None, "default has no key");
        assert!(projects.get(DEFAULT_PROJECT).is_some());
    }

    #[test]
    fn names_and_settings_are_checked() {
        assert!(check_name("payments", "project name").is_ok());
        assert!(check_name("org/repo:main", "sub-project").is_ok());
        for bad in ["", "has space", &"x".repeat(65), "ü"] {
            assert!(check_name(bad, "project name").is_err(), "{bad}");
        }
        let err = check_name("sk-or-v1-0123456789abcdef0123456789abcdef", "project name")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("0123456789abcdef"), "{err}");
        let mut s = ProjectSettings {
            weight: 0,
            ..ProjectSettings::default()
        };
        assert!(s.check().is_err());
        s.weight = 2;
        s.limits.max_cloud_in_flight = Some(0);
        assert!(s.check().is_err());
        s.limits.max_cloud_in_flight = Some(1);
        s.limits.cloud_usd_per_day = Some(f64::NAN);
        assert!(s.check().is_err());
    }
}
