"""The transfer plan, page by page: PLAN-1."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Protocol

import attrs

from kvspec.core._errors import PlanError
from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig, KVCacheSpec, MambaSpec

__all__ = ["BlockPairsLike", "PageCopy", "compute_page_copies", "get_page_byte_ranges"]


class BlockPairsLike(Protocol):
    """What the planner needs from a :class:`kvspec.BlockPairs`; a connector may return its own object.

    Both lists hold one group per KV-cache group with equal per-group lengths:
    ``consumer_block_ids[g][i]`` receives ``producer_block_ids[g][i]`` (ALIGN-1).
    """

    @property
    def producer_block_ids(self) -> BlockIds: ...

    @property
    def consumer_block_ids(self) -> BlockIds: ...


@attrs.frozen(kw_only=True)
class PageCopy:
    """One contiguous copy from the producer's region to the consumer's region.

    Regions are indexes into each side's ``kv_cache_tensors`` (one registered
    region per tensor, in config order). Named by role, never local/remote:
    :meth:`TransferPlan.to_descriptors` is the one place that maps roles onto
    the initiator and its peer.
    """

    producer_region: int
    producer_offset: int
    consumer_region: int
    consumer_offset: int
    nbytes: int


def get_page_byte_ranges(spec: KVCacheSpec) -> tuple[tuple[int, int], ...]:
    """The ``(offset, nbytes)`` ranges of one page that a transfer moves.

    An attention page moves whole. A state group's page holds its state
    tensors back to back from the page's start, then padding up to the
    shared page size (docs/spec/memory-layout.md): tensor ``i`` starts after
    the bytes of tensors ``0 .. i-1`` and is ``prod(shape) * itemsize``
    bytes long. Those ranges move; the padding never does (PLAN-1).
    """
    if not isinstance(spec, MambaSpec):
        return ((0, spec.page_size_bytes),)
    ranges = []
    offset = 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        ranges.append((offset, nbytes))
        offset += nbytes
    return tuple(ranges)


def _check_block_id(config: KVCacheConfig, role: str, group: int, position: int, block_id: int) -> None:
    # A peer's parameters must never steer a copy onto the null block (NULL-1)...
    if block_id == NULL_BLOCK_ID:
        raise PlanError(
            f"{role} group {group} position {position}: null block id {NULL_BLOCK_ID} in a pair; "
            "compute_block_pairs drops null pairs (NULL-1)"
        )
    # ... nor outside the pool (PLAN-1).
    if not 0 < block_id < config.num_blocks:
        raise PlanError(
            f"{role} group {group} position {position}: block id {block_id} outside [1, {config.num_blocks - 1}]"
        )


def _check_page_fits(config: KVCacheConfig, role: str, group: int, layer: str, block_id: int, page: int) -> None:
    region, offset = config.page_offset(layer, block_id)
    size = config.kv_cache_tensors[region].size
    # A page past its tensor's end would copy bytes of another allocation (PLAN-1).
    if offset + page > size:
        raise PlanError(
            f"{role} group {group} layer {layer!r} block {block_id}: page [{offset}, {offset + page}) "
            f"outside tensor {region} of {size} bytes"
        )


def _check_configs(producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike) -> None:
    producer_ids, consumer_ids = pairs.producer_block_ids, pairs.consumer_block_ids
    # Pair i of group g joins producer[g][i] and consumer[g][i]: both sides list the same groups (ALIGN-1).
    if len(producer_ids) != len(consumer_ids):
        raise PlanError(f"pairs: producer has {len(producer_ids)} groups, consumer {len(consumer_ids)}")
    # Zero groups is a full prefix hit; otherwise one list per group of the config (PLAN-1).
    if len(producer_ids) not in (0, producer_config.num_groups):
        raise PlanError(f"pairs: expected 0 or {producer_config.num_groups} groups, got {len(producer_ids)}")
    # Groups pair by index; the handshake already refuses different counts (HS-1).
    if producer_config.num_groups != consumer_config.num_groups:
        raise PlanError(
            f"configs: producer has {producer_config.num_groups} groups, consumer {consumer_config.num_groups} (HS-1)"
        )


def _check_group_layout(producer_config: KVCacheConfig, consumer_config: KVCacheConfig, group: int) -> int:
    producer_group = producer_config.kv_cache_groups[group]
    consumer_group = consumer_config.kv_cache_groups[group]
    # Layers pair by name; the handshake already refuses different lists (HS-1).
    if producer_group.layer_names != consumer_group.layer_names:
        raise PlanError(
            f"group {group}: layer names differ: producer {list(producer_group.layer_names)}, "
            f"consumer {list(consumer_group.layer_names)} (HS-1)"
        )
    page = producer_group.kv_cache_spec.page_size_bytes
    # A page copied must be the same size on both sides (HS-1).
    if consumer_group.kv_cache_spec.page_size_bytes != page:
        raise PlanError(
            f"group {group}: page size differs: producer {page}, "
            f"consumer {consumer_group.kv_cache_spec.page_size_bytes} (HS-1)"
        )
    # The bytes moved inside a page are read on one side and written at the same offsets on the other:
    # a state group's tensors must lie alike on both sides; the handshake already refuses others (STATE-5).
    producer_ranges = get_page_byte_ranges(producer_group.kv_cache_spec)
    consumer_ranges = get_page_byte_ranges(consumer_group.kv_cache_spec)
    if producer_ranges != consumer_ranges:
        raise PlanError(
            f"group {group}: state tensor byte ranges differ: producer {list(producer_ranges)}, "
            f"consumer {list(consumer_ranges)} (STATE-5)"
        )
    return page


def _check_group_pairs(
    producer_config: KVCacheConfig,
    consumer_config: KVCacheConfig,
    g: int,
    producer_ids: Sequence[int],
    consumer_ids: Sequence[int],
) -> int:
    """Group ``g``'s pairs and layouts checked; its page size."""
    # Every pair has both ends (ALIGN-1).
    if len(producer_ids) != len(consumer_ids):
        raise PlanError(f"group {g}: {len(producer_ids)} producer ids paired with {len(consumer_ids)} consumer ids")
    page = _check_group_layout(producer_config, consumer_config, g)
    for i, (p_id, c_id) in enumerate(zip(producer_ids, consumer_ids, strict=True)):
        _check_block_id(producer_config, "producer", g, i, p_id)
        _check_block_id(consumer_config, "consumer", g, i, c_id)
    return page


def compute_page_copies(
    *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
) -> tuple[PageCopy, ...]:
    """The copies that move exactly the pages of the pairs, merged where both sides go on (PLAN-1).

    One page per (layer of the group, pair); layers pair by name. Layer ``l``
    of block ``b`` starts at ``offset + l * layer_stride + b * block_stride``
    in its tensor. Of each page, the ranges :func:`get_page_byte_ranges`
    names move: the whole page for attention, each state tensor's bytes
    (never the padding) for a state group. Every id is checked against ``num_blocks`` (the null block
    is refused, NULL-1) and every page against its tensor's size. Copies
    ordered by producer region and offset merge when the next one continues
    the last on both sides. Zero groups (full prefix hit) give no copies (PLAN-1).
    """
    _check_configs(producer_config, consumer_config, pairs)
    pages: list[PageCopy] = []
    both = zip(pairs.producer_block_ids, pairs.consumer_block_ids, strict=True)
    for g, (producer_ids, consumer_ids) in enumerate(both):
        page = _check_group_pairs(producer_config, consumer_config, g, producer_ids, consumer_ids)
        for layer in producer_config.kv_cache_groups[g].layer_names:
            if producer_ids:
                # Strides are linear in the block id, so the largest id bounds every page (PLAN-1).
                _check_page_fits(producer_config, "producer", g, layer, max(producer_ids), page)
                _check_page_fits(consumer_config, "consumer", g, layer, max(consumer_ids), page)
            for p_id, c_id in zip(producer_ids, consumer_ids, strict=True):
                p_region, p_offset = producer_config.page_offset(layer, p_id)
                c_region, c_offset = consumer_config.page_offset(layer, c_id)
                for start, nbytes in get_page_byte_ranges(producer_config.kv_cache_groups[g].kv_cache_spec):
                    pages.append(
                        PageCopy(
                            producer_region=p_region,
                            producer_offset=p_offset + start,
                            consumer_region=c_region,
                            consumer_offset=c_offset + start,
                            nbytes=nbytes,
                        )
                    )
    # Two copies onto the same consumer bytes mean a duplicated consumer id (PLAN-1).
    landed = sorted((copy.consumer_region, copy.consumer_offset, copy.nbytes) for copy in pages)
    for (region_a, offset_a, nbytes_a), (region_b, offset_b, _) in itertools.pairwise(landed):
        if region_a == region_b and offset_a + nbytes_a > offset_b:
            raise PlanError(f"consumer region {region_a}: copies overlap at byte {offset_b}")
    merged: list[PageCopy] = []
    for copy in sorted(pages, key=attrs.astuple):  # by producer region and offset
        last = merged[-1] if merged else None
        if (
            last is not None
            and copy.producer_region == last.producer_region
            and copy.consumer_region == last.consumer_region
            and copy.producer_offset == last.producer_offset + last.nbytes
            and copy.consumer_offset == last.consumer_offset + last.nbytes
        ):
            merged[-1] = attrs.evolve(last, nbytes=last.nbytes + copy.nbytes)  # the next page goes on both sides
        else:
            merged.append(copy)
    return tuple(merged)
