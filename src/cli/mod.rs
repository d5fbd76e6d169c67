//! The `fantom-sidecar` command line: argument parsing, logging set-up and the one-shot tools
//! (`embed`, `rerank`, `models`, `gate`). The binary's `main` only calls [`main`].

mod bench;
mod fleet;
mod gate;
mod hub_etcd;
mod input;
mod kernel_check;
mod migration;
mod models;
mod oneshot;
mod progress;
mod projects;
mod reload;
mod stream;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::model::ModelChoice;
use crate::inference::{DTypeSpec, DeviceSpec, EngineConfig};
use crate::model_spec::Pooling;

#[derive(Parser)]
#[command(
    name = "fantom-sidecar",
    version,
    about = "GPU inference sidecar for Fantom MCP Server"
)]
struct Cli {
    /// Log format on stderr: text for people, json for collectors; auto = text on a terminal.
    #[arg(long, value_enum, default_value_t = LogFormat::Auto, global = true)]
    log_format: LogFormat,
    /// Export traces to this OpenTelemetry collector over OTLP/HTTP (protobuf), e.g.
    /// http://127.0.0.1:4318: a hub's request spans (a client's `traceparent` is their parent)
    /// and an agent's work spans, linked to the requests they served.
    #[arg(long, global = true, env = "FANTOM_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Auto,
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Embed texts: JSON Lines of strings on stdin, {"index", "embedding"} lines on stdout.
    Embed(oneshot::EmbedArgs),
    /// Rerank documents against --query: JSON Lines of strings on stdin, {"index", "score"} out.
    Rerank(oneshot::RerankArgs),
    /// Throughput on synthetic rows of an exact length (with --random-weights: any architecture
    /// from its config alone).
    Bench(bench::BenchArgs),
    /// List, fetch and verify pinned models.
    #[command(subcommand)]
    Models(models::ModelsCommand),
    /// The hub: shared role queues, the client/admin APIs and the agents' WebSocket endpoint.
    Hub(Box<fleet::HubCommand>),
    /// An agent: loads local models, dials the hub, pulls work.
    Agent(fleet::AgentCommand),
    /// Hub and one agent in one process: the default for a single machine.
    Serve(Box<fleet::ServeCommand>),
    /// Copy a single hub's state dir into an empty etcd store (once, with every hub stopped),
    /// for hubs that then share it (`hub --etcd-endpoints`).
    MigrateState(Box<hub_etcd::MigrateArgs>),
    /// Compare two embedding routes on the gate's probe texts (exit 0 pass, 1 refused, 2 error).
    Gate(gate::GateCommand),
    /// The hub's projects: keys, weights and limits (through its admin API).
    #[command(subcommand)]
    Projects(projects::ProjectsCommand),
    /// Move an embedding role to another encoder without breaking its index: open a
    /// migration, cut over, close (through the hub's admin API).
    #[command(subcommand)]
    Migration(migration::MigrationCommand),
    /// Run our CUDA kernels on a device against their CPU bodies (exit 1 on a mismatch).
    KernelCheck(kernel_check::KernelCheckArgs),
    /// Shell completions on stdout, generated from this command line: e.g.
    /// `fantom-sidecar completions bash > /etc/bash_completion.d/fantom-sidecar`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The man page (roff) on stdout, generated from this command line: e.g.
    /// `fantom-sidecar man > /usr/local/share/man/man1/fantom-sidecar.1`.
    Man,
}

/// Which model and how to run it (shared by `embed` and `rerank`).
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A pinned model id (see `fantom-sidecar models list`).
    #[arg(long)]
    model: Option<String>,
    /// A folder with the model's files: with --model, the pinned files (verified); alone, any
    /// Hugging Face folder (unpinned).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// With --model-dir: take config.json and tokenizer.json from it and draw the weights at
    /// random (throughput of an architecture without its download; outputs are meaningless).
    /// With --model too: that pinned model's settings (task, pooling, max tokens, prompts,
    /// head) on those random weights, as it would start.
    #[arg(long, requires = "model_dir")]
    random_weights: bool,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// auto (f32 on CPU, bf16 on CUDA), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    dtype: DTypeSpec,
    /// Pooling for an unpinned --model-dir: mean, cls or last.
    #[arg(long)]
    pooling: Option<Pooling>,
    /// Max input tokens (special tokens included); longer inputs are truncated.
    #[arg(long)]
    pub(super) max_tokens: Option<usize>,
    /// Refuse inputs longer than the max tokens instead of truncating them.
    #[arg(long)]
    no_truncate: bool,
    /// Padded tokens per batch (longest row × rows) [default: sized from free memory on a
    /// GPU, 16384 on the CPU]; one that cannot fit in memory is refused at start.
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// Rows per batch.
    #[arg(long, default_value_t = EngineConfig::default().max_batch_rows)]
    max_batch_rows: usize,
    /// How much of the worst-case batch runs at start (auto: all of it on a GPU, one row on
    /// the CPU; full; one-row).
    #[arg(long, default_value = "auto")]
    warmup: crate::inference::Warmup,
    #[command(flatten)]
    pins: PinArgs,
}

/// Where manifests and the lock file are.
#[derive(Args, Clone, Debug)]
pub struct PinArgs {
    /// The lock file that pins digests the manifests leave empty.
    #[arg(long, env = "FANTOM_MODELS_LOCK")]
    lock_file: Option<PathBuf>,
    /// A folder of extra manifests (*.toml), added to the built-in ones.
    #[arg(long)]
    manifests: Option<PathBuf>,
}

impl PinArgs {
    fn source_options(&self) -> anyhow::Result<crate::model_source::SourceOptions> {
        crate::config::model::source_options(self.manifests.as_deref(), self.lock_file.as_deref())
    }
}

impl ModelArgs {
    /// The flags as the one model description the agent's config file also uses.
    pub(crate) fn choice(&self) -> ModelChoice {
        ModelChoice {
            model: self.model.clone(),
            model_dir: self.model_dir.clone(),
            random_weights: self.random_weights,
            device: self.device,
            dtype: self.dtype,
            pooling: self.pooling,
            max_tokens: self.max_tokens,
            no_truncate: self.no_truncate,
            max_batch_tokens: self.max_batch_tokens,
            max_batch_rows: self.max_batch_rows,
            warmup: self.warmup,
            lock_file: self.pins.lock_file.clone(),
            manifests: self.pins.manifests.clone(),
        }
    }
}

/// Dependencies whose trace logs would print frame payloads or headers.
const CAPPED_LOG_TARGETS: [&str; 2] = ["tungstenite", "tokio_tungstenite"];

/// Whether a log target belongs to a capped dependency (the crate or one of its modules).
fn capped(target: &str) -> bool {
    CAPPED_LOG_TARGETS.iter().any(|c| {
        target
            .strip_prefix(c)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    })
}

/// Installs the log output and, with an OTLP endpoint, the trace exporter (returned, to be shut
/// down at exit so the last spans are sent).
fn init_logging(
    format: LogFormat,
    otlp: Option<(&str, &'static str)>,
) -> Result<Option<crate::traces::Exporter>, String> {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // The WebSocket library logs whole frames at trace level, and a config frame carries the
    // OpenRouter key: its logs stop at debug whatever RUST_LOG asks for. A filter of its own,
    // so no directive of RUST_LOG (however specific) can lift it.
    let cap = tracing_subscriber::filter::filter_fn(|meta| {
        *meta.level() != tracing::Level::TRACE || !capped(meta.target())
    });
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let registry = tracing_subscriber::registry().with(cap).with(filter);
    let (exporter, spans) = match otlp {
        Some((endpoint, service)) => {
            let (exporter, layer) = crate::traces::Exporter::new(endpoint, service)?;
            (Some(exporter), Some(layer))
        }
        None => (None, None),
    };
    let registry = registry.with(spans);
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let _ = if json {
        registry.with(layer.json().flatten_event(true)).try_init()
    } else {
        registry.with(layer).try_init()
    };
    Ok(exporter)
}

/// Parses the command line, runs the command, maps errors to exit codes (1: failure; `gate`:
/// 1 refused, 2 error).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            let mut command = Cli::command();
            clap_complete::generate(
                shell,
                &mut command,
                "fantom-sidecar",
                &mut std::io::stdout(),
            );
            return ExitCode::SUCCESS;
        }
        Command::Man => {
            use clap::CommandFactory as _;
            return match clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: cannot write the man page: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let service = match &cli.command {
        Command::Hub(_) => "fantom-sidecar-hub",
        Command::Agent(_) => "fantom-sidecar-agent",
        _ => "fantom-sidecar",
    };
    let otlp = cli.otlp_endpoint.as_deref().map(|e| (e, service));
    let exporter = match init_logging(cli.log_format, otlp) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let done = match cli.command {
            // The gate reports its own errors: its exit code tells a refusal from a failure.
            Command::Gate(cmd) => return Ok::<_, anyhow::Error>(gate::run(cmd).await),
            Command::KernelCheck(args) => return kernel_check::run(args),
            Command::Embed(args) => oneshot::embed(args).await,
            Command::Rerank(args) => oneshot::rerank(args).await,
            Command::Models(cmd) => models::run(cmd).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Hub(cmd) => fleet::hub(*cmd).await,
            Command::Agent(cmd) => fleet::agent(cmd).await,
            Command::Serve(cmd) => fleet::serve(*cmd).await,
            Command::Projects(cmd) => projects::run(cmd).await,
            Command::Migration(cmd) => migration::run(cmd).await,
            Command::MigrateState(args) => hub_etcd::migrate(*args).await,
            Command::Completions { .. } | Command::Man => Ok(()),
        };
        done.map(|()| ExitCode::SUCCESS)
    });
    drop(runtime);
    if let Some(exporter) = exporter {
        exporter.shutdown();
    }
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
