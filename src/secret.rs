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

    /// The value's length in characters (to refuse a token too short to be one).
    pub fn char_count(&self) -> usize {
        self.0.chars().count()
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

/// Whether a value typed into some other field is shaped like a key or a token, so it must
/// never be kept, shown, logged or echoed: an `sk-` prefix (OpenRouter's `sk-or-v1-…`, OpenAI's),
/// or 32 or more characters of one token alphabet (letters, digits, `-`, `_`) with a random run
/// of 20 or more between hyphens, mixing letters and digits. Model and provider slugs (`a/b`,
/// short hyphenated words), modes, numbers and host names never match.
pub fn looks_like_key(value: &str) -> bool {
    let v = value.trim();
    if v.len() >= 8 && v.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("sk-")) {
        return true;
    }
    let alphabet = v
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    let longest_run = v.split('-').map(str::len).max().unwrap_or(0);
    let digits = v.chars().filter(char::is_ascii_digit).count();
    let letters = v.chars().filter(char::is_ascii_alphabetic).count();
    v.len() >= 32 && alphabet && longest_run >= 20 && digits >= 4 && letters >= 4
}

/// Whether `value` holds a key anywhere: a key-shaped run of it ([`looks_like_key`]; a key
/// inside `openai/sk-or-…` or `KEY=sk-or-…` counts), or one of the `known` keys as a part.
pub fn holds_key(value: &str, known: &[&Secret]) -> bool {
    value
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .any(looks_like_key)
        || known
            .iter()
            .any(|k| !k.is_empty() && value.contains(k.expose()))
}

/// A message that may quote what a caller typed (a JSON parser's "invalid type: string …"), fit
/// to show: every double-quoted string becomes `"…"` (values; serde quotes field names with
/// backticks), and every key-shaped run left ([`looks_like_key`]) becomes `[withheld]`.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut run = String::new();
    let mut quoted = false;
    let flush = |run: &mut String, out: &mut String| {
        if looks_like_key(run) {
            out.push_str("[withheld]");
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in text.chars() {
        if c == '"' {
            flush(&mut run, &mut out);
            if !quoted {
                out.push_str("\"…\"");
            }
            quoted = !quoted;
        } else if quoted {
            continue;
        } else if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
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
    fn redaction_withholds_key_shaped_runs_only() {
        let key = "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef";
        let text = format!("dims: invalid type: string \"{key}\", expected usize at line 1");
        let shown = redact(&text);
        assert!(!shown.contains(&key[5..]), "{shown}");
        assert_eq!(
            shown,
            "dims: invalid type: string \"…\", expected usize at line 1"
        );
        let path = format!("allowedModels.{key}.dims: invalid type");
        assert_eq!(redact(&path), "allowedModels.[withheld].dims: invalid type");
        assert_eq!(
            redact("model qwen/qwen3-embedding-4b"),
            "model qwen/qwen3-embedding-4b"
        );
        let held = Secret::new("short-held-key");
        assert!(holds_key(&format!("openai/{key}"), &[]));
        assert!(holds_key(&format!("OPENROUTER_API_KEY={key}"), &[]));
        assert!(holds_key("x/short-held-key/y", &[&held]));
        assert!(!holds_key("qwen/qwen3-embedding-4b", &[&held]));
    }

    #[test]
    fn key_shaped_values_are_told_from_slugs_modes_and_hosts() {
        let generated = Secret::generate();
        for key in [
            "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "SK-proj-abcdefgh",
            generated.expose(),
            "ghp_aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5",
        ] {
            assert!(looks_like_key(key), "{key}");
        }
        for plain in [
            "qwen/qwen3-embedding-4b",
            "deepinfra/bf16",
            "sentence-transformers-all-minilm-l6-v2",
            "local-first",
            "cloud-only",
            "code-embedding",
            "fantom.example.internal",
            "2560",
            "skipper",
            "",
        ] {
            assert!(!looks_like_key(plain), "{plain}");
        }
    }

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
