"""The transfer planner: aligned block pairs -> the fewest byte-range copies (PLAN-1)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import attrs

from kvspec._descriptors import DescriptorList
from kvspec._enums import TransferMode
from kvspec._errors import PlanError
from kvspec._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig

__all__ = [
    "BlockPairsLike",
    "GroupPlan",
    "PageCopy",
    "TransferPlan",
    "plan_transfer",
]


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


@attrs.frozen(kw_only=True)
class GroupPlan:
    """What one KV-cache group contributes to a plan."""

    group_index: int
    num_pairs: int
    num_layers: int
    page_size: int

    @property
    def num_pages(self) -> int:
        """Pages copied for this group: one per (layer, pair)."""
        return self.num_pairs * self.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes moved for this group."""
        return self.num_pages * self.page_size


def _to_copies(value: Sequence[PageCopy]) -> tuple[PageCopy, ...]:
    return tuple(value)


def _to_group_plans(value: Sequence[GroupPlan]) -> tuple[GroupPlan, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class TransferPlan:
    """Every byte one request moves, as merged role-named copies (PLAN-1).

    ``total_bytes`` is exactly the bytes of the paired pages: one page per
    (layer of the group, pair), no more and no fewer.
    """

    copies: tuple[PageCopy, ...] = attrs.field(converter=_to_copies)
    groups: tuple[GroupPlan, ...] = attrs.field(converter=_to_group_plans)

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves; equals the sum of its groups' bytes."""
        return sum(copy.nbytes for copy in self.copies)

    @property
    def num_descriptors(self) -> int:
        """Number of merged copies, i.e. descriptors a backend receives."""
        return len(self.copies)

    @property
    def num_pages(self) -> int:
        """Number of pages before merging."""
        return sum(group.num_pages for group in self.groups)

    def to_descriptors(self, mode: TransferMode) -> DescriptorList:
        """Map role-named copies onto the posting agent's local/remote regions.

        READ: the consumer posts, so local = consumer and remote = producer.
        WRITE: the producer posts, so local = producer and remote = consumer.
        This is the only place the role -> initiator mapping is made (ADM-2).
        The result is packed (:class:`kvspec.transport.DescriptorList`), so a
        backend can ship it without touching each descriptor.
        """
        copies = self.copies
        producer = ([c.producer_region for c in copies], [c.producer_offset for c in copies])
        consumer = ([c.consumer_region for c in copies], [c.consumer_offset for c in copies])
        if mode is TransferMode.READ or mode is TransferMode.WRITE:
            (local_region, local_offset), (remote_region, remote_offset) = (
                (consumer, producer) if mode is TransferMode.READ else (producer, consumer)
            )
            return DescriptorList.from_columns(
                local_region=local_region,
                local_offset=local_offset,
                remote_region=remote_region,
                remote_offset=remote_offset,
                nbytes=[c.nbytes for c in copies],
            )
        raise PlanError(f"to_descriptors: expected a TransferMode, got {mode!r}")


# --------------------------------------------------------------------------- checks


def _check_block_id(config: KVCacheConfig, role: str, group: int, position: int, block_id: int) -> None:
    # A peer's parameters must never steer a copy outside the pool (PLAN-1), nor touch the null block (NULL-1).
    if block_id == NULL_BLOCK_ID:
        raise PlanError(
            f"{role} group {group} position {position}: null block id {NULL_BLOCK_ID} in a pair; "
            "compute_block_pairs drops null pairs (NULL-1)"
        )
    if not 0 < block_id < config.num_blocks:
        raise PlanError(
            f"{role} group {group} position {position}: block id {block_id} outside [1, {config.num_blocks - 1}]"
        )


def _check_groups(producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike) -> None:
    producer_ids, consumer_ids = pairs.producer_block_ids, pairs.consumer_block_ids
    if len(producer_ids) != len(consumer_ids):
        raise PlanError(f"pairs: producer has {len(producer_ids)} groups, consumer {len(consumer_ids)}")
    if len(producer_ids) not in (0, producer_config.num_groups):
        raise PlanError(f"pairs: expected 0 or {producer_config.num_groups} groups, got {len(producer_ids)}")
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
    if consumer_group.kv_cache_spec.page_size_bytes != page:
        raise PlanError(
            f"group {group}: page size differs: producer {page}, "
            f"consumer {consumer_group.kv_cache_spec.page_size_bytes} (HS-1)"
        )
    return page


def _check_page_fits(config: KVCacheConfig, role: str, group: int, layer: str, block_id: int, page: int) -> None:
    region, offset = config.page_offset(layer, block_id)
    size = config.kv_cache_tensors[region].size
    if offset + page > size:
        raise PlanError(
            f"{role} group {group} layer {layer!r} block {block_id}: page [{offset}, {offset + page}) "
            f"outside tensor {region} of {size} bytes"
        )


# --------------------------------------------------------------------------- planning


def _page_copies(
    producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
) -> tuple[list[tuple[int, int, int, int, int]], list[GroupPlan]]:
    """Unmerged copies as tuples ``(p_region, p_offset, c_region, c_offset, nbytes)``."""
    pages: list[tuple[int, int, int, int, int]] = []
    groups: list[GroupPlan] = []
    both = zip(pairs.producer_block_ids, pairs.consumer_block_ids, strict=True)
    for g, (producer_ids, consumer_ids) in enumerate(both):
        if len(producer_ids) != len(consumer_ids):
            raise PlanError(f"group {g}: {len(producer_ids)} producer ids paired with {len(consumer_ids)} consumer ids")
        page = _check_group_layout(producer_config, consumer_config, g)
        for i, (p_id, c_id) in enumerate(zip(producer_ids, consumer_ids, strict=True)):
            _check_block_id(producer_config, "producer", g, i, p_id)
            _check_block_id(consumer_config, "consumer", g, i, c_id)
        layers = producer_config.kv_cache_groups[g].layer_names
        for layer in layers:
            p_loc = producer_config.locate(layer)
            c_loc = consumer_config.locate(layer)
            p_tensor = producer_config.kv_cache_tensors[p_loc.tensor_index]
            c_tensor = consumer_config.kv_cache_tensors[c_loc.tensor_index]
            if producer_ids:
                # Strides are linear in the block id, so the largest id bounds every page (PLAN-1).
                _check_page_fits(producer_config, "producer", g, layer, max(producer_ids), page)
                _check_page_fits(consumer_config, "consumer", g, layer, max(consumer_ids), page)
            p_base = p_tensor.offset + p_loc.layer_index * p_tensor.layer_stride
            c_base = c_tensor.offset + c_loc.layer_index * c_tensor.layer_stride
            p_stride, c_stride = p_tensor.block_stride, c_tensor.block_stride
            p_region, c_region = p_loc.tensor_index, c_loc.tensor_index
            pages.extend(
                (p_region, p_base + p_id * p_stride, c_region, c_base + c_id * c_stride, page)
                for p_id, c_id in zip(producer_ids, consumer_ids, strict=True)
            )
        groups.append(GroupPlan(group_index=g, num_pairs=len(producer_ids), num_layers=len(layers), page_size=page))
    return pages, groups


def _check_no_overlap(pages: list[tuple[int, int, int, int, int]]) -> None:
    # Two copies landing on the same consumer bytes mean a duplicated consumer id: refuse.
    ordered = sorted((c_region, c_offset, nbytes) for _, _, c_region, c_offset, nbytes in pages)
    for (region_a, offset_a, nbytes_a), (region_b, offset_b, _) in itertools.pairwise(ordered):
        if region_a == region_b and offset_a + nbytes_a > offset_b:
            raise PlanError(f"consumer region {region_a}: copies overlap at byte {offset_b}")


def _merge(pages: list[tuple[int, int, int, int, int]]) -> list[PageCopy]:
    """Merge copies that continue each other on both sides into maximal runs."""
    pages.sort()
    runs: list[list[int]] = []
    for p_region, p_offset, c_region, c_offset, nbytes in pages:
        if runs:
            run = runs[-1]
            if (
                p_region == run[0]
                and c_region == run[2]
                and p_offset == run[1] + run[4]
                and c_offset == run[3] + run[4]
            ):
                run[4] += nbytes
                continue
        runs.append([p_region, p_offset, c_region, c_offset, nbytes])
    return [
        PageCopy(producer_region=pr, producer_offset=po, consumer_region=cr, consumer_offset=co, nbytes=n)
        for pr, po, cr, co, n in runs
    ]


def plan_transfer(
    *, producer_config: KVCacheConfig, consumer_config: KVCacheConfig, pairs: BlockPairsLike
) -> TransferPlan:
    """Turn aligned block pairs into the fewest copies that move exactly their pages (PLAN-1).

    One page per (layer of the group, pair); layers pair by name. Copies that
    are contiguous on both sides merge into one. Every block id is checked
    against ``num_blocks`` (the null block is refused, NULL-1) and every page
    against its tensor's size before a plan is returned, so nothing is posted
    from a plan that would leave the pools. Zero groups (full prefix hit) give
    an empty plan.
    """
    _check_groups(producer_config, consumer_config, pairs)
    pages, groups = _page_copies(producer_config, consumer_config, pairs)
    _check_no_overlap(pages)
    return TransferPlan(copies=_merge(pages), groups=groups)
