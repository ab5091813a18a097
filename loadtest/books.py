#!/usr/bin/env python3
"""loadtest/books.py: checks a load test's books, Jepsen-style (the bank test).

    loadtest/books.py --acks RUN_DIR/console.log [--base-url URL] [--audit 'walletlock audit']

(API_TOKEN in the environment, if the API wants one: sent as `Authorization: Bearer`.)

The client's side is the k6 console log of the run (ACK_LOG=1): one `WL {...}` record per wallet
opened and per operation, with its final outcome as the client saw it. Undecided operations are
settled first, as a client would: by sending the same request with the same Idempotency-Key. Then
every wallet of the run is read through the API and checked against what the client was told, the
holds are checked once every one not settled has expired, and `walletlock audit` checks the whole
database (loadtest/README.md, "The book check", lists every check). Prints one line per problem,
then the tutorial's line, summed over the run's wallets:

  accepted=N balance=B expected=E OK|BROKEN

and exits 0 on OK, 1 on BROKEN.
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
# The kind of entry an accepted operation makes, where it is not the operation's own name.
ENTRY_KIND = {"capture": "pay"}
# The kinds the load test makes, each acknowledged to the client (and counted) one by one; a
# payment's and a transfer leg's reference is the operation's key.
COUNTED = ("pay", "deposit", "transfer_out", "transfer_in")
KEYED = ("pay", "transfer_out", "transfer_in")


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


def check_wallet(wallet, opening, accepted_ops, refused_keys, state, entries, holds=False):
    """Problems with one wallet's books (accepted_ops: its legs and captures; refused_keys: (op, key)
    of its refused payments and transfers; holds: whether the run placed holds, all expired or
    settled by now); (problems, balance, expected)."""
    problems = []
    moved = defaultdict(int)
    for r in accepted_ops:
        moved[r["op"]] += r["amount"]
    expected = opening + sum(sign(ENTRY_KIND.get(op, op)) * amount for op, amount in moved.items())
    balance = state["balance"]
    if balance < 0:
        problems.append(f"wallet {wallet}: negative balance {balance}")
    if holds and state.get("available") != balance:
        problems.append(
            f"wallet {wallet}: available {state.get('available')} but balance {balance} "
            "after every hold expired or was settled"
        )
    if balance != expected:
        figures = ", ".join(
            f"{op} {sign(ENTRY_KIND.get(op, op)) * amount:+}" for op, amount in sorted(moved.items())
        )
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
        elif entry["kind"] != ENTRY_KIND.get(record["op"], record["op"]) or entry["amount"] != record["amount"]:
            problems.append(f"wallet {wallet}: accepted {record['op']} of {record['amount']} is a {entry['kind']} of {entry['amount']} in the ledger")
        elif record["op"] == "capture" and entry.get("hold_id") != record["hold"]:
            problems.append(f"wallet {wallet}: capture {record['key']} of hold {record['hold']} is a pay entry of hold {entry.get('hold_id')}")
        if record["op"] in KEYED and by_reference.get(record["key"], 0) != 1:
            what = "payment" if record["op"] == "pay" else record["op"]
            problems.append(f"wallet {wallet}: {what} {record['key']} is in the ledger {by_reference.get(record['key'], 0)} times")
    for op, key in refused_keys:
        if by_reference.get(key, 0):
            what = "payment" if op == "pay" else op
            problems.append(f"wallet {wallet}: {what} {key} was refused to the client but is in the ledger")
    for kind in COUNTED:
        # A capture's pay entry (it names its hold) is counted with the captures, below.
        in_ledger = sum(1 for e in entries if e["kind"] == kind and e.get("hold_id") is None)
        acknowledged = sum(1 for r in accepted_ops if r["op"] == kind)
        if in_ledger != acknowledged:
            problems.append(f"wallet {wallet}: {in_ledger} {kind} entries in the ledger, {acknowledged} acknowledged")

    # Each acknowledged capture charged its hold once; no other hold is charged.
    charges = defaultdict(list)
    for e in entries:
        if e.get("hold_id") is not None:
            charges[e["hold_id"]].append(e)
    captures = {r["hold"]: r for r in accepted_ops if r["op"] == "capture"}
    for hold, record in captures.items():
        times = len(charges.get(hold, []))
        if times != 1:
            problems.append(f"wallet {wallet}: capture {record['key']} of hold {hold} is in the ledger {times} times")
    for hold, charged in charges.items():
        if hold not in captures:
            problems.append(
                f"wallet {wallet}: the ledger charges hold {hold} {sum(e['amount'] for e in charged)} "
                f"({len(charged)} {charged[0]['kind']} entries), but the client was not told it was captured"
            )
    return problems, balance, expected


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


def check_hold(client, hold):
    """Problems with one hold as the API shows it (GET /holds/{id}), against what the client was told."""
    status, body = client.get_json(f"/holds/{hold['hold']}")
    if status != 200 or not isinstance(body, dict):
        return [f"GET /holds/{hold['hold']}: HTTP {status}"]
    told = hold["told"]
    settlement = hold.get("settlement") or {}
    want = {
        "wallet_id": hold["w"],
        "amount": hold["amount"],
        "status": told,
        "captured": settlement.get("amount", 0) if told == "captured" else 0,
    }
    if told == "captured":
        want["capture_entry"] = settlement["entry"]
    seen = {field: body.get(field) for field in want}
    if seen == want:
        return []
    shown = ", ".join(f"{field} {value}" for field, value in seen.items())
    return [f"hold {hold['hold']} (wallet {hold['w']}, {hold['key']}): {shown}, but the client was told {told}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--acks", required=True, help="the k6 console log of the run (loadtest/run, ACK_LOG=1)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--audit", default="", help="command that audits the whole database (walletlock audit)")
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()

    started = time.monotonic()
    opened, ops, problems = load_acks(args.acks)
    if not opened:
        raise SystemExit(f"books: no opened wallets in {args.acks}: was k6 run with ACK_LOG=1?")
    for record in ops.values():
        for wallet in wallets_of(record):
            if wallet not in opened:
                problems.append(f"operation {record['key']} on wallet {wallet}, which the run did not open")

    client = Client(args.base_url)
    undecided, settled_charged = settle(client, ops)
    if undecided:
        print(f"settled {undecided} undecided operations by replaying their keys: {settled_charged} charged")

    holds, found = hold_states(ops)
    problems.extend(found)
    # Before the wallets are read: their available balances count only holds still active.
    found, waited = wait_for_expiry(holds)
    problems.extend(found)

    per_wallet = defaultdict(list)
    refused = defaultdict(list)
    for record in ops.values():
        # A void charges nothing; a capture is a payment of what it charged.
        if (record["s"] == 200 and record["op"] != "void") or accepted_split(record):
            for wallet, leg in legs(record):
                per_wallet[wallet].append(leg)
        elif record["op"] in ("pay", "transfer", "split"):
            for wallet in wallets_of(record):
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
                wallet, opened[wallet], per_wallet[wallet], refused[wallet], state, entries, bool(holds)
            )
        with lock:
            totals["balance"] += balance
            totals["expected"] += expected
            problems.extend(found)
        return len(entries or [])

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.threads) as pool:
        entries = sum(pool.map(one, sorted(opened)))
        for found in pool.map(lambda hold: check_hold(client, hold), holds.values()):
            problems.extend(found)

    def count(op, status=200):
        return sum(1 for r in ops.values() if r["s"] == status and r["op"] == op)

    # A capture is a payment: accepted counts it.
    accepted = count("pay") + count("transfer") + count("split", 201) + count("capture")
    refusals = sum(1 for r in ops.values() if r["s"] not in (200, 201))
    print(
        f"books: {len(opened)} wallets, {len(ops)} operations ({count('pay')} payments, {count('transfer')} "
        f"transfers, {count('split', 201)} splits and {count('deposit')} deposits accepted, {refusals} refused), "
        f"{entries} ledger entries read "
        "through the API "
        f"in {time.monotonic() - started:.1f} s"
    )
    if holds:
        told = defaultdict(int)
        for hold in holds.values():
            told[hold["told"]] += 1
        charged = sum(r["amount"] for r in ops.values() if r["op"] == "capture" and r["s"] == 200)
        late = sum(1 for r in ops.values() if r.get("code") == "hold_expired")
        print(
            f"holds: {len(holds)} placed: {told['captured']} captured ({charged} charged), {told['voided']} voided, "
            f"{told['expired']} expired (left alone, or their capture or void refused: {late} too late); waited "
            f"{waited:.1f} s for the last expiry, then read every hold through GET /holds/{{id}}"
        )

    audit_ok = True
    if args.audit:
        result = subprocess.run(shlex.split(args.audit), check=False, capture_output=True, text=True)
        output = (result.stdout + result.stderr).strip().splitlines()
        audit_ok = result.returncode == 0
        if audit_ok:
            # Its verdict is the last line it prints, not a log line (a slow statement's) after it.
            verdict = result.stdout.strip().splitlines() or output
            print(verdict[-1] if verdict else "audit OK")
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
