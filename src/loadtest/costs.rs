//! `walletlock loadtest costs`: what a load test's payments cost Postgres and Redis, from their own
//! statistics (`COSTS=1` of loadtest/run; loadtest/README.md says what each figure counts).
//!
//! A snapshot holds the cumulative counters: pg_stat_wal and pg_stat_database summed over a Citus
//! cluster's nodes, pg_stat_statements' calls summed over the nodes that loaded it, and each Redis primary's INFO
//! commandstats. The report is AFTER - BEFORE (less BEFORE's own queries) per accepted payment
//! (read, health: per request).

use anyhow::{Context, bail};
use serde_json::{Map, Value, json};
use sqlx::{Connection, PgConnection, Row, postgres::PgConnectOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

const PG_FIELDS: [&str; 7] =
    ["wal_sync", "wal_write", "wal_records", "wal_fpi", "wal_bytes", "xact_commit", "xact_rollback"];

/// A Postgres node as deploy/local runs it: its socket directory and port.
#[derive(Clone)]
pub struct Node {
    pub socket: String,
    pub port: u16,
}

/// One query's first column as text (a query a transaction of its own, as psql -c runs it, so that
/// the snapshot's own statements are the ones it subtracts).
async fn query(node: &Node, database: &str, sql: &str) -> anyhow::Result<Vec<String>> {
    let options =
        PgConnectOptions::new().host(&node.socket).port(node.port).username("postgres").database(database);
    let mut conn = PgConnection::connect_with(&options)
        .await
        .with_context(|| format!("{}:{}", node.socket, node.port))?;
    let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).fetch_all(&mut conn).await?;
    conn.close().await?;
    rows.iter().map(|row| Ok(row.try_get::<Option<String>, _>(0)?.unwrap_or_default())).collect()
}

/// The active workers the coordinator lists; none without Citus.
async fn citus_workers(node: &Node) -> anyhow::Result<Vec<Node>> {
    let sql = "select count(*)::text from pg_extension where extname = 'citus'";
    if query(node, "walletlock", sql).await? != ["1"] {
        return Ok(Vec::new());
    }
    let sql = "select nodename || ' ' || nodeport from pg_dist_node where groupid <> 0 and isactive";
    let rows = query(node, "walletlock", sql).await?;
    let worker = |row: &String| -> anyhow::Result<Node> {
        let (socket, port) = row.rsplit_once(' ').context("pg_dist_node")?;
        Ok(Node { socket: socket.to_owned(), port: port.parse()? })
    };
    rows.iter().map(worker).collect()
}

/// ANALYZE of the walletlock database, then CHECKPOINT on every node, so that the measured run
/// is planned with statistics of the tables as they are and no checkpoint runs beside it.
///
/// The ANALYZE is what pgbench's anchors get (`vacuum analyze account`). Without it a run is
/// planned with statistics autovacuum took before the run's wallets were opened, up to a minute
/// (its naptime) old: on a fresh fleet, after `hot`, those said the `wallet` table held about one
/// row when it held 10,000, and the round's statement took four times as long (docs/performance.md).
pub async fn checkpoint(coordinator: &Node) -> anyhow::Result<()> {
    // Under Citus, the coordinator's ANALYZE of a distributed table runs on its shards.
    query(coordinator, "walletlock", "analyze").await?;
    for node in std::iter::once(coordinator.clone()).chain(citus_workers(coordinator).await?) {
        query(&node, "postgres", "checkpoint").await?;
    }
    Ok(())
}

/// One node's WAL and transaction counters (PG_FIELDS).
async fn pg_counters(node: &Node) -> anyhow::Result<Map<String, Value>> {
    let table = |f: &str| if f.starts_with("wal") { "w" } else { "d" };
    let fields: Vec<String> = PG_FIELDS.iter().map(|f| format!("'{f}', {}.{f}", table(f))).collect();
    let sql = format!(
        "select json_build_object({})::text from pg_stat_wal w, pg_stat_database d where d.datname = 'walletlock'",
        fields.join(", ")
    );
    let text = query(node, "walletlock", &sql).await?.concat();
    Ok(serde_json::from_str(&text)?)
}

/// The statements a node ran in the walletlock database, so far.
const STATEMENTS: &str = "select coalesce(sum(calls), 0)::text from stats.pg_stat_statements s, pg_database d \
                          where s.dbid = d.oid and d.datname = 'walletlock'";

async fn pg_snapshot(coordinator: &Node) -> anyhow::Result<Value> {
    let preload =
        query(coordinator, "postgres", "select current_setting('shared_preload_libraries')").await?.concat();
    let workers = citus_workers(coordinator).await?;
    // What this snapshot adds to the counters it reads: its statements in the coordinator's
    // walletlock database, each its own transaction, and one per worker.
    let mut own = if workers.is_empty() { 1 } else { 2 } + 1;
    let mut values = pg_counters(coordinator).await?;
    values.insert("statements".into(), Value::Null);
    let mut note = Some(
        "pg_stat_statements is not loaded (shared_preload_libraries); a Postgres started before deploy/local \
         loaded it must be restarted: deploy/local down, deploy/local up"
            .to_owned(),
    );
    if preload.contains("pg_stat_statements") {
        (note, own) = (None, own + 1);
        match query(coordinator, "walletlock", STATEMENTS).await {
            Ok(calls) => values["statements"] = json!(calls.concat().parse::<i64>()?),
            // Loaded, but the extension is missing from the walletlock database.
            Err(err) => note = Some(format!("pg_stat_statements: {err:#}")),
        }
    }
    for worker in &workers {
        for (field, value) in pg_counters(worker).await? {
            values[&field] = json!(values[&field].as_i64().unwrap_or(0) + value.as_i64().unwrap_or(0));
        }
        // The statements each worker ran (the coordinator's, routed, and its own of Citus's
        // upkeep), where the worker loaded pg_stat_statements too.
        if let (Some(sum), Ok(calls)) =
            (values["statements"].as_i64(), query(worker, "walletlock", STATEMENTS).await)
        {
            values["statements"] = json!(sum + calls.concat().parse::<i64>()?);
            own += 2;
        }
    }
    values.insert("statements_note".into(), json!(note));
    values.insert("nodes".into(), json!(1 + workers.len()));
    values.insert("own".into(), json!({"statements": own, "transactions": own + workers.len()}));
    Ok(Value::Object(values))
}

/// `INFO replication commandstats` of the Redis on 127.0.0.1:PORT as `admin`, in RESP by hand: the
/// two commands redis-cli sends, and nothing else a client library would add to the counts.
fn redis_info(port: &str, password: &str) -> anyhow::Result<String> {
    let mut stream = std::net::TcpStream::connect(format!("127.0.0.1:{port}"))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let mut send = Vec::new();
    for command in [["AUTH", "admin", password].as_slice(), &["INFO", "replication", "commandstats"]] {
        send.extend(format!("*{}\r\n", command.len()).bytes());
        for arg in command {
            send.extend(format!("${}\r\n{arg}\r\n", arg.len()).bytes());
        }
    }
    stream.write_all(&send)?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    if !line.starts_with("+OK") {
        bail!("AUTH: {}", line.trim());
    }
    line.clear();
    reader.read_line(&mut line)?;
    let length: usize = line.trim().strip_prefix('$').context("INFO: not a bulk string")?.parse()?;
    let mut body = vec![0; length];
    std::io::Read::read_exact(&mut reader, &mut body)?;
    Ok(String::from_utf8(body)?)
}

/// Each primary's calls by command, keyed by port (replicas replay their primary's writes: not
/// counted). The nodes are deploy/local's: STATE/node-PORT/redis.pid.
fn redis_snapshot(state: &Path, auth_file: &Path) -> anyhow::Result<Value> {
    let password = std::fs::read_to_string(auth_file)?.trim().to_owned();
    let mut ports: Vec<String> = std::fs::read_dir(state)?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("node-").map(str::to_owned))
        .filter(|port| state.join(format!("node-{port}/redis.pid")).exists())
        .collect();
    ports.sort();
    let mut nodes = Map::new();
    for port in ports {
        let Ok(info) = redis_info(&port, &password) else { continue };
        if !info.lines().any(|l| l.trim() == "role:master") {
            continue;
        }
        let mut calls = Map::new();
        for (name, stats) in info.lines().filter_map(|l| l.trim().strip_prefix("cmdstat_")?.split_once(':')) {
            let count = stats.split(',').find_map(|kv| kv.strip_prefix("calls=")).context("cmdstat")?;
            calls.insert(name.to_owned(), json!(count.parse::<i64>()?));
        }
        nodes.insert(port, Value::Object(calls));
    }
    Ok(Value::Object(nodes))
}

pub async fn snapshot(coordinator: &Node, redis_state: &Path, redis_auth: &Path) -> anyhow::Result<Value> {
    let time = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
    Ok(json!({"time": time, "postgres": pg_snapshot(coordinator).await?,
        "redis": redis_snapshot(redis_state, redis_auth)?}))
}

/// The costs of a run from its snapshots and k6's summary (costs.json), and its line for people.
pub fn report(before: &Value, after: &Value, summary: &Value) -> (Value, String) {
    let figures = &summary["figures"];
    let moves = figures["op"].as_str().unwrap_or("move") == "move";
    let units = figures[if moves { "accepted" } else { "requests" }].as_f64().unwrap_or(0.0);
    let (a, b) = (&after["postgres"], &before["postgres"]);
    let int = |v: &Value| v.as_i64().unwrap_or(0);
    let mut delta = Map::new();
    for f in PG_FIELDS {
        delta.insert(f.into(), json!(int(&a[f]) - int(&b[f])));
    }
    let transactions =
        int(&delta["xact_commit"]) + int(&delta["xact_rollback"]) - int(&b["own"]["transactions"]);
    delta.insert("transactions".into(), json!(transactions));
    let statements = match (a["statements"].as_i64(), b["statements"].as_i64()) {
        (Some(x), Some(y)) => json!(x - y - int(&b["own"]["statements"])),
        _ => Value::Null,
    };
    delta.insert("statements".into(), statements);
    // Every primary's calls by command, summed; INFO is the snapshots' own.
    let calls = |snapshot: &Value| {
        let mut sum = std::collections::BTreeMap::<String, i64>::new();
        for node in snapshot["redis"].as_object().into_iter().flat_map(|n| n.values()) {
            for (name, count) in node.as_object().into_iter().flatten().filter(|(name, _)| *name != "info") {
                *sum.entry(name.clone()).or_default() += int(count);
            }
        }
        sum
    };
    let (rb, ra) = (calls(before), calls(after));
    let mut by_command: Map<String, Value> = Map::new();
    for name in rb.keys().chain(ra.keys()).collect::<std::collections::BTreeSet<_>>() {
        let d = ra.get(name).copied().unwrap_or(0) - rb.get(name).copied().unwrap_or(0);
        by_command.insert(name.clone(), json!(d));
    }
    // The AUTH of each of BEFORE's connections (after its INFO) is the snapshot's own.
    let auth =
        by_command.get("auth").map_or(0, int) - before["redis"].as_object().map_or(0, |n| n.len() as i64);
    by_command.insert("auth".into(), json!(auth));
    by_command.retain(|_, d| int(d) != 0);
    delta.insert("redis_commands".into(), json!(by_command.values().map(int).sum::<i64>()));
    let keys = [
        ("wal_flushes", "wal_sync"),
        ("wal_records", "wal_records"),
        ("wal_bytes", "wal_bytes"),
        ("transactions", "transactions"),
        ("statements", "statements"),
        ("redis_commands", "redis_commands"),
    ];
    let per_unit: Map<String, Value> = keys
        .iter()
        .map(|(k, d)| {
            let value = delta[*d].as_f64().filter(|_| units != 0.0).map_or(Value::Null, |x| json!(x / units));
            ((*k).to_owned(), value)
        })
        .collect();
    let window = ((after["time"].as_f64().unwrap_or(0.0) - before["time"].as_f64().unwrap_or(0.0)) * 10.0)
        .round()
        / 10.0;
    let notes: Vec<&Value> = [&a["statements_note"]].into_iter().filter(|n| n.is_string()).collect();
    let fmt = |key: &str, digits: usize| {
        per_unit[key].as_f64().map_or("n/a".to_owned(), |v| format!("{v:.digits$}"))
    };
    let mut line = format!(
        "costs per {} ({} in {window:?} s, Postgres and Redis statistics): WAL flushes {}, WAL records {}, WAL bytes {}, \
         transactions {}, statements {}, Redis commands {}",
        if moves { "accepted payment" } else { "request" },
        super::report::py(&figures[if moves { "accepted" } else { "requests" }]),
        fmt("wal_flushes", 2),
        fmt("wal_records", 1),
        fmt("wal_bytes", 0),
        fmt("transactions", 2),
        fmt("statements", 2),
        fmt("redis_commands", 2),
    );
    for note in &notes {
        line.push_str(&format!("\n  {}", note.as_str().unwrap_or("")));
    }
    let costs = json!({"per": if moves { "payment" } else { "request" }, "units": figures[if moves { "accepted" } else { "requests" }],
        "window_s": window, "delta": delta, "per_unit": per_unit, "redis_by_command": by_command, "notes": notes});
    (costs, line)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_report_is_the_difference_less_the_snapshots_own_queries_per_payment() {
        let pg = |n: i64, statements: i64| {
            json!({"wal_sync": n, "wal_write": n, "wal_records": 10 * n, "wal_fpi": 0, "wal_bytes": 100 * n,
                "xact_commit": 2 * n, "xact_rollback": 0, "statements": statements, "statements_note": null,
                "own": {"statements": 3, "transactions": 3}})
        };
        let before = json!({"time": 100.0, "postgres": pg(10, 50),
            "redis": {"6390": {"auth": 4, "fcall": 10, "info": 1}, "6391": {"auth": 1, "fcall": 5}}});
        let after = json!({"time": 130.04, "postgres": pg(60, 153),
            "redis": {"6390": {"auth": 6, "fcall": 110, "info": 2}, "6391": {"auth": 2, "fcall": 105}}});
        let summary = json!({"figures": {"op": "move", "accepted": 50, "requests": 70}});
        let (costs, line) = super::report(&before, &after, &summary);
        assert_eq!(costs["window_s"], json!(30.0));
        assert_eq!(costs["delta"]["transactions"], json!(97));
        assert_eq!(costs["delta"]["statements"], json!(100));
        // Each AUTH after BEFORE's INFO but one per node is the load's; INFO is never counted.
        assert_eq!(costs["redis_by_command"], json!({"auth": 1, "fcall": 200}));
        assert_eq!(costs["per_unit"]["wal_flushes"], json!(1.0));
        assert_eq!(costs["per_unit"]["redis_commands"], json!(4.02));
        assert_eq!(
            line,
            "costs per accepted payment (50 in 30.0 s, Postgres and Redis statistics): WAL flushes 1.00, WAL \
             records 10.0, WAL bytes 100, transactions 1.94, statements 2.00, Redis commands 4.02"
        );
        let reads = json!({"figures": {"op": "read", "accepted": 0, "requests": 0}});
        assert_eq!(super::report(&before, &after, &reads).0["per_unit"]["statements"], json!(null));
    }
}
