//! systemd credentials: a unit's `LoadCredential=name:/path` makes the file readable to the
//! service (and only to it) as `$CREDENTIALS_DIRECTORY/name`, without the service user being
//! able to read `/path` and without the value in the unit or an environment file. A token
//! with no file or variable configured is looked up there by its well-known name.

use std::path::PathBuf;

/// The agent's fleet token (the hub's agents' token).
pub const FLEET_TOKEN: &str = "fleet-token";
/// The bearer token of the agent's HTTP port.
pub const HTTP_TOKEN: &str = "http-token";
/// The hub's admin token.
pub const ADMIN_TOKEN: &str = "admin-token";
/// The hub's client token (optional).
pub const CLIENT_TOKEN: &str = "client-token";

/// `$CREDENTIALS_DIRECTORY/name`, when systemd passed that credential.
pub fn path(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("CREDENTIALS_DIRECTORY")?;
    let path = PathBuf::from(dir).join(name);
    path.is_file().then_some(path)
}
