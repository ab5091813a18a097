#!/usr/bin/env python3
"""loadtest/attempt.py: what loadtest/bench needs to know about one attempt of a run.

    loadtest/attempt.py other-pct OTHER_CPU_JSON   the whole percentage of the machine's CPU that
                                                   other processes used (other_cpu.py); 0 if unknown
    loadtest/attempt.py figures DIR                "N/s, p99 M ms" of the attempt in DIR (k6's
                                                   summary.json, or pgbench.out); "?" if unknown
"""

import json
import os
import re
import sys
from pathlib import Path


def other_pct(path):
    try:
        return int(json.loads(Path(path).read_text())["other_pct"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def figures(d):
    try:
        if os.path.exists(os.path.join(d, "summary.json")):
            f = json.loads(Path(d, "summary.json").read_text())["figures"]
            return f"{f['rps']:.0f}/s, p99 {f['p99_ms']:.0f} ms"
        text = Path(d, "pgbench.out").read_text()
        return f"{float(re.search(r'tps = ([0-9.]+)', text).group(1)):.0f}/s"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "?"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "other-pct":
        print(other_pct(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "figures":
        print(figures(sys.argv[2]))
    else:
        raise SystemExit(__doc__.split("\n\n")[1])
