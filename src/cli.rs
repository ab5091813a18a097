//! The `walletlock` command line: one subcommand per job.

use crate::app::{Application, connect};
use crate::config::{DatabaseArgs, RedisArgs, ServeArgs};
use crate::generated_docs;
use crate::http::server::shutdown_signal;
use crate::ledger::{books, schema};
use crate::telemetry::LogFormat;
use crate::tutorial::{self, Demo, Sandbox};
use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use secrecy::ExposeSecret;
use std::collections::HashMap;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "walletlock",
    version,
    about = "Wallet replicas that never lose or double-apply a payment: a Redis lease per wallet, a fenced Postgres commit."
)]
pub struct Cli {
    /// Log format: pretty for people, json for log collectors (one object per line; compose and
    /// Kubernetes use it).
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "pretty", global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API (one replica). Stops on SIGTERM or SIGINT after draining.
    // Boxed: its settings make this variant many times larger than the others.
    Serve(Box<ServeArgs>),
    /// Apply the database migrations (safe to run from several replicas at once). Run it as the
    /// tables' owner; with --app-role, also grant that role what the replicas need, and no more.
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The role the replicas connect as (e.g. walletlock_app); it must exist.
        #[arg(long, env = "APP_ROLE")]
        app_role: Option<String>,
    },
    /// Check the books: every balance equals its ledger, nothing negative, versions and fences
    /// only grow, every stored idempotent success has exactly one ledger entry. Prints one line
    /// per problem and exits 1 if there is any.
    Audit {
        #[command(flatten)]
        database: DatabaseArgs,
        /// Check the ledger against what clients were told too (the bank check of a load): a file
        /// of acknowledgements, one JSON object a line (`ledger::books::Ack`); then the last line
        /// is `accepted=N balance=B expected=E OK|BROKEN` over the wallets it opened.
        #[arg(long)]
        acks: Option<std::path::PathBuf>,
        /// First settle each undecided operation of the acknowledgements as a client would: send
        /// its request again with its key to this API (http://127.0.0.1:8080, say) until an answer
        /// decides it, for a minute at most.
        #[arg(long, requires = "acks")]
        settle: Option<String>,
        /// The bearer token `--settle` sends, if the API wants one.
        #[arg(long, env = "API_TOKEN", hide_env_values = true)]
        api_token: Option<String>,
    },
    /// Export a wallet's entries, oldest first, to stdout, as `GET /wallets/{id}/entries` with
    /// `Accept: text/csv` (or NDJSON) does: each line with the cursor to resume from. For an
    /// operator, as the tables' owner; it reads 1,000 entries at a time.
    Export {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The wallet's id.
        #[arg(long)]
        wallet: String,
        /// Entries written at or after this instant (RFC 3339).
        #[arg(long)]
        from: Option<chrono::DateTime<chrono::Utc>>,
        /// Entries written before this instant (RFC 3339).
        #[arg(long)]
        to: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long, value_enum, default_value = "csv")]
        format: ExportFormat,
        /// Resume after this cursor (the last line's).
        #[arg(long)]
        cursor: Option<String>,
    },
    /// The events of every wallet (`GET /events` without scope), for an operator, as the tables'
    /// owner.
    Events {
        #[command(subcommand)]
        command: EventsCommand,
    },
    /// Load the lease scripts into Redis as the Functions library `walletlock` (replacing an older
    /// one): on the node, on the primary Sentinel names, or on every primary of a Cluster. Run it
    /// as an administrator (REDIS_URL with a user that may FUNCTION LOAD) from the deploy step; the
    /// replicas' user then only needs FCALL.
    RedisFunctions {
        #[command(flatten)]
        redis: RedisArgs,
        /// Stay running and keep the library loaded: check every this long (`1s`, say) and load
        /// it again whenever Redis lost it (a restart without persistence, a replica promoted that
        /// never had it). Without it, load once and exit.
        #[arg(long, env = "REDIS_FUNCTIONS_KEEP", value_parser = crate::config::duration)]
        keep: Option<std::time::Duration>,
    },
    /// Print a fresh random API token (256 bits, hex), for API_TOKENS as `caller:<token>`.
    Token,
    /// GET a URL and exit 0 on a 2xx answer, 1 otherwise: the container health check.
    Probe(ProbeArgs),
    /// Run one of the tutorial's experiments against real Redis and Postgres, in a throwaway
    /// schema, and print its verdict.
    Demo {
        #[arg(value_enum)]
        name: Demo,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Print the settings table of docs/operating/settings.md (every environment variable of every
    /// command, with its flag, default and help, as declared here).
    Settings {
        /// Put the table into docs/operating/settings.md instead (run from the repository's root).
        #[arg(long)]
        write: bool,
    },
    /// Print the table of docs/api/errors.md: every error code, its HTTP status and what it means.
    ErrorCodes {
        /// Put the table into docs/api/errors.md instead (run from the repository's root).
        #[arg(long)]
        write: bool,
    },
    /// Print the table of docs/operating/observability.md: every metric a replica exports, its
    /// labels, its type and what it counts.
    Metrics {
        /// Put the table into docs/operating/observability.md instead (run from the repository's root).
        #[arg(long)]
        write: bool,
    },
    /// The load tests' tools (loadtest/README.md), which loadtest/run and loadtest/bench call.
    #[command(subcommand)]
    Loadtest(LoadtestCommand),
    /// Print a replica's live figures from its /metrics in one row (`deploy/local status`):
    /// payments accepted, the p99 of its API answers, leases taken and their mean wait, writes the
    /// fence refused, resident memory.
    Figures {
        /// The replica's address (127.0.0.1:8081).
        #[arg(required_unless_present = "header")]
        replica: Option<String>,
        /// Print the columns' titles instead.
        #[arg(long)]
        header: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum LoadtestCommand {
    /// Write the table of a `loadtest/bench` run, DIR/bench.md and DIR/bench.json (for
    /// loadtest/chart.py), from DIR/runs.tsv and each run's files, and print it with the targets.
    /// Exits 1 if any run that moves money has books that are not OK.
    Report {
        /// The run's results (loadtest/results/bench-<time>).
        dir: std::path::PathBuf,
        /// The repository, whose commit the table names and to which it puts DIR's path.
        #[arg(long, default_value = ".")]
        root: std::path::PathBuf,
    },
    /// Print a line per replica deploy/local runs under STATE (replica-N/walletlock.pid): NAME PID
    /// VmHWM_kB VmRSS_kB UPTIME_S, its peak and present resident memory and its seconds up (what
    /// loadtest/run keeps as rss.txt, and `report` reads).
    Rss { state: std::path::PathBuf },
    /// What a run cost Postgres and Redis, from their own statistics (loadtest/run's COSTS=1).
    #[command(subcommand)]
    Costs(CostsCommand),
    /// Until SIGTERM (or until process WHILE ends), sample every second the CPU that processes
    /// outside the trees of the ROOT pids use; then write into OUT, as JSON, wall_s, other_cpu_s,
    /// other_pct (of all cores) and the top 5 commands.
    OtherCpu {
        out: std::path::PathBuf,
        #[arg(long = "while", value_name = "PID")]
        while_pid: u32,
        #[arg(required = true)]
        roots: Vec<u32>,
    },
}

#[derive(Debug, Subcommand)]
pub enum CostsCommand {
    /// ANALYZE of the walletlock database and CHECKPOINT on every Postgres node, so that the
    /// measured run is planned on its tables as they are and no checkpoint runs beside it.
    Checkpoint(PgNode),
    /// Write the cumulative counters of Postgres (summed over a Citus cluster) and of each Redis
    /// primary into OUT (JSON).
    Snapshot {
        out: std::path::PathBuf,
        #[command(flatten)]
        pg: PgNode,
        /// deploy/local's Redis directory (its nodes' node-PORT/redis.pid).
        #[arg(long)]
        redis_state: std::path::PathBuf,
        /// The file of Redis's `admin` password.
        #[arg(long)]
        redis_auth: std::path::PathBuf,
    },
    /// Write OUT (costs.json): AFTER - BEFORE, less BEFORE's own queries, per accepted payment
    /// (per request for runs that move no money, as SUMMARY, k6's summary.json, says); print it.
    Report {
        before: std::path::PathBuf,
        after: std::path::PathBuf,
        summary: std::path::PathBuf,
        out: std::path::PathBuf,
    },
}

/// A Postgres node as deploy/local runs it, reached as the superuser over its socket.
#[derive(Debug, clap::Args)]
pub struct PgNode {
    /// The directory of the node's socket.
    #[arg(long)]
    pg_socket: String,
    #[arg(long)]
    pg_port: u16,
}

/// `walletlock probe`: a health check for container runtimes that have no curl.
#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// The URL to GET; the probe succeeds on a 2xx answer.
    #[arg(default_value = "http://127.0.0.1:8080/readyz", env = "PROBE_URL")]
    pub url: String,
    /// How long to wait for the answer.
    #[arg(long, default_value = "2s", value_parser = crate::config::duration)]
    pub timeout: std::time::Duration,
}

impl Cli {
    /// Parses the command line. A bad value ends the process with one line that names it and a
    /// non-zero status; `--help` and `--version` print and exit 0.
    pub fn parse_or_exit() -> Self {
        match Self::try_parse() {
            Ok(cli) => cli,
            Err(err) if !err.use_stderr() => err.exit(),
            Err(err) => {
                let rendered = err.render().to_string();
                eprintln!("{}", rendered.lines().next().unwrap_or("error: invalid arguments"));
                std::process::exit(2);
            }
        }
    }
}

/// Sends each undecided operation of `acks` again with its key to the API at `url` until an
/// answer decides it (a minute at most for them all), and puts what the answer told in its place.
async fn settle_acks(
    url: &str,
    token: Option<&str>,
    acks: Vec<books::Ack>,
) -> anyhow::Result<Vec<books::Ack>> {
    use books::Ack;
    let client = reqwest::Client::builder().timeout(std::time::Duration::from_secs(30)).build()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let (mut settled, mut holds, mut undecided, mut charged) = (Vec::new(), HashMap::new(), 0, 0);
    for ack in acks {
        let Ack::Undecided(op) = ack else {
            settled.push(ack);
            continue;
        };
        undecided += 1;
        let outcome = loop {
            let mut request = client
                .post(format!("{}{}", url.trim_end_matches('/'), op.path))
                .header("content-type", "application/json")
                .header("idempotency-key", &op.key)
                .body(op.body.clone().unwrap_or_default());
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let answer = match request.send().await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let body = response.bytes().await.unwrap_or_default();
                    (status, serde_json::from_slice(&body).unwrap_or_default())
                }
                Err(_) => (0, serde_json::Value::Null),
            };
            if let Some(outcome) = op.settled(answer.0, &answer.1) {
                break outcome;
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "could not settle {} (last answer: HTTP {} {})",
                op.key,
                answer.0,
                answer.1["code"]
            );
            // In flight (a claim that turns stale after IDEMPOTENCY_STALE_AFTER), or no answer yet.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        };
        holds.extend(outcome.hold);
        if let Some(ack) = outcome.ack {
            charged += usize::from(matches!(ack, Ack::Applied { .. }));
            settled.push(ack);
        }
    }
    for ack in &mut settled {
        if let Ack::Hold { hold, told, .. } = ack
            && let Some(settled) = holds.get(hold)
        {
            *told = *settled;
        }
    }
    if undecided > 0 {
        println!("settled {undecided} undecided operations by replaying their keys: {charged} charged");
    }
    Ok(settled)
}

/// Waits until every hold of `acks` its client was told expired has expired (a second past the
/// last `expires_at`, two minutes at most: one that expires later is a problem, not waited for).
async fn wait_for_expiry(conn: &mut sqlx::PgConnection, acks: &[books::Ack]) -> anyhow::Result<()> {
    let [placed, captured, voided, expired] = books::holds_told(acks);
    if placed == 0 {
        return Ok(());
    }
    let wait = match books::last_expiry(conn, acks).await? {
        Some(last) => (last + chrono::Duration::seconds(1) - chrono::Utc::now()).to_std().unwrap_or_default(),
        None => std::time::Duration::ZERO,
    }
    .min(std::time::Duration::from_secs(120));
    tokio::time::sleep(wait).await;
    println!(
        "holds: {placed} placed: {captured} captured, {voided} voided, {expired} expired (left alone, or their \
         capture or void refused); waited {:.1} s for the last expiry",
        wait.as_secs_f64()
    );
    Ok(())
}

/// The formats of `walletlock export`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExportFormat {
    Csv,
    Ndjson,
}

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(args) => {
            Application::build(&args).await?.run_until_stopped(shutdown_signal()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate { database, app_role } => {
            let pool = connect::postgres_pool(&database)?;
            schema::migrate(&pool).await?;
            tracing::info!("migrations applied");
            if let Some(role) = app_role {
                schema::grant_app_role(&pool, &role).await?;
                tracing::info!(role, "privileges granted");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Audit { database, acks, settle, api_token } => {
            // Read first: a file that cannot be read is a usage error, not a broken ledger.
            let acks = match acks {
                Some(path) => {
                    let text = std::fs::read_to_string(&path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    let acks =
                        books::parse(&text).map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))?;
                    Some(acks)
                }
                None => None,
            };
            let acks = match (acks, settle) {
                (Some(acks), Some(url)) => Some(settle_acks(&url, api_token.as_deref(), acks).await?),
                (acks, _) => acks,
            };
            let pool = connect::postgres_pool(&database)?;
            let mut conn = pool.acquire().await?;
            if let Some(acks) = &acks {
                wait_for_expiry(&mut conn, acks).await?;
            }
            let report = crate::ledger::audit::run(&mut conn).await?;
            for problem in &report.problems {
                println!("{problem}");
            }
            let summary = format!(
                "{} wallets, {} ledger entries, {} transfers, {} holds, {} idempotent responses",
                report.wallets, report.entries, report.transfers, report.holds, report.keys
            );
            if report.problems.is_empty() {
                println!(
                    "audit OK: {summary}; every balance equals its ledger, every transfer has its two legs, \
                     no refund exceeds what it refunds, every wallet holds what its active holds add up to, \
                     every velocity window counts what the ledger debited in it, money is conserved"
                );
            } else {
                println!("audit FAILED: {} problems in {summary}", report.problems.len());
            }
            let mut ok = report.problems.is_empty();
            if let Some(acks) = acks {
                let books = books::check(&acks, &books::read(&mut conn, &acks).await?);
                for problem in &books.problems {
                    println!("{problem}");
                }
                println!(
                    "books: {} wallets, {} movements acknowledged as applied",
                    books.wallets, books.accepted
                );
                println!("{}", books.verdict());
                ok &= books.problems.is_empty();
            }
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Command::Export { database, wallet, from, to, format, cursor } => {
            export(&database, &wallet, from, to, format, cursor.as_deref()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Events { command: EventsCommand::Tail { database, after, from_start, wallet, types } } => {
            let start = match (after, from_start) {
                (Some(after), _) => Start::After(after),
                (None, true) => Start::First,
                (None, false) => Start::Now,
            };
            tokio::select! {
                tailed = tail_events(&database, start, wallet, types) => tailed?,
                () = shutdown_signal() => {}
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Events { command: EventsCommand::Listen { listen, secret, quiet } } => {
            crate::http::listen::listen(listen, secret, quiet).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::RedisFunctions { redis, keep } => {
            let pool = connect::redis_pool(&redis)?.0;
            let library = crate::lease::load_library(&pool).await?;
            tracing::info!(library, "lease scripts loaded as Redis Functions");
            if let Some(every) = keep {
                // Until stopped: as a container's first process it must end on SIGTERM itself.
                tokio::select! {
                    () = crate::lease::keep_library(&pool, every) => {}
                    () = crate::http::server::shutdown_signal() => {}
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Token => {
            println!("{:032x}{:032x}", rand::random::<u128>(), rand::random::<u128>());
            Ok(ExitCode::SUCCESS)
        }
        Command::Probe(probe) => Ok(match crate::http::probe(&probe.url, probe.timeout).await {
            Ok(status) if (200..300).contains(&status) => ExitCode::SUCCESS,
            Ok(status) => {
                eprintln!("{}: HTTP {status}", probe.url);
                ExitCode::FAILURE
            }
            Err(err) => {
                eprintln!("{}: {err}", probe.url);
                ExitCode::FAILURE
            }
        }),
        Command::Demo { name, database, redis } => {
            let sandbox =
                Sandbox::create(database.database_url.expose_secret(), connect::redis_pool(&redis)?.0)
                    .await?;
            let outcome = tutorial::run(name, &sandbox).await;
            sandbox.drop().await?;
            for line in outcome? {
                println!("{line}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Settings { write } => {
            let table = generated_docs::settings_table(&Cli::command());
            print_or_write(&generated_docs::SETTINGS, &table, write)
        }
        Command::ErrorCodes { write } => {
            let table = crate::http::error::codes::markdown_table();
            print_or_write(&generated_docs::ERROR_CODES, &table, write)
        }
        Command::Metrics { write } => {
            let table = crate::telemetry::metrics::markdown_table();
            print_or_write(&generated_docs::METRICS, &table, write)
        }
        Command::Loadtest(LoadtestCommand::Report { dir, root }) => {
            Ok(if crate::loadtest::report::report(&dir, &root)? {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Loadtest(LoadtestCommand::Rss { state }) => {
            print!("{}", crate::loadtest::rss::rss(&state, crate::loadtest::clock_ticks()));
            Ok(ExitCode::SUCCESS)
        }
        Command::Loadtest(LoadtestCommand::OtherCpu { out, while_pid, roots }) => {
            crate::loadtest::other_cpu::run(&out, while_pid, roots).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Loadtest(LoadtestCommand::Costs(command)) => {
            use crate::loadtest::costs;
            let node = |pg: PgNode| costs::Node { socket: pg.pg_socket, port: pg.pg_port };
            match command {
                CostsCommand::Checkpoint(pg) => costs::checkpoint(&node(pg)).await?,
                CostsCommand::Snapshot { out, pg, redis_state, redis_auth } => {
                    let snapshot = costs::snapshot(&node(pg), &redis_state, &redis_auth).await?;
                    std::fs::write(out, serde_json::to_string_pretty(&snapshot)?)?;
                }
                CostsCommand::Report { before, after, summary, out } => {
                    let [before, after, summary] = [before, after, summary].map(|path| {
                        let text =
                            std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
                        anyhow::Ok(serde_json::from_str::<serde_json::Value>(&text)?)
                    });
                    let (costs, line) = costs::report(&before?, &after?, &summary?);
                    std::fs::write(out, serde_json::to_string_pretty(&costs)?)?;
                    println!("{line}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Figures { replica, header } => {
            use crate::telemetry::figures;
            let Some(replica) = replica.filter(|_| !header) else {
                println!("{}", figures::header());
                return Ok(ExitCode::SUCCESS);
            };
            let client = reqwest::Client::builder().timeout(std::time::Duration::from_secs(1)).build()?;
            let scrape = client.get(format!("http://{replica}/metrics")).send().await?;
            println!("{}", figures::row(&scrape.error_for_status()?.text().await?));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A generated table: printed, or with `write` put into its page of docs/.
fn print_or_write(
    generated: &generated_docs::GeneratedTable,
    table: &str,
    write: bool,
) -> anyhow::Result<ExitCode> {
    if write {
        generated.write(table)?;
        println!("{} updated", generated.page);
    } else {
        print!("{table}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `walletlock export`: the wallet's entries in `[from, to)` after `cursor`, a chunk at a time
/// (as the API's export reads them), each written out before the next is read.
async fn export(
    database: &DatabaseArgs,
    wallet: &str,
    from: Option<chrono::DateTime<chrono::Utc>>,
    to: Option<chrono::DateTime<chrono::Utc>>,
    format: ExportFormat,
    cursor: Option<&str>,
) -> anyhow::Result<()> {
    use crate::http::history::{Cursor, EXPORT_CHUNK, Export};
    use crate::ledger::history::{EntryFilter, Order};
    use std::io::Write;
    let format = match format {
        ExportFormat::Csv => Export::Csv,
        ExportFormat::Ndjson => Export::Ndjson,
    };
    let after = cursor.map(|cursor| Cursor::parse(cursor, Order::Asc)).transpose()?;
    let pool = connect::postgres_pool(database)?;
    if crate::ledger::find_wallet(&mut *pool.acquire().await?, wallet).await?.is_none() {
        anyhow::bail!("no wallet has the id {wallet}");
    }
    let filter = EntryFilter { from, to, after, limit: EXPORT_CHUNK, ..EntryFilter::default() };
    let mut chunks = Box::pin(crate::ledger::history::chunks(pool, wallet.to_owned(), filter));
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    out.write_all(format.header().as_bytes())?;
    while let Some(chunk) = futures::TryStreamExt::try_next(&mut chunks).await? {
        for entry in chunk {
            out.write_all(format.line(entry, Order::Asc).as_bytes())?;
        }
        out.flush()?;
    }
    Ok(())
}

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Print the events as they are written, one JSON object a line (as `GET /events` shows
    /// each), until stopped: from now on, or from the first, or after a cursor.
    Tail {
        #[command(flatten)]
        database: DatabaseArgs,
        /// Start after this cursor (an event's `cursor`, or a page's `next`).
        #[arg(long, conflicts_with = "from_start")]
        after: Option<String>,
        /// Start from the first event ever written, not from now.
        #[arg(long)]
        from_start: bool,
        /// The events of this wallet only.
        #[arg(long)]
        wallet: Option<String>,
        /// Events of these types only, comma-separated (`payment.accepted,refund.accepted`).
        #[arg(long = "type", value_delimiter = ',')]
        types: Vec<String>,
    },
    /// Receive webhooks as an endpoint would, on this machine (for a developer, or the bench):
    /// verify each delivery's signature, print each event (one JSON line), and answer
    /// `GET /stats` with what arrived (events, duplicates, bad signatures, lag percentiles).
    Listen {
        /// Where to listen; register `http://<this>/` as the endpoint's URL (deploy/local allows
        /// 127.0.0.1).
        #[arg(long, default_value = "127.0.0.1:9000")]
        listen: std::net::SocketAddr,
        /// The endpoint's signing secret (`whsec_...`), as registering it answered.
        #[arg(long, env = "WEBHOOK_SECRET")]
        secret: String,
        /// Print nothing per event (a bench reads `GET /stats`).
        #[arg(long)]
        quiet: bool,
    },
}

/// Where `walletlock events tail` starts.
enum Start {
    Now,
    First,
    After(String),
}

async fn tail_events(
    database: &DatabaseArgs,
    start: Start,
    wallet: Option<String>,
    types: Vec<String>,
) -> anyhow::Result<()> {
    use crate::domain::{EventCursor, EventType, WalletId};
    use crate::ledger::event::{self, EventFilter};
    use std::io::Write;
    let types = types
        .iter()
        .map(|name| EventType::parse(name).with_context(|| format!("{name:?} is not an event type")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let wallet_id = wallet.map(|id| WalletId::parse(&id).map(|id| id.as_str().to_owned())).transpose()?;
    let pool = connect::postgres_pool(database)?;
    let after = match start {
        Start::First => None,
        Start::After(cursor) => {
            Some(EventCursor::parse(&cursor).context("--after: not a cursor of the feed")?)
        }
        // Every event below the horizon is written already: the next ones are at or above it.
        Start::Now => {
            let horizon = event::horizon(&mut *pool.acquire().await?).await?;
            Some(EventCursor { position: horizon, wallet_id: String::new(), seq: 0 })
        }
    };
    let mut filter = EventFilter { after, types, wallet_id, limit: 500, ..EventFilter::default() };
    let mut out = std::io::stdout().lock();
    loop {
        let page = {
            let mut conn = pool.acquire().await?;
            let horizon = event::horizon(&mut conn).await?;
            event::page(&mut conn, &filter, horizon).await?
        };
        if page.is_empty() {
            tokio::time::sleep(crate::wallet::WAIT_TICK).await;
            continue;
        }
        for stored in page {
            filter.after = Some(stored.cursor.clone());
            let line = serde_json::to_string(&crate::http::events::EventBody::from(stored))?;
            writeln!(out, "{line}")?;
        }
        out.flush()?;
    }
}
