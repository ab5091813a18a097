#!/usr/bin/env python3
"""loadtest/tamper.py: a load test's client record, rewritten on purpose to break its books.

    loadtest/tamper.py ACKS first-pay                      "KEY WALLET" of the first payment the
                                                           client saw accepted
    loadtest/tamper.py ACKS first-transfer                 "KEY FROM TO" of the first transfer the
                                                           client saw accepted
    loadtest/tamper.py ACKS drop KEY                       the record without the operation KEY
    loadtest/tamper.py ACKS refuse KEY                     the record with the operation KEY refused
                                                           (503 lock_timeout) instead of charged
    loadtest/tamper.py ACKS undecided WALLET KEY --base-url URL
                                                           the record plus a payment of 1 from
                                                           WALLET with key KEY whose answer was
                                                           never seen

ACKS is a k6 console log of pay.js with ACK_LOG=1 (read by books.py's console_messages); the
rewritten record goes to stdout as k6 JSON log lines, one `WL {...}` message each, for
`loadtest/books.py --acks`. loadtest/test-books uses it to check that the book check catches each
kind of broken books.
"""

import argparse
import json
import sys

import books


def compact(value):
    return json.dumps(value, separators=(",", ":"))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("acks", help="the k6 console log of the run (pay.js with ACK_LOG=1)")
    modes = parser.add_subparsers(dest="mode", required=True)
    modes.add_parser("first-pay", help="print KEY WALLET of the first accepted payment")
    modes.add_parser("first-transfer", help="print KEY FROM TO of the first accepted transfer")
    modes.add_parser("drop", help="leave out the operation KEY").add_argument("key")
    modes.add_parser("refuse", help="the operation KEY refused instead of charged").add_argument("key")
    undecided = modes.add_parser("undecided", help="add a payment of 1 whose answer was never seen")
    undecided.add_argument("wallet")
    undecided.add_argument("key")
    undecided.add_argument("--base-url", required=True, help="the API the payment was sent to")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    records = list(books.ack_records(args.acks))
    if args.mode == "first-pay":
        first = next((r for r in records if r["op"] == "pay" and r["s"] == 200), None)
        if first is None:
            print("tamper.py: the record holds no accepted payment", file=sys.stderr)
            return 1
        print(first["key"], first["w"])
        return 0
    if args.mode == "first-transfer":
        first = next((r for r in records if r["op"] == "transfer" and r["s"] == 200), None)
        if first is None:
            print("tamper.py: the record holds no accepted transfer", file=sys.stderr)
            return 1
        print(first["key"], first["w"], first["to"])
        return 0
    if args.mode == "drop":
        records = [r for r in records if r.get("key") != args.key]
    elif args.mode == "refuse":
        for r in records:
            if r.get("key") == args.key:
                del r["entry"]
                r.pop("to_entry", None)
                r.update(s=503, code="lock_timeout")
    elif args.mode == "undecided":
        body = compact({"amount": 1, "reference": args.key})
        records.append({"op": "pay", "w": args.wallet, "amount": 1, "key": args.key, "s": "undecided",
                        "url": f"{args.base_url}/wallets/{args.wallet}/pay", "body": body})
    for r in records:
        print(json.dumps({"level": "info", "msg": "WL " + compact(r)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
