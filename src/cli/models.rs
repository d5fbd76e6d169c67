//! `models`: list the pinned manifests; fetch and verify one (downloading at its pin if needed)
//! and print what was resolved.

use clap::Subcommand;

use super::PinArgs;
use crate::model_source::{self, ModelSelector, SpecOverrides};

#[derive(Subcommand)]
pub enum ModelsCommand {
    /// The pinned models this binary knows.
    List {
        #[command(flatten)]
        pins: PinArgs,
    },
    /// Resolve a pinned model (HF cache, else download at the pin, or --model-dir), verify
    /// every file's digest, and print the provenance as JSON.
    Verify {
        /// The pinned model id.
        id: String,
        /// Take the files from this folder instead of the Hugging Face cache.
        #[arg(long)]
        model_dir: Option<std::path::PathBuf>,
        #[command(flatten)]
        pins: PinArgs,
    },
}

pub async fn run(cmd: ModelsCommand) -> anyhow::Result<()> {
    match cmd {
        ModelsCommand::List { pins } => {
            let opts = pins.source_options()?;
            for m in opts.registry.iter() {
                let pinned = m.files.values().filter(|d| d.is_some()).count();
                println!(
                    "{:<24} {:<7} {:>5}  {}@{}  ({} of {} digests in the manifest)",
                    m.id,
                    m.spec.task.to_string(),
                    m.spec
                        .dims
                        .map(|d| d.to_string())
                        .unwrap_or_else(|| "-".into()),
                    m.repo,
                    &m.revision.as_str()[..12],
                    pinned,
                    m.files.len()
                );
            }
            Ok(())
        }
        ModelsCommand::Verify {
            id,
            model_dir,
            pins,
        } => {
            let opts = pins.source_options()?;
            let task = opts.registry.get(&id)?.spec.task;
            let selector = ModelSelector::Pinned { id, dir: model_dir };
            let resolved =
                model_source::resolve(&selector, task, &SpecOverrides::default(), &opts).await?;
            println!("{}", serde_json::to_string_pretty(&resolved.provenance)?);
            Ok(())
        }
    }
}
