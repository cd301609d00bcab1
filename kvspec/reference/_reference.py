"""The fast layer over kvspec.spec: the definitions' twins that an engine calls per request, and the re-exports.

Each twin takes its definition's signature (declared, or by :func:`_twin_of`), calls the
definition's own checks (:mod:`kvspec.spec`), and hands any call it cannot
answer faster, or any input it would refuse, to the definition, which says
which rule and why: only what is faster lives here. What is faster:

- whole-list id checks (``BlockIds``' bulk check) instead of one id at a time;
- clipping engine lists before checking them (only the ids kept are checked);
- null scans skipped for groups proven null-free (NULL-1): a proof this layer
  records for the lists it checks or derives (:func:`_proven`), never kept in
  the models, and pairs built from proven lists without re-scanning them.

Each twin is tested equal to its definition, result for result and error
class for error class (tests/test_fast_paths.py).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeAlias, TypeVar

import kvspec.spec as plain
from kvspec.core._deprecation import warn_renamed
from kvspec.core._enums import TransferMode
from kvspec.core._models import (
    NULL_BLOCK_ID,
    BlockIds,
    KVCacheConfig,
    _checked_group,
    _to_block_groups,
)
from kvspec.spec.admission import check_hybrid_support, is_full_attention_spec, is_hma_required
from kvspec.spec.coverage import (
    BlockLists,
    SideCheck,
    TransferRequest,
    _check_counts,
    get_block_ends,
    get_logical_block_count,
    get_needed_block_range,
    get_needed_token_range,
    get_num_skipped_tokens,
    get_side_checks,
)
from kvspec.spec.coverage import _check_side as _spec_check_side
from kvspec.spec.pairing import BlockPairs, check_tail_alignment, get_paired_block_ends
from kvspec.spec.state import get_state_paired_lists, is_state_spec
from kvspec.spec.window import (
    BlockIdsLike,
    TokenBasis,
    get_block_budget,
    get_blocks_per_sw,
    get_token_basis_group,
)

__all__ = [
    "BlockIdsLike",
    "BlockPairs",
    "TokenBasis",
    "check_hybrid_support",
    "check_request_blocks",
    "check_window_coverage",
    "compute_block_pairs",
    "compute_transfer_pairs",
    "get_block_ends",
    "get_blocks_per_sw",
    "get_consumer_block_counts",
    "get_exchange_clipped_blocks",
    "get_logical_block_count",
    "get_needed_block_range",
    "get_needed_token_range",
    "get_num_skipped_tokens",
    "get_pruned_block_ids",
    "get_token_basis_group",
    "is_full_attention_spec",
    "is_hma_required",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Request: TypeAlias = "dict[str, Any]"
"""A twin's keyword arguments, as its definition's signature names them, defaults filled in."""


def _twin_of(definition: Callable[_P, _R], *, positional: int = 1) -> Callable[[Callable[..., _R]], Callable[_P, _R]]:
    """The fast twin of ``definition``: its signature and name, the fast function's body and docstring.

    The fast function gets the ``positional`` arguments, then one dict of every
    keyword the definition takes, its defaults filled in. A call of any other
    shape (a keyword missing or unknown, an argument by the wrong kind) goes to
    the definition, which answers it or raises its ``TypeError``: the
    signature lives once, in :mod:`kvspec.spec`.
    """
    signature = inspect.signature(definition)
    keywords = list(signature.parameters.values())[positional:]
    defaults = {p.name: p.default for p in keywords if p.default is not inspect.Parameter.empty}
    names = frozenset(p.name for p in keywords)
    required = names - defaults.keys()

    def decorate(fast: Callable[..., _R]) -> Callable[_P, _R]:
        @functools.wraps(fast)
        def twin(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if len(args) != positional or not required <= kwargs.keys() <= names:
                return definition(*args, **kwargs)
            return fast(*args, {**defaults, **kwargs})

        twin.__name__ = twin.__qualname__ = definition.__name__
        setattr(twin, "__signature__", signature)  # noqa: B010 (a function type has no such attribute to mypy)
        return twin

    return decorate


# --------------------------------------------------------------------------- NULL-1 proofs, kept out of the models

# id(BlockIds) -> (a weak reference to it, per group: proven to hold no null block). An entry leaves with its list.
_NULL_FREE: dict[int, tuple[weakref.ReferenceType[BlockIds], tuple[bool, ...]]] = {}


def _proven(ids: BlockIds, null_free: Iterable[bool]) -> BlockIds:
    """``ids``, with which of its groups hold no null block recorded for this layer's later checks (NULL-1)."""
    key = id(ids)
    _NULL_FREE[key] = (weakref.ref(ids, lambda _: _NULL_FREE.pop(key, None)), tuple(null_free))
    return ids


def _null_free(ids: BlockIds) -> tuple[bool, ...]:
    """Per group, whether ``ids`` is proven free of the null block; a list this layer never saw proves nothing."""
    known = _NULL_FREE.get(id(ids))
    if known is not None and known[0]() is ids:
        return known[1]
    return (False,) * len(ids)


def _to_block_ids(value: BlockIdsLike) -> BlockIds:
    """``value`` as a ``BlockIds``: plain lists checked once (the model's bulk check), their null-free groups noted."""
    if isinstance(value, BlockIds):
        return value
    groups, lows = _to_block_groups(value)
    return _proven(BlockIds._from_trusted(groups), (low is None or low > NULL_BLOCK_ID for low in lows))


def _trusted_pairs(producer: Sequence[tuple[int, ...]], consumer: Sequence[tuple[int, ...]]) -> BlockPairs:
    """Pairs equal in length and free of the null block by construction, built without re-scanning them (NULL-1)."""
    pairs = object.__new__(BlockPairs)
    null_free = (True,) * len(consumer)
    # BlockPairs is frozen; its validator would scan every pair again for what the pairing just proved.
    object.__setattr__(pairs, "producer_block_ids", _proven(BlockIds._from_trusted(producer), null_free))
    object.__setattr__(pairs, "consumer_block_ids", _proven(BlockIds._from_trusted(consumer), null_free))
    return pairs


# --------------------------------------------------------------------------- CLIP-1 on engine lists


def get_exchange_clipped_blocks(block_ids: BlockIdsLike, budgets: Sequence[int]) -> BlockIds:
    """Keep each budgeted group's last ``n`` ids; others unchanged; zero groups stay zero (CLIP-1).

    Plain lists (vLLM's ``tuple[list[int], ...]``) are clipped first and only
    the ids kept are checked: the ids clipped away never leave the engine
    (CLIP-1). O(kept ids); lists or budgets it cannot take are the plain
    definition's, :func:`kvspec.spec.get_exchange_clipped_blocks` (CLIP-1).
    """
    if (
        isinstance(block_ids, (str, bytes))
        or not isinstance(block_ids, Sequence)
        or (len(block_ids) and len(block_ids) != len(budgets))
        or not all(type(n) is int and n >= 0 for n in budgets)
    ):
        return plain.get_exchange_clipped_blocks(block_ids, budgets)  # it names what is wrong (CLIP-1)
    if len(block_ids) == 0:
        return block_ids if isinstance(block_ids, BlockIds) else BlockIds([])  # full prefix hit (CLIP-1)
    if isinstance(block_ids, BlockIds):
        if not any(budgets):
            return block_ids
        # n > 0 guards Python's ids[-0:], which is the whole list (CLIP-1).
        kept = (group[-n:] if n > 0 else group for group, n in zip(block_ids, budgets, strict=True))
        return _proven(BlockIds._from_trusted(kept), _null_free(block_ids))
    groups: list[tuple[int, ...]] = []
    null_free: list[bool] = []
    for g, (group, n) in enumerate(zip(block_ids, budgets, strict=True)):
        kept_ids, first = group, 0
        if n > 0 and isinstance(group, Iterable) and not isinstance(group, (str, bytes)):
            whole = group if isinstance(group, Sequence) else tuple(group)
            kept_ids = whole[-n:]
            first = len(whole) - len(kept_ids)
        ids, low = _checked_group(g, kept_ids, first)
        groups.append(ids)
        null_free.append(low is None or low > NULL_BLOCK_ID)
    return _proven(BlockIds._from_trusted(groups), null_free)


# --------------------------------------------------------------------------- ALIGN-1, NULL-1


def compute_block_pairs(lists: BlockLists) -> BlockPairs:
    """Pair C's i-th id with P's id at ``len(P[g]) - len(C[g]) + i``; drop null pairs (ALIGN-1, NULL-1).

    O(n) in the ids, in slices; a group proven null-free is not scanned for
    nulls again. The plain definition is :func:`kvspec.spec.compute_block_pairs`
    (ALIGN-1, NULL-1).
    """
    if len(lists.consumer_block_ids) == 0:
        return plain.compute_block_pairs(lists)
    check_tail_alignment(lists)
    producer, consumer = lists.producer_block_ids, lists.consumer_block_ids
    p_free, c_free = _null_free(producer), _null_free(consumer)
    pairs_p: list[tuple[int, ...]] = []
    pairs_c: list[tuple[int, ...]] = []
    for g, (p, c) in enumerate(zip(producer, consumer, strict=True)):
        # Tail alignment: C's list is its uncached suffix, so it ends where P's ends (never front-trim).
        tail = p[len(p) - len(c) :]
        # A group proven null-free skips the scan: O(1) instead of O(n).
        if (not p_free[g] and NULL_BLOCK_ID in tail) or (not c_free[g] and NULL_BLOCK_ID in c):
            # Ids are non-negative, so a product is 0 exactly when the pair holds the null block.
            real = list(map(operator.mul, tail, c))
            tail, c = tuple(itertools.compress(tail, real)), tuple(itertools.compress(c, real))
        pairs_p.append(tail)
        pairs_c.append(c)
    return _trusted_pairs(pairs_p, pairs_c)


# --------------------------------------------------------------------------- WIN-1 and engine helpers


def get_pruned_block_ids(config: KVCacheConfig, block_ids: BlockIdsLike, *, num_computed_tokens: int) -> BlockIds:
    """Null the whole blocks a group skips, as vLLM's ``remove_skipped_blocks`` does (WIN-1).

    Per group, ``k = min(skipped // B_g, len)`` leading blocks become id 0,
    walking back from ``k - 1`` and stopping at the first null
    (docs/spec/alignment-and-coverage.md, WIN-1 Boundaries).
    Pruning with more tokens than C will use (vLLM's ``request.num_tokens``,
    docs/explanation/worked-example.md) can null a block WIN-1 needs; :func:`check_window_coverage`
    catches it. O(n) in the ids, one scan per group; the plain definition is
    :func:`kvspec.spec.get_pruned_block_ids` (WIN-1).
    """
    ids = _to_block_ids(block_ids)
    if len(ids) != config.num_groups:
        return plain.get_pruned_block_ids(config, ids, num_computed_tokens=num_computed_tokens)  # it names the count
    pruned: list[tuple[int, ...]] = []
    for group, spec in zip(ids, (g.kv_cache_spec for g in config.kv_cache_groups), strict=True):
        k = min(get_num_skipped_tokens(spec, num_computed_tokens=num_computed_tokens) // spec.block_size, len(group))
        # Walking back from k - 1 stops at the first null: blocks [stop, k) become null, found by one scan.
        head = group[:k]
        stop = k - head[::-1].index(NULL_BLOCK_ID) if NULL_BLOCK_ID in head else 0
        pruned.append(group[:stop] + (NULL_BLOCK_ID,) * (k - stop) + group[k:])
    return BlockIds._from_trusted(pruned)


def get_consumer_block_counts(
    config: KVCacheConfig, *, num_tokens: int, prefix_hit_tokens: int, recomputed_tokens: int = 0
) -> tuple[int, ...]:
    """Real blocks C allocates and offers per group for its uncached suffix, after clipping (WIN-1, CLIP-1).

    Full attention: ``cdiv(T + R, B) - H / B``. Sliding window: from
    ``max(H, T - W + 1) // B`` to the last block, capped by the budget (vLLM
    allocates nulls for skipped blocks; docs/explanation/worked-example.md). Zero when ``H == T``.
    ``R`` (``recomputed_tokens``) is the trailing tokens C recomputes: its
    list also holds the blocks they are written to (WIN-1). A state group
    gets one slot, for the state it receives (STATE-2).
    """
    listed_tokens = _check_counts(config, num_tokens, prefix_hit_tokens, recomputed_tokens)
    counts = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if is_state_spec(spec):
            # One slot receives the state, none on a full hit (STATE-2, STATE-4).
            counts.append(1 if prefix_hit_tokens < num_tokens else 0)
            continue
        needed = get_needed_block_range(spec, num_tokens=num_tokens, prefix_hit_tokens=prefix_hit_tokens)
        count = get_logical_block_count(spec, num_tokens=listed_tokens) - needed.start if needed else 0
        budget = get_block_budget(spec)
        counts.append(min(count, budget) if budget else count)
    return tuple(counts)


def _check_side(side: SideCheck) -> None:
    """WIN-1's side check with its common case at C speed; the definition names what is wrong (WIN-1)."""
    blocks, needed, end = side.ids[side.group], side.needed, side.end
    first = end - len(blocks)  # the logical block of the list's first entry
    if (
        end <= get_logical_block_count(side.spec, num_tokens=side.listed)
        and first >= side.floor
        and (
            not needed
            or (
                first <= needed.start
                and needed.stop <= end
                and (
                    _null_free(side.ids)[side.group]
                    or NULL_BLOCK_ID not in blocks[needed.start - first : needed.stop - first]
                )
            )
        )
    ):
        return
    _spec_check_side(side)


def check_window_coverage(config: KVCacheConfig, request: TransferRequest) -> None:
    """Raise unless every block covering a needed position is real on both sides (WIN-1).

    O(groups) for groups proven null-free, plus one C-speed scan of the
    needed ids of the others; the plain definition, and what the arguments
    mean, is :func:`kvspec.spec.check_window_coverage` (WIN-1).
    """
    for side in get_side_checks(config, request):
        _check_side(side)


def compute_transfer_pairs(config: KVCacheConfig, request: TransferRequest) -> BlockPairs:
    """Check WIN-1 before any byte moves, then pair the lists (WIN-1, ALIGN-1, NULL-1, STATE-3, STATE-4).

    The request's lists were checked once, when it was built. Coverage is
    O(groups) for groups proven null-free and one C-speed scan of the needed
    slice otherwise; pairing is O(n) slices. The plain definition, and what
    the arguments mean, is :func:`kvspec.spec.compute_transfer_pairs` (WIN-1, ALIGN-1, NULL-1).
    """
    check_window_coverage(config, request)
    if len(request.consumer_block_ids) == 0:
        return plain.compute_block_pairs(request)  # full prefix hit: nothing moves (ALIGN-1)
    # Each state group pairs its one slot by STATE-3; the other groups pair by tail (ALIGN-1).
    return compute_block_pairs(get_state_paired_lists(config, get_paired_block_ends(config, request)))


@_twin_of(plain.check_request_blocks, positional=2)
def check_request_blocks(config: KVCacheConfig, request: TransferRequest, keywords: dict[str, Any]) -> BlockPairs:
    """The guard's rule checks on the block lists a connector used, at engine speed; raise or return the pairs (INT-3).

    The same checks, refusals and pairs as the plain definition
    :func:`kvspec.spec.check_request_blocks` (tests/test_fast_paths.py): the
    clipping check reads list lengths only, and coverage and pairing are this
    module's :func:`compute_transfer_pairs` (whole-list checks, C-speed scans
    of the needed slices), within 2x of a loop that touches every id once
    (``benchmarks/bench_guard.py``) (INT-3).
    """
    budgets = get_blocks_per_sw(config)
    for ids in (request.producer_block_ids, request.consumer_block_ids):
        if any(budget and len(group) > budget for group, budget in zip(ids, budgets, strict=False)):
            # A list past its budget: the definition says which and why (CLIP-1).
            return plain.check_request_blocks(config, request, **keywords)
    return plain.get_checked_pairs(config, request, **keywords, pair=compute_transfer_pairs)


# --------------------------------------------------------------------------- deprecated spellings (removed in 0.3.0)


def validate_hybrid_support(
    config: KVCacheConfig,
    mode: TransferMode | str,
    *,
    read_only_hma: bool = False,
    disable_hybrid_kv_cache_manager: bool = False,
) -> None:
    """Deprecated: :func:`check_hybrid_support`, which takes ``mode`` by keyword (ADM-1, ADM-2)."""
    warn_renamed("kvspec.validate_hybrid_support(config, mode)", "kvspec.check_hybrid_support(config, mode=mode)")
    check_hybrid_support(
        config, mode=mode, read_only_hma=read_only_hma, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager
    )
