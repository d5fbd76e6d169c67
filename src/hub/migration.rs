//! An operator's migration of an embedding role to another encoder (see
//! [`crate::hub::gate::RoleSpaces`]): open, cutover, close and abort, each checked by the gate,
//! persisted before it answers (on etcd under the leader's epoch: a fenced leader refuses),
//! then applied, with the whole config sent again to the agents when the cloud routes the
//! role's live spaces need changed (a cloud founder is built beside the role's own route). A
//! cutover also makes the role's config follow: the migration's policy, and its founder's
//! route when it is a cloud one.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use super::gate::{Live, MigrationRefused, RoleNow, Step};
use super::state::StateError;
use super::{Hub, core, to_the_end};
use crate::roles::{Policy, Role};

/// Why a migration step did not apply.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error(transparent)]
    Refused(#[from] MigrationRefused),
    /// The store did not take it (fenced, deposed, unwritable): nothing changed.
    #[error(transparent)]
    State(#[from] StateError),
}

/// What a step did, for its answer.
#[derive(Clone, Debug, Serialize)]
pub struct StepDone {
    pub role: Role,
    pub event: String,
    /// The role's live spaces now.
    pub spaces: MigrationView,
}

/// One embedding role's live spaces and their progress (`/admin/migrations`, status, the
/// console, the CLI).
#[derive(Clone, Debug, Serialize)]
pub struct MigrationView {
    pub role: Role,
    pub current: SpaceProgress,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<SpaceProgress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<SpaceProgress>,
    /// What founds the next space (while a migration is open).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub founder: Option<crate::hub::gate::Founder>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub opened_ms: Option<u64>,
}

/// One live space: who serves it and what it served.
#[derive(Clone, Debug, Serialize)]
pub struct SpaceProgress {
    /// Absent for a migration's next space until its founder is connected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub live: Live,
    /// Whether its fingerprint is stored (requests pinned to it can be served).
    pub founded: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Who may serve requests bound to it.
    pub policy: Policy,
    /// Connected providers whose verdict for it passes.
    pub passing: Vec<String>,
    /// Rows (vectors) served from it, per provider, since this hub started.
    pub rows_by_provider: BTreeMap<String, u64>,
    /// Rows and tokens served from it, per project, since this hub started.
    pub rows_by_project: BTreeMap<String, u64>,
    pub tokens_by_project: BTreeMap<String, u64>,
    pub rows: u64,
    pub tokens: u64,
}

impl Hub {
    /// Applies an operator's step to `role`'s live spaces: checked, persisted, then applied.
    pub async fn migrate(&self, role: Role, step: Step) -> Result<StepDone, MigrationError> {
        let hub = self.clone();
        to_the_end(async move { hub.apply_migration(role, step).await })
            .await
            .unwrap_or_else(|e| Err(MigrationError::State(e)))
    }

    async fn apply_migration(&self, role: Role, step: Step) -> Result<StepDone, MigrationError> {
        let _writing = self.inner.state_writes.lock().await;
        self.writable()?;
        let mut next = self.state();
        let now = {
            let core = self.core();
            let now = core.role_now(role);
            let (live, applied) = core.gate.migrate(role, &step, &now)?;
            next.role_spaces = live;
            next.spaces = core.gate.spaces().clone();
            if let Some(cut) = &applied.cut {
                // The role's config follows its new current space.
                next.cloud.policies.insert(role, cut.policy);
                if let Some(route) = &cut.route {
                    next.cloud.allowed_models.insert(role, route.clone());
                }
            }
            now
        };
        next.cloud.space_routes = next
            .role_spaces
            .iter()
            .map(|(r, l)| (*r, l.routes()))
            .filter(|(_, routes)| !routes.is_empty())
            .collect();
        let config_changed = next.cloud != self.state().cloud;
        if config_changed {
            next.config_revision = next.config_revision.saturating_add(1);
        }
        let next = self.persist(next).await?;
        let (cloud, revision) = (
            next.cloud.clone(),
            core::ConfigRevision {
                revision: next.config_revision,
                key_generation: next.key_generation.clone(),
            },
        );
        *self.lock_state() = next;
        let mut core = self.core();
        let applied = core.gate.migrated(role, &step, &now).inspect_err(|e| {
            // Cannot happen (checked under the same writers' lock): said, not hidden.
            tracing::error!(role = %role, error = %e, "a persisted migration step did not apply to the live gate");
        })?;
        if config_changed {
            core.set_config(cloud, revision);
            let id = format!("cfg-{}", core.config_revision().revision);
            let sent_to = core.broadcast_config(&id, None);
            tracing::info!(config_id = %id, agents = sent_to.len(), "the config follows the migration");
        }
        core.gate_tick(Instant::now());
        core.dispatch_all();
        let spaces = core
            .migration_view(role)
            .ok_or(MigrationRefused::NoCurrent(role))?;
        Ok(StepDone {
            role,
            event: applied.event,
            spaces,
        })
    }

    /// Every embedding role's live spaces and their progress.
    pub fn migrations(&self) -> Vec<MigrationView> {
        let core = self.core();
        [Role::Embedding, Role::CodeEmbedding]
            .into_iter()
            .filter_map(|r| core.migration_view(r))
            .collect()
    }
}

impl core::Core {
    /// `role` as a migration step sees it: who passes its next space, its policy and route.
    pub fn role_now(&self, role: Role) -> RoleNow {
        RoleNow {
            passing_next: self.passing_next(role).len(),
            policy: self.cloud.policy(role),
            route: self.cloud.allowed_models.get(&role).cloned(),
        }
    }

    /// Connected providers whose verdict for `role`'s next space passes.
    pub fn passing_next(&self, role: Role) -> Vec<String> {
        let next = self
            .gate
            .live()
            .get(&role)
            .and_then(|l| l.next.as_ref()?.space.clone());
        next.map_or_else(Vec::new, |sid| self.passing(role, &sid))
    }

    /// Connected providers of `role` whose verdict for `space` passes.
    fn passing(&self, role: Role, space: &str) -> Vec<String> {
        self.providers()
            .filter(|p| p.role() == role)
            .filter(|p| {
                p.gate_candidate.as_ref().is_some_and(|c| {
                    self.gate.standing(c, space) == crate::hub::gate::Standing::Pass
                })
            })
            .map(|p| p.reference.provider.clone())
            .collect()
    }

    /// `role`'s live spaces and their progress (`None`: it has no space yet).
    pub fn migration_view(&self, role: Role) -> Option<MigrationView> {
        let l = self.gate.live().get(&role)?;
        let progress = |id: Option<&str>, live: Live, policy: Policy| {
            let space = id.and_then(|id| self.gate.space(id));
            let rows_by_provider = id.map(|id| self.gate.rows_of(id)).unwrap_or_default();
            let by_project = id.map(|id| self.gate.project_rows(id)).unwrap_or_default();
            SpaceProgress {
                id: id.map(str::to_string),
                live,
                founded: space.is_some(),
                generation: space.map(|s| s.generation),
                policy,
                passing: id.map(|id| self.passing(role, id)).unwrap_or_default(),
                rows: rows_by_provider.values().sum(),
                tokens: by_project.values().map(|(_, t)| t).sum(),
                rows_by_provider,
                rows_by_project: by_project
                    .iter()
                    .map(|(p, (r, _))| (p.clone(), *r))
                    .collect(),
                tokens_by_project: by_project
                    .iter()
                    .map(|(p, (_, t))| (p.clone(), *t))
                    .collect(),
            }
        };
        Some(MigrationView {
            role,
            current: progress(Some(&l.current), Live::Current, self.cloud.policy(role)),
            next: l
                .next
                .as_ref()
                .map(|m| progress(m.space.as_deref(), Live::Next, m.policy)),
            previous: l
                .previous
                .as_ref()
                .map(|p| progress(Some(&p.space), Live::Previous, p.policy)),
            founder: l.next.as_ref().map(|m| m.founder.clone()),
            opened_ms: l.next.as_ref().map(|m| m.opened_ms),
        })
    }
}
