#!/usr/bin/env python3
"""deploy/replica_figures.py: a replica's live figures from its /metrics, for `deploy/local status`.

    curl -s 127.0.0.1:8081/metrics | ~/.cache/walletlock/tools/bin/python3 deploy/replica_figures.py FORMAT

(a python3 with prometheus_client: the tools virtualenv's, where `deploy/local up` installs it).
Reads the scrape (Prometheus text format) on stdin with the reference parser and prints FORMAT, a
printf format of six %s (deploy/local's figures_format), with no newline, filled with: payments
accepted; the p99 of the API's answers (health checks and scrapes left out); leases taken; their
mean wait; writes the fence refused; resident memory. All are since the replica started. Prints
nothing, and exits non-zero, if the scrape cannot be parsed.
"""

import math
import sys

from prometheus_client.parser import text_string_to_metric_families

# Not answers of the API: the probes and Prometheus's scrapes.
NOT_API = {"/healthz", "/readyz", "/metrics"}


def samples(text):
    """Every sample of the scrape, of every family."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def figures(text):
    """The scrape's sums: {paid, lease_count, lease_sum, lost, rss} and the API's latency
    histogram, {le: answers} summed over the routes."""
    sums = dict.fromkeys(("paid", "lease_count", "lease_sum", "lost", "rss"), 0.0)
    buckets = {}
    for sample in samples(text):
        name, labels, value = sample.name, sample.labels, sample.value
        if name == "walletlock_movements_total":
            if labels.get("kind") == "pay" and labels.get("outcome") == "accepted":
                sums["paid"] += value
        elif name == "walletlock_http_request_duration_seconds_bucket":
            if labels.get("route") not in NOT_API:
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0) + value
        elif name == "walletlock_lease_acquire_wait_seconds_count":
            sums["lease_count"] += value
        elif name == "walletlock_lease_acquire_wait_seconds_sum":
            sums["lease_sum"] += value
        elif name == "walletlock_fence_refusals_total":
            sums["lost"] += value
        elif name == "process_resident_memory_bytes":
            sums["rss"] = value
    return sums, buckets


def p99(buckets):
    """The upper bound of the first bucket that holds 99% of the answers ("-" without any)."""
    total = buckets.get(math.inf, 0)
    if not total:
        return "-"
    le = next(le for le in sorted(buckets) if buckets[le] >= 0.99 * total)
    return f"<={le * 1000:g}ms" if le != math.inf else ">10s"


def columns(sums, buckets):
    """The six columns of `deploy/local status`, as strings."""
    count = sums["lease_count"]
    wait = f"{sums['lease_sum'] / count * 1000:.1f} ms" if count else "-"
    # int(), as printf's %d: the counters are floats in the text format.
    return (f"{int(sums['paid'])}", p99(buckets), f"{int(count)}", wait, f"{int(sums['lost'])}",
            f"{sums['rss'] / 2**20:.1f} MiB")


def main(argv):
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print(argv[1] % columns(*figures(sys.stdin.read())), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
