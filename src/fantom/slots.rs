//! The relay's slots: one per Fantom master, keyed by its `serverUrl` byte for byte (§1.2).
//!
//! A slot holds where the master's relay is (`ws_port`, which `master-identity` may fix), what
//! its config pushes left (the safe [`CloudSettings`], the literal wire modes, and the
//! OpenRouter key, in memory only: §2.1.10, §4.11) and the state of its one socket. The key
//! never leaves this module except to the code that calls OpenRouter with it: the
//! [`SlotView`] snapshot says only whether one is held.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::http::Uri;

use super::frames::{DEFAULT_WS_PORT, RELAY_PATH};
use super::status::{
    KeyState, MasterEntry, VirtualContainer, VirtualInference, VirtualState, WireMode,
};
use crate::agent::CloudOptions;
use crate::cloud::openrouter::OpenRouterClient;
use crate::config::agent::FantomMaster;
use crate::config::push::{
    self, AllowedModel, CloudSettings, MergeReport, OpenRouterPush, PushRefused,
};
use crate::hub::now_ms;
use crate::roles::Role;
use crate::secret::Secret;

/// The relay URL of a master: `ws://<host of server_url>:<ws_port or 3002>/sidecar` (`wss://`
/// for an `https://` server). The server URL's own port is its HTTP port, not the relay's.
/// `None` when `server_url` is not an http(s) URL with a host.
pub fn relay_url(server_url: &str, ws_port: Option<u16>) -> Option<String> {
    let uri: Uri = server_url.parse().ok()?;
    let scheme = match uri.scheme_str()? {
        "http" => "ws",
        "https" => "wss",
        _ => return None,
    };
    // IPv6 hosts keep their brackets here.
    let host = uri.host().filter(|h| !h.is_empty())?;
    let port = ws_port.unwrap_or(DEFAULT_WS_PORT);
    Some(format!("{scheme}://{host}:{port}{RELAY_PATH}"))
}

/// Whether two server URLs name one master: the same host (case-insensitive), port (the
/// scheme's default when none is written) and path (a trailing `/` aside). Spellings of one
/// URL are one master; another host, port or path (two masters behind one proxy) is another.
pub fn same_origin(a: &str, b: &str) -> bool {
    let origin = |url: &str| -> Option<(String, u16, String)> {
        let uri: Uri = url.parse().ok()?;
        let port = uri.port_u16().or(match uri.scheme_str()? {
            "http" => Some(80),
            "https" => Some(443),
            _ => None,
        })?;
        let path = uri.path().trim_end_matches('/').to_string();
        Some((uri.host()?.to_ascii_lowercase(), port, path))
    };
    match (origin(a), origin(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// How a slot reaches its master now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Connection {
    #[default]
    None,
    /// A relay socket is open.
    WebSocket,
    /// The relay cannot be dialled: heartbeats go over HTTP (§3.4).
    Http,
}

impl Connection {
    fn wire(self) -> Option<String> {
        match self {
            Connection::None => None,
            Connection::WebSocket => Some("websocket".into()),
            Connection::Http => Some("http".into()),
        }
    }
}

/// What one slot's cloud route of one role has done (a `virtualContainers[]` row's counters).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VirtualUsage {
    pub served: u64,
    pub failures: u64,
    pub in_flight: u64,
    pub last_served_at_ms: Option<u64>,
    pub last_duration_ms: Option<u64>,
    /// Why the last call failed; `None` once one succeeds.
    pub last_error: Option<String>,
}

/// One master's slot.
#[derive(Clone, Debug)]
pub struct Slot {
    /// The key of the slot, exactly as configured.
    pub server_url: String,
    /// The relay port; `None` dials [`DEFAULT_WS_PORT`].
    pub ws_port: Option<u16>,
    /// Which relay loop owns this slot (a slot removed and added again gets a new one).
    pub generation: u64,
    /// The token this master presents on the agent's HTTP port.
    pub auth_token: Option<Secret>,
    /// What the pushes left, merged by [`push::merge`] (`policies` is not used on the relay).
    pub held: CloudSettings,
    /// `modeByRole` as pushed (`local-only`, `local-first`, `cloud-only`; `rlm` kept for
    /// status); a missing role means `local-only`.
    pub modes: BTreeMap<String, String>,
    /// The pushed OpenRouter key (memory only).
    pub key: Option<Secret>,
    /// The client calling OpenRouter with that key.
    pub client: Option<Arc<OpenRouterClient>>,
    /// Per role key (`embedding`, …, `rlm-sandbox`): what its cloud route did.
    pub usage: BTreeMap<String, VirtualUsage>,
    /// `registered` came on the current socket.
    pub registered: bool,
    pub connection: Connection,
    /// Sockets that reached `registered` since start.
    pub sessions: u64,
    pub last_error: Option<String>,
}

impl Slot {
    pub fn new(server_url: impl Into<String>, ws_port: Option<u16>) -> Self {
        Slot {
            server_url: server_url.into(),
            ws_port,
            generation: 0,
            auth_token: None,
            held: CloudSettings::default(),
            modes: BTreeMap::new(),
            key: None,
            client: None,
            usage: BTreeMap::new(),
            registered: false,
            connection: Connection::None,
            sessions: 0,
            last_error: None,
        }
    }

    /// The port this slot dials.
    pub fn effective_ws_port(&self) -> u16 {
        self.ws_port.unwrap_or(DEFAULT_WS_PORT)
    }

    /// The pushed mode of a role key (`local-only` when none was pushed).
    pub fn mode(&self, role: &str) -> WireMode {
        WireMode::from_wire(self.modes.get(role).map(String::as_str))
    }

    /// The pushed cloud model of a role.
    pub fn allowed(&self, role: Role) -> Option<&AllowedModel> {
        self.held.allowed_models.get(&role)
    }

    /// The `masters[]` row; with `detailed`, the virtual inference and containers too.
    fn entry(&self, detailed: bool) -> MasterEntry {
        let (virtual_inference, virtual_containers) = if detailed {
            let mode_by_role = self
                .modes
                .keys()
                .map(|role| (role.clone(), self.mode(role)))
                .collect();
            let inference = VirtualInference {
                openrouter: if self.key.is_some() {
                    KeyState::Configured
                } else {
                    KeyState::Unset
                },
                mode_by_role,
            };
            (Some(inference), Some(self.virtual_containers()))
        } else {
            (None, None)
        };
        MasterEntry {
            server_url: self.server_url.clone(),
            ws_port: Some(self.effective_ws_port()),
            connection_mode: self.connection.wire(),
            virtual_inference,
            virtual_containers,
        }
    }

    /// One row per pushed cloud model; the sandbox model is the master's role `rlm`.
    fn virtual_containers(&self) -> Vec<VirtualContainer> {
        self.held
            .allowed_models
            .iter()
            .map(|(role, m)| {
                let key = role.as_str();
                let shown = if *role == Role::RlmSandbox {
                    "rlm"
                } else {
                    key
                };
                let mode = match self.modes.get(key) {
                    Some(mode) => WireMode::from_wire(Some(mode)),
                    None => self.mode(shown),
                };
                let usage = self.usage.get(key).cloned().unwrap_or_default();
                let state = if usage.in_flight > 0 {
                    VirtualState::Serving
                } else if usage.last_error.is_some() {
                    VirtualState::Failed
                } else {
                    VirtualState::Idle
                };
                VirtualContainer {
                    role: shown.to_string(),
                    model: m.model.clone(),
                    provider: m.provider.clone(),
                    dims: m.dims,
                    mode,
                    served: Some(usage.served),
                    last_served_at: usage.last_served_at_ms,
                    failures: Some(usage.failures),
                    last_error: usage.last_error,
                    last_duration_ms: usage.last_duration_ms,
                    state,
                }
            })
            .collect()
    }
}

/// What became of a config push to one slot.
#[derive(Debug)]
pub enum ConfigOutcome {
    /// Merged (per-role refusals are in the report).
    Applied(MergeReport),
    /// Nothing of it applied (e.g. a keyless first push).
    Refused(PushRefused),
    /// No slot has that server URL (removed meanwhile).
    NoSlot,
}

/// One slot as `GET /api/masters` shows it: never the key nor the token.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotView {
    pub server_url: String,
    /// The effective relay port.
    pub ws_port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connection_mode: Option<String>,
    pub connected: bool,
    pub registered: bool,
    pub sessions: u64,
    pub key_held: bool,
    pub auth_token_set: bool,
    /// Role → its cloud model.
    pub models: BTreeMap<String, SlotModel>,
    pub modes: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SlotModel {
    pub model: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dims: Option<usize>,
}

/// Every slot of this agent.
#[derive(Debug)]
pub struct Slots {
    inner: Mutex<BTreeMap<String, Slot>>,
    cloud: CloudOptions,
    /// Bumped on every change a relay loop must look at (a slot removed, its port fixed).
    changes: watch::Sender<u64>,
    /// Relay dials attempted (connected or not), across slots.
    dials: watch::Sender<u64>,
    next_generation: std::sync::atomic::AtomicU64,
}

impl Slots {
    /// One slot per configured master (a repeated server URL keeps the first); OpenRouter is
    /// called as `cloud` says.
    pub fn new(masters: &[FantomMaster], cloud: CloudOptions) -> Self {
        let slots = Slots {
            inner: Mutex::new(BTreeMap::new()),
            cloud,
            changes: watch::channel(0).0,
            dials: watch::channel(0).0,
            next_generation: std::sync::atomic::AtomicU64::new(1),
        };
        for m in masters {
            slots.add(&m.server_url, m.ws_port, None);
        }
        slots
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Slot>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// One more relay dial was attempted.
    pub fn note_dial(&self) {
        self.dials.send_modify(|n| *n += 1);
    }

    /// Waits (at most `timeout`) until at least one dial per slot was attempted.
    pub async fn first_dials(&self, timeout: std::time::Duration) {
        let wanted = self.lock().len() as u64;
        let mut dials = self.dials.subscribe();
        let _ = tokio::time::timeout(timeout, dials.wait_for(|n| *n >= wanted)).await;
    }

    /// `(registered, all)` slots.
    pub fn registered_count(&self) -> (usize, usize) {
        let all = self.lock();
        (all.values().filter(|s| s.registered).count(), all.len())
    }

    /// Wakes when a slot is removed or its relay port changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    pub fn server_urls(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Adds a slot, or updates the port (and token, when given) of an existing one. Returns
    /// whether it was created and its generation (the relay loop that must run it).
    pub fn add(
        &self,
        server_url: &str,
        ws_port: Option<u16>,
        auth_token: Option<Secret>,
    ) -> (bool, u64) {
        let mut all = self.lock();
        if let Some(slot) = all.get_mut(server_url) {
            let moved = ws_port.is_some() && slot.ws_port != ws_port;
            if ws_port.is_some() {
                slot.ws_port = ws_port;
            }
            if auth_token.is_some() {
                slot.auth_token = auth_token;
            }
            let generation = slot.generation;
            drop(all);
            if moved {
                self.changed();
            }
            return (false, generation);
        }
        let generation = self
            .next_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut slot = Slot::new(server_url, ws_port);
        slot.generation = generation;
        slot.auth_token = auth_token;
        all.insert(server_url.to_string(), slot);
        (true, generation)
    }

    /// Removes a slot (its key and settings go with it); its relay loop closes its socket.
    pub fn remove(&self, server_url: &str) -> bool {
        let removed = self.lock().remove(server_url).is_some();
        if removed {
            self.changed();
        }
        removed
    }

    /// The generation of a slot now (`None`: no such slot).
    pub fn generation(&self, server_url: &str) -> Option<u64> {
        self.lock().get(server_url).map(|s| s.generation)
    }

    /// The relay URL the slot dials now; `None` when there is no such slot.
    pub fn ws_url(&self, server_url: &str) -> Option<String> {
        let all = self.lock();
        let slot = all.get(server_url)?;
        relay_url(&slot.server_url, slot.ws_port)
    }

    /// Reads one slot (the command handlers: its key, settings and modes).
    pub fn with_slot<T>(&self, server_url: &str, f: impl FnOnce(&Slot) -> T) -> Option<T> {
        self.lock().get(server_url).map(f)
    }

    fn update(&self, server_url: &str, f: impl FnOnce(&mut Slot)) {
        if let Some(slot) = self.lock().get_mut(server_url) {
            f(slot);
        }
    }

    /// The slots whose auth token `presented` is (every slot's token is compared, each in
    /// constant time).
    pub fn owners_of(&self, presented: &str) -> Vec<String> {
        let all = self.lock();
        let mut owners = Vec::new();
        for slot in all.values() {
            let matches = slot
                .auth_token
                .as_ref()
                .is_some_and(|t| t.matches(presented));
            if matches {
                owners.push(slot.server_url.clone());
            }
        }
        owners
    }

    /// The slots of the same master as `server_url` (itself, and aliases of its origin).
    pub fn origin_mates(&self, server_url: &str) -> Vec<String> {
        self.lock()
            .keys()
            .filter(|url| same_origin(url, server_url))
            .cloned()
            .collect()
    }

    /// The server URLs of the slots holding a pushed key.
    pub fn keyed(&self) -> Vec<String> {
        self.lock()
            .values()
            .filter(|s| s.key.is_some())
            .map(|s| s.server_url.clone())
            .collect()
    }

    /// Whether any slot has an auth token.
    pub fn any_token(&self) -> bool {
        self.lock().values().any(|s| s.auth_token.is_some())
    }

    /// Merges a `config`/`config-push` onto the slot. On success the pushed key (if any)
    /// replaces the held one (with a new client) and each pushed mode replaces its role's; on
    /// refusal nothing changes, modes included.
    pub fn apply_config(&self, server_url: &str, mut push: OpenRouterPush) -> ConfigOutcome {
        let mut all = self.lock();
        let Some(slot) = all.get_mut(server_url) else {
            return ConfigOutcome::NoSlot;
        };
        let held_key = slot.key.clone();
        match push::merge_holding(&mut slot.held, held_key.is_some(), held_key.as_ref(), &push) {
            Ok(report) => {
                if let Some(key) = push.api_key.take() {
                    slot.client = match OpenRouterClient::new(
                        &self.cloud.openrouter_url,
                        key.clone(),
                        self.cloud.request_timeout,
                    ) {
                        Ok(client) => Some(Arc::new(client)),
                        Err(e) => {
                            tracing::error!(master = %server_url, error = %e, "no OpenRouter client for this master");
                            None
                        }
                    };
                    slot.key = Some(key);
                }
                // Fantom's wire modes are kept as typed, but only those that are modes: a
                // value typed into the wrong field is never kept or shown.
                let key = slot.key.clone();
                if let Some(modes) = push.mode_by_role.take() {
                    slot.modes.extend(
                        modes
                            .into_iter()
                            .filter(|(role, mode)| push::keepable_mode(role, mode, key.as_ref())),
                    );
                }
                ConfigOutcome::Applied(report)
            }
            Err(refused) => ConfigOutcome::Refused(refused),
        }
    }

    /// `revokeServerUrl`: drops that slot's key, settings and modes (the slot stays). Whether
    /// such a slot exists.
    pub fn revoke(&self, server_url: &str) -> bool {
        let mut all = self.lock();
        let Some(slot) = all.get_mut(server_url) else {
            return false;
        };
        slot.key = None;
        slot.client = None;
        slot.held = CloudSettings::default();
        slot.modes.clear();
        true
    }

    /// `master-identity`: sets the relay port of the slot whose server URL is exactly
    /// `canonical_url` (never creates one). `None`: no such slot; `Some(changed)`: whether the
    /// port it dials changed. Port 0 is ignored.
    pub fn fix_ws_port(&self, canonical_url: &str, ws_port: u16) -> Option<bool> {
        let mut all = self.lock();
        let slot = all.get_mut(canonical_url)?;
        if ws_port == 0 {
            return Some(false);
        }
        let changed = slot.effective_ws_port() != ws_port;
        slot.ws_port = Some(ws_port);
        drop(all);
        if changed {
            self.changed();
        }
        Some(changed)
    }

    /// How the slot reaches its master now (closing a socket also ends its registration).
    pub fn set_connection(&self, server_url: &str, connection: Connection) {
        self.update(server_url, |slot| {
            slot.connection = connection;
            if connection != Connection::WebSocket {
                slot.registered = false;
            }
        });
    }

    /// `registered` came: one more session, no error.
    pub fn set_registered(&self, server_url: &str) {
        self.update(server_url, |slot| {
            slot.registered = true;
            slot.sessions += 1;
            slot.last_error = None;
        });
    }

    pub fn set_error(&self, server_url: &str, error: String) {
        self.update(server_url, |slot| slot.last_error = Some(error));
    }

    /// A cloud call of this slot's `role` starts.
    pub fn begin_call(&self, server_url: &str, role: &str) {
        self.update(server_url, |slot| {
            slot.usage.entry(role.to_string()).or_default().in_flight += 1;
        });
    }

    /// A cloud call of this slot's `role` ended after `duration_ms`.
    pub fn end_call(&self, server_url: &str, role: &str, duration_ms: u64, error: Option<String>) {
        self.update(server_url, |slot| {
            let usage = slot.usage.entry(role.to_string()).or_default();
            usage.in_flight = usage.in_flight.saturating_sub(1);
            usage.last_duration_ms = Some(duration_ms);
            match error {
                Some(e) => {
                    usage.failures += 1;
                    usage.last_error = Some(e);
                }
                None => {
                    usage.served += 1;
                    usage.last_served_at_ms = Some(now_ms());
                    usage.last_error = None;
                }
            }
        });
    }

    /// The `masters[]` rows of the slots `shown` (all when `None`): small for heartbeats,
    /// with the virtual containers for `GET /api/status` (`detailed`).
    pub fn master_entries(&self, detailed: bool, shown: Option<&[String]>) -> Vec<MasterEntry> {
        self.lock()
            .values()
            .filter(|s| shown.is_none_or(|urls| urls.contains(&s.server_url)))
            .map(|s| s.entry(detailed))
            .collect()
    }

    /// The slots `shown` (every slot when `None`), without their keys or tokens.
    pub fn snapshot(&self, shown: Option<&[String]>) -> Vec<SlotView> {
        self.lock()
            .values()
            .filter(|s| shown.is_none_or(|urls| urls.contains(&s.server_url)))
            .map(|slot| SlotView {
                server_url: slot.server_url.clone(),
                ws_port: slot.effective_ws_port(),
                connection_mode: slot.connection.wire(),
                connected: slot.connection == Connection::WebSocket,
                registered: slot.registered,
                sessions: slot.sessions,
                key_held: slot.key.is_some(),
                auth_token_set: slot.auth_token.is_some(),
                models: slot
                    .held
                    .allowed_models
                    .iter()
                    .map(|(role, m)| {
                        let model = SlotModel {
                            model: m.model.clone(),
                            provider: m.provider.clone(),
                            dims: m.dims,
                        };
                        (role.as_str().to_string(), model)
                    })
                    .collect(),
                modes: slot.modes.clone(),
                domain: slot.held.domain.clone(),
                last_error: slot.last_error.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn master(url: &str, ws_port: Option<u16>) -> FantomMaster {
        FantomMaster {
            server_url: url.into(),
            ws_port,
            auth_token_file: None,
        }
    }

    fn push(json: &str) -> OpenRouterPush {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn relay_urls_take_the_host_and_the_relay_port_not_the_http_port() {
        let url = relay_url;
        let expect = "ws://10.0.0.2:3002/sidecar";
        assert_eq!(url("http://10.0.0.2:3848", None).as_deref(), Some(expect));
        let tls = url("https://fantom.example/base", Some(3003));
        assert_eq!(tls.as_deref(), Some("wss://fantom.example:3003/sidecar"));
        let v6 = url("http://[::1]:3848", Some(3003));
        assert_eq!(v6.as_deref(), Some("ws://[::1]:3003/sidecar"));
        assert_eq!(url("ws://10.0.0.2:3848", None), None);
        assert_eq!(url("not a url", None), None);
    }

    #[test]
    fn pushes_merge_per_slot_and_a_keyless_first_push_changes_nothing() {
        let slots = Slots::new(
            &[
                master("http://a:3848", Some(3003)),
                master("http://b", None),
            ],
            CloudOptions::default(),
        );
        let keyless = push(r#"{"modeByRole":{"embedding":"cloud-only"}}"#);
        let outcome = slots.apply_config("http://a:3848", keyless);
        assert!(matches!(
            outcome,
            ConfigOutcome::Refused(PushRefused::FirstPushWithoutKey)
        ));
        assert!(
            slots.snapshot(None)[0].modes.is_empty(),
            "modes dropped too"
        );

        let first = push(
            r#"{"apiKey":"sk-or-v1-slot-secret","allowedModels":{
                "embedding":{"model":"qwen/qwen3-embedding-8b","provider":"Nebius","dims":4096}},
              "modeByRole":{"embedding":"cloud-only","rlm":"local-only"},"domain":"code"}"#,
        );
        let outcome = slots.apply_config("http://a:3848", first);
        assert!(matches!(outcome, ConfigOutcome::Applied(ref r) if r.key_included));
        let partial = push(r#"{"modeByRole":{"embedding":"local-first"}}"#);
        let outcome = slots.apply_config("http://a:3848", partial);
        assert!(matches!(outcome, ConfigOutcome::Applied(ref r) if !r.key_included));

        let views = slots.snapshot(None);
        let a = &views[0];
        assert!(a.key_held, "the partial push kept the key");
        assert_eq!(a.modes["embedding"], "local-first");
        assert_eq!(a.modes["rlm"], "local-only");
        assert_eq!(a.models["embedding"].dims, Some(4096));
        assert!(!views[1].key_held, "slots are independent");
        let text = serde_json::to_string(&views).unwrap();
        assert!(!text.contains("slot-secret"), "{text}");
        assert!(text.contains("\"keyHeld\":true"), "{text}");
        assert!(!format!("{slots:?}").contains("slot-secret"));
        let key = slots
            .with_slot("http://a:3848", |s| s.key.clone())
            .flatten();
        assert_eq!(
            key.map(|k| k.expose().to_string()).as_deref(),
            Some("sk-or-v1-slot-secret")
        );

        assert!(slots.revoke("http://a:3848"));
        assert!(!slots.snapshot(None)[0].key_held);
        assert!(matches!(
            slots.apply_config("http://c", push(r#"{"apiKey":"k"}"#)),
            ConfigOutcome::NoSlot
        ));
    }

    #[test]
    fn master_identity_fixes_a_slot_in_place() {
        let slots = Slots::new(
            &[master("http://10.0.0.2:3848", None)],
            CloudOptions::default(),
        );
        assert_eq!(
            slots.fix_ws_port("http://10.0.0.2:3848/", 3003),
            None,
            "byte-exact"
        );
        assert_eq!(slots.fix_ws_port("http://10.0.0.2:3848", 3002), Some(false));
        assert_eq!(slots.fix_ws_port("http://10.0.0.2:3848", 3003), Some(true));
        assert_eq!(slots.fix_ws_port("http://10.0.0.2:3848", 3003), Some(false));
        assert_eq!(
            slots.server_urls(),
            vec!["http://10.0.0.2:3848".to_string()]
        );
        let url = slots.ws_url("http://10.0.0.2:3848");
        assert_eq!(url.as_deref(), Some("ws://10.0.0.2:3003/sidecar"));
    }
}
