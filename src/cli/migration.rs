//! `migration status|open|cutover|close|abort`: an embedding role's move to another encoder
//! through the hub's admin API (`/admin/migrations`), with the admin token. Each prints the
//! hub's answer: the role's live spaces with who passes each and the rows each served.

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use super::projects::{HubAccess, admin_token, call};

/// The role a step applies to.
#[derive(Args, Clone, Debug)]
pub struct RoleArg {
    /// The embedding role: embedding or code-embedding.
    #[arg(long, default_value = "embedding")]
    role: String,
}

/// What founds the next space: a local model an agent serves, or a cloud route.
#[derive(Args, Clone, Debug)]
#[group(required = true, multiple = false)]
pub struct FounderArgs {
    /// A local model an agent serves for the role (its id as `/admin/status` shows it, a hub
    /// model id or `sha256:…`).
    #[arg(long)]
    local_model: Option<String>,
    /// An OpenRouter model (with --cloud-provider and --dims).
    #[arg(long, requires_all = ["cloud_provider", "dims"])]
    cloud_model: Option<String>,
}

#[derive(Subcommand)]
pub enum MigrationCommand {
    /// Every embedding role's live spaces and what each served.
    Status {
        #[command(flatten)]
        access: HubAccess,
    },
    /// Open a migration: the role's next space, founded by a local model or a cloud route.
    Open {
        #[command(flatten)]
        role: RoleArg,
        #[command(flatten)]
        founder: FounderArgs,
        /// The cloud route's pinned upstream provider (with --cloud-model).
        #[arg(long)]
        cloud_provider: Option<String>,
        /// The next space's width (required with --cloud-model).
        #[arg(long)]
        dims: Option<usize>,
        /// Who serves requests pinned to the next space, and the role after the cutover:
        /// local, cloud, aggregate or backup [default: local for a local model, cloud for a
        /// cloud route].
        #[arg(long)]
        policy: Option<String>,
        #[command(flatten)]
        access: HubAccess,
    },
    /// Make the next space current (the old one stays served to pinned requests until close).
    Cutover {
        #[command(flatten)]
        role: RoleArg,
        #[command(flatten)]
        access: HubAccess,
    },
    /// Stop serving the previous space.
    Close {
        #[command(flatten)]
        role: RoleArg,
        #[command(flatten)]
        access: HubAccess,
    },
    /// Drop the next space and the providers built for it.
    Abort {
        #[command(flatten)]
        role: RoleArg,
        #[command(flatten)]
        access: HubAccess,
    },
}

pub async fn run(cmd: MigrationCommand) -> anyhow::Result<()> {
    let (access, path, body) = match cmd {
        MigrationCommand::Status { access } => (access, "/admin/migrations".to_string(), None),
        MigrationCommand::Open {
            role,
            founder,
            cloud_provider,
            dims,
            policy,
            access,
        } => {
            let founder = match (founder.local_model, founder.cloud_model) {
                (Some(model), _) => json!({"backend": "local", "model": model, "dims": dims}),
                (None, Some(model)) => json!({
                    "backend": "cloud",
                    "model": model,
                    "provider": cloud_provider,
                    "dims": dims,
                }),
                (None, None) => anyhow::bail!("name --local-model or --cloud-model"),
            };
            let mut body = json!({"role": role.role, "founder": founder});
            if let Some(p) = policy {
                body["policy"] = Value::from(p);
            }
            (access, "/admin/migrations".to_string(), Some(body))
        }
        MigrationCommand::Cutover { role, access } => {
            (access, step(&role, "cutover"), Some(json!({})))
        }
        MigrationCommand::Close { role, access } => (access, step(&role, "close"), Some(json!({}))),
        MigrationCommand::Abort { role, access } => (access, step(&role, "abort"), Some(json!({}))),
    };
    let token = admin_token(&access)?;
    let method = if body.is_some() { "POST" } else { "GET" };
    let answer = call(&access.hub, &token, method, &path, body).await?;
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(())
}

fn step(role: &RoleArg, what: &str) -> String {
    format!("/admin/migrations/{}/{what}", role.role)
}
