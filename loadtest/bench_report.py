#!/usr/bin/env python3
"""loadtest/bench_report.py DIR: the table of a loadtest/bench run.

Reads DIR/runs.tsv (written by loadtest/bench) and each run's files; writes DIR/bench.json (for
loadtest/chart.py) and DIR/bench.md (table, targets, method, machine); prints table and targets.
"""

import datetime
import functools
import glob
import json
import os
import platform
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, H, T = "walletlock: spread", "walletlock: hot", "walletlock: transfer"
NO_EVENTS, HOOKS = "walletlock: spread, events off", "walletlock: spread, webhooks"
# The issues' targets, in order: (kind, target, runs, bound). ratio: rps of the first run ÷ the
# second's ≥ bound (None: stated, no bound); p99: ≤ bound ms; statements, wal_flushes: costs.json's
# per unit ≤ bound; judge() says the others.
TARGETS = [
    ("ratio", "spread payments/s ÷ read requests/s ≥ 0.6", (S, "walletlock: read"), 0.6),
    ("ratio", "hot payments/s ÷ pgbench hot tps ≥ 1.5", (H, "pgbench: hot"), 1.5),
    ("p99", "spread p99 ≤ 50 ms", (S,), 50),
    ("p99", "hot p99 ≤ 30 ms", (H,), 30),
    ("lock_timeout", "hot: zero lock_timeout", (H,), 0),
    ("rss", "every replica's peak RSS < 50 MB", (), 50e6),
    ("ratio", "hot: under Postgres alone ÷ on leases (stated)", ("Redis gone: hot", H), None),
    ("ratio", "spread: under Postgres alone ÷ on leases (stated)", ("Redis gone: spread", S), None),
    ("ratio", "spread: on Citus (coordinator + 2 workers, these cores) ÷ on one Postgres (stated)",
     ("Citus: spread", S), None),
    ("statements", "spread: statements per payment ≤ 2", (S,), 2),
    ("wal_flushes", "spread: WAL flushes per payment ≤ 0.25", (S,), 0.25),
    # Issue 33 (one movement model): transfers and splits against spread payments.
    ("ratio", "transfers/s ÷ spread payments/s ≥ 0.6", (T, S), 0.6),
    ("ratio", "3-leg splits/s ÷ spread payments/s ≥ 0.5", ("walletlock: split", S), 0.5),
    ("statements", "transfer: statements per transfer ≤ 2", (T,), 2),
    ("wal_flushes", "transfer: WAL flushes per transfer ≤ 0.3", (T,), 0.3),
    ("p99 ratio", "transfer p99 ≤ 1.5x spread p99", (T, S), 1.5),
    ("ratio", "spread with metadata ÷ spread payments/s ≥ 0.9", ("walletlock: spread with metadata", S), 0.9),
    # Issue 37 (limits), issue 36 (events and webhooks).
    ("ratio", "spread with daily and monthly limits ÷ spread payments/s ≥ 0.9", ("walletlock: spread with limits", S),
     0.9),
    ("ratio", "spread ÷ spread with events off payments/s ≥ 0.9", (S, NO_EVENTS), 0.9),
    ("flushes", "spread: WAL flushes per payment with events ≤ with them off + 0.01", (S, NO_EVENTS), 0.01),
    ("ratio", "spread with a webhook endpoint ÷ spread payments/s (stated)", (HOOKS, S), None),
    ("lag", "webhooks: event lag p99 ≤ 1 s with the receiver healthy, every event delivered", (HOOKS,), 1),
    ("drain", "webhooks: a backlog drains at ≥ 2x the payment rate, every event delivered",
     ("walletlock: spread, webhooks after",), 2),
]
# The cost columns: (header, key in costs.json's per_unit).
COSTS = [("WAL flushes/payment", "wal_flushes"), ("transactions/payment", "transactions"),
         ("statements/payment", "statements"), ("Redis commands/payment", "redis_commands")]


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def text(path):
    try:
        return read(path)
    except OSError:
        return ""


def maybe_json(path):
    try:
        return json.loads(read(path))
    except (OSError, ValueError):
        return None


def sh(*cmd):
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20)
        return (out.stdout + out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


def percentile(sorted_values, p):
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))]


def fmt_ms(v):
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def per_unit(r, key):
    return (r.get("costs") or {}).get("per_unit", {}).get(key)


def pgbench_figures(run_dir):
    text = read(os.path.join(run_dir, "pgbench.out"))
    processed = int(re.search(r"number of transactions actually processed: (\d+)", text).group(1))
    failed = re.search(r"number of failed transactions: (\d+)", text)
    latencies = sorted(int(f[2]) / 1000.0 for path in glob.glob(os.path.join(run_dir, "pgbench_log.*"))
                       for f in map(str.split, read(path).splitlines()) if len(f) >= 3 and f[2].isdigit())
    return {"rps": float(re.search(r"tps = ([0-9.]+) \(without initial connection time\)", text).group(1)),
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99), "requests": processed,
            "accepted": processed, "unexpected": int(failed.group(1)) if failed else 0, "lock_timeout": 0}


def row(label, kind, scenario, run_dir, status):
    """One run's row: pgbench's figures from its output, a walletlock run's from k6's summary."""
    at = functools.partial(os.path.join, run_dir)
    f = pgbench_figures(run_dir) if kind == "pgbench" else json.loads(read(at("summary.json")))["figures"]
    books_line = ["", *text(at("books.txt")).strip().splitlines()][-1]
    books = (re.findall(r"\b(OK|BROKEN)$", books_line) or ["?"])[0]
    moves = f.get("op", "move") == "move"
    if not moves:
        books = "-"  # reads and health checks move no money: nothing to check
    if books == "?" and status not in (0, 2):
        books = f"run failed (exit {status})"
    rss = [[line.split()[0], int(line.split()[2]) / 1024] for line in text(at("rss.txt")).splitlines()]
    r = {"label": label, "kind": kind, "scenario": scenario, "moves": moves, "costs": maybe_json(at("costs.json")),
         **{k: f[k] for k in ("rps", "p50_ms", "p99_ms", "requests", "accepted", "unexpected", "lock_timeout")}}
    if kind != "pgbench":
        r.update(dependency_unavailable=f["dependency_unavailable"], failed_thresholds=f["failed_thresholds"])
    r.update(rss_mib=rss, books=books, books_line=books_line, status=status, dir=run_dir)
    if kind != "pgbench":
        r["webhooks"] = webhooks(at("webhooks.json"))
    return r


def webhooks(path):
    """What `walletlock events listen` took in a webhook run, with the drain's seconds: from the
    listener's start to its first event (`wait`) and from its first to its last (`drain`)."""
    w = maybe_json(path)

    def at(key):  # RFC 3339 with nanoseconds (date) or microseconds (chrono): seconds since the epoch
        return datetime.datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", w[key])).timestamp()

    if w and w.get("first_at") and w.get("last_at") and w.get("listened_at"):
        w["wait_seconds"] = at("first_at") - at("listened_at")
        w["drain_seconds"] = at("last_at") - at("first_at")
    return w


def judge(kind, target, bound, a, b, rows, listed):
    """(target, result, met) of one target of TARGETS whose runs (a, and b) have their rows."""
    if kind == "ratio":
        if b["rps"] <= 0:
            return target, "not measured", None if bound is not None else "-"
        x = a["rps"] / b["rps"]
        return target, f"{x:.2f} ({a['rps']:,.0f}/s ÷ {b['rps']:,.0f}/s)", x >= bound if bound is not None else "-"
    if kind == "p99":
        return target, f"{fmt_ms(a['p99_ms'])} ms", a["p99_ms"] <= bound
    if kind == "lock_timeout":
        return target, f"{a['lock_timeout']} of {a['requests']:,}", a["lock_timeout"] == 0
    if kind in ("statements", "wal_flushes"):
        value = per_unit(a, kind)
        return (target, "not measured", None) if value is None else (target, f"{value:.2f}", value <= bound)
    if kind == "rss":
        peaks = [mib for r in rows if r["kind"] == "walletlock" for _name, mib in r["rss_mib"]]
        if peaks:
            peak = max(peaks)
            return target, f"{peak * 1.048576:.1f} MB ({peak:.1f} MiB) at most", peak * 1024 * 1024 < bound
        ran = any(r["kind"] == "walletlock" for r in rows) or any(not x.startswith("pgbench") for x in listed)
        return target, "not measured" if ran else "not run", None
    if kind == "p99 ratio":
        limit = bound * b["p99_ms"]
        return f"{target} ({fmt_ms(limit)} ms)", f"{fmt_ms(a['p99_ms'])} ms", a["p99_ms"] <= limit
    if kind == "flushes":
        x, y = per_unit(a, "wal_flushes"), per_unit(b, "wal_flushes")
        if x is None or y is None:
            return target, "not measured", None
        return target, f"{x:.3f} vs {y:.3f}", x <= y + bound
    w = a.get("webhooks") or {}
    delivered = w.get("events", 0) == w.get("expected", -1) and w.get("bad_signatures", 1) == 0
    if kind == "lag":
        p99 = w.get("lag_p99_seconds")
        shown = "?" if p99 is None else f"{p99:.3f}"
        return (target, f"{shown} s ({w.get('events'):,} of {w.get('expected'):,} events delivered)",
                delivered and (p99 or 99) <= bound)
    rate = w["events"] / w["drain_seconds"] / a["rps"] if w.get("drain_seconds") and a["rps"] else None
    if rate is None:
        return target, "not measured", False
    result = (f"{rate:.2f}x ({w['events']:,} events in {w['drain_seconds']:.1f} s, {a['rps']:,.0f} payments/s; "
              f"the first {w['wait_seconds']:.1f} s after the receiver came back)")
    return target, result, delivered and rate >= bound


def targets(rows, listed=()):
    """[(target, result, met)], met True, False, None (not measured) or "-" (stated, no bound). A
    target whose runs are not all in `rows` says "not run" (BENCH_ONLY left one out), or "not
    measured" when each was run (`listed`: runs.tsv's labels) but its results could not be read."""
    by = {r["label"]: r for r in rows}
    out = []
    for kind, target, labels, bound in TARGETS:
        gone = [label for label in labels if label not in by]
        if gone:
            said = "not measured" if all(label in listed for label in gone) else "not run"
            out.append((target, said, "-" if kind == "ratio" and bound is None else None))
        else:
            a, b = ([by[label] for label in labels] + [None, None])[:2]
            out.append(judge(kind, target, bound, a, b, rows, listed))
    return out


def machine():
    def first(path, prefix, default):
        return next((line.split(":", 1)[1].strip() for line in read(path).splitlines() if line.startswith(prefix)),
                    default)

    debian = text("/etc/debian_version").strip() or "?"
    pg_bin = os.environ.get("PG_BINDIR", "")
    nginx = sh("nginx", "-v")
    return {
        "cpus": os.cpu_count(),
        "cpu": first("/proc/cpuinfo", "model name", "?"),
        "ram_gib": round(int(first("/proc/meminfo", "MemTotal:", "0 kB").split()[0]) / 1024 / 1024, 1),
        "os": f"Debian {debian}, Linux {platform.release()}",
        "postgres": sh(os.path.join(pg_bin, "postgres"), "--version"),
        "pgbench": sh(os.path.join(pg_bin, "pgbench"), "--version"),
        "redis": sh("redis-server", "--version"),
        "nginx": nginx if nginx != "?" else sh("/usr/sbin/nginx", "-v"),
        "k6": sh(os.environ.get("K6", "k6"), "version"),
        "rustc": sh("rustc", "--version"),
        "walletlock": os.environ.get("BENCH_COMMIT") or sh("git", "-C", ROOT, "describe", "--always", "--dirty"),
    }


def cells(r):
    """A row of the table."""
    ratio = r["ratio"]
    if r["kind"] == "pgbench":
        shown = "1 (anchor)"
    else:
        shown = f"{ratio:.3f} (1/{1 / ratio:.{1 if ratio > 0.1 else 0}f})" if ratio else "-"
    costs = ["-" if per_unit(r, key) is None else f"{per_unit(r, key):.2f}"
             + ("" if r["costs"]["per"] == "payment" else "/req") for _header, key in COSTS]
    return [r["label"], f"{r['rps']:,.0f}", fmt_ms(r["p50_ms"]), fmt_ms(r["p99_ms"]), f"{r['unexpected']}", shown,
            " / ".join(f"{mib:.1f}" for _name, mib in r["rss_mib"]) or "-",
            str(r["lock_timeout"]) if r["kind"] != "pgbench" and r["moves"] else "-", r["books"], *costs,
            f"{r['other_cpu']['other_pct']:.0f}%" if r.get("other_cpu") else "?"]


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def plain(header, rows, left=False):
    """The table aligned in columns: the first left, the others right (all left with `left`)."""
    widths = [max([len(header[i]), *(len(c[i]) for c in rows)]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 or left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
                     .rstrip() for cells in [header, *rows])


def attempt(label, number, run_dir):
    """What an attempt that was not kept measured, and the CPU it shared."""
    kind = "pgbench" if os.path.exists(os.path.join(run_dir, "pgbench.out")) else "walletlock"
    try:
        r = row("", kind, "", run_dir, 0)
        figures = f"{r['rps']:,.0f}/s, p99 {fmt_ms(r['p99_ms'])} ms"
    except (OSError, AttributeError, KeyError, ValueError):
        figures = "?"
    other = (maybe_json(os.path.join(run_dir, "other_cpu.json")) or {}).get("other_pct")
    return f"{label} attempt {number}: {figures} with {'?' if other is None else f'{other:.0f}%'} other CPU"


def main():
    out = sys.argv[1]
    settings = json.loads(read(os.path.join(out, "settings.json")))
    rows, listed = [], []
    for line in read(os.path.join(out, "runs.tsv")).splitlines():
        label, kind, scenario, run_dir, status, idle = line.split("\t")
        listed.append(label)
        try:
            rows.append({**row(label, kind, scenario, run_dir, int(status)), "idle_before_pct": int(idle),
                         "other_cpu": maybe_json(os.path.join(run_dir, "other_cpu.json"))})
        except (OSError, AttributeError, KeyError, ValueError) as err:
            print(f"bench: no results for {label} in {run_dir}: {err}", file=sys.stderr)
    anchors = {r["scenario"]: r["rps"] for r in rows if r["kind"] == "pgbench"}
    for r in rows:
        anchor = anchors.get(r["scenario"])
        r["ratio"] = r["rps"] / anchor if r["kind"] != "pgbench" and anchor else None

    info = machine()
    replicas = max((len(r["rss_mib"]) for r in rows), default=0)
    rss = f" ({'/'.join(f'r{n + 1}' for n in range(replicas))})" if replicas else ""
    header = ["scenario", "rps", "p50 ms", "p99 ms", "unexpected errors", "ratio to anchor", f"peak RSS, MiB{rss}",
              "lock_timeout", "books", *(h for h, _key in COSTS), "other CPU"]
    table = [cells(r) for r in rows]
    secs, vus, clients = settings["seconds"], settings["vus"], settings["clients"]
    title = (f"walletlock {info['walletlock'].split()[0]} vs raw Postgres, {info['cpus']} cores ({info['cpu']}), "
             f"{secs} s per run; pgbench {clients} clients, k6 {vus} VUs via nginx + {replicas} replicas")
    try:
        discarded = [attempt(*line.split("\t")) for line in read(os.path.join(out, "discarded.tsv")).splitlines()]
    except (OSError, TypeError):
        discarded = []
    notes = [
        (f"Every run lasted {secs} s on the same machine, one after the other: {info['cpus']} cores ({info['cpu']}), "
        f"{info['ram_gib']} GiB RAM, {info['os']}; Postgres, Redis, nginx, the {replicas} replicas and the load "
        f"generator (pgbench {clients} clients, or k6 {vus} VUs with GOGC={os.environ.get('GOGC', '400')}) all share "
        "those cores. What each run measures, and how: loadtest/README.md, `loadtest/bench`."),
        ("The machine was idle before each run (whole-machine idle CPU over 3 s: "
        + ", ".join(f"{r['label']} {r['idle_before_pct']}%" for r in rows)
        + "). other CPU: the share of the machine's CPU that processes outside the benchmark used during the run "
        "(a lower bound)."),
        (f"A run in which other processes took more than {settings.get('max_other_pct', 10)}% of the CPU was run again "
        f"(up to {settings.get('tries', 3)} attempts), and the attempt that shared the CPU least is the one in the "
        f"table, whatever its figures. Attempts not kept: {'; '.join(discarded) or 'none'}."),
    ]
    goals = targets(rows, listed)
    goal_header = ["target", "result", "met?"]
    goal_cells = [[t, res, {True: "yes", False: "no", None: "?", "-": "-"}[met]] for t, res, met in goals]
    only = settings.get("only", "")
    command = (f'BENCH_ONLY="{only}" ' if only else "") + f"BENCH_SECONDS={secs} BENCH_VUS={vus} loadtest/bench"
    md = [
        "# walletlock benchmark", "",
        f"`{command}` (results in `{os.path.relpath(out, ROOT)}`), {settings['started']}.", "",
        markdown(header, table), "",
        ("Targets (issue 13): rps as in the table (payments or reads answered per second); the costs and the p99s "
         "of the runs above."), "",
        markdown(goal_header, goal_cells), "", "Method and conditions:", "", *[f"- {n}" for n in notes], "",
        "Machine and versions:", "", *[f"- {k}: {v}" for k, v in info.items()], "", "![benchmark](bench.png)", "",
    ]
    bench = {"title": title, "settings": settings, "machine": info, "rows": rows, "command": command,
             "targets": [{"target": t, "result": res, "met": met} for t, res, met in goals]}
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(bench, f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write("\n".join(md))
    print(f"{title}\n{plain(header, table)}\n\n{plain(goal_header, goal_cells, left=True)}")
    for r in rows:
        if r.get("failed_thresholds"):
            print(f"  {r['label']}: thresholds failed: {'; '.join(r['failed_thresholds'])}")
    return 0 if all(r["books"] == "OK" for r in rows if r["moves"]) else 1


if __name__ == "__main__":
    sys.exit(main())
