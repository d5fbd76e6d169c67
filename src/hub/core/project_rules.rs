//! The projects' rules where the core applies them: at admission (a project's
//! `max_queued_items`, its share of the role queue's room and of the bytes the hub holds, its
//! daily cloud allowance for work only the cloud can serve), at dispatch (who may take a
//! cloud permit: `max_cloud_in_flight`, the allowance, the weighted share of the budget's
//! permits while others wait) and when a cloud call ends (its tokens and cost, per project).
//! The rules themselves live in [`crate::hub::projects`]; this file feeds them the core's
//! numbers.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Binding, Core, RequestFailure};
use crate::hub::policy;
use crate::hub::projects::{AdmitRefusal, Caller, CloudShare, ProjectLimits, usage::room_for};
use crate::hub::queue::RequestId;
use crate::protocol::Backend;
use crate::roles::{Policy, Role};

impl Core {
    /// Whether `caller`'s project may queue `n` more items of `bytes` for `role` now.
    pub(super) fn check_project(
        &mut self,
        caller: &Caller,
        role: Role,
        binding: &Binding,
        n: usize,
        bytes: usize,
    ) -> Result<(), AdmitRefusal> {
        let project = &caller.project;
        let limits = self
            .projects
            .get(project)
            .map(|r| r.settings.limits.clone())
            .unwrap_or_default();
        let usage = self.projects.usage.entry(project.clone()).or_default();
        if let Some(limit) = limits.max_queued_items
            && usage.held_items.saturating_add(n as u64) > limit
        {
            return Err(AdmitRefusal::QueuedItems {
                project: project.to_string(),
                held: usage.held_items,
                items: n,
                limit,
                retry_after_s: self.retry_after_s(role),
            });
        }
        let mine_bytes = usage.held_bytes;
        // With no project but `default`, there is nobody to keep room for.
        if self.projects.records().count() <= 1 {
            return self.check_quota(caller, role, binding, &limits);
        }
        // The role queue's room, shared out (past the room: the queue's own 429).
        let queue = &self.queues[&role];
        let waiting = queue.waiting_by_project();
        let (total, capacity) = (queue.len(), queue.capacity());
        if total.saturating_add(n) <= capacity {
            let mine = waiting.get(project).copied().unwrap_or(0);
            let holders = self.weight_of(waiting.keys(), project);
            if !room_for(capacity, total, mine, n, caller.weight, holders) {
                return Err(AdmitRefusal::Share {
                    project: project.to_string(),
                    what: "role queue's items",
                    held: mine,
                    limit: capacity,
                    retry_after_s: self.retry_after_s(role),
                });
            }
        }
        // The bytes every accepted request holds, shared out the same way.
        let limit = self.settings.limits.max_held_bytes;
        if self.held_bytes.saturating_add(bytes) <= limit {
            let holding: Vec<&Arc<str>> = self
                .projects
                .usage
                .iter()
                .filter(|(_, u)| u.held_bytes > 0)
                .map(|(p, _)| p)
                .collect();
            let holders = self.weight_of(holding.into_iter(), project);
            if !room_for(
                limit,
                self.held_bytes,
                mine_bytes,
                bytes,
                caller.weight,
                holders,
            ) {
                return Err(AdmitRefusal::Share {
                    project: project.to_string(),
                    what: "bytes of accepted input (max_held_mb)",
                    held: mine_bytes,
                    limit,
                    retry_after_s: self.retry_after_s(role),
                });
            }
        }
        self.check_quota(caller, role, binding, &limits)
    }

    /// A project past a daily allowance may queue no work only the cloud could serve.
    fn check_quota(
        &mut self,
        caller: &Caller,
        role: Role,
        binding: &Binding,
        limits: &ProjectLimits,
    ) -> Result<(), AdmitRefusal> {
        let project = &caller.project;
        let now_ms = crate::hub::now_ms();
        let usage = self.projects.usage.entry(project.clone()).or_default();
        if let Some(hit) = usage.quota_hit(limits, now_ms)
            && self.cloud_only(role, binding)
        {
            return Err(AdmitRefusal::Quota {
                project: project.to_string(),
                limit: hit.limit,
                used: hit.used,
                allowed: hit.allowed,
                retry_after_s: hit.reset_s,
            });
        }
        Ok(())
    }

    /// Refuses at once a request of a role only the cloud may serve (policy `cloud`) from a
    /// project past a daily allowance: nothing connected or to come could serve it today.
    pub fn check_allowance(&mut self, caller: &Caller, role: Role) -> Result<(), AdmitRefusal> {
        if self.cloud.policy(role) != Policy::Cloud {
            return Ok(());
        }
        let limits = self
            .projects
            .get(&caller.project)
            .map(|r| r.settings.limits.clone())
            .unwrap_or_default();
        let usage = self
            .projects
            .usage
            .entry(caller.project.clone())
            .or_default();
        match usage.quota_hit(&limits, crate::hub::now_ms()) {
            None => Ok(()),
            Some(hit) => {
                *usage.refused.entry("project_quota").or_default() += 1;
                Err(AdmitRefusal::Quota {
                    project: caller.project.to_string(),
                    limit: hit.limit,
                    used: hit.used,
                    allowed: hit.allowed,
                    retry_after_s: hit.reset_s,
                })
            }
        }
    }

    /// The weights of `projects` and of `me` (once), added.
    fn weight_of<'a>(&self, projects: impl Iterator<Item = &'a Arc<str>>, me: &str) -> u32 {
        let mut seen_me = false;
        let mut sum = 0u32;
        for p in projects {
            seen_me |= &**p == me;
            sum = sum.saturating_add(self.projects.weight(p));
        }
        if !seen_me {
            sum = sum.saturating_add(self.projects.weight(me));
        }
        sum
    }

    /// Whether only the cloud could serve items of `binding` for `role` (the policy allows
    /// nothing else, or no local provider of the binding is connected).
    pub(super) fn cloud_only(&self, role: Role, binding: &Binding) -> bool {
        let policy = self.policy_for(role, binding);
        if policy == Policy::Local {
            return false;
        }
        !self.providers().any(|p| {
            p.role() == role
                && p.info.backend == Backend::Local
                && policy::allows(policy, Backend::Local)
                && p.refused.is_none()
                && binding.admits(p, &self.gate)
        })
    }

    /// Who may take a cloud permit now: the projects with work waiting in a role the cloud
    /// may serve (in any of its live spaces), and the budget's permits.
    pub(super) fn cloud_share(&self) -> CloudShare {
        let mut waiting: BTreeMap<Arc<str>, u32> = BTreeMap::new();
        for (role, queue) in &self.queues {
            // The role's policy or one of its other live spaces' lets the cloud serve.
            if !self.backends_of(*role).cloud {
                continue;
            }
            for project in queue.waiting_by_project().into_keys() {
                let weight = self.projects.weight(&project);
                waiting.insert(project, weight);
            }
        }
        CloudShare {
            waiting,
            permits: self.budget.limit(),
        }
    }

    /// Whether `project` may take one more cloud permit: under its `max_cloud_in_flight`,
    /// within its daily allowance, and within its weighted share while others wait.
    pub(super) fn cloud_allows(&mut self, project: &Arc<str>, share: &CloudShare) -> bool {
        let (limits, weight) = match self.projects.get(project) {
            Some(r) => (r.settings.limits.clone(), r.settings.weight),
            None => (Default::default(), 1),
        };
        let usage = self.projects.usage.entry(project.clone()).or_default();
        if limits
            .max_cloud_in_flight
            .is_some_and(|max| usage.cloud_in_flight >= max)
        {
            return false;
        }
        if usage.quota_hit(&limits, crate::hub::now_ms()).is_some() {
            return false;
        }
        share.allows(project, weight, usage.cloud_in_flight)
    }

    /// A cloud call of `project` ended having read `tokens` at `cost_usd`: its accounting,
    /// and, once it is past a daily allowance, its waiting work that only the cloud could
    /// serve fails with the allowance's reset.
    pub(super) fn record_cloud_use(&mut self, project: &Arc<str>, tokens: u64, cost: Option<f64>) {
        let now_ms = crate::hub::now_ms();
        let limits = self
            .projects
            .get(project)
            .map(|r| r.settings.limits.clone())
            .unwrap_or_default();
        let usage = self.projects.usage.entry(project.clone()).or_default();
        usage.record_cloud(tokens, cost, now_ms);
        let Some(hit) = usage.quota_hit(&limits, now_ms) else {
            return;
        };
        let stranded: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, p)| p.caller.project == *project && p.streamed.is_none())
            .filter(|(_, p)| self.cloud_only(p.role, &p.binding))
            .map(|(id, _)| *id)
            .collect();
        for id in stranded {
            let refusal = AdmitRefusal::Quota {
                project: project.to_string(),
                limit: hit.limit,
                used: hit.used.clone(),
                allowed: hit.allowed.clone(),
                retry_after_s: hit.reset_s,
            };
            self.fail_request(id, RequestFailure::Project(refusal));
        }
    }
}
