"""Time the reference path of one 128k-token request on Gemma 3 27B: clip, coverage check, align.

The producer's list is a pre-built ``BlockIds`` and the consumer's is not clipped in the
timed loop, so this is a lower bound; benchmarks/bench_engine.py times what an engine pays
on its own lists, every step, and compares with vLLM.
"""

from __future__ import annotations

import argparse
import time

from kvspec import (
    BlockIds,
    BlockLists,
    TransferRequest,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_logical_block_count,
)
from kvspec.fast import (
    check_window_coverage,
    compute_block_pairs,
    get_exchange_clipped_blocks,
    get_pruned_block_ids,
)
from kvspec.presets import get_preset

TARGET_US = 1000.0


def build_request(num_tokens: int, prefix_hit_tokens: int) -> tuple[object, BlockIds, BlockIds]:
    """The full-size Gemma 3 27B config and both sides' unclipped lists, as vLLM would hold them."""
    config = get_preset("gemma-3-27b").build_config(num_blocks=65536)
    next_id = 1
    producer = []
    for group in config.kv_cache_groups:
        count = get_logical_block_count(group.kv_cache_spec, num_tokens=num_tokens)
        producer.append(list(range(next_id, next_id + count)))
        next_id += count
    pruned = get_pruned_block_ids(config, producer, num_computed_tokens=num_tokens)
    counts = get_consumer_block_counts(config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens)
    consumer = []
    for count in counts:
        consumer.append(list(range(next_id, next_id + count)))
        next_id += count
    return config, pruned, BlockIds(consumer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--prefix-hit", type=int, default=0, help="consumer prefix hit in tokens (multiple of 16)")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()

    config, producer_unclipped, consumer = build_request(args.tokens, args.prefix_hit)
    budgets = get_blocks_per_sw(config)  # computed once per engine, not per request

    def one_request() -> int:
        producer = get_exchange_clipped_blocks(producer_unclipped, budgets)  # P before advertising (CLIP-1)
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=args.tokens,
                prefix_hit_tokens=args.prefix_hit,
                producer_block_ids=producer,
                consumer_block_ids=consumer,
            ),
        )
        return compute_block_pairs(BlockLists(producer_block_ids=producer, consumer_block_ids=consumer)).num_pairs

    pairs = one_request()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(args.repeat):
            one_request()
        best = min(best, (time.perf_counter() - start) / args.repeat)
    us = best * 1e6
    print(f"gemma-3-27b, {args.tokens} tokens, prefix hit {args.prefix_hit}: {config.num_groups} groups, {pairs} pairs")
    print(f"clip + coverage + align: {us:.1f} us per request (best of 5 x {args.repeat})")
    print(f"ratio to the 1 ms target: {us / TARGET_US:.3f} ({'met' if us < TARGET_US else 'MISSED'})")


if __name__ == "__main__":
    main()
