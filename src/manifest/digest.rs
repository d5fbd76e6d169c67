//! SHA-256 digests of model files: the value type, its hex form, and hashing files.
//!
//! A digest is what pins a model file to its bytes. Manifests and `models.lock` store digests as
//! 64 lowercase hex characters, the same form as the Hugging Face hub's LFS object ids.

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256 as Sha256Hasher};

/// A SHA-256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256([u8; 32]);

/// A digest string that is not 64 hex characters.
#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not a sha256 digest (expected 64 hex characters)")]
pub struct BadDigest(String);

impl Sha256 {
    /// Hashes a whole file, streaming it (model weights are gigabytes).
    pub fn of_file(path: &Path) -> io::Result<Self> {
        let mut file = File::open(path)?;
        let mut hasher = Sha256Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        Ok(Self(hasher.finalize().into()))
    }

    /// A digest computed elsewhere (a hasher fed while streaming).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Hashes bytes in memory.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self(Sha256Hasher::digest(bytes).into())
    }

    /// The first 12 hex characters, for log lines.
    pub fn short(&self) -> String {
        self.to_string()[..12].to_string()
    }
}

impl fmt::Display for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256({self})")
    }
}

impl FromStr for Sha256 {
    type Err = BadDigest;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex = s.strip_prefix("sha256:").unwrap_or(s);
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BadDigest(s.to_string()));
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| BadDigest(s.to_string()))?;
        }
        Ok(Self(out))
    }
}

impl Serialize for Sha256 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Sha256 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector_and_round_trip() {
        let d = Sha256::of_bytes(b"abc");
        assert_eq!(
            d.to_string(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(d.to_string().parse::<Sha256>().unwrap(), d);
        assert_eq!(
            format!("sha256:{d}").parse::<Sha256>().unwrap(),
            d,
            "the sha256: prefix is accepted"
        );
        assert_eq!(d.short(), "ba7816bf8f01");
    }

    #[test]
    fn rejects_malformed() {
        assert!("abc".parse::<Sha256>().is_err());
        assert!("z".repeat(64).parse::<Sha256>().is_err());
    }

    #[test]
    fn file_digest_matches_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        assert_eq!(Sha256::of_file(&p).unwrap(), Sha256::of_bytes(&data));
    }
}
