"""Benchmark: what checking a remote pool by digests costs (``kvspec conform --peer``).

Usage::

    .venv/bin/python benchmarks/bench_remote.py            # 16 KiB, 64 KiB and 2 MiB pages, 64 MiB per size
    .venv/bin/python benchmarks/bench_remote.py --mib 16   # a smaller pool

The agent server digests every region of the producer's pool with keyed
BLAKE2b (hashlib, 16-byte digests, the session's key) and the suite digests
its shadow of it, instead of reading the pool back. Printed per page size:
MB/s of ``digest_pages`` over a pool of those pages, of one digest over the
whole region (what ``pool.digests`` does first), and of a plain copy of the
same bytes in this process (the baseline: what reading the pool back would at
least cost here), with the ratios. No assertion is made on timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvspec.transport._wire import digest, digest_pages

MB = 1e6


def best_of(reps: int, func: object) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        func()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="pool size per page size (MiB)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    key = os.urandom(32)
    size = args.mib << 20
    region = memoryview(bytearray(os.urandom(1 << 20) * args.mib))
    print(f"# keyed BLAKE2b (hashlib), {args.mib} MiB pool, median of {args.reps}")
    print(f"{'page':>6} {'pages':>6} {'per-page MB/s':>14} {'region MB/s':>12} {'copy MB/s':>10} {'digest/copy':>12}")
    for page in (16 << 10, 64 << 10, 2 << 20):
        table = [(0, offset, page) for offset in range(0, size, page)]
        per_page = best_of(args.reps, lambda t=table: digest_pages(key, t, [region]))
        whole = best_of(args.reps, lambda: digest(key, region))
        copy = best_of(args.reps, lambda: bytes(region))
        label = f"{page >> 10}K" if page < 1 << 20 else f"{page >> 20}M"
        print(
            f"{label:>6} {len(table):>6} {size / per_page / MB:14.0f} {size / whole / MB:12.0f} "
            f"{size / copy / MB:10.0f} {copy / per_page:12.2f}"
        )


if __name__ == "__main__":
    main()
