#!/usr/bin/env python3
"""loadtest/tamper.py: a load test's client record, rewritten on purpose to break its books.

    loadtest/tamper.py ACKS first-pay                      "KEY WALLET" of the first payment the
                                                           client saw accepted
    loadtest/tamper.py ACKS first-transfer                 "KEY FROM TO" of the first transfer the
                                                           client saw accepted
    loadtest/tamper.py ACKS first-split                    "KEY PAYER" of the first split the
                                                           client saw accepted
    loadtest/tamper.py ACKS first-capture                  "KEY WALLET HOLD" of the first capture
                                                           the client saw accepted (first-void: of
                                                           the first void)
    loadtest/tamper.py ACKS drop KEY                       the record without the operation KEY
    loadtest/tamper.py ACKS refuse KEY                     the record with the operation KEY refused
                                                           (503 lock_timeout) instead of charged
    loadtest/tamper.py ACKS captured KEY                   the record with the void KEY a capture
                                                           of all of its hold instead, by a pay
                                                           entry that does not exist
    loadtest/tamper.py ACKS undecided WALLET KEY --base-url URL
                                                           the record plus a deposit of 1 to
                                                           WALLET with key KEY whose answer was
                                                           never seen (a deposit, which is always
                                                           applied: the mixed run may leave WALLET
                                                           empty, and a payment would be refused)

ACKS is a k6 console log of a loadtest/k6 scenario with ACK_LOG=1 (read by books.py's console_messages); the
rewritten record goes to stdout as k6 JSON log lines, one `WL {...}` message each, for
`loadtest/books.py --acks`. loadtest/test-books uses it to check that the book check catches each
kind of broken books.
"""

import argparse
import json
import sys
import uuid

import books

# first-OP: the operation, what it is called, the fields printed and what they are.
FIRSTS = {
    "first-pay": ("pay", "payment", ("key", "w"), "KEY WALLET"),
    "first-transfer": ("transfer", "transfer", ("key", "w", "to"), "KEY FROM TO"),
    "first-split": ("split", "split", ("key", "w"), "KEY PAYER"),
    "first-capture": ("capture", "capture", ("key", "w", "hold"), "KEY WALLET HOLD"),
    "first-void": ("void", "void", ("key", "w", "hold"), "KEY WALLET HOLD"),
}


def compact(value):
    return json.dumps(value, separators=(",", ":"))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("acks", help="the k6 console log of the run (loadtest/run, ACK_LOG=1)")
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode, (_, name, _, shown) in FIRSTS.items():
        modes.add_parser(mode, help=f"print {shown} of the first accepted {name}")
    modes.add_parser("drop", help="leave out the operation KEY").add_argument("key")
    modes.add_parser("refuse", help="the operation KEY refused instead of charged").add_argument("key")
    modes.add_parser("captured", help="the void KEY a capture by a made-up entry").add_argument("key")
    undecided = modes.add_parser("undecided", help="add a deposit of 1 whose answer was never seen")
    undecided.add_argument("wallet")
    undecided.add_argument("key")
    undecided.add_argument("--base-url", required=True, help="the API the payment was sent to")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    records = list(books.ack_records(args.acks))
    if args.mode in FIRSTS:
        op, name, fields, _ = FIRSTS[args.mode]
        accepted = 201 if op == "split" else 200
        first = next((r for r in records if r["op"] == op and r["s"] == accepted), None)
        if first is None:
            print(f"tamper.py: the record holds no accepted {name}", file=sys.stderr)
            return 1
        print(*(first[field] for field in fields))
        return 0
    if args.mode == "drop":
        records = [r for r in records if r.get("key") != args.key]
    elif args.mode == "refuse":
        for r in records:
            if r.get("key") == args.key:
                r.pop("entry", None)
                r.pop("to_entry", None)
                if "legs" in r:
                    r["to"] = [[wallet, amount] for wallet, amount, _ in r.pop("legs")]
                r.update(s=503, code="lock_timeout")
    elif args.mode == "captured":
        for r in records:
            if r.get("key") == args.key:
                r.update(op="capture", entry=str(uuid.uuid4()))
    elif args.mode == "undecided":
        body = compact({"amount": 1})
        records.append({"op": "deposit", "w": args.wallet, "amount": 1, "key": args.key, "s": "undecided",
                        "url": f"{args.base_url}/wallets/{args.wallet}/deposit", "body": body})
    for r in records:
        print(json.dumps({"level": "info", "msg": "WL " + compact(r)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
