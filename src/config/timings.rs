//! How long work of each role may take: the lease (renewed by heartbeats while the work runs),
//! the client request's timeout and one provider call's timeout, per role, with defaults that
//! fit the role's work (a chat needs minutes, an embedding batch seconds) and clamps that keep
//! them coherent (a lease outlives two heartbeats; a call fits in its request).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::roles::{Op, Role};

/// One role's keys in the hub file (`[roles.code-assistant]`), each optional.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RoleTimingsLayer {
    pub lease_s: Option<u64>,
    pub request_timeout_s: Option<u64>,
    pub call_timeout_s: Option<u64>,
}

/// One role's timings, resolved and clamped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoleTimings {
    /// A lease no heartbeat renews for this long goes back to the front of its queue.
    pub lease: Duration,
    /// How long a client request may wait for all its items (then 504).
    pub request_timeout: Duration,
    /// The longest one provider call (a model batch, an upstream call) may take.
    pub call_timeout: Duration,
}

/// The longest lease, request and call: an hour, a day, an hour.
pub const MAX_LEASE: Duration = Duration::from_secs(3600);
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(86_400);
/// The heartbeat's bounds (milliseconds).
pub const HEARTBEAT_MS_RANGE: (u64, u64) = (100, 60_000);
pub const DEFAULT_HEARTBEAT_MS: u64 = 5_000;

impl RoleTimings {
    /// The defaults of a role: embeddings and reranks in seconds, chats in minutes.
    pub fn default_for(role: Role) -> RoleTimings {
        let s = Duration::from_secs;
        match role.op() {
            Op::Embed | Op::Rerank => RoleTimings {
                lease: s(60),
                request_timeout: s(600),
                call_timeout: s(120),
            },
            Op::Chat => RoleTimings {
                lease: s(120),
                request_timeout: s(900),
                call_timeout: s(600),
            },
        }
    }

    /// Clamped: the lease to [2 heartbeats (at least 1 s), 1 h], the request to [1 s, 1 day],
    /// the call to [1 s, the request]. Each clamp applied is named in `notes`.
    fn clamped(mut self, heartbeat: Duration, role: Role, notes: &mut Vec<String>) -> Self {
        let min_lease = (heartbeat * 2).max(Duration::from_secs(1));
        let mut clamp = |name: &str, value: &mut Duration, lo: Duration, hi: Duration| {
            let wanted = *value;
            *value = wanted.clamp(lo, hi.max(lo));
            if *value != wanted {
                notes.push(format!(
                    "roles.{role}.{name} {} s is outside [{}, {}] s; using {} s",
                    wanted.as_secs_f64(),
                    lo.as_secs_f64(),
                    hi.max(lo).as_secs_f64(),
                    value.as_secs_f64()
                ));
            }
        };
        clamp("lease_s", &mut self.lease, min_lease, MAX_LEASE);
        clamp(
            "request_timeout_s",
            &mut self.request_timeout,
            Duration::from_secs(1),
            MAX_REQUEST_TIMEOUT,
        );
        let request = self.request_timeout;
        clamp(
            "call_timeout_s",
            &mut self.call_timeout,
            Duration::from_secs(1),
            request,
        );
        self
    }
}

/// Every role's timings: a role's own key, else the file's or flag's global key, else the
/// role's default; then clamped. Returns the table and the clamps applied.
pub fn resolve(
    global: &RoleTimingsLayer,
    roles: &BTreeMap<Role, RoleTimingsLayer>,
    heartbeat: Duration,
) -> (BTreeMap<Role, RoleTimings>, Vec<String>) {
    let mut notes = Vec::new();
    let table = Role::ALL
        .into_iter()
        .map(|role| {
            let own = roles.get(&role).cloned().unwrap_or_default();
            let default = RoleTimings::default_for(role);
            let pick = |own: Option<u64>, global: Option<u64>, default: Duration| {
                own.or(global).map_or(default, Duration::from_secs)
            };
            let timings = RoleTimings {
                lease: pick(own.lease_s, global.lease_s, default.lease),
                request_timeout: pick(
                    own.request_timeout_s,
                    global.request_timeout_s,
                    default.request_timeout,
                ),
                call_timeout: pick(
                    own.call_timeout_s,
                    global.call_timeout_s,
                    default.call_timeout,
                ),
            };
            (role, timings.clamped(heartbeat, role, &mut notes))
        })
        .collect();
    (table, notes)
}

/// The heartbeat interval, clamped to its bounds.
pub fn heartbeat(ms: Option<u64>) -> Duration {
    let (lo, hi) = HEARTBEAT_MS_RANGE;
    Duration::from_millis(ms.unwrap_or(DEFAULT_HEARTBEAT_MS).clamp(lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roles_key_wins_over_the_global_one_over_the_roles_default_and_all_are_clamped() {
        let global = RoleTimingsLayer {
            lease_s: Some(30),
            ..Default::default()
        };
        let roles = BTreeMap::from([
            (
                Role::CodeAssistant,
                RoleTimingsLayer {
                    lease_s: Some(300),
                    call_timeout_s: Some(5_000),
                    request_timeout_s: Some(1_200),
                },
            ),
            (
                Role::Reranker,
                RoleTimingsLayer {
                    lease_s: Some(0),
                    ..Default::default()
                },
            ),
        ]);
        let (table, notes) = resolve(&global, &roles, Duration::from_secs(5));
        let chat = table[&Role::CodeAssistant];
        assert_eq!(chat.lease, Duration::from_secs(300));
        assert_eq!(chat.request_timeout, Duration::from_secs(1_200));
        assert_eq!(
            chat.call_timeout, chat.request_timeout,
            "a call fits its request"
        );
        assert_eq!(table[&Role::Embedding].lease, Duration::from_secs(30));
        assert_eq!(
            table[&Role::Embedding].call_timeout,
            RoleTimings::default_for(Role::Embedding).call_timeout
        );
        assert_eq!(
            table[&Role::Reranker].lease,
            Duration::from_secs(10),
            "a lease outlives two heartbeats"
        );
        assert_eq!(table[&Role::RlmSandbox].request_timeout.as_secs(), 900);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes.iter().any(|n| n.contains("roles.reranker.lease_s")));
        assert_eq!(heartbeat(Some(1)), Duration::from_millis(100));
        assert_eq!(heartbeat(None), Duration::from_secs(5));
    }
}
