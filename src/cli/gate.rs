//! `gate`: the compatibility gate's measure, run once from the command line. Owns the
//! `local:` / `openrouter:` route syntax, the OpenRouter key's intake (environment or stdin,
//! never a flag), embedding the probe set through both routes, and the verdict's report and
//! exit code (0 pass, 1 refused, 2 error). The judging itself is the hub's
//! ([`crate::hub::gate::measure`]).

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::json;

use crate::cloud::{CloudRoute, DEFAULT_BASE_URL, OpenRouterClient};
use crate::config::model::ModelChoice;
use crate::config::push::AllowedModel;
use crate::hub::gate::measure::{Judgement, MIN_COSINE_FLOOR, check_shape, judge, probe_texts};
use crate::inference::{DTypeSpec, DeviceSpec, EmbedOptions, Engine, EngineConfig};
use crate::model_spec::Task;
use crate::roles::Role;
use crate::secret::Secret;

/// How long one OpenRouter call may take.
const CLOUD_TIMEOUT: Duration = Duration::from_secs(120);

/// Characters of each probe text the report shows.
const SHOWN_CHARS: usize = 40;

const UNPINNED: &str = "an embedding route needs a pinned upstream: openrouter:<model>@<slug>";

#[derive(Args)]
pub struct GateCommand {
    /// The reference: local:<model id or model dir> or openrouter:<model>@<provider slug>.
    #[arg(long = "a", value_name = "ROUTE")]
    a: String,
    /// The candidate, in the same syntax as --a.
    #[arg(long = "b", value_name = "ROUTE")]
    b: String,
    /// The table's width; default: the first local route's dims (required when both are cloud).
    #[arg(long)]
    dims: Option<usize>,
    /// The lowest cosine any probe may have; values under 0.99 are raised to 0.99.
    #[arg(long, default_value_t = MIN_COSINE_FLOOR)]
    min_cosine: f64,
    /// OpenRouter's API base URL. The key comes from OPENROUTER_API_KEY or stdin's first line.
    #[arg(long, default_value = DEFAULT_BASE_URL)]
    openrouter_url: String,
    /// One JSON object instead of the text report.
    #[arg(long)]
    json: bool,
}

/// A parsed route.
enum Route {
    Local(ModelChoice),
    Cloud { model: String, slug: String },
}

/// A route ready to embed.
enum Encoder {
    Local(Engine),
    Cloud { model: String, slug: String },
}

/// Runs the gate; errors are reported here (exit 2), so a refusal (exit 1) stays distinct.
pub async fn run(cmd: GateCommand) -> ExitCode {
    match gate(&cmd).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Whether B passed against A.
async fn gate(cmd: &GateCommand) -> anyhow::Result<bool> {
    let a = parse_route(&cmd.a).context("--a")?;
    let b = parse_route(&cmd.b).context("--b")?;
    let is_cloud = |r: &Route| matches!(r, Route::Cloud { .. });
    if cmd.dims.is_none() && is_cloud(&a) && is_cloud(&b) {
        bail!("--dims is required when both routes are cloud");
    }
    let min_cosine = if cmd.min_cosine >= MIN_COSINE_FLOOR {
        cmd.min_cosine
    } else {
        eprintln!(
            "note: --min-cosine {} is under the floor; using {MIN_COSINE_FLOOR}",
            cmd.min_cosine
        );
        MIN_COSINE_FLOOR
    };
    let client = if is_cloud(&a) || is_cloud(&b) {
        Some(OpenRouterClient::new(
            &cmd.openrouter_url,
            read_key()?,
            CLOUD_TIMEOUT,
        )?)
    } else {
        None
    };
    let a = open(a)
        .await
        .with_context(|| format!("route A ({})", cmd.a))?;
    let b = open(b)
        .await
        .with_context(|| format!("route B ({})", cmd.b))?;
    let width = match (cmd.dims, local_dims(&a).or(local_dims(&b))) {
        (Some(dims), _) | (None, Some(dims)) => dims,
        (None, None) => bail!("--dims is required when both routes are cloud"),
    };
    let texts = probe_texts();
    let a_vectors = embed(&a, client.as_ref(), width, &texts)
        .await
        .with_context(|| format!("route A ({})", cmd.a))?;
    let judgement = match check_shape(&a_vectors, texts.len(), width) {
        Err(why) => Judgement::Refused {
            reason: format!("route A does not fit the width: {why}"),
            evidence: None,
        },
        Ok(()) => {
            let b_vectors = embed(&b, client.as_ref(), width, &texts)
                .await
                .with_context(|| format!("route B ({})", cmd.b))?;
            judge(&a_vectors, &b_vectors, width, min_cosine)
        }
    };
    report(cmd, &texts, width, &judgement)?;
    Ok(judgement.passed())
}

fn parse_route(text: &str) -> anyhow::Result<Route> {
    if let Some(rest) = text.strip_prefix("local:") {
        let rest = rest.trim();
        if rest.is_empty() {
            bail!("route '{text}': name a model id or a model folder after local:");
        }
        let path = PathBuf::from(rest);
        let choice = if path.is_dir() {
            local_choice(None, Some(path))
        } else {
            local_choice(Some(rest.to_string()), None)
        };
        return Ok(Route::Local(choice));
    }
    if let Some(rest) = text.strip_prefix("openrouter:") {
        let Some((model, slug)) = rest.rsplit_once('@') else {
            bail!("route '{text}': {UNPINNED}");
        };
        let (model, slug) = (model.trim(), slug.trim());
        if model.is_empty() || slug.is_empty() {
            bail!("route '{text}': {UNPINNED}");
        }
        return Ok(Route::Cloud {
            model: model.to_string(),
            slug: slug.to_string(),
        });
    }
    bail!("route '{text}' is neither local:<model> nor openrouter:<model>@<slug>")
}

/// A local model with the defaults of the `embed` command's flags.
fn local_choice(model: Option<String>, model_dir: Option<PathBuf>) -> ModelChoice {
    let engine = EngineConfig::default();
    ModelChoice {
        model,
        model_dir,
        random_weights: false,
        device: DeviceSpec::Auto,
        dtype: DTypeSpec::Auto,
        pooling: None,
        max_tokens: None,
        no_truncate: false,
        max_batch_tokens: engine.max_batch_tokens,
        max_batch_rows: engine.max_batch_rows,
        warmup: engine.warmup,
        lock_file: std::env::var_os("FANTOM_MODELS_LOCK").map(PathBuf::from),
        manifests: None,
    }
}

/// The key: `OPENROUTER_API_KEY`, else the first line of stdin (never a flag, never printed).
fn read_key() -> anyhow::Result<Secret> {
    if let Ok(value) = std::env::var("OPENROUTER_API_KEY") {
        let key = Secret::new(value);
        if !key.is_empty() {
            return Ok(key);
        }
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        bail!("an openrouter: route needs a key: set OPENROUTER_API_KEY or pipe it on stdin");
    }
    let mut line = String::new();
    stdin
        .lock()
        .read_line(&mut line)
        .context("cannot read the OpenRouter key from stdin")?;
    let key = Secret::new(line);
    if key.is_empty() {
        bail!("the OpenRouter key is empty: set OPENROUTER_API_KEY or pipe it on stdin");
    }
    Ok(key)
}

async fn open(route: Route) -> anyhow::Result<Encoder> {
    Ok(match route {
        Route::Local(choice) => Encoder::Local(choice.load(Task::Embed).await?),
        Route::Cloud { model, slug } => Encoder::Cloud { model, slug },
    })
}

fn local_dims(encoder: &Encoder) -> Option<usize> {
    match encoder {
        Encoder::Local(engine) => Some(engine.info().dims),
        Encoder::Cloud { .. } => None,
    }
}

/// The probe texts as documents: no query template, no `dimensions`.
async fn embed(
    encoder: &Encoder,
    client: Option<&OpenRouterClient>,
    width: usize,
    texts: &[String],
) -> anyhow::Result<Vec<Vec<f32>>> {
    match encoder {
        Encoder::Local(engine) => Ok(engine
            .embed(texts.to_vec(), EmbedOptions::default())
            .await?),
        Encoder::Cloud { model, slug } => {
            let client = client.context("no OpenRouter client")?;
            let allowed = AllowedModel {
                model: model.clone(),
                provider: Some(slug.clone()),
                dims: Some(width),
                note: None,
                quantization: None,
            };
            let route = CloudRoute::from_allowed(Role::Embedding, &allowed)?;
            Ok(client.embed(&route, texts, None, None).await?.vectors)
        }
    }
}

fn report(
    cmd: &GateCommand,
    texts: &[String],
    width: usize,
    judgement: &Judgement,
) -> anyhow::Result<()> {
    let (evidence, reason) = match judgement {
        Judgement::Pass { evidence } => (Some(evidence), None),
        Judgement::Refused { reason, evidence } => (evidence.as_ref(), Some(reason.as_str())),
    };
    let mut out = std::io::stdout().lock();
    if cmd.json {
        let verdict = if judgement.passed() {
            "pass"
        } else {
            "refused"
        };
        let line = json!({
            "a": cmd.a,
            "b": cmd.b,
            "dims": width,
            "verdict": verdict,
            "reason": reason,
            "min_cosine": evidence.map(|e| e.min_cosine),
            "mean_cosine": evidence.map(|e| e.mean_cosine),
            "cosines": evidence.map(|e| &e.cosines),
        });
        writeln!(out, "{line}")?;
    } else {
        if let Some(e) = evidence {
            for (i, (cosine, text)) in e.cosines.iter().zip(texts).enumerate() {
                writeln!(out, "probe {i:>2}  cosine {cosine:.6}  {}", shown(text))?;
            }
            let (min, mean) = (e.min_cosine, e.mean_cosine);
            writeln!(out, "min {min:.6}  mean {mean:.6}  dims {}", e.dims)?;
        }
        match reason {
            None => writeln!(out, "verdict: pass")?,
            Some(reason) => writeln!(out, "verdict: refused: {reason}")?,
        }
    }
    out.flush()?;
    Ok(())
}

/// The first characters of a probe on one line: newlines as ⏎, other controls as spaces.
fn shown(text: &str) -> String {
    text.chars()
        .take(SHOWN_CHARS)
        .map(|c| match c {
            '\n' => '⏎',
            c if c.is_control() => ' ',
            c => c,
        })
        .collect()
}
