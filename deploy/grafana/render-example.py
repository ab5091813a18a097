#!/usr/bin/env python3
"""Draws deploy/grafana/walletlock-dashboard.json's panels from a live Prometheus, to a PNG.

This is NOT Grafana: it is a rendering of the dashboard's own queries, for docs/operating/observability.md (no Docker
engine, so no Grafana, runs on the development machines). It reads the dashboard JSON, runs every
panel's PromQL exprs against Prometheus's HTTP API (query_range) over a time window, and draws each
panel where its gridPos puts it: time series as lines (stacked where the panel stacks), stat panels
as their last value. Grafana's variables are filled in as Grafana would with their defaults:
$replica is every replica (.*) and $__rate_interval is max(4 x scrape interval, step + scrape
interval).

    deploy/local up --observability           # Prometheus on 127.0.0.1:9090 scraping the replicas
    ... run some load ...
    ~/.cache/walletlock/render/bin/python3 deploy/grafana/render-example.py \\
        --minutes 3 --out deploy/grafana/dashboard-example.png

Needs matplotlib (python3 -m venv ~/.cache/walletlock/render && ~/.cache/walletlock/render/bin/pip
install matplotlib). Talks to the given Prometheus only.
"""

import argparse
import datetime
import json
import math
import os
import re
import sys
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

HERE = os.path.dirname(os.path.abspath(__file__))
SCRAPE_INTERVAL = 5  # seconds, as in deploy/prometheus/prometheus.yml

# Grafana's dark theme.
BACKGROUND, PANEL, BORDER, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e9e"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0",
           "#37872d", "#fade2a", "#447ebc", "#c15c17", "#890f02", "#0a437c", "#6d1f62", "#584477"]
COLORS = {"green": "#73bf69", "red": "#f2495c", "orange": "#ff9830", "yellow": "#fade2a"}


def query_range(prometheus, expr, start, end, step):
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=10) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def fill_variables(expr, step):
    rate_interval = max(4 * SCRAPE_INTERVAL, step + SCRAPE_INTERVAL)
    expr = expr.replace("$__rate_interval", f"{rate_interval}s").replace("${__rate_interval}", f"{rate_interval}s")
    return re.sub(r"\$\{?replica\}?", ".*", expr)


def legend(template, labels):
    text = re.sub(r"\{\{\s*([a-zA-Z_]+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template or "")
    return text.strip() or ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"


def formatter(unit):
    def fmt(value, _pos=None):
        if value is None or math.isnan(value):
            return "-"
        if unit == "s":
            if value == 0:
                return "0"
            return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
        if unit == "percentunit":
            return f"{value * 100:.0f}%"
        if unit == "bytes":
            return f"{value / 2**20:.3g} MiB"
        if unit in ("reqps", "ops"):
            return f"{value:.3g}/s" if value else "0"
        return f"{value:.3g}"
    return fmt


def with_gaps(points, step):
    """Breaks the line where Prometheus has no value (Grafana's spanNulls: false)."""
    out = []
    for i, (t, v) in enumerate(points):
        if i and t - points[i - 1][0] > 1.5 * step:
            out.append((points[i - 1][0] + step, float("nan")))
        out.append((t, v))
    return out


def draw_timeseries(ax, panel, series, start, end, step):
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "short")
    stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
    overrides = panel.get("fieldConfig", {}).get("overrides", [])
    right = None
    if not series:
        ax.text(0.5, 0.5, "No data", color=MUTED, ha="center", va="center", transform=ax.transAxes, fontsize=11)
    times_all = sorted({t for _, points in series for t, _ in points})
    base = {t: 0.0 for t in times_all}
    for i, (name, points) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        target = ax
        for override in overrides:
            matcher = override.get("matcher", {})
            if matcher.get("id") == "byRegexp" and re.fullmatch(matcher.get("options", ""), name):
                if right is None:
                    right = ax.twinx()
                    right.tick_params(colors=MUTED, labelsize=7)
                    right.set_ylim(bottom=0)
                    for side in right.spines.values():
                        side.set_visible(False)
                    props = {p["id"]: p.get("value") for p in override.get("properties", [])}
                    right.yaxis.set_major_formatter(FuncFormatter(formatter(props.get("unit", "short"))))
                target = right
        points = with_gaps(points, step)
        xs = [datetime.datetime.fromtimestamp(t) for t, _ in points]
        ys = [v for _, v in points]
        if stacked and target is ax:
            lows = [base.get(t, 0.0) for t, _ in points]
            highs = [lo + v for lo, v in zip(lows, ys)]
            for t, hi in zip((t for t, _ in points), highs):
                if not math.isnan(hi):
                    base[t] = hi
            ax.fill_between(xs, lows, highs, color=color, alpha=0.35, linewidth=0)
            ax.plot(xs, highs, color=color, linewidth=1.1, label=name)
        else:
            target.plot(xs, ys, color=color, linewidth=1.2, label=name, linestyle="--" if target is not ax else "-")
    ax.set_xlim(datetime.datetime.fromtimestamp(start), datetime.datetime.fromtimestamp(end))
    ax.set_ylim(bottom=defaults.get("min", None))
    if defaults.get("max") is not None:
        ax.set_ylim(top=defaults["max"])
    ax.yaxis.set_major_formatter(FuncFormatter(formatter(unit)))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(maxticks=5))
    ax.tick_params(colors=MUTED, labelsize=7)
    ax.grid(color=BORDER, linewidth=0.5)
    if series:
        # The legend names the series that moved; those that stayed at 0 are drawn but only counted.
        handles, labels = ax.get_legend_handles_labels()
        if right is not None:
            h2, l2 = right.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        moved = {name for name, points in series if any(v for _, v in points if not math.isnan(v))}
        kept = [(h, label) for h, label in zip(handles, labels) if label in moved]
        zero = len(labels) - len(kept)
        if zero:
            kept.append((plt.Line2D([], [], color=MUTED, linewidth=1.2), f"{zero} series at 0 throughout" if kept else
                         f"all {zero} series at 0 throughout"))
        ax.legend([h for h, _ in kept], [label for _, label in kept], loc="upper left", fontsize=6,
                  ncol=2 if len(kept) > 4 else 1, frameon=True, facecolor=PANEL, edgecolor=BORDER,
                  framealpha=0.85, labelcolor=TEXT, handlelength=1.2)


def draw_stat(ax, panel, series):
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    values = [v for _, points in series for _, v in points[-1:] if not math.isnan(v)]
    ax.set_axis_off()
    if not values:
        ax.text(0.5, 0.45, "No data", color=MUTED, ha="center", va="center", transform=ax.transAxes, fontsize=14)
        return
    value = values[0]
    color = COLORS["green"]
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step.get("value") is None or value >= step["value"]:
            color = COLORS.get(step.get("color"), step.get("color"))
    decimals = defaults.get("decimals")
    unit = defaults.get("unit", "none")
    if unit in ("reqps", "ops") and decimals is not None:
        text = f"{value:.{decimals}f}/s"
    elif unit == "none":
        text = f"{value:.0f}"
    else:
        text = formatter(unit)(value)
    ax.text(0.5, 0.45, text, color=color, ha="center", va="center", transform=ax.transAxes,
            fontsize=20, fontweight="bold")
    for _, points in series[:1]:
        xs = [t for t, _ in points]
        ys = [v for _, v in points]
        if len(xs) > 1:
            spark = ax.inset_axes([0, 0, 1, 0.35])
            spark.fill_between(xs, ys, color=color, alpha=0.18, linewidth=0)
            spark.plot(xs, ys, color=color, linewidth=0.8, alpha=0.7)
            spark.set_axis_off()
            spark.set_ylim(bottom=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--dashboard", default=os.path.join(HERE, "walletlock-dashboard.json"))
    parser.add_argument("--minutes", type=float, default=5, help="the window: the last N minutes before --end")
    parser.add_argument("--end", type=float, default=None, help="unix time the window ends (default: now)")
    parser.add_argument("--out", default=os.path.join(HERE, "dashboard-example.png"))
    args = parser.parse_args()

    with open(args.dashboard) as f:
        dashboard = json.load(f)
    end = args.end or datetime.datetime.now().timestamp()
    start = end - args.minutes * 60
    step = max(SCRAPE_INTERVAL, int(args.minutes * 60 / 240))
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.36  # inches per grid row; 24 columns over the figure's width
    width, height = 18.0, rows * unit_h + 0.9
    fig = plt.figure(figsize=(width, height), facecolor=BACKGROUND)
    top = 0.6 / height

    def box(grid, pad=0.06):
        x0 = grid["x"] / 24 + pad / width
        w = grid["w"] / 24 - 2 * pad / width
        y0 = 1 - top - (grid["y"] + grid["h"]) * unit_h / height + pad / height
        h = grid["h"] * unit_h / height - 2 * pad / height
        return x0, y0, w, h

    window = (f"{datetime.datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} to "
              f"{datetime.datetime.fromtimestamp(end):%H:%M:%S}")
    fig.text(0.008, 1 - 0.25 / height, dashboard["title"], color=TEXT, fontsize=15, fontweight="bold", va="center")
    fig.text(0.992, 1 - 0.25 / height,
             f"not Grafana: {os.path.basename(args.dashboard)}'s queries, drawn by render-example.py "
             f"from {args.prometheus}, {window}", color=MUTED, fontsize=8.5, va="center", ha="right")

    for panel in panels:
        x0, y0, w, h = box(panel["gridPos"])
        if panel["type"] == "row":
            fig.text(x0, y0 + h / 2, panel["title"], color=TEXT, fontsize=11, fontweight="bold", va="center")
            continue
        frame = fig.add_axes([x0, y0, w, h])
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for side in frame.spines.values():
            side.set_color(BORDER)
        title_h = 0.3 / height
        frame.text(0.012, 1 - 0.15 / (h * height), panel["title"], color=TEXT, fontsize=8.5, fontweight="bold",
                   va="center", transform=frame.transAxes)
        series = []
        for target in panel.get("targets", []):
            expr = fill_variables(target["expr"], step)
            for result in query_range(args.prometheus, expr, start, end, step):
                points = [(float(t), float(v)) for t, v in result["values"]]
                series.append((legend(target.get("legendFormat"), result["metric"]), points))
        if panel["type"] == "stat":
            inner = fig.add_axes([x0 + 0.01 * w, y0 + 0.04 * h, 0.98 * w, h - title_h - 0.08 * h])
            draw_stat(inner, panel, series)
        else:
            inner = fig.add_axes([x0 + 0.045 * 24 / panel["gridPos"]["w"] * w / 1.0 * 0.6, y0 + 0.28 / height,
                                  w * (1 - 0.045 * 24 / panel["gridPos"]["w"] * 0.6) - 0.012 * w,
                                  h - title_h - 0.36 / height])
            inner.set_facecolor(PANEL)
            for side in inner.spines.values():
                side.set_visible(False)
            draw_timeseries(inner, panel, series, start, end, step)
    fig.savefig(args.out, dpi=100, facecolor=BACKGROUND)
    print(f"wrote {args.out} ({len([p for p in panels if p['type'] != 'row'])} panels, {window})", file=sys.stderr)


if __name__ == "__main__":
    main()
