"""Loopback throughput against a plain memoryview copy, exchange and offload copies, and the bytes clipping saves.

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

from kvspec import TransferMode, get_sub_block_offset, map_sub_blocks
from kvspec.presets import get_preset
from kvspec.protocol._summary import blocks_needed_for, summarize_plan
from kvspec.transport import Descriptor, MemoryRegion, TransferState
from kvspec.transport.loopback import LoopbackBackend

__all__: list[str] = []

KIB = 1024
MIB = 1024 * KIB
# (page size, blocks moved): 1000 non-contiguous blocks, fewer at 2 MiB (docs/backends/index.md).
CASES = ((16 * KIB, 1000), (64 * KIB, 1000), (2 * MIB, 128))
# Offload copies (issue 14): 64 KiB pages, 1000 chunks of f pages each, f = 1 and f = 4.
OFFLOAD_CASES = ((64 * KIB, 1000, 1), (64 * KIB, 1000, 4))


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


def bench_offload(page: int, chunks: int, f: int, reps: int) -> dict[str, float]:
    """GB/s of offload copies through loopback (store: WRITE GPU -> chunk rows; load: READ back) and of memoryview.

    The GPU side is ``chunks * f`` blocks at random ids of a pool twice that
    size; chunk ``k``'s sub-block ``s`` sits at ``get_sub_block_offset(k, s)``
    (OFF-7). The baselines copy the very same pages: one memoryview slice per
    page ("per-page"), and one contiguous copy of the same byte count ("plain").
    """
    pages = chunks * f
    gpu_blocks = 2 * pages + 2
    pattern = random.Random(0).randbytes(MIB)
    gpu = bytearray((pattern * (gpu_blocks * page // MIB + 1))[: gpu_blocks * page])
    rows = bytearray(pages * page)
    backend = LoopbackBackend()
    gpu_agent, chunk_agent = backend.create_agent("gpu"), backend.create_agent("chunks")
    gpu_agent.register_memory([MemoryRegion(buffer=memoryview(gpu))])
    chunk_agent.register_memory([MemoryRegion(buffer=memoryview(rows))])
    peer = gpu_agent.add_remote_agent(chunk_agent.get_agent_metadata())
    block_ids = random.Random(1).sample(range(1, gpu_blocks), pages)
    pairs = [
        (block * page, get_sub_block_offset(entry, sub, page_size=page, blocks_per_chunk=f))
        for block, (entry, sub) in zip(block_ids, map_sub_blocks(0, pages, blocks_per_chunk=f), strict=True)
    ]
    descriptors = [
        Descriptor(local_region=0, local_offset=g, remote_region=0, remote_offset=c, nbytes=page) for g, c in pairs
    ]
    gpu_view, row_view = memoryview(gpu), memoryview(rows)
    total = page * pages

    def plain() -> None:
        row_view[:total] = gpu_view[total : 2 * total]

    def per_page() -> None:
        for g, c in pairs:
            row_view[c : c + page] = gpu_view[g : g + page]

    def through(mode: TransferMode) -> Callable[[], None]:
        def copy() -> None:
            handle = gpu_agent.post(mode, descriptors, peer=peer)
            while gpu_agent.check(handle).state is TransferState.PENDING:
                pass
            gpu_agent.release(handle)

        return copy

    # One run of each per round, in turn, so that drift on the shared machine hits all of them alike; each
    # ratio is the median over rounds of the paired ratio (robust to a slow round), GB/s the median time.
    runs: dict[str, Callable[[], None]] = {
        "plain": plain,
        "per_page": per_page,
        "store": through(TransferMode.WRITE),
        "load": through(TransferMode.READ),
    }
    for fn in runs.values():
        fn()  # warm-up: page faults, first touch
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3 * reps):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    backend.close()
    result = {name: total / statistics.median(ts) / 1e9 for name, ts in times.items()}
    for name in ("store", "load"):
        paired = [pp / t for pp, t in zip(times["per_page"], times[name], strict=True)]
        result[f"{name}_ratio"] = statistics.median(paired)
        result[f"{name}_vs_plain"] = statistics.median(
            [p / t for p, t in zip(times["plain"], times[name], strict=True)]
        )
    return result


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
    print("loopback offload copies vs memoryview copy of the same pages (GB/s; ratio = loopback / per-page copy,")
    print("the median of paired runs; target >= 0.8) and vs one contiguous copy of as many bytes")
    print(
        f"{'page':>8} {'chunks':>6} {'f':>2} {'plain':>7} {'per-page':>8} {'store':>7} {'load':>7} "
        f"{'store/pp':>8} {'load/pp':>8} {'load/plain':>10}"
    )
    for page, chunks, f in OFFLOAD_CASES:
        r = bench_offload(page, chunks, f, args.reps)
        print(
            f"{page // KIB:>5} KiB {chunks:>6} {f:>2} {r['plain']:>7.2f} {r['per_page']:>8.2f} {r['store']:>7.2f} "
            f"{r['load']:>7.2f} {r['store_ratio']:>8.2f} {r['load_ratio']:>8.2f} {r['load_vs_plain']:>10.2f}"
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
