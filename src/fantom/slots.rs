//! The relay's slots: one per Fantom master, keyed by its `serverUrl` byte for byte (§1.2).
//!
//! A slot holds where the master's relay is (`ws_port`, which `master-identity` may fix), what
//! its config pushes left (the safe [`CloudSettings`], the literal wire modes, and the
//! OpenRouter key, in memory only: §2.1.10, §4.11) and the state of its one socket. The key
//! never leaves this module except to the code that calls OpenRouter with it: the
//! [`SlotView`] snapshot says only whether one is held.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::Serialize;
use tokio_tungstenite::tungstenite::http::Uri;

use super::frames::{DEFAULT_WS_PORT, RELAY_PATH};
use crate::config::agent::FantomMaster;
use crate::config::push::{self, CloudSettings, MergeReport, OpenRouterPush, PushRefused};
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

/// One master's slot.
#[derive(Clone, Debug)]
pub struct Slot {
    /// The key of the slot, exactly as configured.
    pub server_url: String,
    /// The relay port; `None` dials [`DEFAULT_WS_PORT`].
    pub ws_port: Option<u16>,
    /// What the pushes left, merged by [`push::merge`] (`policies` is not used on the relay).
    pub held: CloudSettings,
    /// `modeByRole` as pushed (`local-only`, `local-first`, `cloud-only`; `rlm` kept for
    /// status); a missing role means `local-only`.
    pub modes: BTreeMap<String, String>,
    /// The pushed OpenRouter key (memory only).
    pub key: Option<Secret>,
    /// `registered` came on the current socket.
    pub registered: bool,
    /// A socket is open.
    pub connected: bool,
    /// Sockets that reached `registered` since start.
    pub sessions: u64,
    pub last_error: Option<String>,
}

impl Slot {
    pub fn new(server_url: impl Into<String>, ws_port: Option<u16>) -> Self {
        Slot {
            server_url: server_url.into(),
            ws_port,
            held: CloudSettings::default(),
            modes: BTreeMap::new(),
            key: None,
            registered: false,
            connected: false,
            sessions: 0,
            last_error: None,
        }
    }

    /// The port this slot dials.
    pub fn effective_ws_port(&self) -> u16 {
        self.ws_port.unwrap_or(DEFAULT_WS_PORT)
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

/// One slot as the status routes show it: never the key.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotView {
    pub server_url: String,
    /// The effective relay port.
    pub ws_port: u16,
    pub connected: bool,
    pub registered: bool,
    pub sessions: u64,
    pub key_held: bool,
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
#[derive(Debug, Default)]
pub struct Slots {
    inner: Mutex<BTreeMap<String, Slot>>,
}

impl Slots {
    /// One slot per configured master (a repeated server URL keeps the first).
    pub fn new(masters: &[FantomMaster]) -> Self {
        let mut all = BTreeMap::new();
        for m in masters {
            all.entry(m.server_url.clone())
                .or_insert_with(|| Slot::new(m.server_url.clone(), m.ws_port));
        }
        Slots {
            inner: Mutex::new(all),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Slot>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn server_urls(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
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

    /// Merges a `config`/`config-push` onto the slot. On success the pushed key (if any)
    /// replaces the held one and each pushed mode replaces its role's; on refusal nothing
    /// changes, modes included.
    pub fn apply_config(&self, server_url: &str, mut push: OpenRouterPush) -> ConfigOutcome {
        let mut all = self.lock();
        let Some(slot) = all.get_mut(server_url) else {
            return ConfigOutcome::NoSlot;
        };
        match push::merge(&mut slot.held, slot.key.is_some(), &push) {
            Ok(report) => {
                if let Some(key) = push.api_key.take() {
                    slot.key = Some(key);
                }
                if let Some(modes) = push.mode_by_role.take() {
                    slot.modes.extend(modes);
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
        Some(changed)
    }

    /// A socket opened (`true`) or closed (`false`: not registered either).
    pub fn set_connected(&self, server_url: &str, connected: bool) {
        self.update(server_url, |slot| {
            slot.connected = connected;
            if !connected {
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

    /// Every slot, without its key.
    pub fn snapshot(&self) -> Vec<SlotView> {
        self.lock()
            .values()
            .map(|slot| SlotView {
                server_url: slot.server_url.clone(),
                ws_port: slot.effective_ws_port(),
                connected: slot.connected,
                registered: slot.registered,
                sessions: slot.sessions,
                key_held: slot.key.is_some(),
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
        let slots = Slots::new(&[
            master("http://a:3848", Some(3003)),
            master("http://b", None),
        ]);
        let keyless = push(r#"{"modeByRole":{"embedding":"cloud-only"}}"#);
        let outcome = slots.apply_config("http://a:3848", keyless);
        assert!(matches!(
            outcome,
            ConfigOutcome::Refused(PushRefused::FirstPushWithoutKey)
        ));
        assert!(slots.snapshot()[0].modes.is_empty(), "modes dropped too");

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

        let views = slots.snapshot();
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
        assert!(!slots.snapshot()[0].key_held);
        assert!(matches!(
            slots.apply_config("http://c", push(r#"{"apiKey":"k"}"#)),
            ConfigOutcome::NoSlot
        ));
    }

    #[test]
    fn master_identity_fixes_a_slot_in_place() {
        let slots = Slots::new(&[master("http://10.0.0.2:3848", None)]);
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
