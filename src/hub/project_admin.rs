//! The hub's side of projects: who a client request is ([`Hub::identify`]), and the admin
//! operations (create, change, rotate, remove), each written to the state first and then
//! applied to the core, under the state writers' lock; the day's cloud use is checkpointed
//! with the state every few seconds while it changes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::Serialize;

use super::projects::{
    self, Caller, DEFAULT_PROJECT, ProjectError, ProjectLimits, ProjectRecord, ProjectSettings,
};
use super::{Hub, now_ms, to_the_end};
use crate::protocol::WorkClass;
use crate::secret::Secret;

/// How often the projects' day usage is written while it changes.
const USAGE_CHECKPOINT_MS: u64 = 5_000;

/// Why a client request has no project.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unidentified {
    #[error(
        "the bearer token looks like a project key (fsp-…) but is not one of this hub's: it was rotated, removed or mistyped (a project key is never taken as 'default'); an operator shows the projects with `fantom-sidecar projects list` and makes a new key with `fantom-sidecar projects rotate <name>`"
    )]
    UnknownKey,
    #[error(
        "this hub requires a project key: send 'Authorization: Bearer <project key>' (an operator makes one with `fantom-sidecar projects add <name>`; a placeholder such as EMPTY is not one)"
    )]
    KeyRequired,
    #[error(
        "this endpoint needs 'Authorization: Bearer <client token or project key>' (a placeholder such as EMPTY is neither)"
    )]
    TokenRequired,
}

/// A project as the admin API shows it (never its key).
#[derive(Debug, Serialize)]
pub struct ProjectView {
    pub name: String,
    #[serde(flatten)]
    pub settings: ProjectSettings,
    /// Whether it has a key (`default` has none).
    pub has_key: bool,
    pub created_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_rotated_ms: Option<u64>,
    pub usage: UsageView,
}

/// A project's accounting since the hub started, and its cloud use today (UTC).
#[derive(Debug, Serialize)]
pub struct UsageView {
    pub requests: u64,
    pub texts: u64,
    pub local_tokens: u64,
    pub cloud_tokens: u64,
    pub cloud_calls: u64,
    pub cloud_usd: f64,
    /// Cloud calls whose answer carried no cost (their tokens are counted).
    pub cloud_calls_without_cost: u64,
    /// Items accepted and not yet answered (waiting or on a lease).
    pub items_queued: u64,
    pub bytes_held: usize,
    pub cloud_in_flight: u32,
    pub queue_seconds_count: u64,
    pub refused: BTreeMap<&'static str, u64>,
    pub today: TodayView,
}

#[derive(Debug, Serialize)]
pub struct TodayView {
    pub cloud_tokens: u64,
    pub cloud_usd: f64,
    pub cloud_calls_without_cost: u64,
    /// The daily allowance it is past, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over: Option<&'static str>,
}

/// A change of a project's settings (`PATCH`): absent fields stay; in `limits`, a field set
/// to `null` is cleared.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectPatch {
    #[serde(default)]
    pub weight: Option<u32>,
    #[serde(default)]
    pub limits: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub sub_projects: Option<bool>,
}

impl Hub {
    /// The caller of a client request: the project whose key `bearer` is (or `default` for
    /// the client token, or for no token where neither the client token nor a project key is
    /// required), its sub-project (when its key may name one) and the request's class.
    ///
    /// A bearer that begins with [`projects::KEY_PREFIX`] and matches no key is refused: a
    /// rotated, removed or mistyped project key never lands in `default`. Any other bearer
    /// that is not the client token is a placeholder (`EMPTY`, `unused`: what an
    /// OpenAI-compatible client must send) and counts as no `Authorization` header at all,
    /// as vLLM, TEI and Ollama treat it.
    pub fn identify(
        &self,
        bearer: Option<&str>,
        sub_project: Option<&str>,
        class: WorkClass,
    ) -> Result<Caller, Unidentified> {
        let core = self.core();
        let known = match bearer {
            Some(token) => match core.projects.authenticate(token) {
                Some(project) => Some(project),
                None if self
                    .inner
                    .client_token
                    .as_ref()
                    .is_some_and(|t| t.matches(token)) =>
                {
                    Some(Arc::from(DEFAULT_PROJECT))
                }
                None if token.starts_with(projects::KEY_PREFIX) => {
                    return Err(Unidentified::UnknownKey);
                }
                // A placeholder: as if no header were sent.
                None => None,
            },
            None => None,
        };
        let project = match known {
            Some(project) => project,
            None if self.inner.require_project_key => return Err(Unidentified::KeyRequired),
            None if self.inner.client_token.is_some() => return Err(Unidentified::TokenRequired),
            None => Arc::from(DEFAULT_PROJECT),
        };
        let may_name = core
            .projects
            .get(&project)
            .is_some_and(|r| r.settings.sub_projects);
        let sub = sub_project
            .filter(|_| may_name)
            .filter(|s| projects::check_name(s, "sub-project").is_ok())
            .map(Arc::from);
        Ok(core.projects.caller(project, sub, class))
    }

    /// Every project with its settings and accounting (never a key).
    pub fn projects_view(&self) -> Vec<ProjectView> {
        let mut core = self.core();
        let now = now_ms();
        let records: Vec<(Arc<str>, ProjectRecord)> = core
            .projects
            .records()
            .map(|(n, r)| (n.clone(), r.clone()))
            .collect();
        records
            .into_iter()
            .map(|(name, record)| {
                let usage = core.projects.usage.entry(name.clone()).or_default();
                let over = usage
                    .quota_hit(&record.settings.limits, now)
                    .map(|h| h.limit);
                ProjectView {
                    name: name.to_string(),
                    has_key: record.key_sha256.is_some(),
                    created_ms: record.created_ms,
                    key_rotated_ms: record.key_rotated_ms,
                    usage: UsageView {
                        requests: usage.requests,
                        texts: usage.texts,
                        local_tokens: usage.local_tokens,
                        cloud_tokens: usage.cloud_tokens,
                        cloud_calls: usage.cloud_calls,
                        cloud_usd: usage.cloud_usd,
                        cloud_calls_without_cost: usage.calls_without_cost,
                        items_queued: usage.held_items,
                        bytes_held: usage.held_bytes,
                        cloud_in_flight: usage.cloud_in_flight,
                        queue_seconds_count: usage.queue_seconds.count(),
                        refused: usage.refused.clone(),
                        today: TodayView {
                            cloud_tokens: usage.day.cloud_tokens,
                            cloud_usd: usage.day.cloud_usd,
                            cloud_calls_without_cost: usage.day.calls_without_cost,
                            over,
                        },
                    },
                    settings: record.settings,
                }
            })
            .collect()
    }

    /// Creates a project; its key is returned this once (the hub keeps only its digest).
    pub async fn create_project(
        &self,
        name: String,
        settings: ProjectSettings,
    ) -> Result<Secret, ProjectError> {
        projects::check_name(&name, "project name")?;
        settings.check()?;
        let (key, digest) = projects::new_key();
        self.change_projects(move |all| {
            if name == DEFAULT_PROJECT || all.contains_key(&name) {
                return Err(ProjectError::Exists(name));
            }
            all.insert(
                name,
                ProjectRecord {
                    settings,
                    key_sha256: Some(digest),
                    created_ms: now_ms(),
                    key_rotated_ms: None,
                },
            );
            Ok(())
        })
        .await?;
        Ok(key)
    }

    /// Changes a project's settings (live: new requests and the next dispatch use them).
    pub async fn update_project(
        &self,
        name: String,
        patch: ProjectPatch,
    ) -> Result<(), ProjectError> {
        projects::check_name(&name, "project name")?;
        self.change_projects(move |all| {
            let record = all
                .get_mut(&name)
                .ok_or_else(|| ProjectError::NotFound(name.clone()))?;
            let mut next = record.settings.clone();
            if let Some(w) = patch.weight {
                next.weight = w;
            }
            if let Some(s) = patch.sub_projects {
                next.sub_projects = s;
            }
            if let Some(changes) = patch.limits {
                next.limits = merge_limits(&next.limits, changes)?;
            }
            next.check()?;
            record.settings = next;
            Ok(())
        })
        .await
    }

    /// A new key for a project; the old one stops working at once.
    pub async fn rotate_project(&self, name: String) -> Result<Secret, ProjectError> {
        projects::check_name(&name, "project name")?;
        if name == DEFAULT_PROJECT {
            return Err(ProjectError::Default("given a key"));
        }
        let (key, digest) = projects::new_key();
        self.change_projects(move |all| {
            let record = all
                .get_mut(&name)
                .ok_or_else(|| ProjectError::NotFound(name.clone()))?;
            record.key_sha256 = Some(digest);
            record.key_rotated_ms = Some(now_ms());
            Ok(())
        })
        .await?;
        Ok(key)
    }

    /// Removes a project: its key stops working at once; work it already has accepted is
    /// still served.
    pub async fn remove_project(&self, name: String) -> Result<(), ProjectError> {
        projects::check_name(&name, "project name")?;
        if name == DEFAULT_PROJECT {
            return Err(ProjectError::Default("removed"));
        }
        self.change_projects(move |all| {
            all.remove(&name)
                .map(|_| ())
                .ok_or(ProjectError::NotFound(name))
        })
        .await
    }

    /// Applies `change` to the persisted projects, writes them, then gives the core the
    /// result (to the end even if the caller goes away).
    async fn change_projects(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, ProjectRecord>) -> Result<(), ProjectError>
        + Send
        + 'static,
    ) -> Result<(), ProjectError> {
        let hub = self.clone();
        to_the_end(async move {
            let _writing = hub.inner.state_writes.lock().await;
            let mut next = hub.state();
            let mut all = next.projects.clone();
            all.entry(DEFAULT_PROJECT.to_string())
                .or_insert_with(|| ProjectRecord {
                    settings: ProjectSettings::default(),
                    key_sha256: None,
                    created_ms: 0,
                    key_rotated_ms: None,
                });
            change(&mut all)?;
            next.projects = all;
            next.project_usage = hub.core().projects.days();
            let next = hub.persist(next).await?;
            let records = next.projects.clone();
            *hub.lock_state() = next;
            let mut core = hub.core();
            core.projects.replace(&records);
            core.dispatch_all();
            Ok(())
        })
        .await
        .unwrap_or_else(|e| Err(ProjectError::State(e)))
    }

    /// Writes the projects' day usage when it changed and the last write is old enough.
    pub(super) async fn checkpoint_usage_if_due(&self) {
        let now = now_ms();
        let last = self.inner.usage_saved_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) < USAGE_CHECKPOINT_MS {
            return;
        }
        let days = self.core().projects.days();
        if days == self.lock_state().project_usage {
            return;
        }
        self.inner.usage_saved_ms.store(now, Ordering::Relaxed);
        self.save_usage(days).await;
    }

    /// Writes the projects' day usage now.
    async fn save_usage(&self, days: BTreeMap<String, projects::usage::DayUsage>) {
        let _writing = self.inner.state_writes.lock().await;
        let mut next = self.state();
        next.project_usage = days;
        match self.persist(next).await {
            Ok(next) => *self.lock_state() = next,
            Err(e) => {
                tracing::warn!(error = %e, "the projects' usage could not be saved; trying again")
            }
        }
    }
}

/// `limits` with `changes` laid over it (`null` clears a field; an unknown field is refused).
fn merge_limits(
    limits: &ProjectLimits,
    changes: serde_json::Map<String, serde_json::Value>,
) -> Result<ProjectLimits, ProjectError> {
    let mut merged = match serde_json::to_value(limits) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    for (k, v) in changes {
        if v.is_null() {
            merged.remove(&k);
        } else {
            merged.insert(k, v);
        }
    }
    serde_json::from_value(serde_json::Value::Object(merged)).map_err(|e| {
        ProjectError::Invalid(format!("limits: {}", crate::secret::redact(&e.to_string())))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::gate;

    fn hub(dir: &std::path::Path, client_token: Option<&str>, require_key: bool) -> Hub {
        std::fs::create_dir_all(dir).unwrap();
        Hub::open_for_tests(
            dir,
            client_token,
            require_key,
            gate::GateSettings::default(),
        )
    }

    fn who(hub: &Hub, bearer: Option<&str>) -> Result<String, Unidentified> {
        hub.identify(bearer, None, WorkClass::Batch)
            .map(|c| c.project.to_string())
    }

    #[tokio::test]
    async fn a_placeholder_is_no_key_and_an_unknown_project_key_is_never_default() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing required: no header and any placeholder are `default`.
        let open = hub(&dir.path().join("open"), None, false);
        let key = open
            .create_project("alpha".into(), ProjectSettings::default())
            .await
            .unwrap();
        assert_eq!(who(&open, Some(key.expose())).unwrap(), "alpha");
        for placeholder in [None, Some("EMPTY"), Some("unused"), Some("sk-anything")] {
            assert_eq!(
                who(&open, placeholder).unwrap(),
                "default",
                "{placeholder:?}"
            );
        }
        // A project key of the right shape that is not one: 401, however open the hub.
        let rotated = open.rotate_project("alpha".into()).await.unwrap();
        assert!(matches!(
            who(&open, Some(key.expose())),
            Err(Unidentified::UnknownKey)
        ));
        assert_eq!(who(&open, Some(rotated.expose())).unwrap(), "alpha");
        let stranger = format!("{}{}", projects::KEY_PREFIX, "0".repeat(64));
        assert!(matches!(
            who(&open, Some(&stranger)),
            Err(Unidentified::UnknownKey)
        ));

        // A client token: it is `default`; a placeholder is as no header, refused.
        let guarded = hub(&dir.path().join("guarded"), Some("client-token-1"), false);
        assert_eq!(who(&guarded, Some("client-token-1")).unwrap(), "default");
        for placeholder in [None, Some("EMPTY")] {
            assert!(matches!(
                who(&guarded, placeholder),
                Err(Unidentified::TokenRequired)
            ));
        }
        // A project key required: a placeholder is refused as no key is.
        let strict = hub(&dir.path().join("strict"), None, true);
        for placeholder in [None, Some("EMPTY")] {
            assert!(matches!(
                who(&strict, placeholder),
                Err(Unidentified::KeyRequired)
            ));
        }
        // No message echoes what was sent.
        for e in [
            Unidentified::UnknownKey,
            Unidentified::KeyRequired,
            Unidentified::TokenRequired,
        ] {
            assert!(!e.to_string().contains(&stranger));
        }
    }
}
