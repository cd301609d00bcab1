"""The fast paths against straightforward oracles kept here: same answers, same refusals (CLIP-1, ALIGN-1, PLAN-1).

kvspec checks block ids with whole-list operations, clips engine lists before
checking them, skips null scans for groups proven null-free, and plans per run
of adjacent layers. Each oracle below is the one-id-at-a-time (or
one-page-at-a-time) definition those fast paths replace.
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from strategies import Scenario, scenarios
from test_plan import LAYOUTS, MODELS, Pairs, small_config

import kvspec._plan as plan_module
from kvspec import (
    NULL_BLOCK_ID,
    BlockIds,
    BlockIdsLike,
    ConfigError,
    KVCacheConfig,
    KVSpecError,
    PlanError,
    TransferMode,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_exchange_clipped_blocks,
    get_needed_block_range,
    get_pruned_block_ids,
)
from kvspec._plan import PageCopy, TransferPlan, _plan_page_by_page, plan_transfer
from kvspec.presets import Layout, get_preset

# --------------------------------------------------------------------------- oracles


def oracle_ids(groups: Sequence[Sequence[object]]) -> tuple[tuple[int, ...], ...] | str:
    """Each id checked on its own: an int that is not a bool, not negative. Returns the first bad position."""
    out = []
    for g, group in enumerate(groups):
        for i, block_id in enumerate(group):
            if not isinstance(block_id, int) or isinstance(block_id, bool) or block_id < 0:
                return f"groups[{g}][{i}]"
        out.append(tuple(int(b) for b in group))  # type: ignore[call-overload]
    return tuple(out)


def oracle_clip(groups: Sequence[Sequence[object]], budgets: Sequence[int]) -> tuple[tuple[int, ...], ...] | str:
    """CLIP-1 on engine lists: the last n of each budgeted group, then each kept id checked."""
    kept = [list(group)[-n:] if n > 0 else list(group) for group, n in zip(groups, budgets, strict=True)]
    checked = oracle_ids(kept)
    if isinstance(checked, str):  # name the position in the list the engine handed over
        g, i = (int(x) for x in checked.removeprefix("groups[").removesuffix("]").split("]["))
        return f"groups[{g}][{len(groups[g]) - len(kept[g]) + i}]"
    return checked


def oracle_pairs(producer: BlockIds, consumer: BlockIds) -> list[list[tuple[int, int]]]:
    """ALIGN-1 and NULL-1, pair by pair: C's i-th id with P's at len(P) - len(C) + i, null pairs dropped."""
    return [
        [
            (p[len(p) - len(c) + i], c[i])
            for i in range(len(c))
            if p[len(p) - len(c) + i] != NULL_BLOCK_ID and c[i] != NULL_BLOCK_ID
        ]
        for p, c in zip(producer, consumer, strict=True)
    ]


def oracle_plan(producer: KVCacheConfig, consumer: KVCacheConfig, pairs: Pairs) -> list[PageCopy]:
    """PLAN-1 by definition: a copy per (layer, pair) from the page formula, sorted, merged where both sides go on."""
    pages = []
    for g, group in enumerate(producer.kv_cache_groups):
        page = group.kv_cache_spec.page_size_bytes
        for layer in group.layer_names:
            for p_id, c_id in zip(pairs.producer_block_ids[g], pairs.consumer_block_ids[g], strict=True):
                pages.append((*producer.page_offset(layer, p_id), *consumer.page_offset(layer, c_id), page))
    merged: list[list[int]] = []
    for pr, po, cr, co, n in sorted(pages):
        last = merged[-1] if merged else None
        if last and (pr, cr) == (last[0], last[2]) and po == last[1] + last[4] and co == last[3] + last[4]:
            last[4] += n
        else:
            merged.append([pr, po, cr, co, n])
    return [
        PageCopy(producer_region=pr, producer_offset=po, consumer_region=cr, consumer_offset=co, nbytes=n)
        for pr, po, cr, co, n in merged
    ]


# --------------------------------------------------------------------------- BlockIds and CLIP-1


class Colour(enum.IntEnum):
    RED = 7


odd_ids = st.one_of(
    st.integers(0, 10**6),
    st.integers(-5, -1),
    st.booleans(),
    st.just(Colour.RED),
    st.floats(0, 10, allow_nan=False),
    st.just(None),
)
engine_lists = st.lists(st.lists(st.integers(0, 10**6) | odd_ids, max_size=10), max_size=5)


@given(groups=engine_lists)
@example(groups=[[1, True]])  # a bool is an int to Python, never a block id
@example(groups=[[3, Colour.RED]])  # an int subclass is accepted and stored as a plain int
@example(groups=[[0, 5, -1]])
@example(groups=[[2.0]])
def test_bulk_id_check_accepts_and_refuses_what_the_per_id_check_does(groups: list[list[object]]) -> None:
    expected = oracle_ids(groups)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            BlockIds(groups)
        return
    ids = BlockIds(groups)
    assert ids.groups == expected
    assert all(type(b) is int for group in ids for b in group)
    # What BlockIds proves about the null block is true.
    for g, group in enumerate(ids):
        assert ids._has_null(g) == (NULL_BLOCK_ID in group)
        if ids._null_free[g]:
            assert NULL_BLOCK_ID not in group


@given(groups=engine_lists, budgets=st.lists(st.integers(0, 4), max_size=5))
@example(groups=[[-1, 2.0, 5, 6]], budgets=[2])  # bad ids clipped away: never exchanged
@example(groups=[[5, -1, 6]], budgets=[2])  # a bad id kept: named at its position in P's list
@example(groups=[[1, 2, 3]], budgets=[0])  # budget 0: the whole list (ids[-0:] trap, H3)
def test_clip_of_engine_lists_equals_clip_then_check(groups: list[list[object]], budgets: list[int]) -> None:
    budgets = (budgets + [0] * len(groups))[: len(groups)]
    expected = oracle_clip(groups, budgets)
    if not groups:
        assert len(get_exchange_clipped_blocks(groups, budgets)) == 0  # type: ignore[arg-type]
        return
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            get_exchange_clipped_blocks(groups, budgets)  # type: ignore[arg-type]
        return
    clipped = get_exchange_clipped_blocks(groups, budgets)  # type: ignore[arg-type]
    assert clipped.groups == expected
    # Tuples and generators of groups clip the same way as lists.
    as_tuples: Any = tuple(tuple(g) for g in groups)
    as_iterators: Any = [iter(g) for g in groups]
    assert get_exchange_clipped_blocks(as_tuples, budgets) == clipped
    assert get_exchange_clipped_blocks(as_iterators, budgets) == clipped


# --------------------------------------------------------------------------- WIN-1, ALIGN-1 on engine lists


@given(scenario=scenarios(), seed=st.integers(0, 2**16), nulls=st.integers(0, 3))
def test_pairs_from_engine_lists_equal_the_pair_by_pair_oracle(scenario: Scenario, seed: int, nulls: int) -> None:
    """Plain lists (what vLLM hands over, ids shuffled, stray nulls) give the pairs and refusals of the oracle."""
    rng = random.Random(seed)
    config, t, h = scenario.config, scenario.num_tokens, scenario.prefix_hit_tokens
    # Rename ids through a shuffled pool, and null a few at random: coverage may now fail, as it must.
    pool = list(range(1, 10_000))
    rng.shuffle(pool)
    rename = dict(zip(range(1, 10_000), pool, strict=True))
    producer = [[rename.get(b, b) for b in group] for group in scenario.producer_unclipped]
    consumer = [[rename.get(b, b) for b in group] for group in scenario.consumer_block_ids]
    for _ in range(nulls):
        side = rng.choice([producer, consumer])
        group = rng.choice(side) if side else []
        if group:
            group[rng.randrange(len(group))] = NULL_BLOCK_ID
    budgets = get_blocks_per_sw(config)
    p_clipped = get_exchange_clipped_blocks(producer, budgets)
    c_clipped = get_exchange_clipped_blocks(consumer, budgets)
    # The slow way: BlockIds built from the clipped lists with every null re-scanned (no null-free proofs).
    p_slow = BlockIds._from_trusted(p_clipped.groups)
    c_slow = BlockIds._from_trusted(c_clipped.groups)

    def outcome(p: BlockIdsLike, c: BlockIdsLike) -> object:
        try:
            pairs = compute_transfer_pairs(
                config, num_tokens=t, prefix_hit_tokens=h, producer_block_ids=p, consumer_block_ids=c
            )
        except KVSpecError as exc:
            return type(exc), str(exc)
        return [
            list(zip(*g, strict=True)) for g in zip(pairs.producer_block_ids, pairs.consumer_block_ids, strict=True)
        ]

    fast = outcome(p_clipped, c_clipped)
    assert fast == outcome(p_slow, c_slow)
    assert fast == outcome([list(g) for g in p_clipped], [list(g) for g in c_clipped])
    if isinstance(fast, list):
        assert fast == oracle_pairs(p_clipped, c_clipped)


# --------------------------------------------------------------------------- PLAN-1


def random_group_ids(rng: random.Random, config: KVCacheConfig, count: int, style: str) -> list[int]:
    if style == "contiguous":
        start = rng.randint(1, max(1, config.num_blocks - count))
        return list(range(start, start + count))
    if style == "runs":  # a few consecutive runs in random order
        ids: list[int] = []
        while len(ids) < count:
            start = rng.randint(1, config.num_blocks - 1)
            ids += range(start, min(config.num_blocks, start + rng.randint(1, 4)))
        return ids[:count]
    return [rng.randint(0, config.num_blocks) for _ in range(count)]  # anything: dups, nulls, out of range


def random_pairs(rng: random.Random, producer: KVCacheConfig, consumer: KVCacheConfig) -> Pairs:
    p_groups, c_groups = [], []
    for _ in range(producer.num_groups):
        count = rng.randint(0, 6)
        p_groups.append(random_group_ids(rng, producer, count, rng.choice(["contiguous", "runs", "any"])))
        c_groups.append(random_group_ids(rng, consumer, count, rng.choice(["contiguous", "runs", "any"])))
    return Pairs(producer_block_ids=BlockIds(p_groups), consumer_block_ids=BlockIds(c_groups))


def plan_or_error(producer: KVCacheConfig, consumer: KVCacheConfig, pairs: Pairs) -> TransferPlan | str:
    try:
        return plan_transfer(producer_config=producer, consumer_config=consumer, pairs=pairs)
    except PlanError as exc:
        return str(exc)


@settings(max_examples=300)
@given(
    model=st.sampled_from(MODELS),
    producer_layout=st.sampled_from(LAYOUTS),
    consumer_layout=st.sampled_from(LAYOUTS),
    producer_blocks=st.integers(2, 40),
    consumer_blocks=st.integers(2, 40),
    seed=st.integers(0, 2**32),
)
@example(
    model="gemma-3-27b", producer_layout="blocks_first", consumer_layout="blocks_first",
    producer_blocks=30, consumer_blocks=30, seed=3,
)  # fmt: skip
def test_fast_plan_equals_the_page_by_page_oracle(
    model: str, producer_layout: Layout, consumer_layout: Layout, producer_blocks: int, consumer_blocks: int, seed: int
) -> None:
    """Same copies in the same order as the definition, or the same refusal as the page-by-page planner (PLAN-1)."""
    producer = small_config(model, producer_layout, producer_blocks)
    consumer = small_config(model, consumer_layout, consumer_blocks)
    pairs = random_pairs(random.Random(seed), producer, consumer)
    got = plan_or_error(producer, consumer, pairs)
    try:
        straightforward: TransferPlan | str = _plan_page_by_page(producer, consumer, pairs)
    except PlanError as exc:
        straightforward = str(exc)
    assert got == straightforward
    if isinstance(got, TransferPlan):
        assert list(got.copies) == oracle_plan(producer, consumer, pairs)
        descriptors = got.to_descriptors(kvspec_read())
        assert [(d.remote_region, d.remote_offset, d.nbytes) for d in descriptors] == [
            (c.producer_region, c.producer_offset, c.nbytes) for c in got.copies
        ]


def kvspec_read() -> TransferMode:
    return TransferMode.READ


def test_contiguous_shuffled_and_duplicate_ids_take_the_paths_they_should(monkeypatch: pytest.MonkeyPatch) -> None:
    """Consecutive ids merge into one copy per group; a duplicate producer id falls back and still plans."""
    config = small_config("gemma-3-27b", "blocks_first", 64)
    calls: list[bool] = []
    fast = plan_module._plan_fast

    def spy(*args: object) -> TransferPlan | None:
        result = fast(*args)  # type: ignore[arg-type]
        calls.append(result is not None)
        return result

    monkeypatch.setattr(plan_module, "_plan_fast", spy)
    n = config.num_groups
    contiguous = Pairs(
        producer_block_ids=BlockIds([range(1 + 4 * g, 5 + 4 * g) for g in range(n)]),
        consumer_block_ids=BlockIds([range(33 + 4 * g, 37 + 4 * g) for g in range(n)]),
    )
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=contiguous)
    assert plan.num_descriptors == n  # blocks_first: every layer of 4 consecutive blocks is one copy
    assert calls == [True]
    duplicate = Pairs(
        producer_block_ids=BlockIds([[5, 5]] + [[]] * (n - 1)), consumer_block_ids=BlockIds([[9, 10]] + [[]] * (n - 1))
    )
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=duplicate)
    assert calls == [True, False]  # a page read twice: only the page-by-page planner is exact
    assert list(plan.copies) == oracle_plan(config, config, duplicate)


def test_a_fast_path_that_ignores_the_consumer_side_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: chains cut on producer ids only; the oracle comparison fails on a pair broken on C's side."""
    config = small_config("llama-3.1-8b", "blocks_first", 16)
    pairs = Pairs(producer_block_ids=BlockIds([[3, 4, 5]]), consumer_block_ids=BlockIds([[10, 11, 13]]))
    assert list(plan_transfer(producer_config=config, consumer_config=config, pairs=pairs).copies) == oracle_plan(
        config, config, pairs
    )
    original = plan_module._sorted_pairs

    def producer_only(p: Sequence[int], c: Sequence[int], *args: object) -> object:
        return original(p, list(range(c[0], c[0] + len(c))), *args)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "_sorted_pairs", producer_only)
    plan_module._LAYOUT_CACHE.clear()
    mutant = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    assert list(mutant.copies) != oracle_plan(config, config, pairs)


def test_plans_from_columns_and_from_copies_are_equal() -> None:
    config = small_config("gpt-oss-20b", "layers_first", 16)
    pairs = Pairs(producer_block_ids=BlockIds([[1, 2], [7]]), consumer_block_ids=BlockIds([[3, 4], [9]]))
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    rebuilt = TransferPlan(copies=plan.copies, groups=plan.groups)
    assert rebuilt == plan
    assert hash(rebuilt) == hash(plan)
    assert rebuilt.total_bytes == plan.total_bytes == sum(c.nbytes for c in plan.copies)
    assert rebuilt.to_descriptors(kvspec_read()) == plan.to_descriptors(kvspec_read())
    assert "TransferPlan(copies=[PageCopy(" in repr(plan)


# --------------------------------------------------------------------------- pruning (WIN-1 helper)


def oracle_prune(config: KVCacheConfig, groups: Sequence[Sequence[int]], num_computed_tokens: int) -> list[list[int]]:
    """vLLM's walk back from block k - 1, one id at a time, stopping at the first null."""
    from kvspec import get_num_skipped_tokens

    out = []
    for group, spec in zip(groups, (g.kv_cache_spec for g in config.kv_cache_groups), strict=True):
        blocks = list(group)
        k = min(get_num_skipped_tokens(spec, num_computed_tokens=num_computed_tokens) // spec.block_size, len(blocks))
        for i in range(k - 1, -1, -1):
            if blocks[i] == NULL_BLOCK_ID:
                break
            blocks[i] = NULL_BLOCK_ID
        out.append(blocks)
    return out


@given(
    model=st.sampled_from(MODELS),
    n=st.integers(0, 3000),
    data=st.lists(st.integers(0, 30), min_size=0, max_size=40),
)
@example(model="gemma-3-27b", n=2048, data=[5, 0, 6, 7, 8, 9] * 7)  # a null inside the skipped head stops the walk
def test_pruning_equals_the_walk_back_oracle(model: str, n: int, data: list[int]) -> None:
    config = small_config(model, "blocks_first", 4)
    groups = [list(itertools.islice(itertools.cycle(data or [1]), len(data))) for _ in range(config.num_groups)]
    got = get_pruned_block_ids(config, groups, num_computed_tokens=n)
    assert got.to_lists() == oracle_prune(config, groups, n)


@pytest.mark.parametrize("allocation", ["contiguous", "shuffled"])
def test_an_engine_shaped_request_takes_the_fast_path_and_equals_the_page_by_page_plan(
    allocation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full-size Gemma 3 27B (62 layers, blocks_first), 8k tokens, ids as an engine's free list hands them out."""
    preset = get_preset("gemma-3-27b")
    config = preset.build_config(num_blocks=4096)
    rng = random.Random(7)
    free = list(range(1, config.num_blocks))
    if allocation == "shuffled":
        rng.shuffle(free)
    budgets = get_blocks_per_sw(config)
    producer, consumer = [], []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        total = -(-8192 // spec.block_size)
        start = get_needed_block_range(spec, num_tokens=8192, prefix_hit_tokens=0).start
        producer.append([NULL_BLOCK_ID] * start + [free.pop() for _ in range(total - start)])
        consumer.append([NULL_BLOCK_ID] * start + [free.pop() for _ in range(total - start)])
    pairs = compute_transfer_pairs(
        config,
        num_tokens=8192,
        prefix_hit_tokens=0,
        producer_block_ids=get_exchange_clipped_blocks(producer, budgets),
        consumer_block_ids=get_exchange_clipped_blocks(consumer, budgets),
    )
    calls: list[bool] = []
    fast = plan_module._plan_fast

    def spy(*args: Any) -> TransferPlan | None:
        result = fast(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(plan_module, "_plan_fast", spy)
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    assert calls == [True]
    assert plan == _plan_page_by_page(config, config, pairs)
    assert plan.num_pages == sum(
        len(g.layer_names) * len(ids) for g, ids in zip(config.kv_cache_groups, pairs.consumer_block_ids, strict=True)
    )
    if allocation == "contiguous":
        assert plan.num_descriptors <= 2 * config.num_groups  # a run per group, split at most once by the pool
