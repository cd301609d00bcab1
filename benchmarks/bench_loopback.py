"""Loopback throughput as a ratio of a plain memoryview copy, and the bytes clipping saves.

Run: ``.venv/bin/python benchmarks/bench_loopback.py [--reps N]``. Prints tables; asserts nothing
about time (timing lives in benchmarks, never in tests). The machine is shared and noisy
(docs/backends/index.md), so each figure is the median of ``--reps`` repetitions, and both sides of a
ratio are measured alternately.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from kvspec import TransferMode
from kvspec._summary import blocks_needed_for, summarize_plan
from kvspec.presets import get_preset
from kvspec.transport import Descriptor, MemoryRegion, TransferState
from kvspec.transport.loopback import LoopbackBackend

__all__: list[str] = []

KIB = 1024
MIB = 1024 * KIB
# (page size, blocks moved): 1000 non-contiguous blocks, fewer at 2 MiB (docs/backends/index.md).
CASES = ((16 * KIB, 1000), (64 * KIB, 1000), (2 * MIB, 128))


def _median_time(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up: page faults, first-touch
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_copy(page: int, count: int, reps: int) -> dict[str, float]:
    """GB/s of the loopback READ, a plain contiguous memoryview copy and a per-page memoryview loop."""
    num_blocks = 2 * count + 2
    chunk = random.Random(0).randbytes(MIB)
    src = bytearray((chunk * (num_blocks * page // MIB + 1))[: num_blocks * page])
    dst = bytearray(num_blocks * page)
    backend = LoopbackBackend()
    producer, consumer = backend.create_agent("producer"), backend.create_agent("consumer")
    producer.register_memory([MemoryRegion(buffer=memoryview(src))])
    consumer.register_memory([MemoryRegion(buffer=memoryview(dst))])
    peer = consumer.add_remote_agent(producer.get_agent_metadata())
    rng = random.Random(1)
    # Random ids on each side, chosen independently: nothing merges ("rand" in docs/backends/index.md).
    src_ids, dst_ids = rng.sample(range(num_blocks), count), rng.sample(range(num_blocks), count)
    descriptors = [
        Descriptor(local_region=0, local_offset=d * page, remote_region=0, remote_offset=s * page, nbytes=page)
        for s, d in zip(src_ids, dst_ids, strict=True)
    ]
    total = page * count
    src_view, dst_view = memoryview(src), memoryview(dst)

    def plain() -> None:
        dst_view[:total] = src_view[total : 2 * total]

    def per_page() -> None:
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst_view[d * page : (d + 1) * page] = src_view[s * page : (s + 1) * page]

    def loopback() -> None:
        handle = consumer.post(TransferMode.READ, descriptors, peer=peer)
        while consumer.check(handle).state is TransferState.PENDING:
            pass
        consumer.release(handle)

    # Alternate the measurements so that drift on the shared machine hits all of them alike.
    samples: dict[str, list[float]] = {"plain": [], "per_page": [], "loopback": []}
    for _ in range(max(1, reps // 3)):
        for name, fn in (("plain", plain), ("per_page", per_page), ("loopback", loopback)):
            samples[name].append(_median_time(fn, 3))
    backend.close()
    return {name: total / statistics.median(times) / 1e9 for name, times in samples.items()}


def bench_clipping() -> list[tuple[str, int, int, int]]:
    """(model, tokens, bytes unclipped, bytes clipped) for Gemma 3 27B and GPT-OSS 120B."""
    rows = []
    for model in ("google/gemma-3-27b-it", "openai/gpt-oss-120b"):
        preset = get_preset(model)
        for tokens in (8 * 1024, 32 * 1024, 128 * 1024):
            sizing = preset.build_config(num_blocks=2)
            config = preset.build_config(num_blocks=blocks_needed_for(sizing, num_tokens=tokens))
            summary = summarize_plan(config, num_tokens=tokens)
            rows.append((model, tokens, summary.bytes_unclipped, summary.bytes_clipped))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9, help="repetitions per figure (median)")
    args = parser.parse_args()

    print("loopback READ vs memoryview copy (GB/s of payload; ratio = loopback / copy)")
    print(f"{'page':>8} {'blocks':>6} {'plain':>7} {'per-page':>8} {'loopback':>8} {'vs plain':>8} {'vs loop':>8}")
    for page, count in CASES:
        r = bench_copy(page, count, args.reps)
        print(
            f"{page // KIB:>5} KiB {count:>6} {r['plain']:>7.2f} {r['per_page']:>8.2f} {r['loopback']:>8.2f} "
            f"{r['loopback'] / r['plain']:>8.2f} {r['loopback'] / r['per_page']:>8.2f}"
        )
    print()
    print("bytes one request moves, without and with clipping (CLIP-1; prefix hit 0, block size 16)")
    print(f"{'model':<24} {'tokens':>7} {'unclipped':>12} {'clipped':>12} {'saved':>12} {'saved %':>8}")
    for model, tokens, unclipped, clipped in bench_clipping():
        saved = unclipped - clipped
        print(
            f"{model:<24} {tokens:>7} {unclipped / MIB:>8.0f} MiB {clipped / MIB:>8.0f} MiB "
            f"{saved / MIB:>8.0f} MiB {saved / unclipped:>8.1%}"
        )


if __name__ == "__main__":
    main()
