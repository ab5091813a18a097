//! The `walletlock` binary: parses the command line, starts logging, runs the subcommand.

use std::process::ExitCode;
use walletlock::cli::{self, Cli};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse_or_exit();
    walletlock::telemetry::init(cli.log_format);
    match cli::run(cli).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
