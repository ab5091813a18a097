#!/usr/bin/env python3
"""deploy/free_port.py: free TCP ports on 127.0.0.1, for servers the scripts are about to start.

    deploy/free_port.py       a port nothing listens on now (the kernel picks it: bind to port 0)
    deploy/free_port.py N     the first of N consecutive ports, between 20000 and 60000, that are
                              all free now (random ranges are tried; exits 1 if 200 are not enough)

deploy/lib.sh calls it (wl_free_port, wl_free_ports). A port is free when it was checked, not
later: whoever binds it first gets it.
"""

import random
import socket
import sys

ATTEMPTS = 200
LOWEST, HIGHEST = 20000, 60000


def kernel_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_free(ports):
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
    return True


def consecutive_ports(n):
    for _ in range(ATTEMPTS):
        base = random.randrange(LOWEST, HIGHEST - n)
        if all_free(range(base, base + n)):
            return base
    return None


def main(argv):
    if len(argv) == 1:
        print(kernel_port())
        return 0
    if len(argv) == 2 and argv[1].isdigit() and int(argv[1]) > 0:
        n = int(argv[1])
        base = consecutive_ports(n)
        if base is None:
            print(f"free_port.py: no free range of {n} ports", file=sys.stderr)
            return 1
        print(base)
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
