"""Time the offload path of one 128k-token request on Gemma 3 27B: store set, hit and load set (OFF-3 ... OFF-6)."""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

from kvspec import (
    KVCacheConfig,
    OffloadConfig,
    SlidingWindowSpec,
    get_load_set,
    get_offload_hit_tokens,
    get_store_set,
)
from kvspec.presets import get_preset

TARGET_US = 1000.0


def gpu_block_ids(config: KVCacheConfig, num_tokens: int, *, window_nulls: bool) -> list[list[int]]:
    """Fresh ids per group; with ``window_nulls`` window groups start with vLLM's null prefix."""
    ids, next_id = [], 1
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        count = -(-num_tokens // spec.block_size)
        nulls = 0
        if window_nulls and isinstance(spec, SlidingWindowSpec):
            nulls = max(0, num_tokens - spec.sliding_window + 1) // spec.block_size
        ids.append([0] * nulls + list(range(next_id, next_id + count - nulls)))
        next_id += count
    return ids


def best_of(func: Callable[[], object], repeat: int) -> float:
    """Best mean seconds per call over 5 runs of ``repeat`` calls, garbage collection off (as timeit does)."""
    best = float("inf")
    gc.disable()
    try:
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeat):
                func()
            best = min(best, (time.perf_counter() - start) / repeat)
    finally:
        gc.enable()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--blocks-per-chunk", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()

    config = get_preset("gemma-3-27b").build_config(num_blocks=2)
    offload = OffloadConfig(blocks_per_chunk=args.blocks_per_chunk, hash_block_size=16)
    n = args.tokens
    stored_ids = gpu_block_ids(config, n, window_nulls=False)  # the request that computed everything
    chunk_tokens = [g.kv_cache_spec.block_size * args.blocks_per_chunk for g in config.kv_cache_groups]
    present = [[True] * (n // c) for c in chunk_tokens]  # every complete chunk stored (OFF-4)
    zero = [0] * config.num_groups

    def one_request() -> int:
        store = get_store_set(config, stored_ids, num_offloadable_tokens=n, next_chunk=zero, offload=offload)
        hit = get_offload_hit_tokens(config, present, num_tokens=n, local_hit_tokens=0, offload=offload)
        load = get_load_set(config, loaded_ids, num_tokens=hit, local_hit_tokens=0, offload=offload)
        return sum(store.num_blocks) + sum(load.num_blocks)

    hit = get_offload_hit_tokens(config, present, num_tokens=n, local_hit_tokens=0, offload=offload)
    loaded_ids = gpu_block_ids(config, hit, window_nulls=True)  # the later request's allocation
    moved = one_request()

    def baseline() -> int:
        # Touch every block id of the request once: the least any store-set computation must do.
        return sum(len(tuple(ids)) for ids in stored_ids)

    base_us = best_of(baseline, args.repeat) * 1e6
    us = best_of(one_request, args.repeat) * 1e6
    print(
        f"gemma-3-27b, {n} tokens, f={args.blocks_per_chunk}: {config.num_groups} groups, hit {hit} tokens, "
        f"{moved} blocks stored + loaded"
    )
    print(f"store set + hit + load set: {us:.1f} us per request (best of 5 x {args.repeat})")
    print(f"baseline (copy every block id once): {base_us:.1f} us; ratio {us / base_us:.2f}")
    print(f"ratio to the 1 ms target: {us / TARGET_US:.3f} ({'met' if us < TARGET_US else 'MISSED'})")


if __name__ == "__main__":
    main()
