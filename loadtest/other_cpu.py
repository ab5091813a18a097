#!/usr/bin/env python3
"""loadtest/other_cpu.py OUT_JSON PID...: how much CPU processes outside the benchmark used meanwhile.

Samples every process's CPU time (/proc/PID/stat) once a second until SIGTERM or SIGINT, then
writes OUT_JSON: {"wall_s", "other_cpu_s", "other_pct" (of all cores), "top": [[command, cpu_s]]}.
The benchmark is the PIDs given (the stack's servers and the benchmark's own shell) and all their
descendants; every other process counts as "other". A process that starts and ends between two
samples is missed, so the figure is a lower bound; it is there to show that a run shared the
cores with, say, a compiler, or another client of the same machine.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def snapshot():
    seen = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[1]: ppid; fields[11], [12]: utime, stime (the 4th, 14th and 15th fields of stat)
        seen[int(pid)] = (comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return seen


def ours(pid, procs, roots, memo):
    """Whether pid is one of roots or descends from one."""
    chain = []
    while pid > 1 and pid not in memo:
        if pid in roots:
            memo[pid] = True
            break
        chain.append(pid)
        pid = procs[pid][1] if pid in procs else 0
    verdict = memo.get(pid, False)
    for p in chain:
        memo[p] = verdict
    return verdict


def main():
    out = sys.argv[1]
    roots = {int(p) for p in sys.argv[2:]} | {os.getpid()}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    start = time.monotonic()
    # CPU time at the start; a process that appears later counts from zero.
    base = {pid: cpu for pid, (_comm, _ppid, cpu) in snapshot().items()}
    used = {}  # pid -> (command, CPU seconds used since the start), for other processes
    while not stop:
        time.sleep(1)
        procs = snapshot()
        memo = {}
        for pid, (comm, _ppid, cpu) in procs.items():
            base.setdefault(pid, 0.0)
            if not ours(pid, procs, roots, memo):
                used[pid] = (comm, cpu - base[pid])
    wall = time.monotonic() - start
    per_comm = {}
    for comm, cpu in used.values():
        per_comm[comm] = per_comm.get(comm, 0.0) + max(cpu, 0.0)
    other = sum(per_comm.values())
    top = sorted(per_comm.items(), key=lambda kv: -kv[1])[:5]
    cores = os.cpu_count() or 1
    Path(out).write_text(json.dumps(
        {
            "wall_s": round(wall, 1),
            "other_cpu_s": round(other, 1),
            "other_pct": round(100 * other / (wall * cores), 1) if wall > 0 else 0,
            "top": [[c, round(s, 1)] for c, s in top if s >= 0.1],
        },
    ))


if __name__ == "__main__":
    main()
