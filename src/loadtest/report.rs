//! `walletlock loadtest report DIR`: the table of a `loadtest/bench` run. Reads DIR/runs.tsv and
//! each run's files; writes DIR/bench.json (for loadtest/chart.py) and DIR/bench.md (table,
//! targets, method, machine); prints the table and the targets.

use anyhow::{Context, anyhow};
use serde_json::{Map, Value, json};

use std::path::Path;

const S: &str = "walletlock: spread";
const H: &str = "walletlock: hot";
const T: &str = "walletlock: transfer";
const BULK: &str = "walletlock: bulk";
const NO_EVENTS: &str = "walletlock: spread, events off";
const HOOKS: &str = "walletlock: spread, webhooks";
const CITUS: &str = "Citus: spread";

/// What a target compares: its runs' rows by label, the first `a`, the second `b`.
#[derive(Clone, Copy, PartialEq)]
enum TargetKind {
    /// rps of a ÷ rps of b ≥ bound (no bound: stated).
    Ratio,
    /// a's p99 ≤ bound ms.
    P99,
    /// a's rps ≥ bound.
    Rate,
    LockTimeout,
    /// Every replica's peak RSS < bound bytes.
    Rss,
    /// costs.json's per_unit statements or wal_flushes of a ≤ bound.
    PerUnit(&'static str),
    /// a's p99 ≤ bound × b's.
    P99Ratio,
    /// a's WAL flushes per unit ≤ b's + bound.
    Flushes,
    /// The webhooks' event lag p99 ≤ bound s, every event delivered.
    Lag,
    /// A webhook backlog drains at ≥ bound × the payment rate, every event delivered.
    Drain,
}

/// The issues' targets, in order.
const TARGETS: &[(TargetKind, &str, &[&str], Option<f64>)] = &[
    (TargetKind::Ratio, "spread payments/s ÷ read requests/s ≥ 0.6", &[S, "walletlock: read"], Some(0.6)),
    (TargetKind::Ratio, "hot payments/s ÷ pgbench hot tps ≥ 1.5", &[H, "pgbench: hot"], Some(1.5)),
    (TargetKind::P99, "spread p99 ≤ 50 ms", &[S], Some(50.0)),
    (TargetKind::P99, "hot p99 ≤ 30 ms", &[H], Some(30.0)),
    (TargetKind::LockTimeout, "hot: zero lock_timeout", &[H], Some(0.0)),
    // Over single requests: a batch of up to 1,000 items (a body of up to 1 MiB) takes more.
    (TargetKind::Rss, "every replica's peak RSS < 50 MB (single requests)", &[], Some(50e6)),
    (TargetKind::Ratio, "hot: under Postgres alone ÷ on leases (stated)", &["Redis gone: hot", H], None),
    (
        TargetKind::Ratio,
        "spread: under Postgres alone ÷ on leases (stated)",
        &["Redis gone: spread", S],
        None,
    ),
    (TargetKind::PerUnit("statements"), "spread: statements per payment ≤ 2", &[S], Some(2.0)),
    (TargetKind::PerUnit("wal_flushes"), "spread: WAL flushes per payment ≤ 0.25", &[S], Some(0.25)),
    // Issue 33 (one movement model): transfers and splits against spread payments.
    (TargetKind::Ratio, "transfers/s ÷ spread payments/s ≥ 0.6", &[T, S], Some(0.6)),
    (TargetKind::Ratio, "3-leg splits/s ÷ spread payments/s ≥ 0.5", &["walletlock: split", S], Some(0.5)),
    (TargetKind::PerUnit("statements"), "transfer: statements per transfer ≤ 2", &[T], Some(2.0)),
    (TargetKind::PerUnit("wal_flushes"), "transfer: WAL flushes per transfer ≤ 0.3", &[T], Some(0.3)),
    (TargetKind::P99Ratio, "transfer p99 ≤ 1.5x spread p99", &[T, S], Some(1.5)),
    // Issue 38 (past the one-request ceiling): payments in batches of 100 (and of 1,000) against
    // Postgres writing 32 payments and their ledger rows to a transaction.
    (TargetKind::Rate, "bulk: payments in batches of 100 ≥ 20,000/s", &[BULK], Some(20_000.0)),
    (
        TargetKind::Ratio,
        "bulk payments/s ÷ batched pgbench payments/s ≥ 0.3",
        &[BULK, "pgbench: batched"],
        Some(0.3),
    ),
    (TargetKind::P99, "a batch of 1,000's p99 ≤ 500 ms", &["walletlock: bulk of 1,000"], Some(500.0)),
    // ... and rounds that stay batched on Citus (a coordinator and two workers on these cores),
    // their costs summed over the three nodes.
    (TargetKind::Ratio, "spread: on Citus ÷ on one Postgres ≥ 0.5", &[CITUS, S], Some(0.5)),
    (
        TargetKind::PerUnit("wal_flushes"),
        "Citus spread: WAL flushes per payment ≤ 0.35",
        &[CITUS],
        Some(0.35),
    ),
    (TargetKind::PerUnit("statements"), "Citus spread: statements per payment ≤ 1", &[CITUS], Some(1.0)),
    (
        TargetKind::Ratio,
        "spread with metadata ÷ spread payments/s ≥ 0.9",
        &["walletlock: spread with metadata", S],
        Some(0.9),
    ),
    // Issue 37 (limits), issue 36 (events and webhooks).
    (
        TargetKind::Ratio,
        "spread with daily and monthly limits ÷ spread payments/s ≥ 0.9",
        &["walletlock: spread with limits", S],
        Some(0.9),
    ),
    (TargetKind::Ratio, "spread ÷ spread with events off payments/s ≥ 0.9", &[S, NO_EVENTS], Some(0.9)),
    (
        TargetKind::Flushes,
        "spread: WAL flushes per payment with events ≤ with them off + 0.01",
        &[S, NO_EVENTS],
        Some(0.01),
    ),
    (TargetKind::Ratio, "spread with a webhook endpoint ÷ spread payments/s (stated)", &[HOOKS, S], None),
    (
        TargetKind::Lag,
        "webhooks: event lag p99 ≤ 1 s with the receiver healthy, every event delivered",
        &[HOOKS],
        Some(1.0),
    ),
    (
        TargetKind::Drain,
        "webhooks: a backlog drains at ≥ 2x the payment rate, every event delivered",
        &["walletlock: spread, webhooks after"],
        Some(2.0),
    ),
];

/// The cost columns: (header, key in costs.json's per_unit).
const COSTS: [(&str, &str); 4] = [
    ("WAL flushes/payment", "wal_flushes"),
    ("transactions/payment", "transactions"),
    ("statements/payment", "statements"),
    ("Redis commands/payment", "redis_commands"),
];

/// Whether a target was met: yes, no, not measured (`?`), or stated without a bound (`-`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Met {
    Yes,
    No,
    Unknown,
    Stated,
}

impl Met {
    pub fn from(met: bool) -> Self {
        if met { Met::Yes } else { Met::No }
    }
    fn json(self) -> Value {
        match self {
            Met::Yes => Value::Bool(true),
            Met::No => Value::Bool(false),
            Met::Unknown => Value::Null,
            Met::Stated => Value::from("-"),
        }
    }
    fn cell(self) -> &'static str {
        match self {
            Met::Yes => "yes",
            Met::No => "no",
            Met::Unknown => "?",
            Met::Stated => "-",
        }
    }
}

/// A run's row: a JSON object (indexing a missing key gives null).
type Row = Value;

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn maybe_json(path: &Path) -> Value {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null)
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// A number as Python's str() writes it: 3, 3.5, 1e-05.
pub(super) fn py(v: &Value) -> String {
    match v {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(0.0);
            if x.fract() == 0.0 && x.abs() < 1e16 { format!("{x:.1}") } else { format!("{x}") }
        }
        Value::String(s) => s.clone(),
        Value::Null => "None".to_owned(),
        other => other.to_string(),
    }
}

/// X with thousands separators and DIGITS decimals (Python's `{:,.Nf}`).
fn thousands(x: f64, digits: usize) -> String {
    let text = format!("{:.*}", digits, x.abs());
    let (whole, fraction) = text.split_once('.').map_or((text.as_str(), None), |(w, f)| (w, Some(f)));
    let mut grouped = String::new();
    for (i, digit) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    let sign = if x < 0.0 && text.chars().any(|c| c.is_ascii_digit() && c != '0') { "-" } else { "" };
    format!("{sign}{grouped}{}", fraction.map(|f| format!(".{f}")).unwrap_or_default())
}

/// An integer-valued figure with separators (`{:,}`): 1,234, or 1,234.0 for a float.
fn count(v: &Value) -> String {
    match v {
        Value::Number(n) if n.is_f64() => thousands(num(v), 1),
        _ => thousands(num(v), 0),
    }
}

fn fmt_ms(v: f64) -> String {
    if v < 100.0 { format!("{v:.1}") } else { format!("{v:.0}") }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64 + 0.5).round_ties_even() as i64 - 1;
    sorted[rank.clamp(0, sorted.len() as i64 - 1) as usize]
}

fn per_unit(r: &Row, key: &str) -> Option<f64> {
    r.get("costs")?.get("per_unit")?.get(key)?.as_f64()
}

/// The number after PREFIX in TEXT (`number of failed transactions: 3`).
fn after<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = &text[text.find(prefix)? + prefix.len()..];
    let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    Some(&rest[..end]).filter(|n| !n.is_empty())
}

fn pgbench_figures(dir: &Path) -> anyhow::Result<Value> {
    let text = read(&dir.join("pgbench.out"))?;
    let processed: u64 = after(&text, "number of transactions actually processed: ")
        .ok_or_else(|| anyhow!("pgbench.out: no transactions processed"))?
        .parse()?;
    let failed: u64 = after(&text, "number of failed transactions: ").map_or(Ok(0), str::parse)?;
    let tps = text
        .lines()
        .find(|line| line.ends_with("(without initial connection time)"))
        .and_then(|line| after(line, "tps = "))
        .ok_or_else(|| anyhow!("pgbench.out: no tps"))?;
    let mut latencies = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("pgbench_log.")) {
            for line in read(&path)?.lines() {
                if let Some(us) = line.split_whitespace().nth(2).and_then(|f| f.parse::<u64>().ok()) {
                    latencies.push(us as f64 / 1000.0);
                }
            }
        }
    }
    latencies.sort_by(f64::total_cmp);
    // Payments a second: a transaction of the batched anchor is 32 of them (its latencies stay a
    // transaction's).
    let payments: f64 = read(&dir.join("payments_per_transaction")).map_or(Ok(1.0), |n| n.trim().parse())?;
    Ok(json!({"rps": tps.parse::<f64>()? * payments, "p50_ms": percentile(&latencies, 50.0),
        "p99_ms": percentile(&latencies, 99.0), "requests": processed, "accepted": processed,
        "unexpected": failed, "lock_timeout": 0}))
}

/// What `walletlock events listen` took in a webhook run, with the drain's seconds: from the
/// listener's start to its first event (`wait`) and from its first to its last (`drain`).
fn webhooks(path: &Path) -> Value {
    let mut w = maybe_json(path);
    let at = |w: &Value, key: &str| {
        w.get(key)?
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.timestamp_micros())
    };
    if let (Some(listened), Some(first), Some(last)) =
        (at(&w, "listened_at"), at(&w, "first_at"), at(&w, "last_at"))
    {
        w["wait_seconds"] = json!((first - listened) as f64 / 1e6);
        w["drain_seconds"] = json!((last - first) as f64 / 1e6);
    }
    w
}

/// One run's row: pgbench's figures from its output, a walletlock run's from k6's summary.
fn row(label: &str, kind: &str, scenario: &str, dir: &Path, status: i64) -> anyhow::Result<Row> {
    let f = if kind == "pgbench" {
        pgbench_figures(dir)?
    } else {
        serde_json::from_str::<Value>(&read(&dir.join("summary.json"))?)?["figures"].take()
    };
    let field = |key: &str| f.get(key).cloned().ok_or_else(|| anyhow!("no {key} in the figures"));
    let books_text = std::fs::read_to_string(dir.join("books.txt")).unwrap_or_default();
    let books_line = books_text.trim().lines().last().unwrap_or("").to_owned();
    let mut books = ["OK", "BROKEN"]
        .into_iter()
        .find(|word| {
            books_line
                .strip_suffix(word)
                .is_some_and(|rest| !rest.ends_with(|c: char| c.is_alphanumeric() || c == '_'))
        })
        .unwrap_or("?")
        .to_owned();
    let moves = f.get("op").and_then(Value::as_str).unwrap_or("move") == "move";
    if !moves {
        books = "-".to_owned(); // reads and health checks move no money: nothing to check
    }
    if books == "?" && status != 0 && status != 2 {
        books = format!("run failed (exit {status})");
    }
    let mut rss = Vec::new();
    for line in std::fs::read_to_string(dir.join("rss.txt")).unwrap_or_default().lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let kb: i64 = parts.get(2).ok_or_else(|| anyhow!("rss.txt: {line}"))?.parse()?;
        rss.push(json!([parts[0], kb as f64 / 1024.0]));
    }
    let mut r = json!({"label": label, "kind": kind, "scenario": scenario, "moves": moves,
        "costs": maybe_json(&dir.join("costs.json"))});
    for key in ["rps", "p50_ms", "p99_ms", "requests", "accepted", "unexpected", "lock_timeout"] {
        r[key] = field(key)?;
    }
    // A batch is a request of many payments: its row's rate is theirs (its latencies, a batch's).
    if scenario == "bulk" {
        r["rps"] = field("ops_per_s")?;
    }
    if kind != "pgbench" {
        r["dependency_unavailable"] = field("dependency_unavailable")?;
        r["failed_thresholds"] = field("failed_thresholds")?;
    }
    r["rss_mib"] = Value::Array(rss);
    r["books"] = json!(books);
    r["books_line"] = json!(books_line);
    r["status"] = json!(status);
    r["dir"] = json!(dir.to_string_lossy());
    if kind != "pgbench" {
        r["webhooks"] = webhooks(&dir.join("webhooks.json"));
    }
    Ok(r)
}

fn rss_mib(r: &Row) -> impl Iterator<Item = f64> + '_ {
    r["rss_mib"].as_array().into_iter().flatten().map(|pair| num(&pair[1]))
}

/// (target, result, met) of one target whose runs (a, and b) have their rows.
fn judge(
    kind: TargetKind,
    target: &str,
    bound: Option<f64>,
    a: &Row,
    b: Option<&Row>,
    rows: &[Row],
    listed: &[String],
) -> (String, String, Met) {
    let (target, stated, bound) = (target.to_owned(), bound.is_none(), bound.unwrap_or(0.0));
    let not_measured = |target: String| (target, "not measured".to_owned(), Met::Unknown);
    let (rps, p99) = (num(&a["rps"]), num(&a["p99_ms"]));
    let b = b.unwrap_or(a);
    match kind {
        TargetKind::Ratio => {
            let b_rps = num(&b["rps"]);
            let x = rps / b_rps;
            let met = if stated { Met::Stated } else { Met::from(x >= bound) };
            if b_rps <= 0.0 {
                return (target, "not measured".to_owned(), if stated { Met::Stated } else { Met::Unknown });
            }
            (target, format!("{x:.2} ({}/s ÷ {}/s)", thousands(rps, 0), thousands(b_rps, 0)), met)
        }
        TargetKind::P99 => (target, format!("{} ms", fmt_ms(p99)), Met::from(p99 <= bound)),
        TargetKind::Rate => (target, format!("{}/s", thousands(rps, 0)), Met::from(rps >= bound)),
        TargetKind::LockTimeout => {
            let result = format!("{} of {}", py(&a["lock_timeout"]), count(&a["requests"]));
            (target, result, Met::from(num(&a["lock_timeout"]) == 0.0))
        }
        TargetKind::PerUnit(key) => match per_unit(a, key) {
            None => not_measured(target),
            Some(value) => (target, format!("{value:.2}"), Met::from(value <= bound)),
        },
        TargetKind::Rss => {
            let peaks: Vec<f64> = rows
                .iter()
                .filter(|r| r["kind"] == "walletlock" && r["scenario"] != "bulk")
                .flat_map(rss_mib)
                .collect();
            if let Some(peak) = peaks.into_iter().reduce(f64::max) {
                let result = format!("{:.1} MB ({peak:.1} MiB) at most", peak * 1.048576);
                return (target, result, Met::from(peak * 1024.0 * 1024.0 < bound));
            }
            let ran = rows.iter().any(|r| r["kind"] == "walletlock")
                || listed.iter().any(|x| !x.starts_with("pgbench"));
            (target, if ran { "not measured" } else { "not run" }.to_owned(), Met::Unknown)
        }
        TargetKind::P99Ratio => {
            let limit = bound * num(&b["p99_ms"]);
            (
                format!("{target} ({} ms)", fmt_ms(limit)),
                format!("{} ms", fmt_ms(p99)),
                Met::from(p99 <= limit),
            )
        }
        TargetKind::Flushes => match (per_unit(a, "wal_flushes"), per_unit(b, "wal_flushes")) {
            (Some(x), Some(y)) => (target, format!("{x:.3} vs {y:.3}"), Met::from(x <= y + bound)),
            _ => not_measured(target),
        },
        TargetKind::Lag | TargetKind::Drain => {
            let w = if a["webhooks"].is_object() { a["webhooks"].clone() } else { json!({}) };
            let events = w.get("events").cloned().unwrap_or(json!(0));
            let delivered = num(&events) == w.get("expected").map_or(-1.0, num)
                && w.get("bad_signatures").map_or(1.0, num) == 0.0;
            if kind == TargetKind::Lag {
                let p99 = w.get("lag_p99_seconds").and_then(Value::as_f64);
                let shown = p99.map_or("?".to_owned(), |p| format!("{p:.3}"));
                let expected = w.get("expected").cloned().unwrap_or(Value::Null);
                let result =
                    format!("{shown} s ({} of {} events delivered)", count(&events), count(&expected));
                let lag = p99.filter(|p| *p != 0.0).unwrap_or(99.0);
                return (target, result, Met::from(delivered && lag <= bound));
            }
            let drain = w.get("drain_seconds").and_then(Value::as_f64).filter(|d| *d != 0.0);
            let Some(drain) = drain.filter(|_| rps != 0.0) else {
                return (target, "not measured".to_owned(), Met::No);
            };
            let rate = num(&events) / drain / rps;
            let result = format!(
                "{rate:.2}x ({} events in {drain:.1} s, {} payments/s; the first {:.1} s after the \
                 receiver came back)",
                count(&events),
                thousands(rps, 0),
                w.get("wait_seconds").map_or(0.0, num)
            );
            (target, result, Met::from(delivered && rate >= bound))
        }
    }
}

/// The targets' (target, result, met). A target whose runs are not all in `rows` says "not run"
/// (BENCH_ONLY left one out), or "not measured" when each was run (`listed`: runs.tsv's labels)
/// but its results could not be read.
fn targets(rows: &[Row], listed: &[String]) -> Vec<(String, String, Met)> {
    let by = |label: &str| rows.iter().find(|r| r["label"] == label);
    TARGETS
        .iter()
        .map(|&(kind, target, labels, bound)| {
            let gone: Vec<&&str> = labels.iter().filter(|label| by(label).is_none()).collect();
            if gone.is_empty() {
                let a = labels.first().and_then(|l| by(l));
                let b = labels.get(1).and_then(|l| by(l));
                // The RSS target names no run: null stands in for `a`.
                judge(kind, target, bound, a.unwrap_or(&Value::Null), b, rows, listed)
            } else {
                let said = if gone.iter().all(|l| listed.iter().any(|x| x == **l)) {
                    "not measured"
                } else {
                    "not run"
                };
                let met =
                    if kind == TargetKind::Ratio && bound.is_none() { Met::Stated } else { Met::Unknown };
                (target.to_owned(), said.to_owned(), met)
            }
        })
        .collect()
}

/// The first line of what COMMAND says (stdout, then stderr), or `?`.
fn version(command: &str, args: &[&str]) -> String {
    let Ok(out) = std::process::Command::new(command).args(args).output() else { return "?".to_owned() };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    text.trim().lines().next().map_or("?".to_owned(), str::to_owned)
}

fn machine(root: &Path) -> Map<String, Value> {
    let first = |path: &str, prefix: &str, default: &str| {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let found = text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.split_once(':'));
        found.map_or(default.to_owned(), |(_, v)| v.trim().to_owned())
    };
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpus = cpuinfo.lines().filter(|l| l.starts_with("processor")).count();
    let ram_kb: f64 = first("/proc/meminfo", "MemTotal:", "0 kB")
        .split_whitespace()
        .next()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0.0);
    let read_trim =
        |path: &str| std::fs::read_to_string(path).map(|t| t.trim().to_owned()).unwrap_or_default();
    let debian = Some(read_trim("/etc/debian_version")).filter(|d| !d.is_empty()).unwrap_or("?".to_owned());
    let pg = |name: &str| {
        Path::new(&std::env::var("PG_BINDIR").unwrap_or_default()).join(name).to_string_lossy().into_owned()
    };
    let nginx = Some(version("nginx", &["-v"]))
        .filter(|v| v != "?")
        .unwrap_or_else(|| version("/usr/sbin/nginx", &["-v"]));
    let commit = std::env::var("BENCH_COMMIT").ok().filter(|c| !c.is_empty());
    let root = root.to_string_lossy();
    let mut info = Map::new();
    info.insert("cpus".into(), json!(cpus));
    info.insert("cpu".into(), json!(first("/proc/cpuinfo", "model name", "?")));
    info.insert("ram_gib".into(), json!((ram_kb / 1024.0 / 1024.0 * 10.0).round_ties_even() / 10.0));
    info.insert(
        "os".into(),
        json!(format!("Debian {debian}, Linux {}", read_trim("/proc/sys/kernel/osrelease"))),
    );
    info.insert("postgres".into(), json!(version(&pg("postgres"), &["--version"])));
    info.insert("pgbench".into(), json!(version(&pg("pgbench"), &["--version"])));
    info.insert("redis".into(), json!(version("redis-server", &["--version"])));
    info.insert("nginx".into(), json!(nginx));
    info.insert("k6".into(), json!(version(&std::env::var("K6").unwrap_or("k6".into()), &["version"])));
    info.insert("rustc".into(), json!(version("rustc", &["--version"])));
    let describe = || version("git", &["-C", &root, "describe", "--always", "--dirty"]);
    info.insert("walletlock".into(), json!(commit.unwrap_or_else(describe)));
    info
}

/// A row of the table.
fn cells(r: &Row) -> Vec<String> {
    let shown = match r.get("ratio").and_then(Value::as_f64) {
        _ if r["kind"] == "pgbench" => "1 (anchor)".to_owned(),
        Some(ratio) if ratio != 0.0 => format!("{ratio:.3} (1/{:.*})", usize::from(ratio > 0.1), 1.0 / ratio),
        _ => "-".to_owned(),
    };
    let per = if r["costs"]["per"] == "payment" { "" } else { "/req" };
    let costs =
        COSTS.iter().map(|(_, key)| per_unit(r, key).map_or("-".to_owned(), |v| format!("{v:.2}{per}")));
    let rss: Vec<String> = rss_mib(r).map(|mib| format!("{mib:.1}")).collect();
    let lock_timeout =
        if r["kind"] != "pgbench" && r["moves"] == true { py(&r["lock_timeout"]) } else { "-".to_owned() };
    let other = r.get("other_cpu").and_then(|o| o.get("other_pct")).and_then(Value::as_f64);
    let mut cells = vec![
        py(&r["label"]),
        thousands(num(&r["rps"]), 0),
        fmt_ms(num(&r["p50_ms"])),
        fmt_ms(num(&r["p99_ms"])),
        py(&r["unexpected"]),
        shown,
        if rss.is_empty() { "-".to_owned() } else { rss.join(" / ") },
        lock_timeout,
        py(&r["books"]),
    ];
    cells.extend(costs);
    cells.push(other.map_or("?".to_owned(), |o| format!("{o:.0}%")));
    cells
}

fn markdown(header: &[String], rows: &[Vec<String>]) -> String {
    let mut lines =
        vec![format!("| {} |", header.join(" | ")), format!("|{}|", vec!["---"; header.len()].join("|"))];
    lines.extend(rows.iter().map(|cells| format!("| {} |", cells.join(" | "))));
    lines.join("\n")
}

/// The table aligned in columns: the first left, the others right (all left with `left`).
fn plain(header: &[String], rows: &[Vec<String>], left: bool) -> String {
    let width = |i: usize| {
        rows.iter().map(|c| c[i].chars().count()).chain([header[i].chars().count()]).max().unwrap_or(0)
    };
    let widths: Vec<usize> = (0..header.len()).map(width).collect();
    let line = |cells: &Vec<String>| {
        let padded = cells.iter().zip(&widths).enumerate().map(|(i, (c, &w))| {
            let pad = " ".repeat(w.saturating_sub(c.chars().count()));
            if i == 0 || left { format!("{c}{pad}") } else { format!("{pad}{c}") }
        });
        padded.collect::<Vec<_>>().join("  ").trim_end().to_owned()
    };
    std::iter::once(header.to_vec())
        .chain(rows.iter().cloned())
        .map(|c| line(&c))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What an attempt that was not kept measured, and the CPU it shared.
fn attempt(label: &str, number: &str, dir: &Path) -> String {
    let kind = if dir.join("pgbench.out").exists() { "pgbench" } else { "walletlock" };
    let figures = row("", kind, "", dir, 0).map_or("?".to_owned(), |r| {
        format!("{}/s, p99 {} ms", thousands(num(&r["rps"]), 0), fmt_ms(num(&r["p99_ms"])))
    });
    let other = maybe_json(&dir.join("other_cpu.json")).get("other_pct").and_then(Value::as_f64);
    let other = other.map_or("?".to_owned(), |o| format!("{o:.0}%"));
    format!("{label} attempt {number}: {figures} with {other} other CPU")
}

/// Writes DIR/bench.json and DIR/bench.md, prints the table and the targets; false if any run that
/// moves money has books that are not OK.
pub fn report(out: &Path, root: &Path) -> anyhow::Result<bool> {
    let settings: Value = serde_json::from_str(&read(&out.join("settings.json"))?)?;
    let (mut rows, mut listed) = (Vec::new(), Vec::new());
    for line in read(&out.join("runs.tsv"))?.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        let [label, kind, scenario, dir, status, idle] = fields[..] else {
            anyhow::bail!("runs.tsv: {line}")
        };
        listed.push(label.to_owned());
        let dir = Path::new(dir);
        match status
            .parse()
            .map_err(anyhow::Error::from)
            .and_then(|status| row(label, kind, scenario, dir, status))
        {
            Ok(mut r) if idle.parse::<i64>().is_ok() => {
                r["idle_before_pct"] = json!(idle.parse::<i64>()?);
                r["other_cpu"] = maybe_json(&dir.join("other_cpu.json"));
                rows.push(r);
            }
            Ok(_) => eprintln!("bench: no results for {label} in {}: idle {idle:?}", dir.display()),
            Err(err) => eprintln!("bench: no results for {label} in {}: {err}", dir.display()),
        }
    }
    let anchor = |scenario: &Value| {
        rows.iter()
            .rev()
            .find(|r| r["kind"] == "pgbench" && &r["scenario"] == scenario)
            .map(|r| num(&r["rps"]))
    };
    let ratios: Vec<Value> = rows
        .iter()
        .map(|r| match anchor(&r["scenario"]) {
            Some(a) if r["kind"] != "pgbench" && a != 0.0 => json!(num(&r["rps"]) / a),
            _ => Value::Null,
        })
        .collect();
    for (r, ratio) in rows.iter_mut().zip(ratios) {
        r["ratio"] = ratio;
    }

    let info = machine(root);
    let replicas = rows.iter().map(|r| rss_mib(r).count()).max().unwrap_or(0);
    let rss = if replicas > 0 {
        format!(" ({})", (1..=replicas).map(|n| format!("r{n}")).collect::<Vec<_>>().join("/"))
    } else {
        String::new()
    };
    let mut header: Vec<String> =
        ["scenario", "rps", "p50 ms", "p99 ms", "unexpected errors", "ratio to anchor"]
            .map(String::from)
            .to_vec();
    header.push(format!("peak RSS, MiB{rss}"));
    header.extend(["lock_timeout", "books"].map(String::from));
    header.extend(COSTS.iter().map(|(h, _)| h.to_string()));
    header.push("other CPU".into());
    let table: Vec<Vec<String>> = rows.iter().map(cells).collect();
    let (secs, vus, clients) = (py(&settings["seconds"]), py(&settings["vus"]), py(&settings["clients"]));
    let (commit, cpus, cpu) = (py(&info["walletlock"]), py(&info["cpus"]), py(&info["cpu"]));
    let title = format!(
        "walletlock {} vs raw Postgres, {cpus} cores ({cpu}), {secs} s per run; pgbench {clients} clients, \
         k6 {vus} VUs via nginx + {replicas} replicas",
        commit.split_whitespace().next().unwrap_or("")
    );
    let discarded: Vec<String> = std::fs::read_to_string(out.join("discarded.tsv"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| match line.split('\t').collect::<Vec<_>>()[..] {
            [label, number, dir] => Some(attempt(label, number, Path::new(dir))),
            _ => None,
        })
        .collect();
    let idle: Vec<String> =
        rows.iter().map(|r| format!("{} {}%", py(&r["label"]), py(&r["idle_before_pct"]))).collect();
    let gogc = std::env::var("GOGC").unwrap_or("400".into());
    let notes = [
        format!(
            "Every run lasted {secs} s on the same machine, one after the other: {cpus} cores ({cpu}), {} \
             GiB RAM, {}; Postgres, Redis, nginx, the {replicas} replicas and the load generator (pgbench \
             {clients} clients, or k6 {vus} VUs with GOGC={gogc}) all share those cores. What each run \
             measures, and how: loadtest/README.md, `loadtest/bench`.",
            py(&info["ram_gib"]),
            py(&info["os"])
        ),
        format!(
            "The machine was idle before each run (whole-machine idle CPU over 3 s: {}). other CPU: the \
             share of the machine's CPU that processes outside the benchmark used during the run (a lower \
             bound).",
            idle.join(", ")
        ),
        format!(
            "A run in which other processes took more than {}% of the CPU was run again (up to {} \
             attempts), and the attempt that shared the CPU least is the one in the table, whatever its \
             figures. Attempts not kept: {}.",
            settings.get("max_other_pct").map_or("10".to_owned(), py),
            settings.get("tries").map_or("3".to_owned(), py),
            if discarded.is_empty() { "none".to_owned() } else { discarded.join("; ") }
        ),
    ];
    // The history run's targets join the table; its figures are a section of their own.
    let history = out.join("history");
    let (history, history_targets) = if history.is_dir() {
        let (text, judged) =
            super::history::section(&history).with_context(|| history.display().to_string())?;
        (Some(text), judged)
    } else {
        (None, super::history::not_run())
    };
    let mut goals = targets(&rows, &listed);
    goals.extend(history_targets);
    let goal_header: Vec<String> = ["target", "result", "met?"].map(String::from).to_vec();
    let goal_cells: Vec<Vec<String>> =
        goals.iter().map(|(t, res, met)| vec![t.clone(), res.clone(), met.cell().to_owned()]).collect();
    let only = settings.get("only").and_then(Value::as_str).unwrap_or("");
    let command = format!(
        "{}BENCH_SECONDS={secs} BENCH_VUS={vus} loadtest/bench",
        if only.is_empty() { String::new() } else { format!("BENCH_ONLY=\"{only}\" ") }
    );
    let relative = out.strip_prefix(root).unwrap_or(out).to_string_lossy().into_owned();
    let mut md = vec![
        "# walletlock benchmark".to_owned(),
        String::new(),
        format!("`{command}` (results in `{relative}`), {}.", py(&settings["started"])),
        String::new(),
        markdown(&header, &table),
        String::new(),
        "Targets (issues 13 and 33-38): rps as in the table (payments or reads answered per second); the costs and the p99s of the runs above, and the history run's figures below.".to_owned(),
        String::new(),
        markdown(&goal_header, &goal_cells),
        String::new(),
    ];
    md.extend(history.iter().flat_map(|section| [section.clone(), String::new()]));
    md.extend(["Method and conditions:".to_owned(), String::new()]);
    md.extend(notes.iter().map(|n| format!("- {n}")));
    md.extend([String::new(), "Machine and versions:".to_owned(), String::new()]);
    md.extend(info.iter().map(|(k, v)| format!("- {k}: {}", py(v))));
    md.extend([String::new(), "![benchmark](bench.png)".to_owned(), String::new()]);
    let targets: Vec<Value> =
        goals.iter().map(|(t, res, met)| json!({"target": t, "result": res, "met": met.json()})).collect();
    let bench = json!({"title": title, "settings": settings, "machine": info, "rows": rows, "command": command, "targets": targets});
    std::fs::write(out.join("bench.json"), serde_json::to_string_pretty(&bench)?)?;
    std::fs::write(out.join("bench.md"), md.join("\n"))?;
    println!("{title}\n{}\n\n{}", plain(&header, &table, false), plain(&goal_header, &goal_cells, true));
    if let Some(section) = &history {
        print!("\n{section}");
    }
    for r in &rows {
        let failed: Vec<String> =
            r.get("failed_thresholds").and_then(Value::as_array).into_iter().flatten().map(py).collect();
        if !failed.is_empty() {
            println!("  {}: thresholds failed: {}", py(&r["label"]), failed.join("; "));
        }
    }
    Ok(rows.iter().all(|r| r["moves"] != true || r["books"] == "OK"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_written_as_python_wrote_them() {
        assert_eq!(thousands(1234567.5, 0), "1,234,568");
        assert_eq!(thousands(999.0, 0), "999");
        assert_eq!(thousands(1000.25, 1), "1,000.2");
        assert_eq!(count(&json!(68123)), "68,123");
        assert_eq!(
            (py(&json!(3)), py(&json!(3.0)), py(&json!(0.25))),
            ("3".into(), "3.0".into(), "0.25".into())
        );
        assert_eq!((fmt_ms(99.94), fmt_ms(180.6)), ("99.9".to_owned(), "181".to_owned()));
        // Ties go to even, as Python's round(): the median of 1..=100 is the 50th value, not the 51st.
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (percentile(&values, 50.0), percentile(&values, 99.0), percentile(&[], 99.0)),
            (50.0, 100.0, 0.0)
        );
    }

    #[test]
    fn a_target_says_whether_its_runs_ran() {
        let run = |label: &str, rps: f64| json!({"label": label, "kind": "walletlock", "rps": rps, "p99_ms": 20.0, "rss_mib": []});
        let rows = [run(S, 600.0), run("walletlock: read", 1000.0)];
        let goals = targets(&rows, &[S.to_owned(), "walletlock: read".to_owned(), H.to_owned()]);
        let goal = |target: &str| goals.iter().find(|g| g.0 == target).unwrap().clone();
        assert_eq!(
            goal(TARGETS[0].1),
            (TARGETS[0].1.to_owned(), "0.60 (600/s ÷ 1,000/s)".to_owned(), Met::Yes)
        );
        assert_eq!(goal("spread p99 ≤ 50 ms").2, Met::Yes);
        // Listed in runs.tsv but unreadable: not measured; left out by BENCH_ONLY: not run.
        assert_eq!(goal("hot p99 ≤ 30 ms").1, "not measured");
        assert_eq!(goal("hot payments/s ÷ pgbench hot tps ≥ 1.5").1, "not run");
        assert_eq!(goal("spread: under Postgres alone ÷ on leases (stated)").2, Met::Stated);
        assert_eq!(
            goal("every replica's peak RSS < 50 MB (single requests)"),
            (
                goal("every replica's peak RSS < 50 MB (single requests)").0,
                "not measured".into(),
                Met::Unknown
            )
        );
    }
}
