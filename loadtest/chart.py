#!/usr/bin/env python3
"""loadtest/chart.py BENCH_JSON PNG: the chart of loadtest/bench's table (matplotlib).

Left: throughput (payments per second, log scale; for the read and health ceilings, requests per
second) of each run, with its ratio to its raw-Postgres anchor. Right: p50 and p99 latency (ms, log
scale). Grey: pgbench; blue: walletlock's payments; green: its read and health ceilings; orange:
its payments in a Redis outage (under Postgres alone); red: the tutorial's lock.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def color(r):
    if r["kind"] == "pgbench":
        return "#7f7f7f"
    if "tutorial" in r["label"]:
        return "#d62728"
    if "Redis gone" in r["label"]:
        return "#ff7f0e"
    return "#1f77b4" if r.get("moves", True) else "#2ca02c"


def main():
    with open(sys.argv[1]) as f:
        bench = json.load(f)
    rows = [r for r in bench["rows"] if r["rps"] > 0 and r["p50_ms"] > 0]
    if not rows:
        sys.exit("chart: no run in the table to draw")
    y = list(range(len(rows)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.9 * len(rows) + 1.8), sharey=True)
    rps = [r["rps"] for r in rows]
    left.barh(y, rps, color=[color(r) for r in rows])
    left.set_xscale("log")
    left.set_xlabel("payments per second (read, health: requests per second; log scale)")
    left.set_yticks(y)
    left.set_yticklabels([r["label"].replace(": ", ":\n") for r in rows], fontsize=9)
    for yi, r in zip(y, rows):
        note = f" {r['rps']:,.0f}/s" + ("" if r.get("moves", True) else " (ceiling)")
        note += f"  ({r['ratio']:.3f}x anchor)" if r.get("ratio") is not None else ""
        left.text(r["rps"], yi, note, va="center", fontsize=8)
    left.set_xlim(min(rps) / 2, max(rps) * 12)
    left.grid(axis="x", which="both", alpha=0.3)

    height = 0.38
    p50 = [max(r["p50_ms"], 0.01) for r in rows]
    p99 = [max(r["p99_ms"], 0.01) for r in rows]
    for shift, values, shade, label in ((height / 2, p50, "#9ecae1", "p50"), (-height / 2, p99, "#08519c", "p99")):
        right.barh([v + shift for v in y], values, height=height, color=shade, label=label)
        for yi, v in zip(y, values):
            right.text(v, yi + shift, f" {v:,.1f}", va="center", fontsize=7)
    right.set_xscale("log")
    right.set_xlabel("latency, ms (log scale)")
    right.set_xlim(min(p50) / 2, max(p99) * 8)
    right.legend(loc="lower right", fontsize=8)
    right.grid(axis="x", which="both", alpha=0.3)

    fig.suptitle(bench["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
