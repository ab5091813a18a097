//! Logging and metrics. Logs: `tracing` to stderr, human-readable or one JSON object per line;
//! metrics: the Prometheus recorder, in [`metrics`].
//!
//! The log filter comes from `RUST_LOG` when set (e.g. `RUST_LOG=walletlock=debug` shows every lease
//! acquisition and release), else `info`. Secrets never reach a log line: the URLs that may carry
//! passwords are `SecretString`s, which print as `[REDACTED]`.

pub mod figures;
pub mod metrics;

use std::io::IsTerminal;
use tracing_subscriber::{EnvFilter, fmt};

/// How log lines are written (`LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx::postgres::notice=warn"));
    // Colours only for a terminal: escape codes in a log file or a collector are noise.
    let builder =
        fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    // A second initialisation (tests that start several servers in one process) keeps the first.
    let _ = match format {
        LogFormat::Pretty => builder.try_init(),
        LogFormat::Json => {
            builder.json().flatten_event(true).with_current_span(true).with_span_list(false).try_init()
        }
    };
}
