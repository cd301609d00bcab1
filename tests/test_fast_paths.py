"""The fast paths against the plain definitions in kvspec.spec: same answers, same refusals (CLIP-1, ALIGN-1, PLAN-1).

kvspec checks block ids with whole-list operations, clips engine lists before
checking them, skips null scans for groups proven null-free, and plans per run
of adjacent layers. kvspec.spec holds the one-id-at-a-time (or
one-page-at-a-time) definitions those fast paths replace; the only oracle kept
here is the per-id check of a BlockIds (a model, not a rule).
"""

from __future__ import annotations

import enum
import inspect
import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from strategies import Scenario, build_scenario, scenarios
from test_offload import FA_SW, hit_cases, offload
from test_plan import LAYOUTS, MODELS, Pairs, small_config

import kvspec.protocol._plan as plan_module
import kvspec.reference._reference as fast_layer
import kvspec.spec as plain
from kvspec import (
    NULL_BLOCK_ID,
    BlockIds,
    BlockIdsLike,
    BlockLists,
    BlockPairs,
    ConfigError,
    KVCacheConfig,
    KVSpecError,
    OffloadConfig,
    PlanError,
    TransferMode,
    TransferRequest,
    get_blocks_per_sw,
    get_needed_block_range,
)
from kvspec.fast import (
    compute_transfer_pairs,
    get_exchange_clipped_blocks,
    get_offload_hit_tokens,
    get_pruned_block_ids,
)
from kvspec.presets import Layout, get_preset
from kvspec.protocol._plan import TransferPlan, _plan_by_definition, plan_transfer

T = TypeVar("T")

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


def result_of(call: Callable[[], T]) -> T | tuple[type[KVSpecError], str]:
    """What a call returns, or the kvspec error it raises as (class, message): both sides must agree on either."""
    try:
        return call()
    except KVSpecError as exc:
        return type(exc), str(exc)


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
    # What the fast layer proves about the null block when it checks the lists is true, and is all it knows.
    proven = fast_layer._to_block_ids(groups)  # type: ignore[arg-type]
    assert proven == ids
    assert fast_layer._null_free(proven) == tuple(NULL_BLOCK_ID not in group for group in ids)
    assert fast_layer._null_free(ids) == (False,) * len(ids)


@given(groups=engine_lists, budgets=st.lists(st.integers(0, 4), max_size=5))
@example(groups=[[-1, 2.0, 5, 6]], budgets=[2])  # bad ids clipped away: never exchanged
@example(groups=[[5, -1, 6]], budgets=[2])  # a bad id kept: named at its position in P's list
@example(groups=[[1, 2, 3]], budgets=[0])  # budget 0: the whole list (ids[-0:] trap, H3)
def test_clip_of_engine_lists_equals_clip_then_check(groups: list[list[object]], budgets: list[int]) -> None:
    budgets = (budgets + [0] * len(groups))[: len(groups)]
    engine: Any = groups
    expected = result_of(lambda: plain.get_exchange_clipped_blocks(engine, budgets))
    assert result_of(lambda: get_exchange_clipped_blocks(engine, budgets)) == expected
    if not isinstance(expected, BlockIds):
        assert expected[0] is ConfigError
        return
    clipped = get_exchange_clipped_blocks(engine, budgets)
    # Tuples and generators of groups clip the same way as lists.
    as_tuples: Any = tuple(tuple(g) for g in groups)
    as_iterators: Any = [iter(g) for g in groups]
    assert get_exchange_clipped_blocks(as_tuples, budgets) == clipped
    assert get_exchange_clipped_blocks(as_iterators, budgets) == clipped


def test_each_fast_twin_takes_its_definitions_signature_and_hands_it_what_it_cannot_take() -> None:
    """The signature lives once, on the definition; a call of another shape is the definition's (its TypeError)."""
    import kvspec.fast

    for name in kvspec.fast.__all__:
        assert inspect.signature(getattr(kvspec.fast, name)) == inspect.signature(getattr(plain, name)), name
    shapes: list[Callable[[Any], object]] = [
        lambda f: f(None, bogus=1),
        lambda f: f(None, num_tokens=1),
        lambda f: f(None),
    ]
    for call in shapes:
        with pytest.raises(TypeError) as fast_error:
            call(kvspec.fast.check_window_coverage)
        with pytest.raises(TypeError) as plain_error:
            call(plain.check_window_coverage)
        assert str(fast_error.value) == str(plain_error.value)


# --------------------------------------------------------------------------- WIN-1, ALIGN-1 on engine lists


_SHIFTS = (None, -1, 0, 1)


@given(scenario=scenarios(), seed=st.integers(0, 2**16), nulls=st.integers(0, 3), recomputed=st.integers(0, 2))
def test_pairs_from_engine_lists_equal_the_pair_by_pair_oracle(
    scenario: Scenario, seed: int, nulls: int, recomputed: int
) -> None:
    """Plain lists (what vLLM hands over, ids shuffled, stray nulls) give the pairs and refusals of the oracle.

    Protocol 1.1 too: lists built for T + R tokens, with each side's ends
    undeclared, at the request's last block, or one block off either way
    (WIN-1, ALIGN-1).
    """
    rng = random.Random(seed)
    config, t, h = scenario.config, scenario.num_tokens, scenario.prefix_hit_tokens
    scenario = build_scenario(config, t, h, recomputed_tokens=recomputed)
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
    lasts = [-(-(t + recomputed) // g.kv_cache_spec.block_size) for g in config.kv_cache_groups]

    def ends(shift: int | None) -> tuple[int, ...] | None:
        return None if shift is None else tuple(max(0, last + shift) for last in lasts)

    def outcome(
        p: BlockIdsLike,
        c: BlockIdsLike,
        p_ends: Sequence[int] | None,
        c_ends: Sequence[int] | None,
        *,
        definition: bool = False,
    ) -> object:
        try:
            request = TransferRequest(
                num_tokens=t,
                prefix_hit_tokens=h,
                producer_block_ids=p,
                consumer_block_ids=c,
                recomputed_tokens=recomputed,
                producer_block_ends=p_ends,
                consumer_block_ends=c_ends,
            )
            pairs = (plain.compute_transfer_pairs if definition else compute_transfer_pairs)(config, request)
        except KVSpecError as exc:
            return type(exc), str(exc)
        return outcome_of_pairs(pairs)

    for p_ends, c_ends in itertools.product(map(ends, _SHIFTS), repeat=2):
        fast = outcome(p_clipped, c_clipped, p_ends, c_ends)
        assert fast == outcome(p_slow, c_slow, p_ends, c_ends)
        assert fast == outcome([list(g) for g in p_clipped], [list(g) for g in c_clipped], p_ends, c_ends)
        if p_ends is None and c_ends is None and isinstance(fast, list):
            plain_pairs = plain.compute_block_pairs(
                BlockLists(producer_block_ids=p_clipped, consumer_block_ids=c_clipped)
            )
            assert fast == outcome_of_pairs(plain_pairs)
        assert fast == outcome(p_clipped, c_clipped, p_ends, c_ends, definition=True), (p_ends, c_ends)


def outcome_of_pairs(pairs: BlockPairs) -> list[list[tuple[int, int]]]:
    """Per group, the (producer id, consumer id) pairs."""
    return [list(zip(*g, strict=True)) for g in zip(pairs.producer_block_ids, pairs.consumer_block_ids, strict=True)]


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
def test_fast_plan_equals_the_page_by_page_definition(
    model: str, producer_layout: Layout, consumer_layout: Layout, producer_blocks: int, consumer_blocks: int, seed: int
) -> None:
    """Same copies in the same order as kvspec.spec's definition, or the same refusal (PLAN-1)."""
    producer = small_config(model, producer_layout, producer_blocks)
    consumer = small_config(model, consumer_layout, consumer_blocks)
    pairs = random_pairs(random.Random(seed), producer, consumer)
    got = plan_or_error(producer, consumer, pairs)
    try:
        straightforward: TransferPlan | str = _plan_by_definition(producer, consumer, pairs)
    except PlanError as exc:
        straightforward = str(exc)
    assert got == straightforward
    definition = result_of(
        lambda: plain.compute_page_copies(producer_config=producer, consumer_config=consumer, pairs=pairs)
    )
    if isinstance(got, TransferPlan):
        assert got.copies == definition
        descriptors = got.to_descriptors(kvspec_read())
        assert [(d.remote_region, d.remote_offset, d.nbytes) for d in descriptors] == [
            (c.producer_region, c.producer_offset, c.nbytes) for c in got.copies
        ]
    else:
        assert definition == (PlanError, got)


def kvspec_read() -> TransferMode:
    return TransferMode.READ


# State hybrids (padded state pages, several state tensors) and a pure state model (no padding).
STATE_MODELS = ("qwen3-next-80b", "hymba-1.5b", "kimi-linear-48b", "mamba-130m")


@settings(max_examples=40)
@given(
    model=st.sampled_from(STATE_MODELS),
    producer_layout=st.sampled_from(LAYOUTS),
    consumer_layout=st.sampled_from(LAYOUTS),
    producer_blocks=st.integers(2, 24),
    consumer_blocks=st.integers(2, 24),
    seed=st.integers(0, 2**32),
)
@example(
    model="qwen3-next-80b", producer_layout="blocks_first", consumer_layout="layers_first",
    producer_blocks=24, consumer_blocks=24, seed=1,
)  # fmt: skip
def test_fast_plan_of_state_groups_equals_the_definition(
    model: str, producer_layout: Layout, consumer_layout: Layout, producer_blocks: int, consumer_blocks: int, seed: int
) -> None:
    """A state group's pages move their state tensors' bytes only, on the fast path as in the definition (PLAN-1)."""
    producer = small_config(model, producer_layout, producer_blocks)
    consumer = small_config(model, consumer_layout, consumer_blocks)
    pairs = random_pairs(random.Random(seed), producer, consumer)
    got = plan_or_error(producer, consumer, pairs)
    definition = result_of(
        lambda: plain.compute_page_copies(producer_config=producer, consumer_config=consumer, pairs=pairs)
    )
    if isinstance(got, TransferPlan):
        assert got.copies == definition
        assert got == _plan_by_definition(producer, consumer, pairs)
        moved = [plain.get_page_byte_ranges(g.kv_cache_spec)[-1] for g in producer.kv_cache_groups]
        assert got.total_bytes == sum(
            len(group.layer_names) * len(ids) * (end[0] + end[1])
            for group, ids, end in zip(producer.kv_cache_groups, pairs.producer_block_ids, moved, strict=True)
        )
    else:
        assert definition == (PlanError, got)


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
    assert list(plan.copies) == list(
        plain.compute_page_copies(producer_config=config, consumer_config=config, pairs=duplicate)
    )


def test_a_fast_path_that_ignores_the_consumer_side_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: chains cut on producer ids only; the oracle comparison fails on a pair broken on C's side."""
    config = small_config("llama-3.1-8b", "blocks_first", 16)
    pairs = Pairs(producer_block_ids=BlockIds([[3, 4, 5]]), consumer_block_ids=BlockIds([[10, 11, 13]]))
    definition = plain.compute_page_copies(producer_config=config, consumer_config=config, pairs=pairs)
    assert plan_transfer(producer_config=config, consumer_config=config, pairs=pairs).copies == definition
    original = plan_module._sorted_pairs

    def producer_only(p: Sequence[int], c: Sequence[int], *args: object) -> object:
        return original(p, list(range(c[0], c[0] + len(c))), *args)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "_sorted_pairs", producer_only)
    plan_module._LAYOUT_CACHE.clear()
    mutant = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    assert mutant.copies != definition


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
    assert got == plain.get_pruned_block_ids(config, groups, num_computed_tokens=n)


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
        TransferRequest(
            num_tokens=8192,
            prefix_hit_tokens=0,
            producer_block_ids=get_exchange_clipped_blocks(producer, budgets),
            consumer_block_ids=get_exchange_clipped_blocks(consumer, budgets),
        ),
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
    assert plan == _plan_by_definition(config, config, pairs)
    assert plan.copies == plain.compute_page_copies(producer_config=config, consumer_config=config, pairs=pairs)
    assert plan.num_pages == sum(
        len(g.layer_names) * len(ids) for g, ids in zip(config.kv_cache_groups, pairs.consumer_block_ids, strict=True)
    )
    if allocation == "contiguous":
        assert plan.num_descriptors <= 2 * config.num_groups  # a run per group, split at most once by the pool


# --------------------------------------------------------------------------- OFF-5 hit


@given(case=hit_cases(), local_shift=st.sampled_from([0, 0, 1]), extra_key=st.booleans(), drop_group=st.booleans())
@example(case=(FA_SW, offload(), [[True] * 3, [True] * 3], 12, 0), local_shift=0, extra_key=False, drop_group=False)
@example(  # R3: window chunks {0, 1, 2, 4} of 6 present, N = 25: the hit ends at 12
    case=(FA_SW, offload(), [[True] * 6, [True, True, True, False, True, False]], 25, 0),
    local_shift=0,
    extra_key=False,
    drop_group=False,
)
def test_offload_hit_equals_the_definition_refusals_included(
    case: tuple[KVCacheConfig, OffloadConfig, list[list[bool]], int, int],
    local_shift: int,
    extra_key: bool,
    drop_group: bool,
) -> None:
    """The hit's jumps over absent chunks give the definition's end-by-end answer, and its refusals (OFF-5)."""
    config, off_config, present, num_tokens, local = case
    local += local_shift  # off a block boundary when the block size is above 1, or past the request
    present = [[*keys, True] for keys in present] if extra_key else present  # a key the request cannot have yet
    present = present[:-1] if drop_group else present
    fast = result_of(
        lambda: get_offload_hit_tokens(
            config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config
        )
    )
    definition = result_of(
        lambda: plain.get_offload_hit_tokens(
            config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config
        )
    )
    assert fast == definition


@settings(max_examples=40)
@given(case=hit_cases(states=True), local_shift=st.sampled_from([0, 0, 1]))
def test_offload_hit_with_state_groups_equals_the_definition(
    case: tuple[KVCacheConfig, OffloadConfig, list[list[bool]], int, int], local_shift: int
) -> None:
    """With align-mode state groups, the fast hit's chunk-grid scan gives the definition's answer (OFF-5, OFF-9)."""
    config, off_config, present, num_tokens, local = case
    local += local_shift
    fast = result_of(
        lambda: get_offload_hit_tokens(
            config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config
        )
    )
    definition = result_of(
        lambda: plain.get_offload_hit_tokens(
            config, present, num_tokens=num_tokens, local_hit_tokens=local, offload=off_config
        )
    )
    assert fast == definition


def test_a_state_hybrid_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-Next (padded GDN pages), blocks_first: one copy of state bytes per layer page, on the fast path."""
    config = small_config("qwen3-next-80b", "blocks_first", 32)
    calls: list[bool] = []
    fast = plan_module._plan_fast

    def spy(*args: Any) -> TransferPlan | None:
        result = fast(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(plan_module, "_plan_fast", spy)
    ids = BlockIds([[1], [2], [3], range(4, 12)])  # one slot per state group, 8 FA blocks
    pairs = Pairs(producer_block_ids=ids, consumer_block_ids=ids)
    plan = plan_transfer(producer_config=config, consumer_config=config, pairs=pairs)
    assert calls == [True]
    assert plan == _plan_by_definition(config, config, pairs)
    state = config.kv_cache_groups[0].kv_cache_spec
    moved = sum(nbytes for _, nbytes in plain.get_page_byte_ranges(state))
    assert moved < state.page_size_bytes
    assert plan.num_descriptors == 3 * 2 + 1  # two layers per state group, each its own copy; FA one run
    assert [c.nbytes for c in plan.copies].count(moved) == 6
