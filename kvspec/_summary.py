"""Plan reporting: what one request would move, with and without clipping (CLIP-1, PLAN-1).

It runs the reference functions and the planner over fresh, contiguous block
tables, so ``kvspec plan`` and the docs' figures can show what clipping saves
for a model without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec._enums import TransferMode
from kvspec._models import BlockIds, KVCacheConfig
from kvspec._plan import plan_transfer
from kvspec._reference import (
    BlockPairs,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_logical_block_count,
    get_pruned_block_ids,
)

__all__ = ["GroupSummary", "PlanSummary", "blocks_needed_for", "summarize_plan"]


@attrs.frozen(kw_only=True)
class GroupSummary:
    """One group's share of a request, with and without clipping (CLIP-1, PLAN-1)."""

    group_index: int
    kind: str
    block_size: int
    sliding_window: int | None
    num_layers: int
    page_size: int
    blocks_unclipped: int
    blocks_clipped: int

    @property
    def bytes_unclipped(self) -> int:
        """Bytes moved when every block of the uncached suffix is sent."""
        return self.blocks_unclipped * self.num_layers * self.page_size

    @property
    def bytes_clipped(self) -> int:
        """Bytes moved after clipping to the window budget."""
        return self.blocks_clipped * self.num_layers * self.page_size


def _to_group_summaries(value: Sequence[GroupSummary]) -> tuple[GroupSummary, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class PlanSummary:
    """What one request of ``num_tokens`` tokens moves, per group and in total.

    ``descriptors_*`` count merged copies for fresh, contiguous block
    allocations on both sides (the best case; a fragmented pool gives up to
    ``pages_*``).
    """

    num_tokens: int
    prefix_hit_tokens: int
    mode: TransferMode
    groups: tuple[GroupSummary, ...] = attrs.field(converter=_to_group_summaries)
    descriptors_unclipped: int
    descriptors_clipped: int

    @property
    def bytes_unclipped(self) -> int:
        """Total bytes without clipping."""
        return sum(g.bytes_unclipped for g in self.groups)

    @property
    def bytes_clipped(self) -> int:
        """Total bytes with clipping."""
        return sum(g.bytes_clipped for g in self.groups)

    @property
    def bytes_saved(self) -> int:
        """Bytes clipping saves."""
        return self.bytes_unclipped - self.bytes_clipped

    @property
    def pages_unclipped(self) -> int:
        """Pages (unmerged copies) without clipping."""
        return sum(g.blocks_unclipped * g.num_layers for g in self.groups)

    @property
    def pages_clipped(self) -> int:
        """Pages (unmerged copies) with clipping."""
        return sum(g.blocks_clipped * g.num_layers for g in self.groups)


def _contiguous_ids(counts: Sequence[int], first: int = 1) -> BlockIds:
    groups, next_id = [], first
    for n in counts:
        groups.append(range(next_id, next_id + n))
        next_id += n
    return BlockIds(groups)


def summarize_plan(
    config: KVCacheConfig, *, num_tokens: int, prefix_hit_tokens: int = 0, mode: TransferMode = TransferMode.READ
) -> PlanSummary:
    """What a request moves with and without clipping, for ``config``'s layout (CLIP-1, WIN-1, PLAN-1).

    Without clipping, every block of the uncached suffix ``[H, T)`` moves in
    every group. With clipping, the producer prunes and clips its table and
    the consumer allocates only what it needs, as the exchange does. ``config``
    must have enough blocks for both tables; :func:`blocks_needed_for` says
    how many.
    """
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    totals = [get_logical_block_count(s, num_tokens=num_tokens) for s in specs]
    suffix = [t - prefix_hit_tokens // s.block_size for t, s in zip(totals, specs, strict=True)]
    producer_full = _contiguous_ids(totals)
    unclipped = _align_pairs_unchecked(producer_full, _contiguous_ids(suffix))
    producer_sent = get_exchange_clipped_blocks(
        get_pruned_block_ids(config, producer_full, num_computed_tokens=num_tokens), get_blocks_per_sw(config)
    )
    consumer_counts = get_consumer_block_counts(config, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens)
    consumer_ids = _contiguous_ids(consumer_counts) if prefix_hit_tokens < num_tokens else BlockIds([])
    clipped = compute_transfer_pairs(
        config,
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        producer_block_ids=producer_sent,
        consumer_block_ids=consumer_ids,
    )
    plan_unclipped = plan_transfer(producer_config=config, consumer_config=config, pairs=unclipped)
    plan_clipped = plan_transfer(producer_config=config, consumer_config=config, pairs=clipped)
    groups = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        groups.append(
            GroupSummary(
                group_index=g,
                kind=spec.kind.value,
                block_size=spec.block_size,
                sliding_window=window if isinstance(window, int) else None,
                num_layers=len(group.layer_names),
                page_size=spec.page_size_bytes,
                blocks_unclipped=len(unclipped.consumer_block_ids[g]) if len(unclipped.consumer_block_ids) else 0,
                blocks_clipped=len(clipped.consumer_block_ids[g]) if len(clipped.consumer_block_ids) else 0,
            )
        )
    return PlanSummary(
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        mode=mode,
        groups=groups,
        descriptors_unclipped=plan_unclipped.num_descriptors,
        descriptors_clipped=plan_clipped.num_descriptors,
    )


def blocks_needed_for(config: KVCacheConfig, *, num_tokens: int) -> int:
    """Blocks (null block included) a pool needs for one request's full table on one side."""
    return 1 + sum(-(-num_tokens // g.kv_cache_spec.block_size) for g in config.kv_cache_groups)


def _align_pairs_unchecked(producer_block_ids: BlockIds, consumer_block_ids: BlockIds) -> BlockPairs:
    """Tail-align without WIN-1: what a connector that never clips would send (ALIGN-1).

    Both tables are fresh contiguous allocations from block 1, so no id is null (NULL-1).
    """
    if len(consumer_block_ids) == 0:
        return BlockPairs(producer_block_ids=BlockIds([]), consumer_block_ids=BlockIds([]))
    producer = [p[len(p) - len(c) :] for p, c in zip(producer_block_ids, consumer_block_ids, strict=True)]
    return BlockPairs(producer_block_ids=BlockIds(producer), consumer_block_ids=consumer_block_ids)
