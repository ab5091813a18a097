#!/usr/bin/env python3
"""loadtest/costs.py: what a load test's payments cost Postgres and Redis, from their own statistics.

    loadtest/costs.py checkpoint --pg-socket DIR --pg-port N
    loadtest/costs.py snapshot OUT_JSON --pg-socket DIR --pg-port N --redis-state DIR --redis-auth FILE
    loadtest/costs.py report BEFORE_JSON AFTER_JSON SUMMARY_JSON OUT_JSON

`checkpoint` runs CHECKPOINT on Postgres (and every Citus worker) before the first snapshot, so
that no checkpoint runs beside the measured run. `snapshot` reads the cumulative counters:
pg_stat_wal, pg_stat_database (walletlock) and pg_stat_statements (when loaded) as the superuser
over the socket, summed over a Citus cluster's nodes but for the statements (the coordinator's are
the ones the replicas sent), and INFO commandstats of each Redis primary as `admin`. `report`
subtracts BEFORE from AFTER (less the BEFORE snapshot's own queries) and divides by the run's
accepted payments (read, health: its requests); loadtest/README.md (COSTS=1) says what each
figure counts.

Postgres backends report their counters when they go idle, and one that stayed busy up to 10 s
after (PGSTAT_IDLE_INTERVAL): the caller waits about 11 s after the traffic stops before a
snapshot (COSTS_SETTLE_S in loadtest/run).
"""

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PG_FIELDS = ["wal_sync", "wal_write", "wal_records", "wal_fpi", "wal_bytes", "xact_commit", "xact_rollback"]


def arg(name):
    args = sys.argv
    if name not in args or args.index(name) + 1 >= len(args):
        raise SystemExit(f"costs.py: {name} is required")
    return args[args.index(name) + 1]


def psql(socket, port, db, query):
    out = subprocess.run(
        ["psql", "-X", "-q", "-t", "-A", "-h", socket, "-p", str(port), "-U", "postgres", "-d", db,
         "-v", "ON_ERROR_STOP=1", "-c", query],
        check=False, capture_output=True, text=True, timeout=30,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return out.stdout.strip()


def pg_counters(socket, port):
    """One node's WAL and transaction counters (PG_FIELDS)."""
    query = (
        "select json_build_object("
        + ", ".join(f"'{f}', {'w' if f.startswith('wal') else 'd'}.{f}" for f in PG_FIELDS)
        + ") from pg_stat_wal w, pg_stat_database d where d.datname = 'walletlock'"
    )
    return json.loads(psql(socket, port, "walletlock", query))


def citus_workers(socket, port):
    """The (socket, port) of every active worker the coordinator lists; none without Citus."""
    has_citus = psql(socket, port, "walletlock", "select count(*) from pg_extension where extname = 'citus'")
    if has_citus != "1":
        return []
    rows = psql(socket, port, "walletlock",
                "select nodename || ' ' || nodeport from pg_dist_node where groupid <> 0 and isactive")
    return [tuple(row.rsplit(" ", 1)) for row in rows.splitlines() if row]


def checkpoint():
    socket, port = arg("--pg-socket"), arg("--pg-port")
    for node in [(socket, port), *citus_workers(socket, port)]:
        psql(*node, "postgres", "checkpoint")


def pg_snapshot(socket, port):
    preload = psql(socket, port, "postgres", "select current_setting('shared_preload_libraries')")
    workers = citus_workers(socket, port)
    # What this snapshot itself adds to the counters it reads: its statements in the coordinator's
    # walletlock database, each its own transaction, and one transaction on each worker.
    own = 2 if workers else 1
    values = pg_counters(socket, port)
    own += 1
    note = None
    values["statements"] = None
    if "pg_stat_statements" in preload:
        try:
            values["statements"] = int(psql(
                socket, port, "walletlock",
                "select sum(calls) from stats.pg_stat_statements s, pg_database d "
                "where s.dbid = d.oid and d.datname = 'walletlock'",
            ) or 0)
        except RuntimeError as err:  # loaded, but the extension is missing from the walletlock database
            note = f"pg_stat_statements: {err}"
        own += 1  # an error, too, ends its transaction (a rollback)
    else:
        note = ("pg_stat_statements is not loaded (shared_preload_libraries); a Postgres started before "
                "deploy/local loaded it must be restarted: deploy/local down, deploy/local up")
    for worker in workers:
        for field, value in pg_counters(*worker).items():
            values[field] += value
    values["statements_note"] = note
    values["nodes"] = 1 + len(workers)
    values["own"] = {"statements": own, "transactions": own + len(workers)}
    return values


def redis_snapshot(state, auth_file):
    env = dict(os.environ, REDISCLI_AUTH=Path(auth_file).read_text().strip())
    nodes = {}
    for pid_file in sorted(glob.glob(os.path.join(state, "node-*", "redis.pid"))):
        port = os.path.basename(os.path.dirname(pid_file))[len("node-"):]
        out = subprocess.run(
            ["redis-cli", "--no-auth-warning", "--user", "admin", "-h", "127.0.0.1", "-p", port,
             "info", "replication", "commandstats"],
            check=False, capture_output=True, text=True, timeout=10, env=env,
        )
        if out.returncode != 0 or "role:" not in out.stdout:
            continue  # not running
        calls = {}
        role = ""
        for line in out.stdout.splitlines():
            line = line.strip()
            if line.startswith("role:"):
                role = line.split(":", 1)[1]
            elif line.startswith("cmdstat_"):
                name, fields = line[len("cmdstat_"):].split(":", 1)
                stats = dict(kv.split("=", 1) for kv in fields.split(","))
                calls[name] = int(stats["calls"])
        # Replicas replay their primary's writes: only primaries count the service's commands.
        if role == "master":
            nodes[port] = calls
    return nodes


def snapshot():
    out = sys.argv[2]
    snap = {"time": time.time()}
    snap["postgres"] = pg_snapshot(arg("--pg-socket"), arg("--pg-port"))
    snap["redis"] = redis_snapshot(arg("--redis-state"), arg("--redis-auth"))
    Path(out).write_text(json.dumps(snap, indent=1))


def redis_calls(snap):
    total = {}
    for calls in snap["redis"].values():
        for name, n in calls.items():
            if name != "info":
                total[name] = total.get(name, 0) + n
    return total


def report():
    before, after, summary = (json.loads(Path(p).read_text()) for p in sys.argv[2:5])
    out = sys.argv[5]
    figures = summary["figures"]
    moves = figures.get("op", "move") == "move"
    per = "payment" if moves else "request"
    units = figures["accepted"] if moves else figures["requests"]
    a, b = after["postgres"], before["postgres"]
    delta = {f: a[f] - b[f] for f in PG_FIELDS}
    delta["transactions"] = delta["xact_commit"] + delta["xact_rollback"] - b["own"]["transactions"]
    if a.get("statements") is not None and b.get("statements") is not None:
        delta["statements"] = int(a["statements"]) - int(b["statements"]) - b["own"]["statements"]
    else:
        delta["statements"] = None
    rb, ra = redis_calls(before), redis_calls(after)
    by_command = {n: ra.get(n, 0) - rb.get(n, 0) for n in sorted(set(ra) | set(rb))}
    by_command["auth"] = by_command.get("auth", 0) - len(before["redis"])  # redis-cli's, in BEFORE
    by_command = {n: d for n, d in by_command.items() if d}
    delta["redis_commands"] = sum(by_command.values())

    def each(value):
        return None if value is None or not units else value / units

    costs = {
        "per": per,
        "units": units,
        "window_s": round(after["time"] - before["time"], 1),
        "delta": delta,
        "per_unit": {
            "wal_flushes": each(delta["wal_sync"]),
            "wal_records": each(delta["wal_records"]),
            "wal_bytes": each(delta["wal_bytes"]),
            "transactions": each(delta["transactions"]),
            "statements": each(delta["statements"]),
            "redis_commands": each(delta["redis_commands"]),
        },
        "redis_by_command": by_command,
        "notes": [n for n in (a.get("statements_note"),) if n],
    }
    Path(out).write_text(json.dumps(costs, indent=1))

    def fmt(v, digits=2):
        return "n/a" if v is None else f"{v:.{digits}f}"

    u = costs["per_unit"]
    print(
        f"costs per {'accepted payment' if moves else 'request'} ({units} in {costs['window_s']} s, "
        f"Postgres and Redis statistics): WAL flushes {fmt(u['wal_flushes'])}, WAL records "
        f"{fmt(u['wal_records'], 1)}, WAL bytes {fmt(u['wal_bytes'], 0)}, transactions "
        f"{fmt(u['transactions'])}, statements {fmt(u['statements'])}, Redis commands {fmt(u['redis_commands'])}"
    )
    for note in costs["notes"]:
        print(f"  {note}")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "checkpoint":
        checkpoint()
    elif len(sys.argv) >= 3 and sys.argv[1] == "snapshot":
        snapshot()
    elif len(sys.argv) == 6 and sys.argv[1] == "report":
        report()
    else:
        raise SystemExit(__doc__.split("\n\n")[1])
