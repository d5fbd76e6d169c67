//! The five inference roles and the routing policies that decide who may serve each.
//!
//! Roles are a closed set: a name outside it is an error at every front door (HTTP `model`,
//! a provider in `hello`, a key of a config push), never a silent new queue.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// One inference role; each has its own queue and policy.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Embedding,
    CodeEmbedding,
    Reranker,
    CodeAssistant,
    RlmSandbox,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Embedding,
        Role::CodeEmbedding,
        Role::Reranker,
        Role::CodeAssistant,
        Role::RlmSandbox,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::CodeEmbedding => "code-embedding",
            Role::Reranker => "reranker",
            Role::CodeAssistant => "code-assistant",
            Role::RlmSandbox => "rlm-sandbox",
        }
    }

    /// Roles whose outputs are stored vectors: a cloud route needs an upstream pin and dims.
    pub fn is_embedding(self) -> bool {
        matches!(self, Role::Embedding | Role::CodeEmbedding)
    }

    /// What a role's work is.
    pub fn op(self) -> Op {
        match self {
            Role::Embedding | Role::CodeEmbedding => Op::Embed,
            Role::Reranker => Op::Rerank,
            Role::CodeAssistant | Role::RlmSandbox => Op::Chat,
        }
    }

    /// The policy a role has before any push names one (RLM sessions are costly: cloud is
    /// opt-in for them).
    pub fn default_policy(self) -> Policy {
        match self {
            Role::RlmSandbox => Policy::Local,
            Role::Reranker | Role::CodeAssistant => Policy::Backup,
            Role::Embedding | Role::CodeEmbedding => Policy::Aggregate,
        }
    }

    pub fn names() -> String {
        Role::ALL.map(Role::as_str).join(", ")
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is not one of the five.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("unknown role '{0}'; the roles are: {roles}", roles = Role::names())]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownRole(s.to_string()))
    }
}

/// The kind of work a role does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Embed,
    Rerank,
    Chat,
}

/// Who may serve a role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Local GPU providers only; nothing leaves the network.
    Local,
    /// Cloud providers only.
    Cloud,
    /// Local and cloud providers pull from the same queue.
    Aggregate,
    /// Local first; cloud only when no healthy local provider exists, or the item already
    /// failed on a local one.
    Backup,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Local => "local",
            Policy::Cloud => "cloud",
            Policy::Aggregate => "aggregate",
            Policy::Backup => "backup",
        }
    }

    /// Reads a policy name, or one of Fantom's wire modes (`local-only` → local, `cloud-only`
    /// → backup, the conservative reading; `local-first` has no mapping: `None`, the role's
    /// default applies).
    pub fn parse_mode(s: &str) -> Result<Option<Policy>, String> {
        Ok(Some(match s {
            "local" | "local-only" => Policy::Local,
            "cloud" => Policy::Cloud,
            "aggregate" => Policy::Aggregate,
            "backup" | "cloud-only" => Policy::Backup,
            "local-first" => return Ok(None),
            // The value is not repeated: it may be something typed into the wrong field.
            _ => {
                return Err(
                    "not a mode this agent knows; the policies are: local, cloud, aggregate, backup (and Fantom's local-only, cloud-only, local-first)"
                        .to_string(),
                );
            }
        }))
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_round_trip_and_unknown_names_list_the_roles() {
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>(), Ok(role));
            let json = serde_json::to_string(&role).unwrap();
            assert_eq!(json, format!("\"{role}\""));
        }
        let err = "embeddings".parse::<Role>().unwrap_err().to_string();
        assert!(
            err.contains("'embeddings'") && err.contains("code-embedding"),
            "{err}"
        );
    }

    #[test]
    fn wire_modes_map_to_policies() {
        assert_eq!(Policy::parse_mode("local-only"), Ok(Some(Policy::Local)));
        assert_eq!(Policy::parse_mode("cloud-only"), Ok(Some(Policy::Backup)));
        assert_eq!(Policy::parse_mode("local-first"), Ok(None));
        assert_eq!(Policy::parse_mode("aggregate"), Ok(Some(Policy::Aggregate)));
        assert!(Policy::parse_mode("everywhere").is_err());
    }
}
