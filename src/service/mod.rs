//! Running as a service: the systemd notify protocol ([`notify`]: `READY=1`, `STATUS=`,
//! `WATCHDOG=1`, `STOPPING=1`, `RELOADING=1`) and the credentials systemd hands a unit
//! ([`credentials`]: `LoadCredential=` files under `$CREDENTIALS_DIRECTORY`), and the host's
//! name ([`host`]).
//!
//! Both are no-ops outside systemd: no `NOTIFY_SOCKET`, no `CREDENTIALS_DIRECTORY`.

pub mod credentials;
pub mod host;
pub mod notify;
