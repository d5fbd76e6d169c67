//! `fantom-sidecar kernel-check`: runs our kernels ([`crate::inference::kernels`]) on a device
//! and compares each with its CPU body. One JSON line per check on stdout, a table on stderr,
//! exit 1 when any check fails (the GPU script calls it: no cargo on the GPU machine).

use clap::Args;

use crate::inference::device;
use crate::inference::kernel_check;
use crate::inference::{DTypeSpec, DeviceSpec};

#[derive(Args)]
pub struct KernelCheckArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: DeviceSpec,
}

pub fn run(args: KernelCheckArgs) -> anyhow::Result<std::process::ExitCode> {
    let (device, _) = device::open(args.device, DTypeSpec::Auto)?;
    let checks = kernel_check::self_check(&device)?;
    for c in &checks {
        println!("{}", serde_json::to_string(c)?);
    }
    let failed = checks.iter().filter(|c| !c.passed).count();
    eprintln!(
        "{:<16} {:<44} {:>12} {:>6}",
        "kernel", "case", "max |diff|", "ok"
    );
    for c in &checks {
        eprintln!(
            "{:<16} {:<44} {:>12.3e} {:>6}",
            c.kernel,
            c.case,
            c.max_abs_diff,
            if c.passed { "yes" } else { "NO" }
        );
    }
    eprintln!(
        "{} checks on {}, {failed} failed",
        checks.len(),
        args.device
    );
    Ok(if failed == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}
