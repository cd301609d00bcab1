"""What the guard costs, against the work it guards, in the same process (INT-2, INT-3).

Run: ``.venv/bin/python benchmarks/bench_guard.py [--reps N]``. Two tables:

1. **digest + copy over copy**: per page size (16 KiB, 64 KiB, 2 MiB; one
   block of one layer, TP 1, ``hnd``), the time to copy a request's pages
   alone, and to copy them and digest each copied page with INT-2 in full
   mode (XXH3-128 and BLAKE2b-128) and in partial mode (64 bytes a page), as
   the consumer's guard does; the ratio is the guard's price on the copy.
   The goal for full mode is at most 1.3.
2. **rule checks over touching every id**: for a request of N blocks in a
   full and a sliding-window group, :func:`kvspec.fast.check_request_blocks` (the
   engine-speed path a guard calls) and its plain definition
   :func:`kvspec.spec.check_request_blocks`, against a loop that reads every block id once (the least any check of the
   lists can do). The goal is at most 2.

Medians of ``--reps`` alternating rounds; asserts nothing about time (timing
lives in benchmarks, never in tests).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

from kvspec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from kvspec.fast import check_request_blocks
from kvspec.spec import check_request_blocks as plain_check_request_blocks
from kvspec.spec.digest import DigestAlgorithm, PlannedCell, digest_planned_page, get_digest_plan, get_layer_prefix
from kvspec.spec.parallel import get_canonical_page

__all__: list[str] = []

KIB = 1 << 10
REQUEST_BYTES = 32 << 20  # each round copies (and digests) this much


def _median_pair(first: Callable[[], None], second: Callable[[], None], reps: int) -> tuple[float, float]:
    a, b = [], []
    for rep in range(reps + 1):
        for fn, out in ((first, a), (second, b)):
            start = time.perf_counter()
            fn()
            if rep:  # the first round warms caches
                out.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def _copier(source: memoryview, target: memoryview, n: int, count: int) -> Callable[[], None]:
    def copy() -> None:
        for i in range(count):
            target[i * n : (i + 1) * n] = source[i * n : (i + 1) * n]

    return copy


def _guarded_copier(
    source: memoryview, target: memoryview, n: int, count: int, digest: Callable[[memoryview, int], object]
) -> Callable[[], None]:
    def copy_and_digest() -> None:
        for i in range(count):
            target[i * n : (i + 1) * n] = source[i * n : (i + 1) * n]
            digest(target[i * n : (i + 1) * n], i)

    return copy_and_digest


def bench_digest(reps: int) -> None:
    print("INT-2 digest + copy over copy alone (TP 1, hnd, one core; a round moves 32 MiB of pages)")
    print(f"{'page':>8} {'mode':<18} {'copy ms':>8} {'+digest ms':>10} {'ratio':>6}")
    for page_bytes in (16 * KIB, 64 * KIB, 2048 * KIB):
        heads, head_size = 8, 128
        block = page_bytes // (2 * heads * head_size * 2)
        spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_size, dtype="bfloat16")
        page = get_canonical_page(spec)
        n = page.nbytes
        count = max(1, REQUEST_BYTES // n)
        source = memoryview(bytearray(os.urandom(n * count)))
        target = memoryview(bytearray(n * count))
        prefix = get_layer_prefix("model.layers.0.self_attn")
        for label, algorithm, partial in (
            ("full xxh3-128", DigestAlgorithm.XXH3_128, None),
            ("full blake2b-128", DigestAlgorithm.BLAKE2B_128, None),
            ("partial 64 B", DigestAlgorithm.XXH3_128, 64),
        ):
            plan = get_digest_plan(page, tp_size=1, tp_rank=0, split=1, granule=block, partial_bytes=partial)
            digest = functools.partial(_digest_page, algorithm, plan, prefix, block)
            plain, guarded = _median_pair(
                _copier(source, target, n, count), _guarded_copier(source, target, n, count, digest), reps
            )
            size = f"{page_bytes // KIB}Ki"
            print(f"{size:>8} {label:<18} {plain * 1e3:>8.2f} {guarded * 1e3:>10.2f} {guarded / plain:>6.2f}")


def _digest_page(
    algorithm: DigestAlgorithm, plan: tuple[PlannedCell, ...], prefix: bytes, block: int, data: memoryview, index: int
) -> object:
    return digest_planned_page(algorithm, plan, data, prefix=prefix, position=index * block)


def _config(num_blocks: int) -> KVCacheConfig:
    specs = [
        FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16"),
        SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=1024),
    ]
    groups, tensors = [], []
    for g, spec in enumerate(specs):
        name = f"model.layers.{g}.self_attn"
        groups.append(KVCacheGroupSpec(layer_names=[name], kv_cache_spec=spec))
        tensors.append(
            KVCacheTensor(
                size=num_blocks * spec.page_size_bytes, layers=[name], layer_stride=0, block_stride=spec.page_size_bytes
            )
        )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _toucher(lists: list[list[int]], rounds: int) -> Callable[[], None]:
    def touch() -> None:
        for _ in range(rounds):
            total = 0
            for group in lists:
                for block_id in group:
                    total += block_id

    return touch


def _checker(
    check: Callable[..., object],
    config: KVCacheConfig,
    tokens: int,
    producer: list[list[int]],
    consumer: list[list[int]],
    rounds: int,
) -> Callable[[], None]:
    def checks() -> None:
        for _ in range(rounds):
            check(
                config, num_tokens=tokens, prefix_hit_tokens=0, producer_block_ids=producer, consumer_block_ids=consumer
            )

    return checks


def bench_rules(reps: int) -> None:
    print("\nINT-3 rule checks on the lists used, over a loop touching every id once (full + window group)")
    print(f"{'tokens':>7} {'ids':>6} {'touch us':>9} {'checks us':>10} {'ratio':>6} {'definition us':>14} {'ratio':>6}")
    rounds = 20
    for tokens in (4096, 32768, 131072):
        blocks = tokens // 16
        window = min(blocks, 1024 // 16 + 1)
        config = _config(2 * blocks + 8)
        producer = [list(range(1, blocks + 1)), list(range(blocks + 1, blocks + 1 + window))]
        consumer = [list(range(2, blocks + 2)), list(range(blocks + 2, blocks + 2 + window))]
        touch = _toucher([*producer, *consumer], rounds)
        plain, checked = _median_pair(
            touch, _checker(check_request_blocks, config, tokens, producer, consumer, rounds), reps
        )
        plain2, defined = _median_pair(
            touch, _checker(plain_check_request_blocks, config, tokens, producer, consumer, rounds), reps
        )
        ids = 2 * (blocks + window)
        touched = f"{tokens:>7} {ids:>6} {plain / rounds * 1e6:>9.1f}"
        fast = f"{checked / rounds * 1e6:>10.1f} {checked / plain:>6.2f}"
        print(f"{touched} {fast} {defined / rounds * 1e6:>14.1f} {defined / plain2:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    bench_digest(args.reps)
    bench_rules(args.reps)


if __name__ == "__main__":
    main()
