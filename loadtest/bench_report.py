#!/usr/bin/env python3
"""loadtest/bench_report.py DIR: the table of a loadtest/bench run.

Reads DIR/runs.tsv (label, kind, scenario, run directory, exit status; written by loadtest/bench)
and each run's results (a walletlock run's costs.json: loadtest/costs.py), and writes
DIR/bench.json (for loadtest/chart.py) and DIR/bench.md (the table, the targets, the method and
the machine), and prints the table and the targets.
"""

import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def load_json(path):
    return json.loads(read(path))


def sh(*cmd):
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20)
        return (out.stdout + out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


def percentile(sorted_values, p):
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


def verdict(books_file):
    try:
        lines = read(books_file).strip().splitlines()
    except OSError:
        return "?", ""
    last = lines[-1] if lines else ""
    m = re.search(r"\b(OK|BROKEN)$", last)
    return (m.group(1) if m else "?"), last


def pgbench_row(label, scenario, run_dir, status):
    text = read(os.path.join(run_dir, "pgbench.out"))
    tps = float(re.search(r"tps = ([0-9.]+) \(without initial connection time\)", text).group(1))
    processed = int(re.search(r"number of transactions actually processed: (\d+)", text).group(1))
    failed_m = re.search(r"number of failed transactions: (\d+)", text)
    failed = int(failed_m.group(1)) if failed_m else 0
    latencies = []
    for path in glob.glob(os.path.join(run_dir, "pgbench_log.*")):
        with open(path) as log:
            for line in log:
                fields = line.split()
                if len(fields) >= 3 and fields[2].isdigit():
                    latencies.append(int(fields[2]) / 1000.0)  # microseconds -> ms
    latencies.sort()
    books, books_line = verdict(os.path.join(run_dir, "books.txt"))
    return {
        "label": label,
        "kind": "pgbench",
        "scenario": scenario,
        "rps": tps,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "requests": processed,
        "accepted": processed,
        "unexpected": failed,
        "lock_timeout": 0,
        "rss_mib": [],
        "moves": True,
        "costs": None,
        "books": books,
        "books_line": books_line,
        "status": status,
        "dir": run_dir,
    }


def walletlock_row(label, scenario, run_dir, status):
    figures = load_json(os.path.join(run_dir, "summary.json"))["figures"]
    moves = figures.get("op", "move") == "move"
    try:
        costs = load_json(os.path.join(run_dir, "costs.json"))
    except (OSError, ValueError):
        costs = None
    rss = []
    try:
        for line in read(os.path.join(run_dir, "rss.txt")).splitlines():
            name, _pid, hwm_kb, _rss_kb, _up = line.split()
            rss.append([name, int(hwm_kb) / 1024])
    except OSError:
        pass
    books, books_line = verdict(os.path.join(run_dir, "books.txt"))
    if not moves:
        books = "-"  # reads and health checks move no money: nothing to check
    if books == "?" and status not in (0, 2):
        books = f"run failed (exit {status})"
    return {
        "label": label,
        "kind": "walletlock",
        "scenario": scenario,
        "moves": moves,
        "costs": costs,
        "rps": figures["rps"],
        "p50_ms": figures["p50_ms"],
        "p99_ms": figures["p99_ms"],
        "requests": figures["requests"],
        "accepted": figures["accepted"],
        "unexpected": figures["unexpected"],
        "lock_timeout": figures["lock_timeout"],
        "dependency_unavailable": figures["dependency_unavailable"],
        "failed_thresholds": figures["failed_thresholds"],
        "rss_mib": rss,
        "books": books,
        "books_line": books_line,
        "status": status,
        "dir": run_dir,
        "webhooks": webhooks(run_dir),
    }


def webhooks(run_dir):
    """What `walletlock events listen` took in a webhook run (loadtest/bench's webhook_done), with
    the drain's seconds: from the listener's start to its first event (`wait`) and from its first
    to its last (`drain`); None for other runs."""
    try:
        w = load_json(os.path.join(run_dir, "webhooks.json"))
    except (OSError, ValueError):
        return None

    def at(key):
        # RFC 3339 with nanoseconds (date) or microseconds (chrono): seconds since the epoch.
        text = re.sub(r"(\.\d{6})\d*", r"\1", w[key]).replace("Z", "+00:00")
        return datetime.datetime.fromisoformat(text).timestamp()

    if w.get("first_at") and w.get("last_at") and w.get("listened_at"):
        w["wait_seconds"] = at("first_at") - at("listened_at")
        w["drain_seconds"] = at("last_at") - at("first_at")
    return w


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def plain(header, rows, left=False):
    """The table aligned in columns: the first left, the others right (all left with `left`)."""
    widths = [max([len(header[i]), *(len(c[i]) for c in rows)]) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 or left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join(line(cells) for cells in [header, *rows])


def attempt_figures(run_dir):
    """What an attempt that was not kept measured, and the CPU it shared."""
    make = pgbench_row if os.path.exists(os.path.join(run_dir, "pgbench.out")) else walletlock_row
    try:
        row = make("", "", run_dir, 0)
        figures = f"{row['rps']:,.0f}/s, p99 {fmt_ms(row['p99_ms'])} ms"
    except (OSError, AttributeError, KeyError, ValueError):
        figures = "?"
    try:
        other = f"{load_json(os.path.join(run_dir, 'other_cpu.json'))['other_pct']:.0f}%"
    except (OSError, KeyError, ValueError):
        other = "?"
    return f"{figures} with {other} other CPU"


def machine():
    cpu = "?"
    for line in read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = 0
    for line in read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    try:
        debian = read("/etc/debian_version").strip()
    except OSError:
        debian = "?"
    pg_bin = os.environ.get("PG_BINDIR", "")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = os.environ.get("BENCH_COMMIT") or sh("git", "-C", root, "describe", "--always", "--dirty")
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kb / 1024 / 1024, 1),
        "os": f"Debian {debian}, Linux {platform.release()}",
        "postgres": sh(os.path.join(pg_bin, "postgres"), "--version"),
        "pgbench": sh(os.path.join(pg_bin, "pgbench"), "--version"),
        "redis": sh("redis-server", "--version"),
        "nginx": sh("nginx", "-v") if sh("nginx", "-v") != "?" else sh("/usr/sbin/nginx", "-v"),
        "k6": sh(os.environ.get("K6", "k6"), "version"),
        "rustc": sh("rustc", "--version"),
        "walletlock": commit,
    }


def fmt_ms(v):
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


# The cost columns: (header, key in costs.json's per_unit, decimals).
COSTS = [
    ("WAL flushes/payment", "wal_flushes", 2),
    ("transactions/payment", "transactions", 2),
    ("statements/payment", "statements", 2),
    ("Redis commands/payment", "redis_commands", 2),
]


def cost_cell(r, key, digits):
    """A run's cost per accepted payment (per request for reads and health checks: `/req`)."""
    value = (r.get("costs") or {}).get("per_unit", {}).get(key)
    if value is None:
        return "-"
    return f"{value:.{digits}f}" + ("" if r["costs"]["per"] == "payment" else "/req")


def targets(rows, listed=()):
    """The issue's targets: [(target, result, met)] with met True, False, None (not measured) or
    "-" (a figure the issues ask to state, with no bound). A target whose runs are not all in `rows`
    says "not run" (loadtest/bench's BENCH_ONLY left one out), or "not measured" when each was run
    (`listed`: the labels of runs.tsv) but one's results could not be read."""
    by = {r["label"]: r for r in rows}
    out = []

    def missing(*labels):
        """None when every run of `labels` has its row, else what the target says instead."""
        gone = [label for label in labels if label not in by]
        if not gone:
            return None
        return "not measured" if all(label in listed for label in gone) else "not run"

    def ratio(target, a, b, bound):
        """rps of run `a` ÷ rps of run `b` ≥ `bound` (None: stated, no bound)."""
        gone = missing(a, b)
        if gone:
            out.append((target, gone, None if bound is not None else "-"))
        elif by[b]["rps"] > 0:
            x = by[a]["rps"] / by[b]["rps"]
            out.append((target, f"{x:.2f} ({by[a]['rps']:,.0f}/s ÷ {by[b]['rps']:,.0f}/s)",
                        x >= bound if bound is not None else "-"))
        else:
            out.append((target, "not measured", None if bound is not None else "-"))

    def bounded(target, label, result, met):
        """A target on run `label` alone: result(row) and met(row) when it has its row."""
        gone = missing(label)
        out.append((target, gone, None) if gone else (target, result(by[label]), met(by[label])))

    def cost(label, target, key, bound):
        gone = missing(label)
        value = None if gone else (by[label].get("costs") or {}).get("per_unit", {}).get(key)
        if value is None:
            out.append((target, gone or "not measured", None))
        else:
            out.append((target, f"{value:.2f}", value <= bound))

    hot, spread = "walletlock: hot", "walletlock: spread"
    ratio("spread payments/s ÷ read requests/s ≥ 0.6", spread, "walletlock: read", 0.6)
    ratio("hot payments/s ÷ pgbench hot tps ≥ 1.5", hot, "pgbench: hot", 1.5)
    for label, bound, name in ((spread, 50, "spread"), (hot, 30, "hot")):
        bounded(f"{name} p99 ≤ {bound} ms", label, lambda r: f"{fmt_ms(r['p99_ms'])} ms",
                lambda r, bound=bound: r["p99_ms"] <= bound)
    bounded("hot: zero lock_timeout", hot, lambda r: f"{r['lock_timeout']} of {r['requests']:,}",
            lambda r: r["lock_timeout"] == 0)
    peaks = [mib for r in rows if r["kind"] == "walletlock" for _name, mib in r["rss_mib"]]
    if peaks:
        peak = max(peaks)
        out.append(("every replica's peak RSS < 50 MB", f"{peak * 1.048576:.1f} MB ({peak:.1f} MiB) at most",
                    peak * 1024 * 1024 < 50e6))
    else:
        ran = any(r["kind"] == "walletlock" for r in rows) or any(not label.startswith("pgbench") for label in listed)
        out.append(("every replica's peak RSS < 50 MB", "not measured" if ran else "not run", None))
    for name in ("hot", "spread"):
        ratio(f"{name}: under Postgres alone ÷ on leases (stated)", f"Redis gone: {name}", f"walletlock: {name}", None)
    ratio("spread: on Citus (coordinator + 2 workers, these cores) ÷ on one Postgres (stated)", "Citus: spread",
          spread, None)
    cost(spread, "spread: statements per payment ≤ 2", "statements", 2)
    cost(spread, "spread: WAL flushes per payment ≤ 0.25", "wal_flushes", 0.25)
    # Issue 33 (one movement model): transfers and splits against spread payments, in this run.
    transfer = "walletlock: transfer"
    ratio("transfers/s ÷ spread payments/s ≥ 0.6", transfer, spread, 0.6)
    ratio("3-leg splits/s ÷ spread payments/s ≥ 0.5", "walletlock: split", spread, 0.5)
    cost(transfer, "transfer: statements per transfer ≤ 2", "statements", 2)
    cost(transfer, "transfer: WAL flushes per transfer ≤ 0.3", "wal_flushes", 0.30)
    gone = missing(transfer, spread)
    if gone:
        out.append(("transfer p99 ≤ 1.5x spread p99", gone, None))
    else:
        bound = 1.5 * by[spread]["p99_ms"]
        out.append((f"transfer p99 ≤ 1.5x spread p99 ({fmt_ms(bound)} ms)", f"{fmt_ms(by[transfer]['p99_ms'])} ms",
                    by[transfer]["p99_ms"] <= bound))
    # Request metadata: spread's payments, each with a metadata object of 4 keys, against spread's.
    ratio("spread with metadata ÷ spread payments/s ≥ 0.9", "walletlock: spread with metadata", spread, 0.9)
    # Issue 37 (limits): spread's payments from wallets with a daily and a monthly velocity limit.
    ratio("spread with daily and monthly limits ÷ spread payments/s ≥ 0.9", "walletlock: spread with limits",
          spread, 0.9)
    # Issue 36 (events): spread's payments with their events (the default) against the same with
    # EVENTS=off, in this run; the events ride the round's one statement, so no flush of their own.
    no_events = "walletlock: spread, events off"
    ratio("spread ÷ spread with events off payments/s ≥ 0.9", spread, no_events, 0.9)
    gone = missing(spread, no_events)
    flushes = [] if gone else [(by[label].get("costs") or {}).get("per_unit", {}).get("wal_flushes")
                               for label in (spread, no_events)]
    if gone or None in flushes:
        out.append(("spread: WAL flushes per payment with events ≤ with them off + 0.01", gone or "not measured", None))
    else:
        out.append(("spread: WAL flushes per payment with events ≤ with them off + 0.01",
                    f"{flushes[0]:.3f} vs {flushes[1]:.3f}", flushes[0] <= flushes[1] + 0.01))
    # Issue 36 (webhooks): spread's payments with an endpoint whose receiver (`walletlock events
    # listen`) runs through the load, and with one that is down through it and started after.
    hooks, after = "walletlock: spread, webhooks", "walletlock: spread, webhooks after"
    ratio("spread with a webhook endpoint ÷ spread payments/s (stated)", hooks, spread, None)

    def delivered(r):
        w = r.get("webhooks") or {}
        return w.get("events", 0) == w.get("expected", -1) and w.get("bad_signatures", 1) == 0

    def lag(r):
        w = r.get("webhooks") or {}
        p99 = w.get("lag_p99_seconds")
        shown = "?" if p99 is None else f"{p99:.3f}"
        return f"{shown} s ({w.get('events'):,} of {w.get('expected'):,} events delivered)"

    bounded("webhooks: event lag p99 ≤ 1 s with the receiver healthy, every event delivered", hooks, lag,
            lambda r: delivered(r) and (r["webhooks"].get("lag_p99_seconds") or 99) <= 1)

    def drain(r):
        w = r.get("webhooks") or {}
        if not w.get("drain_seconds"):
            return None
        return w["events"] / w["drain_seconds"] / r["rps"] if r["rps"] else None

    bounded("webhooks: a backlog drains at ≥ 2x the payment rate, every event delivered", after,
            lambda r: "not measured" if drain(r) is None else
            f"{drain(r):.2f}x ({r['webhooks']['events']:,} events in {r['webhooks']['drain_seconds']:.1f} s, "
            f"{r['rps']:,.0f} payments/s; the first {r['webhooks']['wait_seconds']:.1f} s after the receiver "
            f"came back)",
            lambda r: drain(r) is not None and delivered(r) and drain(r) >= 2)
    return out


def main():
    out = sys.argv[1]
    settings = load_json(os.path.join(out, "settings.json"))
    rows = []
    listed = []
    for line in read(os.path.join(out, "runs.tsv")).splitlines():
        label, kind, scenario, run_dir, status, idle = line.rstrip("\n").split("\t")
        listed.append(label)
        make = pgbench_row if kind == "pgbench" else walletlock_row
        try:
            rows.append(make(label, scenario, run_dir, int(status)))
            rows[-1]["idle_before_pct"] = int(idle)
            try:
                rows[-1]["other_cpu"] = load_json(os.path.join(run_dir, "other_cpu.json"))
            except (OSError, ValueError):
                rows[-1]["other_cpu"] = None
        except (OSError, AttributeError, KeyError, ValueError) as err:
            print(f"bench: no results for {label} in {run_dir}: {err}", file=sys.stderr)
    anchors = {r["scenario"]: r["rps"] for r in rows if r["kind"] == "pgbench"}
    for r in rows:
        anchor = anchors.get(r["scenario"])
        r["ratio"] = r["rps"] / anchor if r["kind"] != "pgbench" and anchor else None

    info = machine()
    replicas = max((len(r["rss_mib"]) for r in rows), default=0)
    header = ["scenario", "rps", "p50 ms", "p99 ms", "unexpected errors", "ratio to anchor"]
    rss_header = f"peak RSS, MiB ({'/'.join(f'r{n + 1}' for n in range(replicas))})" if replicas else "peak RSS, MiB"
    header += [rss_header, "lock_timeout", "books"]
    header += [h for h, _key, _digits in COSTS] + ["other CPU"]
    table = []
    for r in rows:
        cells = [
            r["label"],
            f"{r['rps']:,.0f}",
            fmt_ms(r["p50_ms"]),
            fmt_ms(r["p99_ms"]),
            f"{r['unexpected']}",
            "1 (anchor)" if r["kind"] == "pgbench" else (f"{r['ratio']:.3f} (1/{1 / r['ratio']:.{1 if r['ratio'] > 0.1 else 0}f})" if r["ratio"] else "-"),
        ]
        cells.append(" / ".join(f"{mib:.1f}" for _name, mib in r["rss_mib"]) or "-")
        cells += [str(r["lock_timeout"]) if r["kind"] != "pgbench" and r["moves"] else "-", r["books"]]
        cells += [cost_cell(r, key, digits) for _h, key, digits in COSTS]
        cells.append(f"{r['other_cpu']['other_pct']:.0f}%" if r.get("other_cpu") else "?")
        table.append(cells)

    secs, vus, clients = settings["seconds"], settings["vus"], settings["clients"]
    title = (
        f"walletlock {info['walletlock'].split()[0]} vs raw Postgres, {info['cpus']} cores ({info['cpu']}), {secs} s per run; "
        f"pgbench {clients} clients, k6 {vus} VUs via nginx + {replicas} replicas"
    )
    notes = [
        (f"Every run lasted {secs} s on the same machine, one after the other: {info['cpus']} cores "
         f"({info['cpu']}), {info['ram_gib']} GiB RAM, {info['os']}; Postgres, Redis, nginx, the "
         f"{replicas} replicas and the load generator (pgbench {clients} clients, or k6 {vus} VUs with "
         f"GOGC={os.environ.get('GOGC', '400')}) all share those cores. What each run measures, and how: "
         "loadtest/README.md, `loadtest/bench`."),
        "The machine was idle before each run (whole-machine idle CPU over 3 s: "
        + ", ".join(f"{r['label']} {r['idle_before_pct']}%" for r in rows)
        + "). other CPU: the share of the machine's CPU that processes outside the benchmark used "
        "during the run (a lower bound).",
    ]
    discarded = []
    try:
        for line in read(os.path.join(out, "discarded.tsv")).splitlines():
            label, attempt, path = line.rstrip("\n").split("\t")
            discarded.append(f"{label} attempt {attempt}: {attempt_figures(path)}")
    except (OSError, ValueError):
        pass
    notes.append(
        f"A run in which other processes took more than {settings.get('max_other_pct', 10)}% of the "
        f"CPU was run again (up to {settings.get('tries', 3)} attempts), and the attempt that shared the CPU least is the one "
        "in the table, whatever its figures. Attempts not kept: "
        + ("; ".join(discarded) if discarded else "none")
        + "."
    )
    goals = targets(rows, listed)
    goal_header = ["target", "result", "met?"]
    goal_cells = [[t, res, {True: "yes", False: "no", None: "?", "-": "-"}[met]] for t, res, met in goals]
    machine_lines = [f"- {k}: {v}" for k, v in info.items()]
    only = settings.get("only", "")
    command = (f'BENCH_ONLY="{only}" ' if only else "") + f"BENCH_SECONDS={secs} BENCH_VUS={vus} loadtest/bench"
    md = "\n".join(
        [
            "# walletlock benchmark",
            "",
            f"`{command}` (results in `{os.path.relpath(out, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}`), {settings['started']}.",
            "",
            markdown(header, table),
            "",
            ("Targets (issue 13): rps as in the table (payments or reads answered per second); the "
             "costs and the p99s of the runs above."),
            "",
            markdown(goal_header, goal_cells),
            "",
            "Method and conditions:",
            "",
            *[f"- {n}" for n in notes],
            "",
            "Machine and versions:",
            "",
            *machine_lines,
            "",
            "![benchmark](bench.png)",
            "",
        ]
    )
    bench = {"title": title, "settings": settings, "machine": info, "rows": rows, "command": command,
             "targets": [{"target": t, "result": res, "met": met} for t, res, met in goals]}
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(bench, f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(md)
    print(title)
    print(plain(header, table))
    print()
    print(plain(goal_header, goal_cells, left=True))
    for r in rows:
        if r["kind"] == "walletlock" and r.get("failed_thresholds"):
            print(f"  {r['label']}: thresholds failed: {'; '.join(r['failed_thresholds'])}")
    return 0 if all(r["books"] == "OK" for r in rows if r["moves"]) else 1


if __name__ == "__main__":
    sys.exit(main())
