//! Where the fleet, admin and client tokens come from: a file (mode 0600 when we write it) or
//! an environment variable; never a command-line value, never a log line.
//!
//! Under systemd a token with neither configured comes from the unit's credentials
//! (`LoadCredential=fleet-token:…`, see [`crate::service::credentials`]). A hub with none of
//! these generates its token into its state dir on first start and logs the file's path (the
//! value stays in the file).

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::secret::Secret;
use crate::service::credentials;

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the token file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the token file {0} is empty")]
    Empty(PathBuf),
    #[error("cannot write the token file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the environment variable {0} is not set or empty")]
    EnvMissing(String),
    #[error(
        "no fleet token: set fleet_token_file or fleet_token_env (or the fleet-token credential under systemd)"
    )]
    NoSource,
}

/// Reads a token file (surrounding whitespace trimmed).
pub fn read_token_file(path: &Path) -> Result<Secret, TokenError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let secret = Secret::new(text);
    if secret.is_empty() {
        return Err(TokenError::Empty(path.to_path_buf()));
    }
    Ok(secret)
}

/// A token from `explicit` (must exist), else the systemd credential `credential`, else from
/// `state_dir/name`, generated there when missing. Returns the token and the file it came from.
pub fn load_or_generate(
    explicit: Option<&Path>,
    credential: &str,
    state_dir: &Path,
    name: &str,
) -> Result<(Secret, PathBuf), TokenError> {
    if let Some(path) = explicit {
        return Ok((read_token_file(path)?, path.to_path_buf()));
    }
    if let Some(path) = credentials::path(credential) {
        return Ok((read_token_file(&path)?, path));
    }
    let path = state_dir.join(name);
    if path.exists() {
        return Ok((read_token_file(&path)?, path));
    }
    let token = Secret::generate();
    write_private(&path, token.expose()).map_err(|source| TokenError::Write {
        path: path.clone(),
        source,
    })?;
    tracing::info!(path = %path.display(), "generated a token file (0600); its value is not logged");
    Ok((token, path))
}

/// A token from a file, an environment variable, or else the systemd credential `credential`;
/// `Ok(None)` when none of them is there.
pub fn optional(
    file: Option<&Path>,
    env: Option<&str>,
    credential: &str,
) -> Result<Option<Secret>, TokenError> {
    match from_file_or_env(file, env) {
        Ok(token) => Ok(Some(token)),
        Err(TokenError::NoSource) => credentials::path(credential)
            .map(|path| read_token_file(&path))
            .transpose(),
        Err(e) => Err(e),
    }
}

/// A token from a file or from an environment variable (the agent's two sources).
pub fn from_file_or_env(file: Option<&Path>, env: Option<&str>) -> Result<Secret, TokenError> {
    if let Some(path) = file {
        return read_token_file(path);
    }
    if let Some(var) = env {
        let secret = Secret::new(std::env::var(var).unwrap_or_default());
        if secret.is_empty() {
            return Err(TokenError::EnvMissing(var.to_string()));
        }
        return Ok(secret);
    }
    Err(TokenError::NoSource)
}

fn write_private(path: &Path, value: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path)?;
    file.write_all(value.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_token_is_generated_once_and_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let (a, path) =
            load_or_generate(None, "no-such-credential", dir.path(), "fleet.token").unwrap();
        let (b, _) =
            load_or_generate(None, "no-such-credential", dir.path(), "fleet.token").unwrap();
        assert_eq!(a.expose(), b.expose());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let missing = dir.path().join("nope");
        assert!(load_or_generate(Some(&missing), "x", dir.path(), "x").is_err());
        std::fs::write(dir.path().join("empty"), "\n").unwrap();
        assert!(matches!(
            read_token_file(&dir.path().join("empty")),
            Err(TokenError::Empty(_))
        ));
    }
}
