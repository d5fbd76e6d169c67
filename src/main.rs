//! The `fantom-sidecar` binary: everything lives in the library; see `fantom_sidecar::cli`.

fn main() -> std::process::ExitCode {
    fantom_sidecar::cli::main()
}
