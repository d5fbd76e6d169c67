//! Who may do what on the agent's HTTP surface (`docs/fantom.md`, "Who may do what").
//!
//! A request's bearer token says who calls: the **operator** (the agent's own `http_token`)
//! may do everything; a **master** (a slot's `auth_token`) may see, change and spend its own
//! slot only; anyone else is **nobody**. With no token configured at all the door is not
//! open: what changes state or spends a key is refused with a message that says how to
//! configure one, and only the inference and read routes answer (as Ollama's do).
//! Comparisons are constant-time ([`crate::secret::Secret::matches`]).

use axum::http::StatusCode;

use super::{Refusal, error};

/// Who a request's bearer token says it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// The agent's own `http_token`.
    Operator,
    /// A master's token: the slots it owns (normally one).
    Master(Vec<String>),
    /// No token, or one nobody here holds (only when no token is configured at all does such a
    /// request get past the bearer check).
    Nobody,
}

impl Caller {
    /// Whether this caller may act on the slot `server_url` (see it, change it, spend its key).
    pub fn owns(&self, server_url: &str) -> bool {
        match self {
            Caller::Operator => true,
            Caller::Master(slots) => slots.iter().any(|s| s == server_url),
            Caller::Nobody => false,
        }
    }

    /// The slots this caller sees: `None` for all of them (the operator), none for nobody.
    pub fn shown(&self) -> Option<&[String]> {
        match self {
            Caller::Master(slots) => Some(slots),
            Caller::Nobody => Some(&[]),
            Caller::Operator => None,
        }
    }

    /// Refuses what changes state or spends a key when no token is configured at all.
    pub fn may_change(&self) -> Result<(), Refusal> {
        match self {
            Caller::Nobody => Err(error(StatusCode::FORBIDDEN, NO_TOKEN)),
            Caller::Operator | Caller::Master(_) => Ok(()),
        }
    }
}

/// Why a state-changing or key-spending route is refused on an agent without any token.
pub const NO_TOKEN: &str = "this agent's HTTP port has no bearer token configured, so routes that change its state or spend a master's key are refused: set http_token_file (or http_token_env, or the http-token systemd credential) in the agent's TOML, or auth_token_file on a [[fantom_master]], and call with 'Authorization: Bearer <token>'";

/// A master's token used on another master's slot.
pub fn not_yours(what: &str) -> Refusal {
    error(
        StatusCode::FORBIDDEN,
        format!(
            "this token is a master's: it may {what} only that master's own slot (the operator's http_token may act on any)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_master_owns_its_slots_and_the_operator_all() {
        let a = Caller::Master(vec!["http://a:3848".into()]);
        assert!(a.owns("http://a:3848") && !a.owns("http://b:3848"));
        assert!(Caller::Operator.owns("http://b:3848"));
        assert!(!Caller::Nobody.owns("http://a:3848"));
        assert!(Caller::Nobody.may_change().is_err() && a.may_change().is_ok());
        assert_eq!(a.shown().map(<[String]>::len), Some(1));
        assert!(Caller::Operator.shown().is_none());
        assert_eq!(
            Caller::Nobody.shown(),
            Some(&[][..]),
            "nobody sees any slot"
        );
    }
}
