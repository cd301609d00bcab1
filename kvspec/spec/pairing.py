"""Pairing producer and consumer ids: ALIGN-1 (tail alignment) and NULL-1 (no null block moves)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from kvspec.core._errors import BlockAlignmentError, GroupCountError
from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig
from kvspec.spec.coverage import BlockLists, TransferRequest, check_window_coverage, get_logical_block_count
from kvspec.spec.state import get_state_paired_lists
from kvspec.spec.window import BlockIdsLike

__all__ = [
    "BlockPairs",
    "check_tail_alignment",
    "compute_block_pairs",
    "compute_transfer_pairs",
    "get_paired_block_ends",
]


def _to_block_ids(value: BlockIdsLike) -> BlockIds:
    return value if isinstance(value, BlockIds) else BlockIds(value)


def _check_pairs(inst: BlockPairs, attribute: attrs.Attribute[Any], value: BlockIds) -> None:
    producer = inst.producer_block_ids
    # Pair i of group g is (producer[g][i], consumer[g][i]): both sides list the same groups (ALIGN-1).
    if len(producer) != len(value):
        raise GroupCountError(f"BlockPairs: {len(producer)} producer groups, {len(value)} consumer groups (ALIGN-1)")
    for g, (p, c) in enumerate(zip(producer, value, strict=True)):
        # Every pair has both ends (ALIGN-1).
        if len(p) != len(c):
            raise BlockAlignmentError(f"BlockPairs: group {g} pairs {len(p)} producer with {len(c)} consumer ids")
        # Block id 0 never reaches a transfer descriptor (NULL-1).
        if NULL_BLOCK_ID in p or NULL_BLOCK_ID in c:
            raise BlockAlignmentError(f"BlockPairs: group {g} holds the null block id 0 (NULL-1)")


@attrs.frozen(kw_only=True)
class BlockPairs:
    """Per-group producer and consumer ids, equal lengths, pair i is (producer[g][i], consumer[g][i]).

    No id is the null block (NULL-1). Zero groups mean nothing to transfer.
    """

    producer_block_ids: BlockIds = attrs.field(converter=_to_block_ids)
    consumer_block_ids: BlockIds = attrs.field(converter=_to_block_ids, validator=_check_pairs)

    @property
    def num_groups(self) -> int:
        """Groups, or 0 when nothing is transferred."""
        return len(self.consumer_block_ids)

    @property
    def num_pairs(self) -> int:
        """Pairs over all groups: the blocks that move."""
        return self.consumer_block_ids.num_blocks

    def iter_pairs(self) -> Iterator[tuple[int, int, int]]:
        """``(group_index, producer_id, consumer_id)`` for every pair, group by group."""
        for g, (p, c) in enumerate(zip(self.producer_block_ids, self.consumer_block_ids, strict=True)):
            for producer_id, consumer_id in zip(p, c, strict=True):
                yield g, producer_id, consumer_id


def check_tail_alignment(lists: BlockLists) -> None:
    """Raise unless C's lists pair with P's by tail: same groups, never longer, ending at the same block (ALIGN-1)."""
    producer, consumer = lists.producer_block_ids, lists.consumer_block_ids
    # Group g pairs with group g: both sides list every group (ALIGN-1).
    if len(producer) != len(consumer):
        raise GroupCountError(f"producer has {len(producer)} groups, consumer {len(consumer)} (ALIGN-1)")
    p_ends, c_ends = lists.producer_block_ends, lists.consumer_block_ends
    for g, (p, c) in enumerate(zip(producer, consumer, strict=True)):
        # C's list is its uncached suffix of P's: it can never be longer (ALIGN-1).
        if len(c) > len(p):
            raise BlockAlignmentError(
                f"group {g}: consumer holds {len(c)} blocks, producer offers {len(p)}; "
                "the consumer may hold at most as many (ALIGN-1)"
            )
        # Tail alignment pairs by position only if both lists end at the same logical block (ALIGN-1).
        if p_ends is not None and c_ends is not None and p_ends[g] != c_ends[g]:
            raise BlockAlignmentError(
                f"group {g}: the producer's list ends at logical block {p_ends[g] - 1}, the consumer's at "
                f"{c_ends[g] - 1}; both must end at the same block (ALIGN-1)"
            )


def compute_block_pairs(lists: BlockLists) -> BlockPairs:
    """Pair C's i-th id with P's id at ``len(P[g]) - len(C[g]) + i``; drop null pairs (ALIGN-1, NULL-1).

    Where both sides say where their lists end, each group's lists must end at
    the same logical block. A side that does not say (``None``, a 1.0 peer) is
    taken to end where the other ends (ALIGN-1, NULL-1).
    """
    producer, consumer = lists.producer_block_ids, lists.consumer_block_ids
    if len(consumer) == 0:
        return BlockPairs(producer_block_ids=[], consumer_block_ids=[])  # full prefix hit (ALIGN-1)
    check_tail_alignment(lists)
    pairs_p: list[list[int]] = []
    pairs_c: list[list[int]] = []
    for g, (p, c) in enumerate(zip(producer, consumer, strict=True)):
        offset = len(p) - len(c)  # tail alignment: never front-trim (ALIGN-1)
        pairs_p.append([])
        pairs_c.append([])
        for i, consumer_id in enumerate(c):
            producer_id = p[offset + i]
            if producer_id != NULL_BLOCK_ID and consumer_id != NULL_BLOCK_ID:  # a null side drops the pair (NULL-1)
                pairs_p[g].append(producer_id)
                pairs_c[g].append(consumer_id)
    return BlockPairs(producer_block_ids=pairs_p, consumer_block_ids=pairs_c)


def get_paired_block_ends(config: KVCacheConfig, request: TransferRequest) -> BlockLists:
    """The lists with the ends both pair at: where one side alone declares its ends, the other's are its last blocks.

    A side that declares no end sits at the request's last block
    (``cdiv(T + R, B_g)``), as WIN-1 placed it; pairing it by tail against a
    list that ends elsewhere would pair different positions (ALIGN-1).
    """
    p_ends, c_ends = request.producer_block_ends, request.consumer_block_ends
    if (p_ends is None) != (c_ends is None):
        lasts = tuple(
            get_logical_block_count(group.kv_cache_spec, num_tokens=request.listed_tokens)
            for group in config.kv_cache_groups
        )
        p_ends, c_ends = (lasts if p_ends is None else p_ends), (lasts if c_ends is None else c_ends)
    return BlockLists(
        producer_block_ids=request.producer_block_ids,
        consumer_block_ids=request.consumer_block_ids,
        producer_block_ends=p_ends,
        consumer_block_ends=c_ends,
    )


def compute_transfer_pairs(config: KVCacheConfig, request: TransferRequest) -> BlockPairs:
    """Check WIN-1 before any byte moves, then pair the lists (WIN-1, ALIGN-1, NULL-1, STATE-3, STATE-4).

    State groups are not checked by WIN-1: each pairs its one slot by
    :func:`kvspec.spec.state.pair_state_slots` (STATE-3), after the prefix hit
    is checked against their state boundaries (STATE-4).

    ``recomputed_tokens`` and the block ends are as in
    :func:`check_window_coverage`; where only one side declares its ends, the
    other's are the request's last blocks, so a declared end elsewhere is
    refused (WIN-1, ALIGN-1, NULL-1).
    """
    check_window_coverage(config, request)
    if len(request.consumer_block_ids) == 0:
        return BlockPairs(producer_block_ids=[], consumer_block_ids=[])  # full prefix hit (ALIGN-1)
    # Each state group pairs its one slot by STATE-3; the other groups pair by tail (ALIGN-1).
    return compute_block_pairs(get_state_paired_lists(config, get_paired_block_ends(config, request)))
