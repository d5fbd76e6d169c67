//! `projects add|list|rotate|remove|set`: the hub's projects through its admin API, with the
//! admin token (its file, else the one the hub generated in its state dir). A new or rotated
//! key is printed once, on stdout; the hub keeps only its digest.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::config::tokens;
use crate::secret::Secret;

#[derive(Args, Clone, Debug)]
pub struct HubAccess {
    /// The hub's base URL.
    #[arg(long, env = "FANTOM_HUB_URL", default_value = "http://127.0.0.1:8090")]
    pub(super) hub: String,
    /// The admin token's file [default: admin.token in the hub's state dir].
    #[arg(long, env = "FANTOM_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// The hub's state dir, where it generated its admin token.
    #[arg(long, env = "FANTOM_STATE_DIR")]
    state_dir: Option<PathBuf>,
}

/// A project's settings on the command line (each optional).
#[derive(Args, Clone, Debug, Default)]
pub struct SettingsArgs {
    /// Its share of each role and of the cloud permits while others wait [default: 1].
    #[arg(long)]
    weight: Option<u32>,
    /// Items it may have accepted and not yet answered.
    #[arg(long)]
    max_queued_items: Option<u64>,
    /// Cloud calls it may hold at once.
    #[arg(long)]
    max_cloud_in_flight: Option<u32>,
    /// Cloud tokens per UTC day.
    #[arg(long)]
    cloud_tokens_per_day: Option<u64>,
    /// Cloud cost per UTC day, in US dollars.
    #[arg(long)]
    cloud_usd_per_day: Option<f64>,
    /// Its key may name sub-projects with X-FantomMCP-Project.
    #[arg(long)]
    sub_projects: Option<bool>,
}

impl SettingsArgs {
    /// The settings given, as the admin API takes them (absent ones left out).
    fn body(&self) -> Value {
        let mut body = json!({"limits": self.limits()});
        if let Some(w) = self.weight {
            body["weight"] = w.into();
        }
        if let Some(s) = self.sub_projects {
            body["sub_projects"] = s.into();
        }
        body
    }

    fn limits(&self) -> serde_json::Map<String, Value> {
        let mut limits = serde_json::Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                limits.insert(k.into(), v);
            }
        };
        put("max_queued_items", self.max_queued_items.map(Value::from));
        put(
            "max_cloud_in_flight",
            self.max_cloud_in_flight.map(Value::from),
        );
        put(
            "cloud_tokens_per_day",
            self.cloud_tokens_per_day.map(Value::from),
        );
        put("cloud_usd_per_day", self.cloud_usd_per_day.map(Value::from));
        limits
    }
}

#[derive(Subcommand)]
pub enum ProjectsCommand {
    /// Create a project; prints its key (shown this once).
    Add {
        name: String,
        #[command(flatten)]
        settings: SettingsArgs,
        #[command(flatten)]
        access: HubAccess,
    },
    /// Every project with its settings and usage (never a key).
    List {
        #[command(flatten)]
        access: HubAccess,
    },
    /// Change a project's weight, limits or sub-projects (live).
    Set {
        name: String,
        #[command(flatten)]
        settings: SettingsArgs,
        #[command(flatten)]
        access: HubAccess,
    },
    /// A new key for a project; the old one stops working at once. Prints the new key.
    Rotate {
        name: String,
        #[command(flatten)]
        access: HubAccess,
    },
    /// Remove a project: its key stops working at once.
    Remove {
        name: String,
        #[command(flatten)]
        access: HubAccess,
    },
}

/// A project name as one URL path segment (names may hold `/` and `:`).
fn segment(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

pub async fn run(cmd: ProjectsCommand) -> anyhow::Result<()> {
    let (access, method, path, body) = match cmd {
        ProjectsCommand::Add {
            name,
            settings,
            access,
        } => {
            let mut body = settings.body();
            body["name"] = name.into();
            (access, "POST", "/admin/projects".to_string(), Some(body))
        }
        ProjectsCommand::List { access } => (access, "GET", "/admin/projects".into(), None),
        ProjectsCommand::Set {
            name,
            settings,
            access,
        } => {
            let body = settings.body();
            (
                access,
                "PATCH",
                format!("/admin/projects/{}", segment(&name)),
                Some(body),
            )
        }
        ProjectsCommand::Rotate { name, access } => (
            access,
            "POST",
            format!("/admin/projects/{}/rotate", segment(&name)),
            None,
        ),
        ProjectsCommand::Remove { name, access } => (
            access,
            "DELETE",
            format!("/admin/projects/{}", segment(&name)),
            None,
        ),
    };
    let token = admin_token(&access)?;
    let answer = call(&access.hub, &token, method, &path, body).await?;
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(())
}

pub(super) fn admin_token(access: &HubAccess) -> anyhow::Result<Secret> {
    let path = match &access.admin_token_file {
        Some(p) => p.clone(),
        None => access
            .state_dir
            .clone()
            .unwrap_or_else(super::fleet::default_state_dir)
            .join("admin.token"),
    };
    tokens::read_token_file(&path).with_context(|| {
        format!(
            "cannot read the admin token {} (give --admin-token-file, or --state-dir of the hub)",
            path.display()
        )
    })
}

pub(super) async fn call(
    hub: &str,
    token: &Secret,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let url = format!("{}{path}", hub.trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let method = reqwest::Method::from_bytes(method.as_bytes())?;
    let mut request = client.request(method, &url).bearer_auth(token.expose());
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("cannot reach the hub at {hub}"))?;
    let status = response.status();
    let answer: Value = response.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        let message = answer["error"]["message"]
            .as_str()
            .or_else(|| answer["message"].as_str())
            .unwrap_or("no message");
        bail!("the hub answered {status}: {message}");
    }
    Ok(answer)
}
