"""A misbehaving implementation of the vectors contract, for `kvspec vectors check` (issue 23, finding 6).

Usage: hostile.py MODE [PIDFILE]. Every mode answers ``{"unsupported": true}``
when it answers at all; MODE says how it misbehaves:

- ``hang``: reads its input, then never answers;
- ``spam``: prints output forever, never a newline;
- ``slow``: answers each vector after 0.2 s;
- ``die``: exits (status 0) without answering.

With PIDFILE it first appends its process id there, so a test can see it is gone.
"""

import sys
import time

mode = sys.argv[1]
if len(sys.argv) > 2:
    with open(sys.argv[2], "a") as handle:
        handle.write(f"{__import__('os').getpid()}\n")
for _line in sys.stdin:
    if mode == "hang":
        time.sleep(3600)
    elif mode == "spam":
        chunk = "x" * 65536
        while True:
            sys.stdout.write(chunk)
    elif mode == "die":
        sys.exit(0)
    elif mode == "slow":
        time.sleep(0.2)
    sys.stdout.write('{"unsupported": true}\n')
    sys.stdout.flush()
