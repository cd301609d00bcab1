"""Pure reference functions: HMA detection, admission, window budgets, clipping, alignment, coverage."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence

from kvspec.core._deprecation import keyword_only, warn_renamed
from kvspec.core._enums import StateProfile, TransferMode
from kvspec.core._errors import (
    GroupCountError,
)
from kvspec.core._models import (
    NULL_BLOCK_ID,
    BlockIds,
    KVCacheConfig,
    KVCacheSpec,
    _checked_group,
)
from kvspec.spec.admission import check_hybrid_support, is_full_attention_spec, is_hma_required
from kvspec.spec.coverage import (
    _check_prefix,
    get_block_ends,
    get_needed_block_range,
    get_needed_token_range,
    get_side_checks,
)
from kvspec.spec.coverage import _check_side as _spec_check_side
from kvspec.spec.coverage import get_logical_block_count as _spec_get_logical_block_count
from kvspec.spec.coverage import get_num_skipped_tokens as _spec_get_num_skipped_tokens
from kvspec.spec.guard import RankPlan, check_rank_plans
from kvspec.spec.guard import check_request_blocks as _plain_check_request_blocks
from kvspec.spec.pairing import BlockPairs, check_tail_alignment, get_paired_block_ends
from kvspec.spec.state import check_state_position, get_state_paired_lists, is_state_spec
from kvspec.spec.window import (
    BlockIdsLike,
    TokenBasis,
    get_block_budget,
    get_blocks_per_sw,
    get_token_basis_group,
)
from kvspec.spec.window import (
    check_count as _check_count,
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _to_block_ids(value: BlockIdsLike) -> BlockIds:
    return value if isinstance(value, BlockIds) else BlockIds(value)


def _derived_block_ids(groups: Sequence[tuple[int, ...]], null_free: Sequence[bool] | None = None) -> BlockIds:
    """A BlockIds made of slices of already-validated BlockIds, without validating every id again.

    Validation is O(n) per id and would dominate a long request (benchmarks/bench_engine.py).
    """
    return BlockIds._from_trusted(groups, null_free)


# --------------------------------------------------------------------------- CLIP-1 on engine lists

# The plain definitions (kvspec.spec) serve as these public names unchanged: no faster form exists.
get_logical_block_count = keyword_only(1, "num_tokens")(_spec_get_logical_block_count)
get_num_skipped_tokens = keyword_only(1, "num_computed_tokens")(_spec_get_num_skipped_tokens)


def get_exchange_clipped_blocks(block_ids: BlockIdsLike, budgets: Sequence[int]) -> BlockIds:
    """Keep each budgeted group's last ``n`` ids; others unchanged; zero groups stay zero (CLIP-1).

    Plain lists (vLLM's ``tuple[list[int], ...]``) are clipped first and only
    the ids kept are checked: the ids clipped away never leave the engine
    (decision 29 in decisions-rules.md). O(kept ids); the plain
    definition is :func:`kvspec.spec.get_exchange_clipped_blocks` (CLIP-1).
    """
    if isinstance(block_ids, BlockIds) or not isinstance(block_ids, Sequence) or isinstance(block_ids, (str, bytes)):
        ids = _to_block_ids(block_ids)
        return _clip_checked(ids, budgets)
    if len(block_ids) == 0:
        return BlockIds([])  # full prefix hit: nothing to exchange (CLIP-1)
    _check_budgets(len(block_ids), budgets)
    groups: list[tuple[int, ...]] = []
    null_free: list[bool] = []
    for g, (group, n) in enumerate(zip(block_ids, budgets, strict=True)):
        # n > 0 guards ids[-0:], the whole list (docs/spec/window-budget-and-clipping.md, CLIP-1).
        kept, first = group, 0
        if n > 0 and isinstance(group, Iterable) and not isinstance(group, (str, bytes)):
            whole = group if isinstance(group, Sequence) else tuple(group)
            kept = whole[-n:]
            first = len(whole) - len(kept)
        ids_g, free = _checked_group(g, kept, first)
        groups.append(ids_g)
        null_free.append(free)
    return _derived_block_ids(groups, null_free)


def _check_budgets(num_groups: int, budgets: Sequence[int]) -> None:
    if num_groups != len(budgets):
        raise GroupCountError(f"block ids have {num_groups} groups, budgets have {len(budgets)} (CLIP-1)")
    for g, n in enumerate(budgets):
        _check_count(f"budgets[{g}]", n)


def _clip_checked(ids: BlockIds, budgets: Sequence[int]) -> BlockIds:
    if len(ids) == 0:
        return ids  # full prefix hit: nothing to exchange (CLIP-1)
    _check_budgets(len(ids), budgets)
    if not any(budgets):
        return ids
    # n > 0 guards Python's ids[-0:], which is the whole list (docs/spec/window-budget-and-clipping.md, CLIP-1).
    return _derived_block_ids(
        [group[-n:] if n > 0 else group for group, n in zip(ids, budgets, strict=True)], ids._null_free
    )


# --------------------------------------------------------------------------- ALIGN-1, NULL-1


def compute_block_pairs(
    *,
    producer_block_ids: BlockIdsLike,
    consumer_block_ids: BlockIdsLike,
    producer_block_ends: Sequence[int] | None = None,
    consumer_block_ends: Sequence[int] | None = None,
) -> BlockPairs:
    """Pair C's i-th id with P's id at ``len(P[g]) - len(C[g]) + i``; drop null pairs (ALIGN-1, NULL-1).

    Where both sides say where their lists end (:func:`get_block_ends`, protocol
    1.1), each group's lists must end at the same logical block: a list
    shifted by a block (lookahead slots on one side) is refused even when both
    were clipped to the same length. A side that does not say (``None``, a
    1.0 peer) is taken to end where the other ends.

    O(n) in the ids, in slices; a group proven null-free when its ``BlockIds``
    was built is not scanned for nulls again. The plain definition is
    :func:`kvspec.spec.compute_block_pairs` (ALIGN-1, NULL-1).
    """
    producer, consumer = _to_block_ids(producer_block_ids), _to_block_ids(consumer_block_ids)
    if len(consumer) == 0:
        return BlockPairs(producer_block_ids=[], consumer_block_ids=[])  # full prefix hit (ALIGN-1)
    check_tail_alignment(
        producer, consumer, producer_block_ends=producer_block_ends, consumer_block_ends=consumer_block_ends
    )
    pairs_p: list[tuple[int, ...]] = []
    pairs_c: list[tuple[int, ...]] = []
    for g, (p, c) in enumerate(zip(producer, consumer, strict=True)):
        # Tail alignment: C's list is its uncached suffix, so it ends where P's ends (never front-trim).
        tail = p[len(p) - len(c) :]
        # A group proven null-free (when it was checked) skips the scan: O(1) instead of O(n).
        if (not producer._null_free[g] and NULL_BLOCK_ID in tail) or consumer._has_null(g):
            # Ids are non-negative, so a product is 0 exactly when the pair holds the null block.
            real = list(map(operator.mul, tail, c))
            tail, c = tuple(itertools.compress(tail, real)), tuple(itertools.compress(c, real))
        pairs_p.append(tail)
        pairs_c.append(c)
    null_free = (True,) * len(pairs_c)
    return BlockPairs(
        producer_block_ids=_derived_block_ids(pairs_p, null_free),
        consumer_block_ids=_derived_block_ids(pairs_c, null_free),
    )


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
        raise GroupCountError(f"block ids have {len(ids)} groups, the config {config.num_groups} (WIN-1)")
    pruned: list[tuple[int, ...]] = []
    for group, spec in zip(ids, (g.kv_cache_spec for g in config.kv_cache_groups), strict=True):
        k = min(get_num_skipped_tokens(spec, num_computed_tokens=num_computed_tokens) // spec.block_size, len(group))
        # Walking back from k - 1 stops at the first null: blocks [stop, k) become null, found by one scan.
        head = group[:k]
        stop = k - head[::-1].index(NULL_BLOCK_ID) if NULL_BLOCK_ID in head else 0
        pruned.append(group[:stop] + (NULL_BLOCK_ID,) * (k - stop) + group[k:])
    return _derived_block_ids(pruned)


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
    _check_prefix(config, num_tokens, prefix_hit_tokens)
    listed_tokens = num_tokens + _check_count("recomputed_tokens", recomputed_tokens)
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


def _check_side(
    role: str,
    ids: BlockIds,
    g: int,
    spec: KVCacheSpec,
    needed: range,
    *,
    end: int,
    floor: int,
    listed_tokens: int,
) -> None:
    """WIN-1's side check with its common case at C speed; the definition names what is wrong (WIN-1)."""
    blocks = ids[g]
    first = end - len(blocks)  # the logical block of the list's first entry
    if (
        end <= get_logical_block_count(spec, num_tokens=listed_tokens)
        and first >= floor
        and (
            not needed
            or (
                first <= needed.start
                and needed.stop <= end
                and (ids._null_free[g] or NULL_BLOCK_ID not in blocks[needed.start - first : needed.stop - first])
            )
        )
    ):
        return
    _spec_check_side(role, blocks, g, spec, needed, end=end, floor=floor, listed=listed_tokens)


def check_window_coverage(
    config: KVCacheConfig,
    *,
    num_tokens: int,
    prefix_hit_tokens: int,
    producer_block_ids: BlockIdsLike,
    consumer_block_ids: BlockIdsLike,
    recomputed_tokens: int = 0,
    producer_block_ends: Sequence[int] | None = None,
    consumer_block_ends: Sequence[int] | None = None,
) -> None:
    """Raise unless every block covering a needed position is real on both sides (WIN-1).

    The lists cover ``T + R`` tokens: T whose KV C takes, then
    ``recomputed_tokens`` (R) that C recomputes (vLLM recomputes the last
    prompt token: T = N - 1, R = 1, lists built for N). Each group's list
    (after clipping) ends at logical block ``end - 1``: the end the side
    declared (:func:`get_block_ends`), or ``cdiv(T + R, B_g)`` when it
    declared none. ``prefix_hit_tokens`` must be a multiple of every group's
    block size. A list that ends past ``cdiv(T + R, B_g)`` or starts before
    logical block 0 (P) or ``H / B_g`` (C) is a :class:`BlockAlignmentError`.
    Zero consumer groups (full prefix hit) pass only when nothing is needed.
    O(groups) for groups whose ``BlockIds`` proved them null-free, plus one
    C-speed scan of the needed ids of the others; the plain definition is
    :func:`kvspec.spec.check_window_coverage` (WIN-1).
    """
    _covered_lists(
        config,
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        producer_block_ids=producer_block_ids,
        consumer_block_ids=consumer_block_ids,
        recomputed_tokens=recomputed_tokens,
        producer_block_ends=producer_block_ends,
        consumer_block_ends=consumer_block_ends,
    )


def _covered_lists(
    config: KVCacheConfig,
    *,
    num_tokens: int,
    prefix_hit_tokens: int,
    producer_block_ids: BlockIdsLike,
    consumer_block_ids: BlockIdsLike,
    recomputed_tokens: int,
    producer_block_ends: Sequence[int] | None,
    consumer_block_ends: Sequence[int] | None,
) -> tuple[BlockIds, BlockIds, int]:
    """Both lists as ``BlockIds`` and the tokens they cover, once WIN-1 holds for them (WIN-1)."""
    _check_prefix(config, num_tokens, prefix_hit_tokens)
    listed_tokens = num_tokens + _check_count("recomputed_tokens", recomputed_tokens)
    producer, consumer = _to_block_ids(producer_block_ids), _to_block_ids(consumer_block_ids)
    _check_coverage(
        config,
        num_tokens,
        prefix_hit_tokens,
        producer,
        consumer,
        listed_tokens=listed_tokens,
        producer_block_ends=producer_block_ends,
        consumer_block_ends=consumer_block_ends,
    )
    return producer, consumer, listed_tokens


def _check_coverage(
    config: KVCacheConfig,
    num_tokens: int,
    prefix_hit_tokens: int,
    producer: BlockIds,
    consumer: BlockIds,
    *,
    listed_tokens: int,
    producer_block_ends: Sequence[int] | None,
    consumer_block_ends: Sequence[int] | None,
) -> None:
    for side in get_side_checks(
        config,
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        producer=producer,
        consumer=consumer,
        listed_tokens=listed_tokens,
        producer_block_ends=producer_block_ends,
        consumer_block_ends=consumer_block_ends,
    ):
        _check_side(
            side.role,
            side.ids,
            side.group,
            side.spec,
            side.needed,
            end=side.end,
            floor=side.floor,
            listed_tokens=listed_tokens,
        )


def compute_transfer_pairs(
    config: KVCacheConfig,
    *,
    num_tokens: int,
    prefix_hit_tokens: int,
    producer_block_ids: BlockIdsLike,
    consumer_block_ids: BlockIdsLike,
    recomputed_tokens: int = 0,
    producer_block_ends: Sequence[int] | None = None,
    consumer_block_ends: Sequence[int] | None = None,
) -> BlockPairs:
    """Check WIN-1 before any byte moves, then pair the lists (WIN-1, ALIGN-1, NULL-1).

    Plain lists are checked once, here (O(n)); lists that are already
    ``BlockIds`` are not checked again. Coverage is O(groups) for groups
    proven null-free and one C-speed scan of the needed slice otherwise;
    pairing is O(n) slices. The plain definition is
    :func:`kvspec.spec.compute_transfer_pairs`. ``recomputed_tokens`` and the block ends
    are as in :func:`check_window_coverage`; where only one side declares its
    ends, the other's are the request's last blocks, so a declared end
    elsewhere is refused (WIN-1, ALIGN-1, NULL-1).
    """
    producer, consumer, listed_tokens = _covered_lists(
        config,
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        producer_block_ids=producer_block_ids,
        consumer_block_ids=consumer_block_ids,
        recomputed_tokens=recomputed_tokens,
        producer_block_ends=producer_block_ends,
        consumer_block_ends=consumer_block_ends,
    )
    producer_block_ends, consumer_block_ends = get_paired_block_ends(
        config,
        listed_tokens=listed_tokens,
        producer_block_ends=producer_block_ends,
        consumer_block_ends=consumer_block_ends,
    )
    # Each state group pairs its one slot by STATE-3; the other groups pair by tail (ALIGN-1).
    producer, consumer, p_ends, c_ends = get_state_paired_lists(
        config, producer, consumer, producer_block_ends, consumer_block_ends
    )
    return compute_block_pairs(
        producer_block_ids=producer,
        consumer_block_ids=consumer,
        producer_block_ends=p_ends,
        consumer_block_ends=c_ends,
    )


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


def check_request_blocks(
    config: KVCacheConfig,
    *,
    num_tokens: int,
    prefix_hit_tokens: int,
    producer_block_ids: BlockIdsLike,
    consumer_block_ids: BlockIdsLike,
    recomputed_tokens: int = 0,
    producer_block_ends: Sequence[int] | None = None,
    consumer_block_ends: Sequence[int] | None = None,
    state_tokens: int | None = None,
    profile: StateProfile | str = StateProfile.RECOMPUTE,
    rank_plans: Iterable[RankPlan] = (),
) -> BlockPairs:
    """The guard's rule checks on the block lists a connector used, at engine speed; raise or return the pairs (INT-3).

    The same checks, refusals and pairs as the plain definition
    :func:`kvspec.spec.check_request_blocks` (tests/test_fast_paths.py): the
    clipping check reads list lengths only, and coverage and pairing are this
    module's :func:`compute_transfer_pairs` (whole-list checks, C-speed scans
    of the needed slices), within 2x of a loop that touches every id once
    (``benchmarks/bench_guard.py``) (INT-3).
    """
    budgets = get_blocks_per_sw(config)
    for ids in (producer_block_ids, consumer_block_ids):
        if not isinstance(ids, (str, bytes)) and isinstance(ids, Sequence):
            for group, budget in zip(ids, budgets, strict=False):
                if budget and isinstance(group, Sequence) and len(group) > budget:
                    break
            else:
                continue
        # A list past its budget, or one this loop cannot read: the definition says which and why (CLIP-1).
        return _plain_check_request_blocks(
            config,
            num_tokens=num_tokens,
            prefix_hit_tokens=prefix_hit_tokens,
            producer_block_ids=producer_block_ids,
            consumer_block_ids=consumer_block_ids,
            recomputed_tokens=recomputed_tokens,
            producer_block_ends=producer_block_ends,
            consumer_block_ends=consumer_block_ends,
            state_tokens=state_tokens,
            profile=profile,
            rank_plans=rank_plans,
        )
    check_state_position(
        config, state_tokens=state_tokens, num_tokens=num_tokens, recomputed_tokens=recomputed_tokens, profile=profile
    )
    pairs = compute_transfer_pairs(
        config,
        num_tokens=num_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        producer_block_ids=producer_block_ids,
        consumer_block_ids=consumer_block_ids,
        recomputed_tokens=recomputed_tokens,
        producer_block_ends=producer_block_ends,
        consumer_block_ends=consumer_block_ends,
    )
    check_rank_plans(rank_plans)
    return pairs
