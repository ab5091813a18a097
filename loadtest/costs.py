#!/usr/bin/env python3
"""loadtest/costs.py: what a load test's payments cost Postgres and Redis, from their own statistics.

    loadtest/costs.py checkpoint --pg-socket DIR --pg-port N
    loadtest/costs.py snapshot OUT_JSON --pg-socket DIR --pg-port N --redis-state DIR --redis-auth FILE
    loadtest/costs.py report BEFORE_JSON AFTER_JSON SUMMARY_JSON OUT_JSON

checkpoint: CHECKPOINT on every node, so that none runs beside the measured run. snapshot: the
cumulative counters (pg_stat_wal, pg_stat_database, pg_stat_statements; Redis INFO commandstats of
each primary), summed over a Citus cluster's nodes but the statements (the coordinator's). report:
AFTER - BEFORE (less BEFORE's own queries) per accepted payment (read, health: per request).
loadtest/README.md (COSTS=1) says what each figure counts, and why the caller waits about 11 s
after the traffic before a snapshot (Postgres backends report their counters when idle).
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
    out = subprocess.run(["psql", "-X", "-q", "-t", "-A", "-h", socket, "-p", str(port), "-U", "postgres", "-d", db,
                          "-v", "ON_ERROR_STOP=1", "-c", query], check=False, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return out.stdout.strip()


def pg_counters(socket, port):
    """One node's WAL and transaction counters (PG_FIELDS)."""
    fields = ", ".join(f"'{f}', {'w' if f.startswith('wal') else 'd'}.{f}" for f in PG_FIELDS)
    return json.loads(psql(socket, port, "walletlock", f"select json_build_object({fields}) "
                           "from pg_stat_wal w, pg_stat_database d where d.datname = 'walletlock'"))


def citus_workers(socket, port):
    """The (socket, port) of every active worker the coordinator lists; none without Citus."""
    if psql(socket, port, "walletlock", "select count(*) from pg_extension where extname = 'citus'") != "1":
        return []
    rows = psql(socket, port, "walletlock",
                "select nodename || ' ' || nodeport from pg_dist_node where groupid <> 0 and isactive")
    return [tuple(row.rsplit(" ", 1)) for row in rows.splitlines() if row]


def pg_snapshot(socket, port):
    preload = psql(socket, port, "postgres", "select current_setting('shared_preload_libraries')")
    workers = citus_workers(socket, port)
    # What this snapshot adds to the counters it reads: its statements in the coordinator's
    # walletlock database, each its own transaction (an error too: a rollback), and one per worker.
    own = (2 if workers else 1) + 1
    values = {**pg_counters(socket, port), "statements": None}
    note = ("pg_stat_statements is not loaded (shared_preload_libraries); a Postgres started before deploy/local "
            "loaded it must be restarted: deploy/local down, deploy/local up")
    if "pg_stat_statements" in preload:
        note, own = None, own + 1
        try:
            values["statements"] = int(psql(socket, port, "walletlock", "select sum(calls) from "
                                            "stats.pg_stat_statements s, pg_database d "
                                            "where s.dbid = d.oid and d.datname = 'walletlock'") or 0)
        except RuntimeError as err:  # loaded, but the extension is missing from the walletlock database
            note = f"pg_stat_statements: {err}"
    for worker in workers:
        for field, value in pg_counters(*worker).items():
            values[field] += value
    return {**values, "statements_note": note, "nodes": 1 + len(workers),
            "own": {"statements": own, "transactions": own + len(workers)}}


def redis_snapshot(state, auth_file):
    """Each primary's calls by command (replicas replay their primary's writes: not counted)."""
    env = dict(os.environ, REDISCLI_AUTH=Path(auth_file).read_text().strip())
    nodes = {}
    for pid_file in sorted(glob.glob(os.path.join(state, "node-*", "redis.pid"))):
        port = os.path.basename(os.path.dirname(pid_file))[len("node-"):]
        out = subprocess.run(["redis-cli", "--no-auth-warning", "--user", "admin", "-h", "127.0.0.1", "-p", port,
                              "info", "replication", "commandstats"],
                             check=False, capture_output=True, text=True, timeout=10, env=env)
        lines = [line.strip() for line in out.stdout.splitlines()]
        if out.returncode == 0 and "role:master" in lines:
            nodes[port] = {name: int(dict(kv.split("=", 1) for kv in stats.split(","))["calls"])
                           for name, stats in (line[len("cmdstat_"):].split(":", 1)
                                               for line in lines if line.startswith("cmdstat_"))}
    return nodes


def report():
    before, after, summary = (json.loads(Path(p).read_text()) for p in sys.argv[2:5])
    figures = summary["figures"]
    moves = figures.get("op", "move") == "move"
    units = figures["accepted"] if moves else figures["requests"]
    a, b = after["postgres"], before["postgres"]
    delta = {f: a[f] - b[f] for f in PG_FIELDS}
    delta["transactions"] = delta["xact_commit"] + delta["xact_rollback"] - b["own"]["transactions"]
    delta["statements"] = (None if a.get("statements") is None or b.get("statements") is None
                           else int(a["statements"]) - int(b["statements"]) - b["own"]["statements"])
    rb, ra = ({n: sum(calls.get(n, 0) for calls in s["redis"].values()) for c in s["redis"].values() for n in c
               if n != "info"} for s in (before, after))
    by_command = {n: ra.get(n, 0) - rb.get(n, 0) for n in sorted(set(ra) | set(rb))}
    by_command["auth"] = by_command.get("auth", 0) - len(before["redis"])  # redis-cli's, in BEFORE
    by_command = {n: d for n, d in by_command.items() if d}
    delta["redis_commands"] = sum(by_command.values())
    keys = {"wal_flushes": "wal_sync", "wal_records": "wal_records", "wal_bytes": "wal_bytes",
            "transactions": "transactions", "statements": "statements", "redis_commands": "redis_commands"}
    u = {k: None if delta[d] is None or not units else delta[d] / units for k, d in keys.items()}
    costs = {"per": "payment" if moves else "request", "units": units,
             "window_s": round(after["time"] - before["time"], 1), "delta": delta, "per_unit": u,
             "redis_by_command": by_command, "notes": [n for n in (a.get("statements_note"),) if n]}
    Path(sys.argv[5]).write_text(json.dumps(costs, indent=1))

    def fmt(v, digits=2):
        return "n/a" if v is None else f"{v:.{digits}f}"

    print(f"costs per {'accepted payment' if moves else 'request'} ({units} in {costs['window_s']} s, Postgres and "
          f"Redis statistics): WAL flushes {fmt(u['wal_flushes'])}, WAL records {fmt(u['wal_records'], 1)}, WAL bytes "
          f"{fmt(u['wal_bytes'], 0)}, transactions {fmt(u['transactions'])}, statements {fmt(u['statements'])}, "
          f"Redis commands {fmt(u['redis_commands'])}")
    for note in costs["notes"]:
        print(f"  {note}")


def checkpoint(socket, port):
    for node in [(socket, port), *citus_workers(socket, port)]:
        psql(*node, "postgres", "checkpoint")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "checkpoint":
        checkpoint(arg("--pg-socket"), arg("--pg-port"))
    elif len(sys.argv) >= 3 and sys.argv[1] == "snapshot":
        snap = {"time": time.time(), "postgres": pg_snapshot(arg("--pg-socket"), arg("--pg-port")),
                "redis": redis_snapshot(arg("--redis-state"), arg("--redis-auth"))}
        Path(sys.argv[2]).write_text(json.dumps(snap, indent=1))
    elif len(sys.argv) == 6 and sys.argv[1] == "report":
        report()
    else:
        raise SystemExit(__doc__.split("\n\n")[1])
