#!/usr/bin/env python3
"""loadtest/books.py: checks a load test's books, Jepsen-style (the bank test).

    loadtest/books.py --acks RUN_DIR/console.log [--base-url URL] [--audit 'walletlock audit']

(API_TOKEN in the environment, if the API wants one: sent as `Authorization: Bearer`.)

The client's side is the k6 console log of the run (pay.js with ACK_LOG=1): one `WL {...}` line
(a console message may hold several, one per line) per wallet it opened (with the balance the API
acknowledged) and per deposit, payment or transfer, with its final outcome as the client saw it: 200
with the ledger entry's id (both legs', for a transfer), a refusal (nothing applied), or undecided.
Undecided operations are settled first, the way a client would: by sending the same request with
the same Idempotency-Key until the API decides it (a stored answer is replayed; a request that
never ran runs now).

Then, for every wallet of the run, through the API (GET /wallets/{id} and every page of
GET /wallets/{id}/transactions):

  balance == opening balance + accepted deposits - accepted payments
             + accepted transfers in - accepted transfers out          (what the client was told)
  balance == the ledger's signed sum, and the ledger's entries chain 1..version
  balance >= 0
  every accepted operation is in the ledger exactly once (its entry id, both legs of a transfer;
  a payment's or a transfer's reference is its key), and the ledger holds no payment, deposit or
  transfer leg the client was not told was accepted

Last, `walletlock audit` checks every wallet in the database. Prints the tutorial's line, summed
over the run's wallets:

  accepted=N balance=B expected=E OK|BROKEN

with one line per problem before it, and exits 0 on OK, 1 on BROKEN.
"""

import argparse
import concurrent.futures
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

MAX_PROBLEMS_SHOWN = 20
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

    def get_json(self, path):
        """GET, retrying transient answers; (status, json or None)."""
        for attempt in range(10):
            status, _, data = self.request("GET", path)
            if status in (502, 503, 504):
                time.sleep(0.2 * (attempt + 1))
                continue
            try:
                return status, json.loads(data)
            except ValueError:
                return status, None
        return status, None


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
        while True:
            status, _, data = client.request("POST", path, body=record["body"].encode(), headers=headers)
            try:
                body = json.loads(data)
            except ValueError:
                body = {}
            code = body.get("code", "") if isinstance(body, dict) else ""
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


def read_wallet(client, wallet):
    """The wallet and its whole ledger, through the API."""
    status, body = client.get_json(f"/wallets/{wallet}")
    if status != 200:
        return None, None, f"GET /wallets/{wallet}: HTTP {status}"
    entries = []
    before = None
    while True:
        query = "limit=500" + (f"&before={before}" if before else "")
        status, page = client.get_json(f"/wallets/{wallet}/transactions?{query}")
        if status != 200 or page is None:
            return body, None, f"GET /wallets/{wallet}/transactions: HTTP {status}"
        entries.extend(page["transactions"])
        before = page.get("next_cursor")
        if not before:
            break
    entries.sort(key=lambda e: e["version"])
    return body, entries, None


# The ledger entry kinds that take money out of a wallet; every other kind puts it in.
DEBITS = ("pay", "transfer_out")
# The kinds the load test makes, each acknowledged to the client (and counted) one by one; a
# payment's and a transfer leg's reference is the operation's key.
COUNTED = ("pay", "deposit", "transfer_out", "transfer_in")
KEYED = ("pay", "transfer_out", "transfer_in")


def sign(kind):
    """-1 for a kind of entry that takes money out of a wallet, 1 for one that puts it in."""
    return -1 if kind in DEBITS else 1


def legs(record):
    """The ledger entries an accepted operation made, one per wallet: (wallet, leg)."""
    if record["op"] != "transfer":
        return [(record["w"], record)]
    common = {"key": record["key"], "amount": record["amount"]}
    return [
        (record["w"], {**common, "op": "transfer_out", "entry": record["entry"]}),
        (record["to"], {**common, "op": "transfer_in", "entry": record["to_entry"]}),
    ]


def check_wallet(wallet, opening, accepted_ops, refused_keys, state, entries):
    """Problems with one wallet's books (accepted_ops: its legs; refused_keys: (op, key) of its
    refused payments and transfers); (problems, balance, expected)."""
    problems = []
    moved = defaultdict(int)
    for r in accepted_ops:
        moved[r["op"]] += r["amount"]
    expected = opening + sum(sign(kind) * amount for kind, amount in moved.items())
    balance = state["balance"]
    if balance < 0:
        problems.append(f"wallet {wallet}: negative balance {balance}")
    if balance != expected:
        figures = ", ".join(f"{kind} {sign(kind) * amount:+}" for kind, amount in sorted(moved.items()))
        problems.append(
            f"wallet {wallet}: balance {balance} but expected {expected} "
            f"(opened with {opening}; accepted: {figures or 'nothing'})"
        )

    # The ledger, as the API pages it.
    ledger_sum = 0
    running = None
    for n, entry in enumerate(entries, start=1):
        if entry["version"] != n:
            problems.append(f"wallet {wallet}: ledger entry {n} is numbered {entry['version']}")
            break
        ledger_sum += sign(entry["kind"]) * entry["amount"]
        if entry["kind"] == "open":
            if n != 1:
                problems.append(f"wallet {wallet}: an open entry at {n}")
            running = entry["amount"]
        else:
            running = (running or 0) + sign(entry["kind"]) * entry["amount"]
        if entry["balance"] != running:
            problems.append(
                f"wallet {wallet}: entry {n} ({entry['kind']} {entry['amount']}) leaves {entry['balance']}, "
                f"not {running}"
            )
            running = entry["balance"]
    if balance != ledger_sum:
        problems.append(f"wallet {wallet}: balance {balance} but its ledger sums to {ledger_sum}")
    if state["version"] != len(entries):
        problems.append(f"wallet {wallet}: version {state['version']} but {len(entries)} ledger entries")
    if not entries or entries[0]["kind"] != "open" or entries[0]["amount"] != opening:
        problems.append(f"wallet {wallet}: the ledger does not open with the acknowledged {opening}")

    # Each acknowledged operation exactly once; nothing else.
    by_id = {e["id"]: e for e in entries}
    by_reference = defaultdict(int)
    for e in entries:
        if e["kind"] in KEYED and e.get("reference") is not None:
            by_reference[e["reference"]] += 1
    for record in accepted_ops:
        entry = by_id.get(record["entry"])
        if entry is None:
            problems.append(f"wallet {wallet}: accepted {record['op']} {record['key']} (entry {record['entry']}) is not in the ledger")
        elif entry["kind"] != record["op"] or entry["amount"] != record["amount"]:
            problems.append(f"wallet {wallet}: accepted {record['op']} of {record['amount']} is a {entry['kind']} of {entry['amount']} in the ledger")
        if record["op"] in KEYED and by_reference.get(record["key"], 0) != 1:
            what = "payment" if record["op"] == "pay" else record["op"]
            problems.append(f"wallet {wallet}: {what} {record['key']} is in the ledger {by_reference.get(record['key'], 0)} times")
    for op, key in refused_keys:
        if by_reference.get(key, 0):
            what = "payment" if op == "pay" else op
            problems.append(f"wallet {wallet}: {what} {key} was refused to the client but is in the ledger")
    for kind in COUNTED:
        in_ledger = sum(1 for e in entries if e["kind"] == kind)
        acknowledged = sum(1 for r in accepted_ops if r["op"] == kind)
        if in_ledger != acknowledged:
            problems.append(f"wallet {wallet}: {in_ledger} {kind} entries in the ledger, {acknowledged} acknowledged")
    return problems, balance, expected


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--acks", required=True, help="the k6 console log of the run (pay.js, ACK_LOG=1)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--audit", default="", help="command that audits the whole database (walletlock audit)")
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()

    started = time.monotonic()
    opened, ops, problems = load_acks(args.acks)
    if not opened:
        raise SystemExit(f"books: no opened wallets in {args.acks}: was pay.js run with ACK_LOG=1?")
    for record in ops.values():
        for wallet in (record["w"], record.get("to")):
            if wallet is not None and wallet not in opened:
                problems.append(f"operation {record['key']} on wallet {wallet}, which the run did not open")

    client = Client(args.base_url)
    undecided, settled_charged = settle(client, ops)
    if undecided:
        print(f"settled {undecided} undecided operations by replaying their keys: {settled_charged} charged")

    per_wallet = defaultdict(list)
    refused = defaultdict(list)
    for record in ops.values():
        if record["s"] == 200:
            for wallet, leg in legs(record):
                per_wallet[wallet].append(leg)
        elif record["op"] in ("pay", "transfer"):
            for wallet in (record["w"], record.get("to")):
                if wallet is not None:
                    refused[wallet].append((record["op"], record["key"]))

    totals = {"balance": 0, "expected": 0}
    lock = threading.Lock()

    def one(wallet):
        state, entries, error = read_wallet(client, wallet)
        if error:
            found = [error]
            balance, expected = (state or {}).get("balance", 0), opened[wallet]
        else:
            found, balance, expected = check_wallet(
                wallet, opened[wallet], per_wallet[wallet], refused[wallet], state, entries
            )
        with lock:
            totals["balance"] += balance
            totals["expected"] += expected
            problems.extend(found)
        return len(entries or [])

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.threads) as pool:
        entries = sum(pool.map(one, sorted(opened)))

    accepted = sum(1 for r in ops.values() if r["s"] == 200 and r["op"] in ("pay", "transfer"))
    deposits = sum(1 for r in ops.values() if r["s"] == 200 and r["op"] == "deposit")
    transfers = sum(1 for r in ops.values() if r["s"] == 200 and r["op"] == "transfer")
    refusals = sum(1 for r in ops.values() if r["s"] != 200)
    print(
        f"books: {len(opened)} wallets, {len(ops)} operations ({accepted - transfers} payments, {transfers} "
        f"transfers and {deposits} deposits accepted, {refusals} refused), {entries} ledger entries read "
        "through the API "
        f"in {time.monotonic() - started:.1f} s"
    )

    audit_ok = True
    if args.audit:
        result = subprocess.run(shlex.split(args.audit), check=False, capture_output=True, text=True)
        output = (result.stdout + result.stderr).strip().splitlines()
        audit_ok = result.returncode == 0
        if audit_ok:
            print(output[-1] if output else "audit OK")
        else:
            for line in output[:MAX_PROBLEMS_SHOWN]:
                print(f"audit: {line}")
            if len(output) > MAX_PROBLEMS_SHOWN:
                print(f"audit: ... {len(output) - MAX_PROBLEMS_SHOWN} more lines")

    problems.sort()
    for line in problems[:MAX_PROBLEMS_SHOWN]:
        print(line)
    if len(problems) > MAX_PROBLEMS_SHOWN:
        print(f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more problems")
    ok = not problems and audit_ok
    print(f"accepted={accepted} balance={totals['balance']} expected={totals['expected']} {'OK' if ok else 'BROKEN'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
