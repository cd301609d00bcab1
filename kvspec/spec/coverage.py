"""Which positions the consumer needs, and that both lists hold them: WIN-1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs

from kvspec.core._deprecation import keyword_only
from kvspec.core._errors import BlockAlignmentError, ConfigError, GroupCountError, WindowCoverageError
from kvspec.core._models import (
    NULL_BLOCK_ID,
    BlockIds,
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvspec.spec.state import check_state_prefix_hit, is_state_spec
from kvspec.spec.window import BlockIdsLike, check_count

__all__ = [
    "BlockLists",
    "SideCheck",
    "TransferRequest",
    "check_window_coverage",
    "get_block_ends",
    "get_checked_block_ends",
    "get_logical_block_count",
    "get_needed_block_range",
    "get_needed_token_range",
    "get_num_skipped_tokens",
    "get_pruned_block_ids",
    "get_side_checks",
]


@keyword_only(1, "num_tokens")  # num_tokens by position: deprecated, removed in 0.3.0
def get_logical_block_count(spec: KVCacheSpec, *, num_tokens: int) -> int:
    """Blocks that ``num_tokens`` tokens span in a group: ``cdiv(T, B_g)`` (WIN-1)."""
    return -(-check_count("num_tokens", num_tokens) // spec.block_size)


def get_needed_token_range(spec: KVCacheSpec, *, num_tokens: int, prefix_hit_tokens: int) -> range:
    """Positions C needs from P: ``[H, T-1]``, from ``max(H, T-W+1)`` for a window, ``max(H, C*(T//C))`` for a chunk.

    (WIN-1)
    """
    start = prefix_hit_tokens
    if isinstance(spec, SlidingWindowSpec):
        # The token at position T attends [T-W+1, T]; T itself is computed by C (WIN-1).
        start = max(start, num_tokens - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        # The token at T attends its own chunk only, from its chunk boundary C*(T//C) (WIN-1, CACHE-1).
        chunk = spec.attention_chunk_size
        start = max(start, (num_tokens // chunk) * chunk)
    return range(start, max(start, num_tokens))


def get_needed_block_range(spec: KVCacheSpec, *, num_tokens: int, prefix_hit_tokens: int) -> range:
    """Logical blocks that cover a needed position (WIN-1)."""
    tokens = get_needed_token_range(spec, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens)
    if not tokens:
        return range(0)
    return range(tokens.start // spec.block_size, (tokens.stop - 1) // spec.block_size + 1)


@keyword_only(1, "num_computed_tokens")  # by position: deprecated, removed in 0.3.0
def get_num_skipped_tokens(spec: KVCacheSpec, *, num_computed_tokens: int) -> int:
    """Leading tokens a group no longer needs, as vLLM's ``get_num_skipped_tokens`` counts them (WIN-1)."""
    n = check_count("num_computed_tokens", num_computed_tokens)
    if isinstance(spec, SlidingWindowSpec):
        return max(0, n - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return (n // spec.attention_chunk_size) * spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        return max(0, n - 1)
    return 0


def get_pruned_block_ids(config: KVCacheConfig, block_ids: BlockIdsLike, *, num_computed_tokens: int) -> BlockIds:
    """Null the whole blocks a group skips, as vLLM's ``remove_skipped_blocks`` does (WIN-1).

    Per group, ``k = min(skipped // B_g, len)`` leading blocks are candidates;
    walking back from ``k - 1``, each becomes id 0 until the first id that is
    already null (docs/spec/alignment-and-coverage.md, WIN-1 Boundaries) (WIN-1).
    """
    ids = block_ids if isinstance(block_ids, BlockIds) else BlockIds(block_ids)
    # One list per group, or a group would be pruned by another group's window (WIN-1).
    if len(ids) != config.num_groups:
        raise GroupCountError(f"block ids have {len(ids)} groups, the config {config.num_groups} (WIN-1)")
    pruned: list[list[int]] = []
    for group, group_spec in zip(ids, config.kv_cache_groups, strict=True):
        spec = group_spec.kv_cache_spec
        blocks = list(group)
        skipped = get_num_skipped_tokens(spec, num_computed_tokens=num_computed_tokens)
        k = min(skipped // spec.block_size, len(blocks))
        for i in range(k - 1, -1, -1):
            if blocks[i] == NULL_BLOCK_ID:
                break  # blocks before a null were nulled by an earlier step
            blocks[i] = NULL_BLOCK_ID
        pruned.append(blocks)
    return BlockIds(pruned)


def get_block_ends(block_ids: BlockIdsLike, *, first_blocks: Sequence[int] | None = None) -> tuple[int, ...]:
    """Where each group's list ends: the logical block just past its last entry (ALIGN-1, WIN-1).

    ``first_blocks[g]`` is the logical block of group ``g``'s first entry;
    a whole block table starts at logical block 0, so its ends are its
    lengths (ALIGN-1, WIN-1).
    """
    ids = block_ids if isinstance(block_ids, BlockIds) else BlockIds(block_ids)
    firsts = [0] * len(ids) if first_blocks is None else list(first_blocks)
    if len(firsts) != len(ids):
        raise GroupCountError(f"block ids have {len(ids)} groups, first_blocks {len(firsts)} (ALIGN-1)")
    return tuple(
        check_count(f"first_blocks[{g}]", first) + len(group)
        for g, (first, group) in enumerate(zip(firsts, ids, strict=True))
    )


def get_checked_block_ends(role: str, ends: Sequence[int] | None, ids: BlockIds) -> tuple[int, ...] | None:
    """The ends a side declared for its lists, checked; None (a 1.0 peer, no ends) passes through (ALIGN-1)."""
    if ends is None:
        return None
    checked = tuple(check_count(f"{role}_block_ends[{g}]", end) for g, end in enumerate(ends))
    # One end per group, or a group's list would be placed by another's end (ALIGN-1).
    if len(checked) != len(ids):
        raise GroupCountError(f"{role} block ids have {len(ids)} groups, its block ends {len(checked)} (ALIGN-1)")
    for g, (end, group) in enumerate(zip(checked, ids, strict=True)):
        # A list of n ids ending at logical block `end` starts at end - n, which may not be negative (ALIGN-1).
        if len(group) > end:
            raise BlockAlignmentError(
                f"group {g}: the {role}'s list holds {len(group)} blocks but says it ends at logical block "
                f"{end - 1}, before its own length (ALIGN-1)"
            )
    return checked


def _check_hit(num_tokens: int, prefix_hit_tokens: int) -> None:
    t = check_count("num_tokens", num_tokens)
    h = check_count("prefix_hit_tokens", prefix_hit_tokens)
    # C cannot hit more tokens than the request has (WIN-1).
    if h > t:
        raise ConfigError(f"prefix_hit_tokens: expected at most num_tokens={t}, got {h}")


def _check_hit_blocks(config: KVCacheConfig, prefix_hit_tokens: int) -> None:
    for g, group in enumerate(config.kv_cache_groups):
        if is_state_spec(group.kv_cache_spec):
            continue  # a state group's hit is a state boundary, checked below (STATE-4)
        # C's list is tail-aligned and starts on a block boundary, so H must be whole blocks (WIN-1).
        if prefix_hit_tokens % group.kv_cache_spec.block_size:
            raise BlockAlignmentError(
                f"prefix_hit_tokens={prefix_hit_tokens} is not a multiple of group {g}'s block size "
                f"{group.kv_cache_spec.block_size} (WIN-1)"
            )
    check_state_prefix_hit(config, prefix_hit_tokens=prefix_hit_tokens)


def _check_counts(config: KVCacheConfig, num_tokens: int, prefix_hit_tokens: int, recomputed_tokens: int) -> int:
    """The tokens both lists cover, ``T + R``, once T, H and R are checked (WIN-1)."""
    _check_hit(num_tokens, prefix_hit_tokens)
    _check_hit_blocks(config, prefix_hit_tokens)
    return num_tokens + check_count("recomputed_tokens", recomputed_tokens)


def _to_block_ids(value: BlockIdsLike) -> BlockIds:
    return value if isinstance(value, BlockIds) else BlockIds(value)


def _to_ends(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _check_ends(inst: BlockLists, attribute: attrs.Attribute[Any], value: tuple[int, ...] | None) -> None:
    # Each side's ends place its own list: one per group, none before the list's start (ALIGN-1).
    get_checked_block_ends("producer", inst.producer_block_ends, inst.producer_block_ids)
    get_checked_block_ends("consumer", value, inst.consumer_block_ids)


@attrs.frozen(kw_only=True)
class BlockLists:
    """Both sides' clipped lists and, per group, where each says it ends; ``None``: a 1.0 peer's (ALIGN-1).

    Checked once, at construction, by :func:`get_checked_block_ends`: one
    end per group of its list, none before its list's length. A side of
    protocol 1.0 declares no ends (ALIGN-1).
    """

    producer_block_ids: BlockIds = attrs.field(converter=_to_block_ids)
    consumer_block_ids: BlockIds = attrs.field(converter=_to_block_ids)
    producer_block_ends: tuple[int, ...] | None = attrs.field(default=None, converter=_to_ends)
    consumer_block_ends: tuple[int, ...] | None = attrs.field(default=None, converter=_to_ends, validator=_check_ends)


def _check_request(inst: TransferRequest, attribute: attrs.Attribute[Any], value: int) -> None:
    # Counts are non-negative and C cannot hit more tokens than the request has, whatever the config (WIN-1).
    _check_hit(inst.num_tokens, inst.prefix_hit_tokens)
    check_count("recomputed_tokens", value)


@attrs.frozen(kw_only=True)
class TransferRequest(BlockLists):
    """One request's geometry: T, H, R and both lists with their ends, checked once at construction (WIN-1).

    C takes the KV of ``num_tokens`` (T) tokens, holds the first
    ``prefix_hit_tokens`` (H <= T) itself, and recomputes the
    ``recomputed_tokens`` (R) after them; both lists cover ``T + R`` tokens.
    The defaults are a protocol 1.0 peer's: no ends, nothing recomputed.
    What depends on the config (group counts, block boundaries) the rules
    check (WIN-1).
    """

    num_tokens: int
    prefix_hit_tokens: int
    recomputed_tokens: int = attrs.field(default=0, validator=_check_request)

    @property
    def listed_tokens(self) -> int:
        """The tokens both lists cover, ``T + R`` (WIN-1)."""
        return self.num_tokens + self.recomputed_tokens


class SideCheck(NamedTuple):
    """One side's list of one group as WIN-1 checks it: ending at block ``end - 1``, from ``floor`` on (WIN-1).

    ``listed`` is the tokens the lists cover, ``T + R``.
    """

    role: str
    ids: BlockIds
    group: int
    spec: KVCacheSpec
    needed: range
    end: int
    floor: int
    listed: int


def get_side_checks(config: KVCacheConfig, request: TransferRequest) -> list[SideCheck]:
    """What WIN-1 checks of each side of each attention group, once the request fits the config (WIN-1).

    Zero consumer groups (full prefix hit) pass only when nothing is needed,
    and then ask nothing more; a state group asks nothing of this rule (WIN-1).
    """
    num_tokens, prefix_hit_tokens, listed = request.num_tokens, request.prefix_hit_tokens, request.listed_tokens
    _check_hit_blocks(config, prefix_hit_tokens)
    producer, consumer = request.producer_block_ids, request.consumer_block_ids
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    needed = [get_needed_block_range(s, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens) for s in specs]
    if len(consumer) == 0:
        # Zero groups is the full-prefix-hit signal: valid only when C needs nothing (WIN-1).
        missing = [f"group {g} blocks {r.start}..{r.stop - 1}" for g, r in enumerate(needed) if r]
        if missing:
            raise WindowCoverageError(f"consumer offers zero groups but needs {'; '.join(missing)} (WIN-1)")
        return []
    if len(producer) == 0 and not any(needed):
        producer = BlockIds([()] * len(specs))  # P offered nothing and nothing is needed
    for role, ids in (("producer", producer), ("consumer", consumer)):
        # One list per group, or a group would be checked against another's window (WIN-1).
        if len(ids) != len(specs):
            raise GroupCountError(f"{role} block ids have {len(ids)} groups, the config {len(specs)} (WIN-1)")
    # Counted again: a producer of zero groups stands for one empty list per group here (WIN-1).
    p_ends = get_checked_block_ends("producer", request.producer_block_ends, producer)
    c_ends = request.consumer_block_ends
    checks = []
    for g, spec in enumerate(specs):
        if is_state_spec(spec):
            continue  # one state slot, no token positions: STATE-2 and STATE-3 check it, not WIN-1
        total = get_logical_block_count(spec, num_tokens=listed)
        p_end = total if p_ends is None else p_ends[g]
        c_end = total if c_ends is None else c_ends[g]
        hit_blocks = prefix_hit_tokens // spec.block_size
        checks.append(SideCheck("producer", producer, g, spec, needed[g], p_end, 0, listed))
        checks.append(SideCheck("consumer", consumer, g, spec, needed[g], c_end, hit_blocks, listed))
    return checks


def check_window_coverage(config: KVCacheConfig, request: TransferRequest) -> None:
    """Raise unless every block covering a needed position is real on both sides (WIN-1).

    The lists cover ``T + R`` tokens: T whose KV C takes, then R
    (``recomputed_tokens``) that C recomputes. Each group's list ends at
    logical block ``end - 1``: the end the side declared, or
    ``cdiv(T + R, B_g)``. It may not end past that block, nor start before
    logical block 0 (P) or ``H / B_g`` (C). Zero consumer groups (full prefix
    hit) pass only when nothing is needed (WIN-1).
    """
    for side in get_side_checks(config, request):
        _check_side(side)


def _check_side(side: SideCheck) -> None:
    """One side's list of one group, ending at logical block ``end - 1``, against the blocks it may hold (WIN-1)."""
    role, blocks, g, spec, needed = side.role, side.ids[side.group], side.group, side.spec, side.needed
    end, listed = side.end, side.listed
    total = get_logical_block_count(spec, num_tokens=listed)
    # A list that reaches past the request's last block was built for more tokens, or shifted (WIN-1).
    if end > total:
        raise BlockAlignmentError(
            f"group {g}: the {role}'s list ends at logical block {end - 1}, past the request's last block "
            f"{total - 1} ({listed} tokens listed) (WIN-1)"
        )
    # A list may not start before block 0 (P) or before C's prefix hit (C) (WIN-1).
    if len(blocks) > end - side.floor:
        raise BlockAlignmentError(
            f"group {g}: {role} lists {len(blocks)} blocks, but {listed} tokens leave at most {end - side.floor} "
            "(WIN-1)"
        )
    first = end - len(blocks)  # the logical block of the list's first entry
    for k in needed:
        block_id = blocks[k - first] if first <= k < end else None
        # Every block holding a needed position is real, or C would read KV that never arrived (WIN-1).
        if block_id is None or block_id == NULL_BLOCK_ID:
            found = "no block" if block_id is None else "the null block"
            span = f"tokens [{k * spec.block_size}, {(k + 1) * spec.block_size - 1}]"
            raise WindowCoverageError(
                f"group {g} ({spec.kind.value}): logical block {k} ({span}) is needed by the consumer but the "
                f"{role} has {found} there; needed blocks {needed.start}..{needed.stop - 1} (WIN-1)"
            )
