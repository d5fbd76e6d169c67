//! SIGHUP for the agent: read the config file again and apply what can change under a running
//! agent: the Fantom masters (slots added, removed, their relay port or token changed) and the
//! bearer token of the HTTP port. Everything else (models, local servers, hub, identity, role
//! ports, cloud settings) needs a restart and is reported by name; the running config stays for it.

use std::path::Path;
use std::sync::Arc;

use crate::config::agent::AgentConfig;
use crate::config::tokens;
use crate::fantom::sidecar::Sidecar;
use crate::service::credentials;
use crate::service::notify::Notifier;

/// What a reload did, for the log and the `STATUS=` line.
#[derive(Debug, Default, PartialEq)]
pub struct ReloadReport {
    pub applied: Vec<String>,
    pub needs_restart: Vec<String>,
    /// The file could not be read or parsed: nothing changed.
    pub error: Option<String>,
}

/// SIGHUP, listened for from the moment this is made. Made before `READY=1` is sent: a reload
/// asked for right after it is never lost (nor, with no handler yet, kills the process).
pub struct Hangups {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangups {
    pub fn listen() -> Hangups {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let signal = signal(SignalKind::hangup()).ok();
            if signal.is_none() {
                tracing::warn!("cannot listen for SIGHUP: no reloads");
            }
            Hangups { signal }
        }
        #[cfg(not(unix))]
        Hangups {}
    }
}

/// On every SIGHUP: `RELOADING=1`, `reload()`, the outcome logged, then `READY=1` with its line.
pub async fn on_hangup(
    hangups: Hangups,
    notifier: Notifier,
    mut reload: impl FnMut() -> ReloadReport,
) {
    #[cfg(unix)]
    {
        let Some(mut hangups) = hangups.signal else {
            return;
        };
        while hangups.recv().await.is_some() {
            notifier.reloading();
            let report = reload();
            let line = report.line();
            if report.error.is_some() {
                tracing::error!(outcome = %line, "SIGHUP: reload failed");
            } else {
                tracing::info!(applied = ?report.applied, needs_restart = ?report.needs_restart, "SIGHUP: config reloaded");
            }
            notifier.ready(&line);
        }
    }
    #[cfg(not(unix))]
    let _ = (hangups, notifier, &mut reload);
}

impl ReloadReport {
    /// A reload that changed nothing because the file could not be read.
    pub fn failed(error: String) -> Self {
        ReloadReport {
            error: Some(error),
            ..Default::default()
        }
    }

    /// `reloaded: <applied>; needs restart: <list>`.
    pub fn line(&self) -> String {
        if let Some(e) = &self.error {
            return format!("reload failed, the running config stays: {e}");
        }
        let applied = if self.applied.is_empty() {
            "nothing changed".to_string()
        } else {
            self.applied.join(", ")
        };
        if self.needs_restart.is_empty() {
            format!("reloaded: {applied}")
        } else {
            format!(
                "reloaded: {applied}; needs restart: {}",
                self.needs_restart.join(", ")
            )
        }
    }
}

/// Reads `path` again and applies what is safe onto `current` and `sidecar`.
pub fn reload_agent(
    path: &Path,
    current: &mut AgentConfig,
    sidecar: Option<&Arc<Sidecar>>,
) -> ReloadReport {
    let new = match AgentConfig::load(path) {
        Ok(new) => new,
        Err(e) => return ReloadReport::failed(e.to_string()),
    };
    let mut report = ReloadReport::default();
    let fixed: [(&str, bool); 13] = [
        ("hub_url", current.hub_url != new.hub_url),
        ("hub_urls", current.hub_urls != new.hub_urls),
        ("agent_id", current.agent_id != new.agent_id),
        ("agent_url", current.agent_url != new.agent_url),
        ("hostname", current.hostname != new.hostname),
        (
            "fleet token source",
            (&current.fleet_token_file, &current.fleet_token_env)
                != (&new.fleet_token_file, &new.fleet_token_env),
        ),
        ("ca_file", current.ca_file != new.ca_file),
        (
            "drain_timeout_s",
            current.drain_timeout_s != new.drain_timeout_s,
        ),
        (
            "openrouter_url",
            current.openrouter_url != new.openrouter_url,
        ),
        (
            "cloud_pipeline_depth",
            current.cloud_pipeline_depth != new.cloud_pipeline_depth,
        ),
        ("models", current.models != new.models),
        ("role_ports", current.role_ports != new.role_ports),
        (
            "local_server",
            current.local_servers != new.local_servers || current.systemctl != new.systemctl,
        ),
    ];
    report.needs_restart = fixed
        .iter()
        .filter(|(_, changed)| *changed)
        .map(|(name, _)| name.to_string())
        .collect();

    match sidecar {
        Some(sidecar) => {
            apply_masters(current, &new, sidecar, &mut report);
            match tokens::optional(
                new.http_token_file.as_deref(),
                new.http_token_env.as_deref(),
                credentials::HTTP_TOKEN,
            ) {
                Ok(token) => {
                    if sidecar.set_http_token(token) {
                        report.applied.push("http token".into());
                    }
                    current.http_token_file = new.http_token_file.clone();
                    current.http_token_env = new.http_token_env.clone();
                }
                Err(e) => report.needs_restart.push(format!("http token ({e})")),
            }
        }
        None if !new.fantom_masters.is_empty() => report
            .needs_restart
            .push("fantom_master (the agent started without masters)".into()),
        None => {}
    }
    report
}

/// Adds, removes and updates the slots so they match `new`'s masters.
fn apply_masters(
    current: &mut AgentConfig,
    new: &AgentConfig,
    sidecar: &Arc<Sidecar>,
    report: &mut ReloadReport,
) {
    let (mut added, mut removed, mut changed) = (0, 0, 0);
    for old in &current.fantom_masters {
        if !new
            .fantom_masters
            .iter()
            .any(|m| m.server_url == old.server_url)
            && sidecar.slots.remove(&old.server_url)
        {
            removed += 1;
        }
    }
    for m in &new.fantom_masters {
        let token = m.auth_token().unwrap_or_else(|e| {
            report
                .needs_restart
                .push(format!("master {} token ({e})", m.server_url));
            None
        });
        let before = current
            .fantom_masters
            .iter()
            .find(|o| o.server_url == m.server_url);
        let (created, generation) = sidecar.slots.add(&m.server_url, m.ws_port, token);
        if created {
            sidecar.spawn_relay(m.server_url.clone(), generation);
            added += 1;
        } else if before
            .is_some_and(|b| b.ws_port != m.ws_port || b.auth_token_file != m.auth_token_file)
        {
            changed += 1;
        }
    }
    current.fantom_masters = new.fantom_masters.clone();
    if added + removed + changed > 0 {
        report
            .applied
            .push(format!("masters +{added} -{removed} ~{changed}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_what_applied_and_what_needs_a_restart() {
        let report = ReloadReport {
            applied: vec!["masters +1 -0 ~0".into(), "http token".into()],
            needs_restart: vec!["models".into()],
            error: None,
        };
        assert_eq!(
            report.line(),
            "reloaded: masters +1 -0 ~0, http token; needs restart: models"
        );
        assert_eq!(ReloadReport::default().line(), "reloaded: nothing changed");
    }

    #[test]
    fn a_changed_model_needs_a_restart_and_a_bad_file_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        let body = |model: &str| {
            format!(
                "hub_url = \"ws://h/v1/agent\"\nfleet_token_env = \"T\"\n[[models]]\nroles = [\"embedding\"]\nmodel = \"{model}\"\n"
            )
        };
        std::fs::write(&path, body("a")).unwrap();
        let mut current = AgentConfig::load(&path).unwrap();
        std::fs::write(&path, body("b")).unwrap();
        let report = reload_agent(&path, &mut current, None);
        assert_eq!(report.needs_restart, vec!["models".to_string()]);
        std::fs::write(&path, "hub_url = 3").unwrap();
        let report = reload_agent(&path, &mut current, None);
        assert!(report.error.is_some());
        assert!(
            report.line().starts_with("reload failed"),
            "{}",
            report.line()
        );
    }
}
