//! Secrets (the OpenRouter key, fleet/admin/client tokens) in a type that cannot leak by
//! accident.
//!
//! [`Secret`] has no `Display` and no `Serialize`; its `Debug` prints a fixed placeholder; its
//! memory is zeroed on drop. The only ways to the bytes are [`Secret::expose`] (grep for it:
//! every call site is a place the secret is used on purpose) and the wire encoder of the
//! config frame ([`crate::protocol`]).

use std::fmt;

use rand::RngCore;
use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// A secret string. Deserializable (it arrives in requests and config files), never printable.
#[derive(Clone)]
pub struct Secret(Zeroizing<String>);

impl Secret {
    /// Wraps a value; surrounding whitespace (a pasted key, a file's newline) is trimmed.
    pub fn new(value: impl Into<String>) -> Self {
        let mut value: String = value.into();
        let trimmed = value.trim();
        if trimmed.len() != value.len() {
            let kept = Zeroizing::new(trimmed.to_string());
            zeroize::Zeroize::zeroize(&mut value);
            return Secret(kept);
        }
        Secret(Zeroizing::new(value))
    }

    /// 32 random bytes as 64 hex characters (generated fleet/admin tokens).
    pub fn generate() -> Self {
        let mut bytes = Zeroizing::new([0u8; 32]);
        rand::rng().fill_bytes(bytes.as_mut());
        let mut hex = String::with_capacity(64);
        for b in bytes.iter() {
            hex.push_str(&format!("{b:02x}"));
        }
        Secret(Zeroizing::new(hex))
    }

    /// The value, for the one place that must use it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Compares with a presented credential in time independent of where they differ (both
    /// sides hashed first, so the length does not leak either).
    pub fn matches(&self, presented: &str) -> bool {
        let a = Sha256::digest(self.0.as_bytes());
        let b = Sha256::digest(presented.as_bytes());
        a.iter()
            .zip(b.iter())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Zeroizing::new(String::deserialize(d)?);
        Ok(Secret::new(value.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value_and_matching_is_exact() {
        let s: Secret = serde_json::from_str("\"  sk-or-v1-abcdef\\n\"").unwrap();
        assert_eq!(s.expose(), "sk-or-v1-abcdef");
        let dbg = format!("{s:?} {:?}", Some(&s));
        assert!(!dbg.contains("abcdef"), "{dbg}");
        assert!(s.matches("sk-or-v1-abcdef"));
        assert!(!s.matches("sk-or-v1-abcdeg"));
        assert!(!s.matches(""));
        let g = Secret::generate();
        assert_eq!(g.expose().len(), 64);
        assert_ne!(g.expose(), Secret::generate().expose());
    }
}
