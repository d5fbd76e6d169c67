//! Reading and writing the stored state's parts, for both backends: nothing is stored that
//! cannot be read back, and a part that cannot be read says which part and which field.
//!
//! * **Writing** ([`encode`]): a part is serialized, then read back as its own type before it
//!   is stored. A number JSON cannot carry (an infinity, a NaN: serde writes `null`) or any
//!   other value that would not load again is refused, naming the part and the field, and
//!   nothing is written: the store keeps the last state that loads.
//! * **Reading** ([`decode`], [`decode_state`]): an unreadable part is an error naming the part
//!   and the field's path (`project_usage.alpha.cloudUsd`), never a bare parser message. With
//!   the operator's `--set-aside-unreadable-state`, the part's bytes are first copied to
//!   `<state dir>/unreadable/` and the part starts from its defaults (for the whole state, or
//!   etcd's `config` part, only the top-level field that fails): an error-level log line and
//!   `/admin/status` → `ha.set_aside` say so. Never silently.

use std::path::PathBuf;
use std::sync::Mutex;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::hub::state::{HubState, StateError};

/// How a load treats a part it cannot read.
#[derive(Debug, Default)]
pub struct Recovery {
    /// With `--set-aside-unreadable-state`: where unreadable parts are copied.
    aside_dir: Option<PathBuf>,
    /// What this hub set aside since it started (for status).
    taken: Mutex<Vec<SetAside>>,
}

/// One part (or field of a part) that could not be read and was set aside.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SetAside {
    pub part: String,
    /// The field's path inside the part (`.` for the whole part).
    pub field: String,
    pub message: String,
    /// The copy of the part's bytes as they were stored.
    pub copy: String,
}

impl Recovery {
    /// Unreadable parts are errors (the default).
    pub fn refuse() -> Self {
        Self::default()
    }

    /// Unreadable parts are copied into `state_dir/unreadable/` and start from their defaults.
    pub fn set_aside_into(state_dir: &std::path::Path) -> Self {
        Self {
            aside_dir: Some(state_dir.join("unreadable")),
            taken: Mutex::new(Vec::new()),
        }
    }

    /// What was set aside since start.
    pub fn taken(&self) -> Vec<SetAside> {
        self.taken
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Copies `bytes` aside and records it; an error when the flag is off or the copy fails.
    fn set_aside(
        &self,
        part: &str,
        field: &str,
        message: &str,
        bytes: &[u8],
    ) -> Result<(), StateError> {
        let Some(dir) = &self.aside_dir else {
            return Err(unreadable(part, field, message));
        };
        let name = format!(
            "{}.{}.json",
            part.replace(['/', '\\'], "_"),
            crate::hub::now_ms()
        );
        let copy = dir.join(name);
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&copy, bytes))
            .map_err(|source| StateError::Write {
                path: copy.clone(),
                source,
            })?;
        tracing::error!(
            part,
            field,
            error = message,
            copy = %copy.display(),
            "a stored part could not be read: its bytes were copied aside and it starts from its defaults (--set-aside-unreadable-state)"
        );
        self.taken
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(SetAside {
                part: part.to_string(),
                field: field.to_string(),
                message: message.to_string(),
                copy: copy.display().to_string(),
            });
        Ok(())
    }
}

fn unreadable(part: &str, field: &str, message: &str) -> StateError {
    StateError::Unreadable {
        part: part.to_string(),
        field: field.to_string(),
        message: message.to_string(),
    }
}

/// `value` as stored bytes, refused (naming the part and field) when they would not read back.
pub fn encode<T: Serialize + DeserializeOwned>(
    part: &str,
    value: &T,
) -> Result<Vec<u8>, StateError> {
    let bytes = serde_json::to_vec(value).map_err(|e| StateError::Unstorable {
        part: part.to_string(),
        field: ".".into(),
        message: e.to_string(),
    })?;
    read::<T>(&bytes).map_err(|(field, message)| StateError::Unstorable {
        part: part.to_string(),
        field,
        message,
    })?;
    Ok(bytes)
}

/// A part as stored; `None` when it was unreadable and set aside (start from its defaults).
pub fn decode<T: DeserializeOwned>(
    part: &str,
    bytes: &[u8],
    recovery: &Recovery,
) -> Result<Option<T>, StateError> {
    match read::<T>(bytes) {
        Ok(v) => Ok(Some(v)),
        Err((field, message)) => {
            recovery.set_aside(part, &field, &message, bytes)?;
            Ok(None)
        }
    }
}

/// The whole state (a state file, or etcd's `config` part): a top-level field that cannot be
/// read is set aside alone and starts from its default, the rest loads.
pub fn decode_state(part: &str, bytes: &[u8], recovery: &Recovery) -> Result<HubState, StateError> {
    let mut value: serde_json::Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => {
            // Not JSON at all: nothing can be kept but the defaults.
            recovery.set_aside(part, ".", &e.to_string(), bytes)?;
            return Ok(HubState::fresh());
        }
    };
    let mut copied = false;
    loop {
        let outcome: Result<HubState, _> = serde_path_to_error::deserialize(&value);
        let e = match outcome {
            Ok(state) => return Ok(state),
            Err(e) => e,
        };
        let field = path_of(e.path());
        let message = e.inner().to_string();
        let top = e.path().iter().next().and_then(|s| match s {
            serde_path_to_error::Segment::Map { key } => Some(key.clone()),
            _ => None,
        });
        let removable = top.as_deref().is_some_and(|t| t != "version")
            && value
                .as_object()
                .is_some_and(|o| o.contains_key(top.as_deref().unwrap_or_default()));
        if !removable {
            recovery.set_aside(part, &field, &message, bytes)?;
            return Ok(HubState::fresh());
        }
        if copied {
            // The bytes are copied once; each field is still said.
            recovery.record_more(part, &field, &message)?;
        } else {
            recovery.set_aside(part, &field, &message, bytes)?;
            copied = true;
        }
        if let (Some(o), Some(top)) = (value.as_object_mut(), top) {
            o.remove(&top);
        }
    }
}

impl Recovery {
    /// Another field of a part already copied aside.
    fn record_more(&self, part: &str, field: &str, message: &str) -> Result<(), StateError> {
        if self.aside_dir.is_none() {
            return Err(unreadable(part, field, message));
        }
        let mut taken = self
            .taken
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let copy = taken
            .iter()
            .rev()
            .find(|s| s.part == part)
            .map(|s| s.copy.clone())
            .unwrap_or_default();
        tracing::error!(part, field, error = message, copy = %copy, "another field of that part could not be read; it starts from its default");
        taken.push(SetAside {
            part: part.to_string(),
            field: field.to_string(),
            message: message.to_string(),
            copy,
        });
        Ok(())
    }
}

/// Reads `bytes` as `T`: the failing field's path and the parser's message on error.
fn read<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, (String, String)> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| (path_of(e.path()), e.inner().to_string()))
}

fn path_of(path: &serde_path_to_error::Path) -> String {
    let p = path.to_string();
    if p.is_empty() { ".".into() } else { p }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_number_json_cannot_carry_is_refused_before_it_is_stored_naming_its_field() {
        let mut state = HubState::fresh();
        let day = crate::hub::projects::usage::DayUsage {
            cloud_usd: f64::INFINITY,
            ..Default::default()
        };
        state.project_usage.insert("alpha".into(), day);
        let refused = encode("usage", &state.project_usage).unwrap_err();
        let message = refused.to_string();
        assert!(
            matches!(refused, StateError::Unstorable { .. }),
            "{message}"
        );
        assert!(message.contains("alpha.cloudUsd"), "{message}");
        assert!(encode("state", &HubState::fresh()).is_ok());
    }

    #[test]
    fn an_unreadable_field_names_itself_or_with_the_flag_is_copied_aside_and_defaults() {
        let mut state = HubState::fresh();
        state.budget_override = Some(3);
        let day = crate::hub::projects::usage::DayUsage {
            cloud_usd: 1.0,
            ..Default::default()
        };
        state.project_usage.insert("alpha".into(), day);
        let text = serde_json::to_string(&state)
            .unwrap()
            .replace("\"cloudUsd\":1.0", "\"cloudUsd\":null");
        let refused = decode_state("hub-state.json", text.as_bytes(), &Recovery::refuse())
            .unwrap_err()
            .to_string();
        assert!(refused.contains("hub-state.json"), "{refused}");
        assert!(refused.contains("projectUsage.alpha.cloudUsd"), "{refused}");
        assert!(
            refused.contains("--set-aside-unreadable-state"),
            "{refused}"
        );

        let dir = tempfile::tempdir().unwrap();
        let recovery = Recovery::set_aside_into(dir.path());
        let loaded = decode_state("hub-state.json", text.as_bytes(), &recovery).unwrap();
        assert_eq!(loaded.budget_override, Some(3), "the rest loads");
        assert!(loaded.project_usage.is_empty(), "the field starts empty");
        let taken = recovery.taken();
        assert_eq!(taken.len(), 1, "{taken:?}");
        assert_eq!(
            std::fs::read_to_string(&taken[0].copy).unwrap(),
            text,
            "the copy is the part as it was stored"
        );
        let none: Option<Vec<u8>> = decode("usage", b"[1, null]", &recovery).unwrap();
        assert!(none.is_none());
        assert_eq!(recovery.taken()[1].field, "[1]");
    }
}
