//! Which cloud providers hold the hub's config now.
//!
//! A push reaches only the agents connected at that moment; one that was away (a black-holed
//! socket, a restart) redials with the routes and the key it held. So every push has a
//! **revision** and every key a **generation** (a random id per push that carried a key, never
//! derived from it), both persisted with the hub's state; agents say which they hold in
//! `hello`, `config_ack` and every heartbeat. The hub serves a cloud provider only while its
//! agent holds the current key generation and its route (model, upstream pin, dims) is the
//! hub's route for the role under a policy that lets the cloud serve; anything else is
//! **stale**: it serves nothing, is probed by no gate and is asked nothing of the account. An
//! agent that is behind is sent the whole config again, without the key (the hub never stored
//! it): it drops a key of another generation, and status names it among the agents that need a
//! push with the key.

use super::Core;
use crate::cloud::route::CloudRoute;
use crate::config::push::{AllowedModel, CloudSettings};
use crate::hub::registry::Stale;
use crate::protocol::{self, Backend, ConfigFrame, ConfigPayload, HeldConfig, HubFrame};
use crate::roles::{Policy, Role};
use crate::secret::Secret;

/// The config the hub holds: its revision (0 before any push) and its key's generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigRevision {
    pub revision: u64,
    pub key_generation: Option<String>,
}

impl ConfigRevision {
    /// A fresh key generation id: random, never derived from the key.
    pub fn new_key_generation() -> String {
        format!("kg-{:016x}", rand::random::<u64>())
    }
}

impl Core {
    /// The hub's config changed (a push applied): every cloud provider is checked again.
    pub fn set_config(&mut self, cloud: CloudSettings, revision: ConfigRevision) {
        self.cloud = cloud;
        self.config = revision;
        self.refresh_routes();
    }

    /// The revision and key generation the hub holds.
    pub fn config_revision(&self) -> &ConfigRevision {
        &self.config
    }

    /// The whole config at the current revision as a config frame, with `key` when the push
    /// that made it carried one: only what the merge kept, never a request's body.
    pub fn config_frame(&self, id: &str, key: Option<Secret>) -> String {
        protocol::encode(&HubFrame::Config(ConfigFrame {
            id: id.to_string(),
            revision: Some(self.config.revision),
            key_generation: self.config.key_generation.clone(),
            payload: ConfigPayload {
                openrouter: Some(self.cloud.whole_push(key)),
            },
        }))
    }

    /// Sends the whole config to every connected agent (a push); returns their ids.
    pub fn broadcast_config(&mut self, id: &str, key: Option<Secret>) -> Vec<String> {
        let frame = self.config_frame(id, key);
        let revision = self.config.revision;
        let mut sent = Vec::new();
        for (agent_id, a) in self.agents.iter_mut() {
            if a.send(frame.clone()) {
                a.config_sent = Some(revision);
                a.config_awaiting_ack = true;
                sent.push(agent_id.clone());
            }
        }
        self.refresh_routes();
        sent
    }

    /// What an agent says it holds (`hello`, `config_ack`, a heartbeat): its cloud providers
    /// are checked again when it changed, and it is sent the whole config when it is behind.
    pub(super) fn agent_holds(&mut self, agent: &str, held: HeldConfig) {
        let Some(a) = self.agents.get_mut(agent) else {
            return;
        };
        if a.held != held {
            a.held = held;
            self.refresh_routes();
        }
        self.sync_agent(agent);
    }

    /// Sends the whole config (without the key) to `agent` when it holds another revision,
    /// once per revision and session. A hub that never had a push says nothing to an agent
    /// that holds nothing.
    pub(super) fn sync_agent(&mut self, agent: &str) {
        let revision = self.config.revision;
        let Some(a) = self.agents.get(agent) else {
            return;
        };
        let holds_nothing = a.held == HeldConfig::default();
        if a.held.config_revision == Some(revision)
            || a.config_sent == Some(revision)
            || (revision == 0 && holds_nothing)
        {
            return;
        }
        let id = format!("cfg-sync-{revision}");
        let frame = self.config_frame(&id, None);
        let behind = a.held.config_revision;
        if let Some(a) = self.agents.get_mut(agent)
            && a.send(frame)
        {
            a.config_sent = Some(revision);
            a.config_awaiting_ack = true;
            tracing::info!(agent, held = ?behind, revision, "the agent is behind: the whole config is sent again (without the key)");
            self.refresh_routes();
        }
    }

    /// Checks every cloud provider against the hub's config (see the module comment).
    pub(super) fn refresh_routes(&mut self) {
        let (cloud, config) = (&self.cloud, &self.config);
        for a in self.agents.values_mut() {
            let config_on_the_way =
                a.config_awaiting_ack && a.held.config_revision != Some(config.revision);
            for p in a.providers.values_mut() {
                let stale = (p.info.backend == Backend::Cloud)
                    .then(|| stale_reason(cloud, config, &a.held, &p.info))
                    .flatten()
                    .map(|reason| Stale {
                        reason,
                        config_on_the_way,
                    });
                if let Some(s) = &stale
                    && p.stale.is_none()
                    && !s.config_on_the_way
                {
                    tracing::warn!(provider = %p.reference.provider, reason = %s.reason, "a cloud provider does not hold the hub's config: it serves nothing");
                }
                p.stale = stale;
            }
        }
    }

    /// Connected agents that do not hold the hub's current key (they were away when it was
    /// pushed): they serve no cloud work until a push with the key reaches them.
    pub fn agents_needing_key(&self) -> Vec<String> {
        if self.config.key_generation.is_none() {
            return Vec::new();
        }
        self.agents
            .iter()
            .filter(|(_, a)| a.held.key_generation != self.config.key_generation)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Agents the current config (with a cloud route for `role` and a key) was sent to and
    /// that have not answered it yet: their cloud providers for it may be a round trip away.
    pub(super) fn config_on_the_way(&self, role: Role) -> usize {
        if self.config.key_generation.is_none() || !self.cloud.allowed_models.contains_key(&role) {
            return 0;
        }
        self.agents
            .values()
            .filter(|a| a.config_awaiting_ack)
            .count()
    }

    /// Whether `agent` holds the hub's current key (account discovery asks only those).
    pub(super) fn holds_current_key(&self, agent: &str) -> bool {
        self.config.key_generation.is_some()
            && self
                .agents
                .get(agent)
                .is_some_and(|a| a.held.key_generation == self.config.key_generation)
    }
}

/// Why a cloud provider does not hold the hub's config now (`None`: it does).
fn stale_reason(
    cloud: &CloudSettings,
    current: &ConfigRevision,
    held: &HeldConfig,
    info: &protocol::ProviderInfo,
) -> Option<String> {
    let role = info.role;
    if current.key_generation.is_none() {
        return Some("no key was pushed to this hub".into());
    }
    if held.key_generation != current.key_generation {
        return Some(
            "its agent does not hold the hub's current key (it was away when the key was pushed): push the key again to serve from it".into(),
        );
    }
    let same = |allowed: &AllowedModel| {
        CloudRoute::from_allowed(role, allowed).is_ok_and(|route| {
            route.model() == info.model
                && route.upstream() == info.upstream
                && route.dims() == info.dims
        })
    };
    // A route one of the role's other live spaces needs (a migration's next space, the
    // previous one) serves whatever the role's policy: its space's policy decides.
    if cloud
        .space_routes
        .get(&role)
        .is_some_and(|routes| routes.iter().any(same))
    {
        return None;
    }
    if cloud.policy(role) == Policy::Local {
        return Some(format!("policy local keeps role {role} on local providers"));
    }
    let Some(allowed) = cloud.allowed_models.get(&role) else {
        return Some(format!("the hub holds no cloud route for role {role}"));
    };
    let route = match CloudRoute::from_allowed(role, allowed) {
        Ok(route) => route,
        Err(e) => return Some(format!("the hub's route is refused ({e})")),
    };
    let same = route.model() == info.model
        && route.upstream() == info.upstream
        && route.dims() == info.dims;
    (!same).then(|| {
        format!("its route (model, upstream pin or dims) is not the hub's route for role {role}")
    })
}
