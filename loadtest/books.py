#!/usr/bin/env python3
"""loadtest/books.py: checks a load test's books, Jepsen-style (the bank test).

    loadtest/books.py --acks RUN_DIR/console.log --audit 'walletlock audit' [--base-url URL]

(API_TOKEN in the environment, if the API wants one: sent as `Authorization: Bearer`.)

The client's side is the k6 console log of the run (ACK_LOG=1): one `WL {...}` record per wallet
opened and per operation, with its final outcome as the client saw it. Undecided operations are
settled first, as a client would: by sending the same request with the same Idempotency-Key; and
the check waits until every hold the client left alone has expired. Then what the clients were
told goes, one acknowledgement a line, to `walletlock audit --acks` (src/ledger/books.rs), the one
bank check, which holds the ledger against it and audits the whole database. Its last line is the
tutorial's, summed over the run's wallets:

  accepted=N balance=B expected=E OK|BROKEN

and this exits 0 on OK, 1 on BROKEN.
"""

import argparse
import http.client
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import defaultdict
from datetime import datetime

MAX_PROBLEMS_SHOWN = 20
# How long the check waits for the last hold not settled by the client to expire (loadtest/k6/holds.js places
# them for 1 s or HOLD_EXPIRES_IN, 30 s); one that expires later is a problem, not waited for.
MAX_HOLD_WAIT_S = 120
TEXT_MSG = re.compile(r'msg="((?:[^"\\]|\\.)*)"')


def console_messages(path):
    """The messages of a k6 console log, in either of k6's log formats (text or json)."""
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    yield json.loads(line).get("msg", "")
                except json.JSONDecodeError:
                    continue
            else:
                match = TEXT_MSG.search(line)
                if match:
                    # logrus quotes with Go's %q; for ASCII text that is JSON's escaping.
                    yield json.loads('"' + match.group(1) + '"')


def ack_records(path):
    """The `WL {...}` records of a k6 console log, in order (a message may hold several, a line each)."""
    for msg in console_messages(path):
        for line in msg.split("\n"):
            if line.startswith("WL "):
                yield json.loads(line[3:])


class Client:
    """One keep-alive HTTP connection per thread."""

    def __init__(self, base_url):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http":
            raise SystemExit(f"books: only http:// base URLs, not {base_url}")
        self.host, self.port = url.hostname, url.port or 80
        self.local = threading.local()
        token = os.environ.get("API_TOKEN", "")
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}

    def request(self, method, path, body=None, headers=None, tries=5):
        headers = {**self.auth, **(headers or {})}
        for attempt in range(tries):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            try:
                conn.request(method, path, body=body, headers=headers)
                res = conn.getresponse()
                data = res.read()
                return res.status, {k.lower(): v for k, v in res.getheaders()}, data
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt == tries - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")


def load_acks(path):
    """What the client saw: opened wallets, and one final record per operation key."""
    opened = {}
    ops = {}
    problems = []
    for record in ack_records(path):
        if record["op"] == "open":
            opened[record["w"]] = record["amount"]
            continue
        key = record["key"]
        if key in ops and ops[key] != record:
            problems.append(f"operation {key}: two different final outcomes logged: {ops[key]} and {record}")
        ops[key] = record
    return opened, ops, problems


def settle(client, ops, deadline_s=60):
    """Decides every undecided operation by replaying its key. Returns how many were settled."""
    undecided = [r for r in ops.values() if r["s"] == "undecided"]
    if not undecided:
        return 0, 0
    charged = 0
    deadline = time.monotonic() + deadline_s
    for record in undecided:
        path = urllib.parse.urlsplit(record["url"]).path
        headers = {"Content-Type": "application/json", "Idempotency-Key": record["key"]}
        # A void has no body.
        request_body = (record["body"] or "").encode()
        while True:
            status, _, data = client.request("POST", path, body=request_body, headers=headers)
            try:
                body = json.loads(data)
            except ValueError:
                body = {}
            code = body.get("code", "") if isinstance(body, dict) else ""
            if status == 201 and record["op"] == "hold":
                record.update(s=201, hold=body["id"], expires_at=body["expires_at"], settled=True)
                break
            if status == 200 and record["op"] == "capture":
                record.update(s=200, amount=body["captured"], entry=body["entry"]["id"], settled=True)
                charged += 1
                break
            if status == 200 and record["op"] == "void":
                record.update(s=200, settled=True)
                break
            if status == 201 and record["op"] == "split":
                signed = [(-1 if e["kind"] == "transfer_out" else 1) * e["amount"] for e in body["legs"]]
                legs = [[e["wallet_id"], n, e["id"]] for e, n in zip(body["legs"], signed)]
                record.update(s=201, legs=legs, settled=True)
                charged += 1
                break
            if status == 200 and record["op"] == "transfer":
                record.update(s=200, entry=body["from_entry"]["id"], to_entry=body["to_entry"]["id"], settled=True)
                charged += 1
                break
            if status == 200:
                record.update(s=200, entry=body["id"], settled=True)
                charged += 1
                break
            if 400 <= status < 500 and code != "idempotency_key_in_flight":
                record.update(s=status, code=code, settled=True)
                break
            if status == 503 and code in ("lock_timeout", "overloaded", "dependency_unavailable"):
                # Nothing applied; a client that gives up here leaves it unapplied.
                record.update(s=status, code=code, settled=True)
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"books: could not settle {record['key']} (last answer HTTP {status} {code})")
            # In flight (a claim that turns stale after IDEMPOTENCY_STALE_AFTER) or no answer yet.
            time.sleep(0.5)
    return len(undecided), charged


# The ledger entry kinds that take money out of a wallet; every other kind puts it in.
DEBITS = ("pay", "transfer_out")
# The kind of entry an accepted operation makes, where it is not the operation's own name.
ENTRY_KIND = {"capture": "pay"}


def sign(kind):
    """-1 for a kind of entry that takes money out of a wallet, 1 for one that puts it in."""
    return -1 if kind in DEBITS else 1


def wallets_of(record):
    """The wallets an operation names: its own, and a transfer's payee or a split's other legs
    (`to`: [[wallet, signed amount], ...], as sent)."""
    to = record.get("to")
    if isinstance(to, list):
        return [wallet for wallet, _ in to]
    return [record["w"]] + ([to] if to is not None else [])


def accepted_split(record):
    return record["op"] == "split" and record["s"] == 201


def legs(record):
    """The ledger entries an accepted operation made, one per wallet: (wallet, leg)."""
    if record["op"] == "split":
        return [
            (wallet, {"key": record["key"], "amount": abs(signed), "entry": entry,
                      "op": "transfer_out" if signed < 0 else "transfer_in"})
            for wallet, signed, entry in record["legs"]
        ]
    if record["op"] != "transfer":
        return [(record["w"], record)]
    common = {"key": record["key"], "amount": record["amount"]}
    return [
        (record["w"], {**common, "op": "transfer_out", "entry": record["entry"]}),
        (record["to"], {**common, "op": "transfer_in", "entry": record["to_entry"]}),
    ]


def hold_states(ops):
    """The holds the client placed, by id, each with what it was told became of it: its capture's
    record, `voided`, or `expired` (left alone, or its capture or void refused)."""
    holds = {r["hold"]: {**r, "told": "expired"} for r in ops.values() if r["op"] == "hold" and r["s"] == 201}
    problems = []
    for r in ops.values():
        if r["op"] not in ("capture", "void") or r["s"] != 200:
            continue
        hold = holds.get(r["hold"])
        if hold is None:
            problems.append(f"{r['op']} {r['key']} of hold {r['hold']}, which the run did not place")
        elif hold["told"] != "expired":
            problems.append(f"hold {r['hold']}: settled twice, by {r['key']} and by {hold['settlement']['key']}")
        else:
            hold.update(told="captured" if r["op"] == "capture" else "voided", settlement=r)
    return holds, problems


def wait_for_expiry(holds):
    """Waits until every hold the client did not capture or void has expired (1 s past the last
    expires_at, at most MAX_HOLD_WAIT_S); returns the problems (holds expiring later) and the wait."""
    pending = [h for h in holds.values() if h["told"] == "expired"]
    if not pending:
        return [], 0.0
    expiry = {h["hold"]: datetime.fromisoformat(h["expires_at"]).timestamp() for h in pending}
    wait = min(max(0.0, max(expiry.values()) + 1 - time.time()), MAX_HOLD_WAIT_S)
    time.sleep(wait)
    now = time.time()
    late = [h for h in pending if expiry[h["hold"]] > now]
    return [f"hold {h['hold']} expires at {h['expires_at']}, after the check's wait ({MAX_HOLD_WAIT_S} s)" for h in late], wait


def acknowledgements(opened, ops, holds):
    """What the clients were told, as `walletlock audit --acks` reads it (src/ledger/books.rs)."""
    for wallet, balance in opened.items():
        yield {"ack": "opened", "wallet": wallet, "balance": balance}
    for record in ops.values():
        # A void charges nothing, and a hold placed writes no entry (its own line says what became of it).
        if (record["s"] == 200 and record["op"] != "void") or accepted_split(record):
            told = [
                {"wallet": wallet, "amount": sign(ENTRY_KIND.get(leg["op"], leg["op"])) * leg["amount"], "entry": leg["entry"]}
                for wallet, leg in legs(record)
            ]
            yield {"ack": "applied", "key": record["key"], "legs": told}
        elif record["s"] not in (200, 201):
            yield {"ack": "refused", "key": record["key"]}
    for hold in holds.values():
        told = {"as": hold["told"]}
        if hold["told"] == "captured":
            told.update(amount=hold["settlement"]["amount"], entry=hold["settlement"]["entry"])
        yield {"ack": "hold", "hold": hold["hold"], "wallet": hold["w"], "amount": hold["amount"], "told": told}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--acks", required=True, help="the k6 console log of the run (loadtest/run, ACK_LOG=1)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--audit", required=True, help="the audit command (walletlock audit), given --acks FILE")
    args = parser.parse_args()

    opened, ops, problems = load_acks(args.acks)
    if not opened:
        raise SystemExit(f"books: no opened wallets in {args.acks}: was k6 run with ACK_LOG=1?")
    for record in ops.values():
        for wallet in wallets_of(record):
            if wallet not in opened:
                problems.append(f"operation {record['key']} on wallet {wallet}, which the run did not open")

    undecided, settled_charged = settle(Client(args.base_url), ops)
    if undecided:
        print(f"settled {undecided} undecided operations by replaying their keys: {settled_charged} charged")
    holds, found = hold_states(ops)
    problems.extend(found)
    # Before the holds are checked: every one the client left alone has expired.
    found, waited = wait_for_expiry(holds)
    problems.extend(found)
    if holds:
        told = defaultdict(int)
        for hold in holds.values():
            told[hold["told"]] += 1
        print(
            f"holds: {len(holds)} placed: {told['captured']} captured, {told['voided']} voided, "
            f"{told['expired']} expired (left alone, or their capture or void refused); "
            f"waited {waited:.1f} s for the last expiry"
        )
    for line in problems[:MAX_PROBLEMS_SHOWN]:
        print(line)

    path = os.path.join(os.path.dirname(os.path.abspath(args.acks)), "acks.ndjson")
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(ack) + "\n" for ack in acknowledgements(opened, ops, holds))
    result = subprocess.run([*shlex.split(args.audit), "--acks", path], check=False, capture_output=True, text=True)
    # The audit's problems, then the books' problems, its summary and its verdict (the last line).
    lines = result.stdout.strip().splitlines()
    if len(lines) > MAX_PROBLEMS_SHOWN + 2:
        lines = [*lines[:MAX_PROBLEMS_SHOWN], f"... {len(lines) - MAX_PROBLEMS_SHOWN - 2} more lines", *lines[-2:]]
    for line in lines:
        print(line)
    if result.returncode not in (0, 1) or not lines:
        print(result.stderr.strip(), file=sys.stderr)
        raise SystemExit(f"books: `{args.audit} --acks {path}` failed (exit {result.returncode})")
    if problems and lines[-1].endswith(" OK"):
        # Problems of the client's own record (an operation on a wallet the run did not open).
        print(lines[-1].removesuffix(" OK") + " BROKEN")
        return 1
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
