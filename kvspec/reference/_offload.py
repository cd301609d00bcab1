"""Offload's fast layer: OFF-5's hit, group by group instead of end by end; every other rule is kvspec.spec.offload's.

The definitions of OFF-1 ... OFF-9 live in :mod:`kvspec.spec.offload` and are
re-exported here for the modules that import them from the reference layer.
:func:`get_offload_hit_tokens` (``kvspec.fast``'s) shrinks the hit end group by
group (prefix runs, windows, state grids) rather than trying every end; it
takes the definition's signature, calls its checks, and is tested equal to it
(tests/test_offload.py, tests/test_fast_paths.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import kvspec.spec.offload as plain_offload
from kvspec.core._models import KVCacheConfig, MambaSpec
from kvspec.reference._reference import _Request, _twin_of
from kvspec.spec.offload import (
    BlockIdGroups,
    LoadSet,
    OffloadConfig,
    OffloadKey,
    StoreSet,
    _cdiv,
    _check_hit_inputs,
    _window,
    check_offload_support,
    get_chunk_sizes,
    get_load_set,
    get_offload_keys,
    get_retained_chunk_starts,
    get_store_set,
    get_sub_block_offset,
    map_sub_blocks,
)

__all__ = [
    "BlockIdGroups",
    "LoadSet",
    "OffloadConfig",
    "OffloadKey",
    "StoreSet",
    "check_offload_support",
    "get_chunk_sizes",
    "get_load_set",
    "get_offload_hit_tokens",
    "get_offload_keys",
    "get_retained_chunk_starts",
    "get_store_set",
    "get_sub_block_offset",
    "map_sub_blocks",
]


# --------------------------------------------------------------------------- OFF-5 hit


def _hit_order(config: KVCacheConfig) -> list[int]:
    # Full attention first (their prefix runs only shrink the hit), then windows, largest first, then state groups.
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    states = [g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec)]
    full = [g for g, spec in enumerate(specs) if _window(spec) is None and g not in states]
    windows = [g for g in range(config.num_groups) if g not in full and g not in states]
    windows.sort(key=lambda g: -(_window(specs[g]) or 0))
    return full + windows + states


def _first_hit_end(num_tokens: int, *, has_window: bool) -> int:
    # A window (or state) group must still hit after the last prompt token is recomputed for its logits.
    return num_tokens - 1 if has_window else num_tokens


def _full_hit_end(present: Sequence[bool], *, end: int, local: int, size: int) -> int:
    """The largest hit end <= end whose chunks from the local hit on are all present."""
    start, stop = local // size, min(_cdiv(end, size), len(present))
    try:
        absent = present.index(False, start, stop)
    except ValueError:
        absent = stop
    return min(end, absent * size)


def _state_hit_end(present: Sequence[bool], *, end: int, local: int, size: int) -> int:
    """The largest chunk end e <= end whose chunk e / C_g - 1 is present: the state after exactly e tokens (OFF-5)."""
    e = end - end % size
    while e - local >= size:
        if present[e // size - 1]:
            return e
        e -= size
    return local


def _window_hit_end(present: Sequence[bool], *, end: int, local: int, size: int, window: int) -> int:
    """The largest hit end e <= end whose chunks over [max(local, e - W + 1), e - 1] are all present.

    Candidates are ``end`` and the chunk boundaries below it: within one chunk
    the largest end needs the fewest chunks. Returns ``local`` when no end at
    least one chunk past the local hit qualifies.
    """
    e = end
    while e - local >= size:
        first_token = max(local, e - window + 1)
        if first_token >= e:  # W = 1: the next token reads no cached KV
            return e
        first, stop = first_token // size, _cdiv(e, size)
        needed = list(present[first:stop])
        if False not in needed:
            return e
        last_absent = first + len(needed) - 1 - needed[::-1].index(False)
        e = last_absent * size  # the next end whose chunks stop before the absent one
    return local


@_twin_of(plain_offload.get_offload_hit_tokens, positional=2)
def get_offload_hit_tokens(config: KVCacheConfig, present: Sequence[Sequence[bool]], request: _Request) -> int:
    """The fast twin of :func:`kvspec.spec.get_offload_hit_tokens`: the same hit, sooner (OFF-5).

    The definition's checks (:mod:`kvspec.spec.offload`), then the hit end
    ``M`` from ``N``, or ``N - 1`` when a window or state group exists, and
    ``M <= len(present[g]) * C_g``. Full attention groups, then window
    groups by window size, shrink ``M`` to the largest end their present
    chunks support: a prefix run from the local hit, or a window whose chunks
    cover ``[max(C, M - W + 1), M - 1]``; the groups are checked again until
    ``M`` holds still. A state group supports only ends on its chunk grid
    whose chunk is present. The hit is 0 when any group could load less than
    one chunk (OFF-5).
    """
    n: int = request["num_tokens"]
    local: int = request["local_hit_tokens"]
    chunk_sizes = _check_hit_inputs(config, present, n, local, request["offload"])
    order = _hit_order(config)
    windows = [_window(group.kv_cache_spec) for group in config.kv_cache_groups]
    states = [isinstance(group.kv_cache_spec, MambaSpec) for group in config.kv_cache_groups]
    end = _first_hit_end(n, has_window=any(w is not None for w in windows) or any(states))
    end = min([end, *(len(p) * size for p, size in zip(present, chunk_sizes, strict=True))])
    while True:
        before = end
        for g in order:
            size, window = chunk_sizes[g], windows[g]
            if end - local < size:
                return 0
            if states[g]:
                end = _state_hit_end(present[g], end=end, local=local, size=size)
            elif window is None:
                end = _full_hit_end(present[g], end=end, local=local, size=size)
            else:
                end = _window_hit_end(present[g], end=end, local=local, size=size, window=window)
            if end - local < size:
                return 0
        if end == before:
            return end - local
