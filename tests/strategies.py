"""Hypothesis strategies for KV-cache configs, block-id lists and exchange scenarios."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import strategies as st

from kvspec import (
    BlockIds,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_logical_block_count,
    get_pruned_block_ids,
)

ADMITTED_KINDS = ("full", "mla", "sw", "sw_mla", "chunked", "indexer")
ALL_KINDS = (*ADMITTED_KINDS, "cross", "mamba", "unknown")
block_sizes = st.sampled_from([1, 2, 4, 8, 16])
windows = st.integers(min_value=1, max_value=200)


@st.composite
def specs(draw: st.DrawFn, kind: str, block_size: int | None = None) -> KVCacheSpec:
    """One tiny spec of ``kind`` (pages of a few bytes)."""
    b = draw(block_sizes) if block_size is None else block_size
    common: dict[str, Any] = {
        "block_size": b,
        "num_kv_heads": 1,
        "head_size": draw(st.integers(1, 4)),
        "dtype": "float16",
    }
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "mla":
        return MLAAttentionSpec(**common)
    if kind == "sw":
        return SlidingWindowSpec(**common, sliding_window=draw(windows))
    if kind == "sw_mla":
        return SlidingWindowMLASpec(**common, sliding_window=draw(windows))
    if kind == "indexer":
        return IndexerSpec(**{**common, "dtype": "uint8"})
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=draw(st.integers(1, 64)))
    if kind == "cross":
        return CrossAttentionSpec(**common)
    if kind == "mamba":
        return MambaSpec(block_size=b, shapes=[(2, 3)], dtypes=["float32"])
    return KVCacheSpec(block_size=b)  # a kind kvspec does not know


def config_from_specs(group_specs: Sequence[KVCacheSpec], *, num_blocks: int = 2) -> KVCacheConfig:
    """One layer and one tensor per group."""
    groups, tensors = [], []
    for g, spec in enumerate(group_specs):
        name = f"layer.{g}"
        page = max(spec.page_size_bytes, 1)
        groups.append(KVCacheGroupSpec(layer_names=[name], kv_cache_spec=spec))
        tensors.append(KVCacheTensor(size=num_blocks * page, layers=[name], layer_stride=0, block_stride=page))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


@st.composite
def configs(
    draw: st.DrawFn, kinds: Sequence[str] = ADMITTED_KINDS, max_groups: int = 4, same_block_size: bool = False
) -> KVCacheConfig:
    """A config of 1..max_groups groups whose kinds are drawn from ``kinds``."""
    n = draw(st.integers(1, max_groups))
    shared = draw(block_sizes) if same_block_size else None
    group_specs = [draw(specs(draw(st.sampled_from(list(kinds))), shared)) for _ in range(n)]
    return config_from_specs(group_specs)


block_id = st.integers(min_value=0, max_value=50)
real_block_id = st.integers(min_value=1, max_value=50)


def block_lists(
    num_groups: int, *, max_len: int = 12, ids: st.SearchStrategy[int] = block_id
) -> st.SearchStrategy[BlockIds]:
    """``num_groups`` lists of block ids, null ids included."""
    return st.lists(st.lists(ids, max_size=max_len), min_size=num_groups, max_size=num_groups).map(BlockIds)


@attrs.frozen(kw_only=True)
class Scenario:
    """One request: a config, T tokens, a prefix hit H, and both sides' lists built as vLLM builds them."""

    config: KVCacheConfig
    num_tokens: int
    prefix_hit_tokens: int
    producer_unclipped: BlockIds
    producer_block_ids: BlockIds
    consumer_block_ids: BlockIds
    recomputed_tokens: int = 0


def build_scenario(
    config: KVCacheConfig,
    num_tokens: int,
    prefix_hit_tokens: int,
    *,
    prune_tokens: int | None = None,
    recomputed_tokens: int = 0,
) -> Scenario:
    """P holds fresh ids for every logical block, pruned with ``prune_tokens`` (default T) then clipped.

    C holds fresh ids (disjoint from P's) for its uncached, clipped suffix. Both
    lists cover ``T + recomputed_tokens`` tokens (vLLM: built for N, C recomputes N - 1).
    """
    next_id = 1
    producer = []
    for group in config.kv_cache_groups:
        count = get_logical_block_count(group.kv_cache_spec, num_tokens=num_tokens + recomputed_tokens)
        producer.append(list(range(next_id, next_id + count)))
        next_id += count
    pruned = get_pruned_block_ids(
        config, producer, num_computed_tokens=num_tokens if prune_tokens is None else prune_tokens
    )
    budgets = get_blocks_per_sw(config)
    counts = get_consumer_block_counts(
        config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens, recomputed_tokens=recomputed_tokens
    )
    consumer = []
    for count in counts:
        consumer.append(list(range(next_id, next_id + count)))
        next_id += count
    return Scenario(
        config=config,
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        producer_unclipped=pruned,
        producer_block_ids=get_exchange_clipped_blocks(pruned, budgets),
        consumer_block_ids=BlockIds(consumer),
        recomputed_tokens=recomputed_tokens,
    )


@st.composite
def scenarios(draw: st.DrawFn, max_tokens: int = 400) -> Scenario:
    """An admitted config (block sizes may differ per group), T and a prefix hit aligned to every group."""
    config = draw(configs())
    # Block sizes are powers of two, so a multiple of the largest is a multiple of each (WIN-1).
    b = max(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
    t = draw(st.integers(0, max_tokens))
    h = draw(st.integers(0, t // b)) * b
    return build_scenario(config, t, h)
