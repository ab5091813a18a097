#!/usr/bin/env python3
"""deploy/free_port.py: free TCP ports on 127.0.0.1, for servers the scripts are about to start.

    deploy/free_port.py [N]   the first of N (1) consecutive ports, between 20000 and 60000, that
                              are all free now (random ranges are tried; exits 1 if 200 are not
                              enough)

deploy/lib.sh calls it (wl_free_port, wl_free_ports). A port is free when it was checked, not
later: whoever binds it first gets it.
"""

import random
import socket
import sys

ATTEMPTS = 200
LOWEST, HIGHEST = 20000, 60000


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


def main(argv):
    if len(argv) > 2 or not all(a.isdigit() and int(a) > 0 for a in argv[1:]):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    n = int(argv[1]) if len(argv) == 2 else 1
    for _ in range(ATTEMPTS):
        base = random.randrange(LOWEST, HIGHEST - n)
        if all_free(range(base, base + n)):
            print(base)
            return 0
    print(f"free_port.py: no free range of {n} ports", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
