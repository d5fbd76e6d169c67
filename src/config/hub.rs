//! The hub's settings: the `hub` flags, and the same keys in a TOML file (`--config`,
//! `systemd/hub.example.toml`). A flag given on the command line wins over its key; a key
//! absent from both takes its default. SIGHUP reads the file again: the roles' timings, the
//! request limits and the gate's keys apply at once; the rest needs a restart and is named.
//!
//! Timings are per role (`[roles.code-assistant] lease_s = 300`, [`super::timings`]); the
//! top-level `lease_s`, `request_timeout_s` and `call_timeout_s` apply to every role that does
//! not set its own.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::timings::{self, RoleTimings, RoleTimingsLayer};
use crate::roles::Role;

/// Every hub setting, each optional: one layer (the flags, or the file).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HubLayer {
    pub listen: Option<SocketAddr>,
    pub state_dir: Option<PathBuf>,
    pub admin_token_file: Option<PathBuf>,
    pub fleet_token_file: Option<PathBuf>,
    pub client_token_file: Option<PathBuf>,
    /// Every client request must present a project key (no key: 401, never `default`).
    pub require_project_key: Option<bool>,
    pub lease_s: Option<u64>,
    pub queue_capacity: Option<usize>,
    pub request_timeout_s: Option<u64>,
    pub call_timeout_s: Option<u64>,
    pub heartbeat_ms: Option<u64>,
    pub max_held_mb: Option<u64>,
    pub max_inputs: Option<usize>,
    pub max_input_chars: Option<usize>,
    /// `Idempotency-Key`s each project's table holds (`hub::replies`).
    pub idempotency_keys_per_project: Option<usize>,
    /// MiB of answers (their memory) each project's `Idempotency-Key` table holds.
    pub idempotency_answers_mib_per_project: Option<u64>,
    pub gate_min_cosine: Option<f64>,
    pub gate_sentinel_s: Option<u64>,
    pub gate_reference: Option<String>,
    /// Local providers (`agent/provider`) whose embedding work carries no canary.
    pub gate_no_canary: Option<Vec<String>>,
    /// Seconds after its agent left that a provider's passing or probe-failed verdict, its
    /// counters and its series are forgotten (suspended and refused verdicts stay).
    pub forget_departed_s: Option<u64>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Roles `/ready` waits for (besides every role a provider or a cloud route has served).
    pub ready_roles: Option<Vec<Role>>,
    /// Per-role timings (`[roles.<role>]`); file only.
    #[serde(default)]
    pub roles: BTreeMap<Role, RoleTimingsLayer>,
}

/// What one client request may hold, and what every request together may.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Bytes of input held by accepted requests (queued, leased or partly served) before new
    /// ones get 429.
    pub max_held_bytes: usize,
    /// Inputs (texts, documents) in one request (more: 413).
    pub max_inputs: usize,
    /// Characters in one input (more: 413).
    pub max_input_chars: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_held_bytes: 1024 << 20,
            max_inputs: 4096,
            max_input_chars: 1_000_000,
        }
    }
}

/// What the hub keeps of each project's `Idempotency-Key`s (`hub::replies`): every project
/// has a table of its own within these bounds, so one project's keys never push out
/// another's; the whole is at most the projects times one table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyLimits {
    /// Keys one project's table holds: a new key forgets the project's oldest answered one
    /// (when all are still under way, the new key is refused with a retry hint).
    pub keys_per_project: usize,
    /// Bytes of answers one project's table holds, counted by their memory: the project's
    /// oldest answers go first (their keys stay, and a retry is told the answer is gone).
    pub answer_bytes_per_project: usize,
}

impl Default for ReplyLimits {
    fn default() -> Self {
        Self {
            keys_per_project: 16_384,
            answer_bytes_per_project: 16 << 20,
        }
    }
}

/// The hub's settings, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct HubConfig {
    pub listen: SocketAddr,
    pub state_dir: Option<PathBuf>,
    pub admin_token_file: Option<PathBuf>,
    pub fleet_token_file: Option<PathBuf>,
    pub client_token_file: Option<PathBuf>,
    pub require_project_key: bool,
    /// The global timing keys (a role's own key wins over them).
    pub timings: RoleTimingsLayer,
    pub roles: BTreeMap<Role, RoleTimingsLayer>,
    pub heartbeat_ms: Option<u64>,
    pub queue_capacity: usize,
    pub limits: RequestLimits,
    pub replies: ReplyLimits,
    pub gate_min_cosine: f64,
    pub gate_sentinel_s: u64,
    pub gate_reference: Option<String>,
    pub gate_no_canary: Vec<String>,
    pub forget_departed_s: u64,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub ready_roles: Vec<Role>,
}

impl HubLayer {
    /// Reads a hub TOML file.
    pub fn load(path: &Path) -> Result<HubLayer, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// `self` over `under`, then the defaults.
    pub fn over(&self, under: &HubLayer) -> Result<HubConfig, String> {
        let tls_cert = self.tls_cert.clone().or_else(|| under.tls_cert.clone());
        let tls_key = self.tls_key.clone().or_else(|| under.tls_key.clone());
        if tls_cert.is_some() != tls_key.is_some() {
            return Err("tls_cert and tls_key go together".into());
        }
        Ok(HubConfig {
            listen: self
                .listen
                .or(under.listen)
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8090))),
            state_dir: self.state_dir.clone().or_else(|| under.state_dir.clone()),
            admin_token_file: pick(&self.admin_token_file, &under.admin_token_file),
            fleet_token_file: pick(&self.fleet_token_file, &under.fleet_token_file),
            client_token_file: pick(&self.client_token_file, &under.client_token_file),
            require_project_key: self
                .require_project_key
                .or(under.require_project_key)
                .unwrap_or(false),
            timings: RoleTimingsLayer {
                lease_s: self.lease_s.or(under.lease_s),
                request_timeout_s: self.request_timeout_s.or(under.request_timeout_s),
                call_timeout_s: self.call_timeout_s.or(under.call_timeout_s),
            },
            roles: if self.roles.is_empty() {
                under.roles.clone()
            } else {
                self.roles.clone()
            },
            heartbeat_ms: self.heartbeat_ms.or(under.heartbeat_ms),
            queue_capacity: self
                .queue_capacity
                .or(under.queue_capacity)
                .unwrap_or(100_000),
            limits: {
                let d = RequestLimits::default();
                RequestLimits {
                    max_held_bytes: self.max_held_mb.or(under.max_held_mb).map_or(
                        d.max_held_bytes,
                        |mb| {
                            usize::try_from(mb.max(1))
                                .unwrap_or(usize::MAX)
                                .saturating_mul(1 << 20)
                        },
                    ),
                    max_inputs: self
                        .max_inputs
                        .or(under.max_inputs)
                        .unwrap_or(d.max_inputs)
                        .max(1),
                    max_input_chars: self
                        .max_input_chars
                        .or(under.max_input_chars)
                        .unwrap_or(d.max_input_chars)
                        .max(1),
                }
            },
            replies: {
                let d = ReplyLimits::default();
                ReplyLimits {
                    keys_per_project: self
                        .idempotency_keys_per_project
                        .or(under.idempotency_keys_per_project)
                        .unwrap_or(d.keys_per_project)
                        .max(1),
                    answer_bytes_per_project: self
                        .idempotency_answers_mib_per_project
                        .or(under.idempotency_answers_mib_per_project)
                        .map_or(d.answer_bytes_per_project, |mb| {
                            usize::try_from(mb)
                                .unwrap_or(usize::MAX)
                                .saturating_mul(1 << 20)
                        }),
                }
            },
            gate_min_cosine: self
                .gate_min_cosine
                .or(under.gate_min_cosine)
                .unwrap_or(0.99),
            gate_sentinel_s: self
                .gate_sentinel_s
                .or(under.gate_sentinel_s)
                .unwrap_or(600),
            gate_reference: pick(&self.gate_reference, &under.gate_reference),
            gate_no_canary: pick(&self.gate_no_canary, &under.gate_no_canary).unwrap_or_default(),
            forget_departed_s: self
                .forget_departed_s
                .or(under.forget_departed_s)
                .unwrap_or(86_400),
            tls_cert,
            tls_key,
            ready_roles: pick(&self.ready_roles, &under.ready_roles).unwrap_or_default(),
        })
    }
}

fn pick<T: Clone>(a: &Option<T>, b: &Option<T>) -> Option<T> {
    a.clone().or_else(|| b.clone())
}

impl HubConfig {
    /// The heartbeat interval (clamped to 100 ms..60 s; 5 s by default).
    pub fn heartbeat(&self) -> Duration {
        timings::heartbeat(self.heartbeat_ms)
    }

    /// Every role's timings, and the clamps applied to get them (to log).
    pub fn role_timings(&self) -> (BTreeMap<Role, RoleTimings>, Vec<String>) {
        self.role_timings_beating(self.heartbeat())
    }

    /// As [`HubConfig::role_timings`], clamped against `heartbeat` (the one that runs: a
    /// reload does not change the heartbeat).
    pub fn role_timings_beating(
        &self,
        heartbeat: Duration,
    ) -> (BTreeMap<Role, RoleTimings>, Vec<String>) {
        timings::resolve(&self.timings, &self.roles, heartbeat)
    }

    /// The keys that differ from `other` and cannot change under a running hub.
    pub fn needs_restart(&self, other: &HubConfig) -> Vec<&'static str> {
        let mut names = Vec::new();
        let mut check = |name, differs: bool| {
            if differs {
                names.push(name);
            }
        };
        check("listen", self.listen != other.listen);
        check("state_dir", self.state_dir != other.state_dir);
        check(
            "require_project_key",
            self.require_project_key != other.require_project_key,
        );
        check(
            "token files",
            (
                &self.admin_token_file,
                &self.fleet_token_file,
                &self.client_token_file,
            ) != (
                &other.admin_token_file,
                &other.fleet_token_file,
                &other.client_token_file,
            ),
        );
        check(
            "queue_capacity",
            self.queue_capacity != other.queue_capacity,
        );
        check("heartbeat_ms", self.heartbeat_ms != other.heartbeat_ms);
        check("ready_roles", self.ready_roles != other.ready_roles);
        check(
            "tls",
            (&self.tls_cert, &self.tls_key) != (&other.tls_cert, &other.tls_key),
        );
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_defaults_fill_the_rest() {
        let file: HubLayer =
            toml::from_str("listen = \"0.0.0.0:9000\"\nlease_s = 30\ngate_sentinel_s = 60")
                .unwrap();
        let flags = HubLayer {
            lease_s: Some(45),
            ..Default::default()
        };
        let cfg = flags.over(&file).unwrap();
        assert_eq!(cfg.listen.to_string(), "0.0.0.0:9000");
        assert_eq!(cfg.timings.lease_s, Some(45));
        assert_eq!(cfg.gate_sentinel_s, 60);
        let (table, _) = cfg.role_timings();
        assert_eq!(table[&Role::Embedding].lease, Duration::from_secs(45));
        assert_eq!(
            table[&Role::CodeAssistant].request_timeout,
            Duration::from_secs(900)
        );
        let per_role: HubLayer = toml::from_str(
            "lease_s = 30\n[roles.code-assistant]\nlease_s = 300\ncall_timeout_s = 400",
        )
        .unwrap();
        let (table, _) = HubLayer::default().over(&per_role).unwrap().role_timings();
        assert_eq!(table[&Role::CodeAssistant].lease, Duration::from_secs(300));
        assert_eq!(table[&Role::Reranker].lease, Duration::from_secs(30));
        assert!(toml::from_str::<HubLayer>("[roles.painting]\nlease_s = 3").is_err());
        assert!(
            toml::from_str::<HubLayer>("lease = 3").is_err(),
            "unknown keys are refused"
        );
        assert_eq!(cfg.replies, ReplyLimits::default());
        let bounded: HubLayer = toml::from_str(
            "idempotency_keys_per_project = 100\nidempotency_answers_mib_per_project = 2",
        )
        .unwrap();
        let replies = HubLayer::default().over(&bounded).unwrap().replies;
        assert_eq!(
            (replies.keys_per_project, replies.answer_bytes_per_project),
            (100, 2 << 20)
        );
        let half_tls = HubLayer {
            tls_cert: Some("c.pem".into()),
            ..Default::default()
        };
        assert!(half_tls.over(&HubLayer::default()).is_err());
    }

    #[test]
    fn the_example_file_parses() {
        let example = include_str!("../../systemd/hub.example.toml");
        let layer: HubLayer = toml::from_str(example).unwrap();
        let cfg = HubLayer::default().over(&layer).unwrap();
        assert_eq!(cfg.listen.to_string(), "0.0.0.0:8090");
        let mut moved = cfg.clone();
        moved.listen = "0.0.0.0:8091".parse().unwrap();
        moved.timings.lease_s = Some(10);
        assert_eq!(cfg.needs_restart(&moved), vec!["listen"]);
    }
}
