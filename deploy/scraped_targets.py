#!/usr/bin/env python3
"""deploy/scraped_targets.py: how many replicas Prometheus scrapes, for `deploy/local status`.

    curl -s 127.0.0.1:9090/api/v1/targets?state=active | python3 deploy/scraped_targets.py

Reads Prometheus's active targets (its HTTP API's JSON) on stdin and prints `UP/ALL` for the
`walletlock` job, with no newline. Exits non-zero, printing nothing, if stdin is not that JSON.
"""

import json
import sys


def main():
    try:
        targets = json.load(sys.stdin)["data"]["activeTargets"]
    except (ValueError, KeyError, TypeError):
        return 1
    replicas = [t for t in targets if t.get("labels", {}).get("job") == "walletlock"]
    print(f"{sum(t.get('health') == 'up' for t in replicas)}/{len(replicas)}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
