"""Window budgets, clipping and the token basis: SW-1, CLIP-1, TOK-1."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeAlias

import attrs

from kvspec.core._errors import ConfigError, GroupCountError
from kvspec.core._models import BlockIds, ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from kvspec.spec.admission import is_full_attention_spec

__all__ = [
    "BlockIdsLike",
    "TokenBasis",
    "get_block_budget",
    "get_blocks_per_sw",
    "get_chunk_budget",
    "get_exchange_clipped_blocks",
    "get_token_basis_group",
]

BlockIdsLike: TypeAlias = "BlockIds | Sequence[Sequence[int]]"
"""A :class:`BlockIds` or plain nested sequences such as vLLM's ``tuple[list[int], ...]``."""


def get_chunk_budget(spec: ChunkedLocalAttentionSpec) -> int:
    """The blocks one attention chunk of C tokens can touch, plus one: ``(C + B - gcd(C, B) - 1) // B + 2`` (SW-1).

    A chunk starts at a multiple of C, so its offset inside a block is a
    multiple of ``g = gcd(C, B)``, at most ``B - g``; from there its C tokens
    touch ``(C + B - g - 1) // B + 1`` blocks (``C / B`` when B divides C).
    The one more block is for the recomputed tokens (WIN-1 clause 2): P clips
    the list it built for ``T + R`` tokens, while C's chunk is T's, which can
    start up to R tokens earlier; with ``R <= 2`` the tail kept still reaches
    T's chunk boundary (SW-1, CACHE-1).
    """
    g = math.gcd(spec.attention_chunk_size, spec.block_size)
    return (spec.attention_chunk_size + spec.block_size - g - 1) // spec.block_size + 2


def get_block_budget(spec: KVCacheSpec) -> int:
    """One group's budget: ``cdiv(W, B) + 1`` for a sliding window, a chunk's blocks for chunked local, else 0 (SW-1).

    Chunked local attention keeps the blocks of the chunk the next token is in:
    its budget is :func:`get_chunk_budget` (SW-1, CACHE-1).
    """
    if isinstance(spec, SlidingWindowSpec):
        # +1: a window that does not start on a block boundary touches one more block (SW-1).
        return -(-spec.sliding_window // spec.block_size) + 1
    if isinstance(spec, ChunkedLocalAttentionSpec):
        # A chunk boundary, not a window: the chunk starts on a multiple of C (SW-1, CACHE-1).
        return get_chunk_budget(spec)
    return 0


def get_blocks_per_sw(config: KVCacheConfig) -> tuple[int, ...]:
    """Per-group budget: ``cdiv(W_g, B_g) + 1`` for sliding-window groups, 0 otherwise (SW-1)."""
    return tuple(get_block_budget(group.kv_cache_spec) for group in config.kv_cache_groups)


def check_count(name: str, value: object) -> int:
    """``value`` if it is a non-negative int (not a bool), else a :class:`ConfigError` naming ``name``."""
    # Counts, budgets and block ends index lists; a negative or non-int one would index from the end.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name}: expected a non-negative int, got {value!r}")
    return value


def _check_id(g: int, position: int, block_id: object) -> int:
    # A block id is a non-negative int and never a bool; the message names its place in the list given.
    if not isinstance(block_id, int) or isinstance(block_id, bool) or block_id < 0:
        raise ConfigError(f"BlockIds.groups[{g}][{position}]: expected a non-negative int block id, got {block_id!r}")
    return int(block_id)


def get_exchange_clipped_blocks(block_ids: BlockIdsLike, budgets: Sequence[int]) -> BlockIds:
    """Keep each budgeted group's last ``n`` ids; others unchanged; zero groups stay zero (CLIP-1).

    Only the ids kept are checked: the ids clipped away never leave the engine
    (decision 29 in decisions-rules.md) (CLIP-1).
    """
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Iterable):
        raise ConfigError(
            f"BlockIds.groups: expected a sequence of per-group sequences of block ids, got {block_ids!r}"
        )
    groups = list(block_ids)
    if not groups:
        return BlockIds([])  # full prefix hit: nothing to exchange (CLIP-1)
    # One budget per group, or the clip would keep the wrong tail (CLIP-1).
    if len(groups) != len(budgets):
        raise GroupCountError(f"block ids have {len(groups)} groups, budgets have {len(budgets)} (CLIP-1)")
    for g, n in enumerate(budgets):
        check_count(f"budgets[{g}]", n)
    kept: list[tuple[int, ...]] = []
    for g, (group, n) in enumerate(zip(groups, budgets, strict=True)):
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise ConfigError(f"BlockIds.groups[{g}]: expected a sequence of block ids, got {group!r}")
        ids = list(group)
        # n > 0 guards Python's ids[-0:], which is the whole list (CLIP-1).
        first = max(0, len(ids) - n) if n > 0 else 0
        kept.append(tuple(_check_id(g, first + i, block_id) for i, block_id in enumerate(ids[first:])))
    return BlockIds(kept)


@attrs.frozen(kw_only=True)
class TokenBasis:
    """The group token counts are checked against, and its block size (TOK-1)."""

    group_index: int
    block_size: int


def get_token_basis_group(config: KVCacheConfig) -> TokenBasis | None:
    """The first full-attention (incl. MLA) group and its block size, or None (TOK-1)."""
    for index, group in enumerate(config.kv_cache_groups):
        if is_full_attention_spec(group.kv_cache_spec):
            return TokenBasis(group_index=index, block_size=group.kv_cache_spec.block_size)
    return None
