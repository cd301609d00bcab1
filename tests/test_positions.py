"""Where a list sits in the request: the recomputed last token (WIN-1) and declared list ends (ALIGN-1), protocol 1.1.

Every property runs against the reference and against a mutant that breaks it;
the mutant must fail (hypothesis finds the counterexample), so each property
can fail.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from strategies import Scenario, build_scenario, config_from_specs, configs

from kvspec import (
    BlockAlignmentError,
    BlockIds,
    BlockLists,
    BlockPairs,
    ChunkedLocalAttentionSpec,
    ConfigError,
    FullAttentionSpec,
    GroupCountError,
    KVCacheConfig,
    SlidingWindowSpec,
    TransferRequest,
    WindowCoverageError,
    check_window_coverage,
    compute_block_pairs,
    compute_transfer_pairs,
    get_block_ends,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_logical_block_count,
    get_needed_block_range,
    get_pruned_block_ids,
)


def fa(b: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=1, dtype="float16")


def sw(w: int, b: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=b, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=w)


Pairing = Callable[[KVCacheConfig, TransferRequest], BlockPairs]
"""The shape of :func:`kvspec.compute_transfer_pairs`."""


def _trims_to_fit(config: KVCacheConfig, request: TransferRequest) -> BlockPairs:
    """Mutant: 'models' the recomputed token by trimming a list that is too long to the length that fits.

    Decision 42 (in docs/explanation/decisions-rules.md) rejects exactly this: it accepts a list really built for
    more tokens.
    """
    basis = request.listed_tokens
    fitted = []
    for side, floor in ((request.producer_block_ids, False), (request.consumer_block_ids, True)):
        groups = []
        for group, ids in zip(config.kv_cache_groups, side, strict=False):
            b = group.kv_cache_spec.block_size
            limit = get_logical_block_count(group.kv_cache_spec, num_tokens=basis) - (
                request.prefix_hit_tokens // b if floor else 0
            )
            groups.append(ids[len(ids) - limit :] if len(ids) > limit else ids)
        fitted.append(BlockIds(groups) if len(side) else side)
    return compute_transfer_pairs(
        config, attrs.evolve(request, producer_block_ids=fitted[0], consumer_block_ids=fitted[1])
    )


def _ignores_ends(config: KVCacheConfig, request: TransferRequest) -> BlockPairs:
    """Mutant: takes the ends and drops them, pairing by length alone (what a 1.0 connector does)."""
    return compute_transfer_pairs(config, attrs.evolve(request, producer_block_ends=None, consumer_block_ends=None))


def _kvspec_1_0(config: KVCacheConfig, request: TransferRequest) -> BlockPairs:
    """Mutant: kvspec 1.0, which knows no recomputed token: the lists are judged against T alone."""
    return compute_transfer_pairs(config, attrs.evolve(request, recomputed_tokens=0))


REFERENCE: Pairing = compute_transfer_pairs


def _expect_property_to_fail(prop: Callable[[], None]) -> None:
    """Run a hypothesis property against a mutant: it must find a counterexample."""
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        settings(max_examples=400, database=None, derandomize=True, report_multiple_bugs=False)(prop)()


# --------------------------------------------------------------------------- strategies


@st.composite
def recompute_scenarios(draw: st.DrawFn, max_tokens: int = 300) -> Scenario:
    """Lists built as vLLM builds them, for T + R tokens with C recomputing R (mostly R = 1)."""
    config = draw(configs())
    b = max(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
    r = draw(st.sampled_from([1, 1, 1, 0, 2]))
    t = draw(st.integers(0, max_tokens))
    h = draw(st.integers(0, t // b)) * b
    return build_scenario(config, t, h, recomputed_tokens=r)


def _ends(s: Scenario) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Both sides' ends as each would declare them from the lists it built."""
    producer = get_block_ends(s.producer_unclipped)
    if len(s.consumer_block_ids) == 0:
        return producer, ()
    basis = s.num_tokens + s.recomputed_tokens
    firsts = [
        get_logical_block_count(g.kv_cache_spec, num_tokens=basis) - len(c)
        for g, c in zip(s.config.kv_cache_groups, s.consumer_block_ids, strict=True)
    ]
    return producer, get_block_ends(s.consumer_block_ids, first_blocks=firsts)


def _pair(
    pairing: Pairing, s: Scenario, producer: BlockIds, *, ends: bool, producer_ends: tuple[int, ...] | None = None
) -> BlockPairs:
    """Pair with both sides' ends declared (``ends``), P's overridden by ``producer_ends`` when given."""
    p_ends, c_ends = _ends(s)
    request = TransferRequest(
        num_tokens=s.num_tokens,
        prefix_hit_tokens=s.prefix_hit_tokens,
        producer_block_ids=producer,
        consumer_block_ids=s.consumer_block_ids,
        recomputed_tokens=s.recomputed_tokens,
        producer_block_ends=(producer_ends or p_ends) if ends else None,
        consumer_block_ends=c_ends if ends and len(s.consumer_block_ids) else None,
    )
    return pairing(s.config, request)


# --------------------------------------------------------------------------- WIN-1 clause 2: accept correct lists


def _check_accepts_correct_lists(pairing: Pairing, s: Scenario, ends: bool) -> None:
    pairs = _pair(pairing, s, s.producer_block_ids, ends=ends)
    basis = s.num_tokens + s.recomputed_tokens
    for g, group in enumerate(s.config.kv_cache_groups):
        if len(s.consumer_block_ids) == 0:
            break
        spec = group.kv_cache_spec
        total = get_logical_block_count(spec, num_tokens=basis)
        moved = set(zip(pairs.producer_block_ids[g], pairs.consumer_block_ids[g], strict=True))
        needed = get_needed_block_range(spec, num_tokens=s.num_tokens, prefix_hit_tokens=s.prefix_hit_tokens)
        for k in needed:
            # Every needed block moves from the producer block of the same logical position.
            consumer_id = s.consumer_block_ids[g][k - (total - len(s.consumer_block_ids[g]))]
            assert (s.producer_unclipped[g][k], consumer_id) in moved


@given(scenario=recompute_scenarios(), ends=st.booleans())
@example(  # vLLM: N = 33, B = 16, C recomputes token 32: (N - 1) % B == 0, one block more than cdiv(T, B)
    scenario=build_scenario(config_from_specs([fa(16), sw(32, 16)]), 32, 0, recomputed_tokens=1), ends=False
)
@example(  # the same with a prefix hit of one block, and ends declared
    scenario=build_scenario(config_from_specs([fa(16), sw(32, 16)]), 48, 16, recomputed_tokens=1), ends=True
)
@example(  # W = 128, B = 16 (a pinned SW-1 value) at the (N - 1) % B == 0 boundary, N = 257
    scenario=build_scenario(config_from_specs([sw(128, 16), fa(16)]), 256, 0, recomputed_tokens=1), ends=True
)
@example(  # chunked local C = 2, B = 1, T = 1, R = 2: T's chunk starts two tokens before the tail of N's (SW-1)
    scenario=build_scenario(
        config_from_specs(
            [
                ChunkedLocalAttentionSpec(
                    block_size=1, num_kv_heads=1, head_size=1, dtype="float16", attention_chunk_size=2
                ),
                fa(1),
            ]
        ),
        1,
        0,
        recomputed_tokens=2,
    ),
    ends=False,
)
def test_lists_for_the_prompt_length_are_accepted_with_the_recomputed_token(scenario: Scenario, ends: bool) -> None:
    _check_accepts_correct_lists(REFERENCE, scenario, ends)


def test_kvspec_1_0_refused_vllm_lists_at_the_boundary() -> None:
    s = build_scenario(config_from_specs([fa(16), sw(32, 16)]), 32, 0, recomputed_tokens=1)
    with pytest.raises(BlockAlignmentError, match="producer lists 3 blocks, but 32 tokens leave at most 2"):
        _check_accepts_correct_lists(_kvspec_1_0, s, ends=False)

    @given(scenario=recompute_scenarios(), ends=st.booleans())
    def prop(scenario: Scenario, ends: bool) -> None:
        _check_accepts_correct_lists(_kvspec_1_0, scenario, ends)

    with pytest.raises(BlockAlignmentError, match=r"tokens leave at most|past the request's last block"):
        settings(max_examples=400, database=None, derandomize=True, report_multiple_bugs=False)(prop)()


# --------------------------------------------------------------------------- WIN-1: refuse lists really too long


def _one_block_more(s: Scenario, g: int) -> BlockIds:
    """P's table as a side builds it for one more token at a block boundary: a real block appended to group g."""
    table = [list(ids) for ids in s.producer_unclipped]
    table[g].append(10_000)
    return get_exchange_clipped_blocks(BlockIds(table), get_blocks_per_sw(s.config))


def _check_refuses_too_long(pairing: Pairing, s: Scenario, g: int, ends: bool) -> None:
    longer = _one_block_more(s, g)
    grows = len(longer[g]) > len(s.producer_block_ids[g])
    assume(len(s.consumer_block_ids) > 0 and (grows or ends))
    table = [list(ids) + ([10_000] if i == g else []) for i, ids in enumerate(s.producer_unclipped)]
    too_long_ends = get_block_ends(table)
    with pytest.raises(BlockAlignmentError, match=f"group {g}"):
        _pair(pairing, s, longer, ends=ends, producer_ends=too_long_ends)


@given(scenario=recompute_scenarios(), data=st.data(), ends=st.booleans())
@example(  # PR #50558: a side counted the sampled token at a block boundary (T + R = 32)
    scenario=build_scenario(config_from_specs([fa(16)]), 31, 0, recomputed_tokens=1), data=None, ends=False
)
def test_a_list_really_too_long_is_refused(scenario: Scenario, data: st.DataObject | None, ends: bool) -> None:
    g = 0 if data is None else data.draw(st.integers(0, scenario.config.num_groups - 1))
    _check_refuses_too_long(REFERENCE, scenario, g, ends)


def test_a_mutant_that_trims_a_too_long_list_to_fit_fails_the_property() -> None:
    @given(scenario=recompute_scenarios(), ends=st.booleans())
    def prop(scenario: Scenario, ends: bool) -> None:
        _check_refuses_too_long(_trims_to_fit, scenario, 0, ends)

    _expect_property_to_fail(prop)


# --------------------------------------------------------------------------- ALIGN-1 clause 5: ends


@st.composite
def shifted_lists(draw: st.DrawFn) -> tuple[Scenario, int]:
    """A correct scenario and a sliding-window group whose producer list is at its budget after clipping.

    There a table one block longer (lookahead slots) clips to the same length: lengths cannot show the shift.
    """
    config = draw(configs(kinds=("sw", "sw_mla", "full")))
    budgets = get_blocks_per_sw(config)
    assume(any(budgets))
    b = max(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
    longest = max(budgets[g] * spec.kv_cache_spec.block_size for g, spec in enumerate(config.kv_cache_groups))
    t = longest + draw(st.integers(0, 3 * b))
    h = draw(st.integers(0, t // b)) * b
    s = build_scenario(config, t, h, recomputed_tokens=draw(st.sampled_from([0, 1])))
    assume(h < t)
    return s, draw(st.sampled_from([g for g, n in enumerate(budgets) if n]))


def _check_shift_refused(pairing: Pairing, s: Scenario, g: int) -> None:
    # P's table has one lookahead block in every group; clipped, group g keeps its length.
    table = BlockIds([[*ids, 20_000 + i] for i, ids in enumerate(s.producer_unclipped)])
    clipped = get_exchange_clipped_blocks(table, get_blocks_per_sw(s.config))
    assert len(clipped[g]) == len(s.producer_block_ids[g])  # lengths alone cannot show the shift
    with pytest.raises(BlockAlignmentError, match="group"):
        _pair(pairing, s, clipped, ends=True, producer_ends=get_block_ends(table))


@given(case=shifted_lists())
@example(  # the spec's example: SW-only W = 32, B = 16, T = 45, lookahead into a fourth block
    case=(build_scenario(config_from_specs([sw(32, 16)]), 45, 0), 0)
)
def test_a_list_shifted_by_lookahead_is_refused_by_its_end(case: tuple[Scenario, int]) -> None:
    _check_shift_refused(REFERENCE, *case)


def test_a_mutant_that_ignores_ends_fails_the_property() -> None:
    @given(case=shifted_lists())
    def prop(case: tuple[Scenario, int]) -> None:
        _check_shift_refused(_ignores_ends, *case)

    _expect_property_to_fail(prop)


@given(
    producer=st.lists(st.integers(1, 50), max_size=6),
    shift=st.integers(-3, 3),
    take=st.integers(0, 6),
    first=st.integers(0, 5),
)
def test_align_refuses_different_ends_and_ignores_missing_ones(
    producer: list[int], shift: int, take: int, first: int
) -> None:
    consumer = list(range(100, 100 + min(take, len(producer))))
    p_end = first + len(producer)
    c_end = p_end + shift
    assume(c_end >= len(consumer))
    plain = compute_block_pairs(BlockLists(producer_block_ids=[producer], consumer_block_ids=[consumer]))
    # A 1.0 peer on either side: 1.0's pairing, whatever the other side says.
    for p_ends, c_ends in (((p_end,), None), (None, (c_end,)), (None, None)):
        got = compute_block_pairs(
            BlockLists(
                producer_block_ids=[producer],
                consumer_block_ids=[consumer],
                producer_block_ends=p_ends,
                consumer_block_ends=c_ends,
            )
        )
        assert got == plain
    kwargs = {"producer_block_ends": (p_end,), "consumer_block_ends": (c_end,)}
    if shift:
        message = rf"group 0: the producer's list ends at logical block {p_end - 1}"
        with pytest.raises(BlockAlignmentError, match=message):
            compute_block_pairs(BlockLists(producer_block_ids=[producer], consumer_block_ids=[consumer], **kwargs))
    else:
        assert (
            compute_block_pairs(BlockLists(producer_block_ids=[producer], consumer_block_ids=[consumer], **kwargs))
            == plain
        )


def test_the_lookahead_example_in_the_spec() -> None:
    # docs/spec/alignment-and-coverage.md, ALIGN-1 clause 5.
    config = config_from_specs([sw(32, 16)])
    table = BlockIds([[11, 12, 13, 14]])
    consumer = BlockIds([[91, 92, 93]])
    assert get_consumer_block_counts(config, num_tokens=45, prefix_hit_tokens=0) == (3,)
    advertised = get_exchange_clipped_blocks(table, get_blocks_per_sw(config))
    assert advertised == BlockIds([[12, 13, 14]])
    # 1.0: lengths agree, the pairs are each one block off, and nothing notices.
    shifted = compute_transfer_pairs(
        config,
        TransferRequest(num_tokens=45, prefix_hit_tokens=0, producer_block_ids=advertised, consumer_block_ids=consumer),
    )
    assert list(shifted.iter_pairs()) == [(0, 12, 91), (0, 13, 92), (0, 14, 93)]
    with pytest.raises(BlockAlignmentError, match="ends at logical block 3, the consumer's at 2"):
        compute_block_pairs(
            BlockLists(
                producer_block_ids=advertised,
                consumer_block_ids=consumer,
                producer_block_ends=get_block_ends(table),
                consumer_block_ends=(3,),
            )
        )
    with pytest.raises(BlockAlignmentError, match="producer's list ends at logical block 3, past the request's"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=45,
                prefix_hit_tokens=0,
                producer_block_ids=advertised,
                consumer_block_ids=consumer,
                producer_block_ends=get_block_ends(table),
            ),
        )


# --------------------------------------------------------------------------- WIN-1: the window of token N - 1


@given(
    window=st.integers(2, 200),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    n=st.integers(2, 400),
)
@example(window=6, block_size=4, n=13)  # the conformance case: both boundaries at once
@example(window=32, block_size=16, n=47)  # (N - W + 1) % B == 0, vLLM 0.33.0's boundary hazard
def test_a_producer_pruned_with_the_prompt_length_is_caught_when_c_recomputes(
    window: int, block_size: int, n: int
) -> None:
    # vLLM 0.33.0 prunes P with num_computed_tokens = N while C recomputes N - 1, which attends N - W.
    config = config_from_specs([fa(block_size), sw(window, block_size)])
    s = build_scenario(config, n - 1, 0, prune_tokens=n, recomputed_tokens=1)
    hazard = n - window >= 0 and (n - window + 1) % block_size == 0
    kwargs = {
        "num_tokens": n - 1,
        "prefix_hit_tokens": 0,
        "producer_block_ids": s.producer_block_ids,
        "consumer_block_ids": s.consumer_block_ids,
        "recomputed_tokens": 1,
    }
    if hazard:
        with pytest.raises(WindowCoverageError, match=r"group 1.*producer has the null block"):
            check_window_coverage(config, TransferRequest(**kwargs))  # type: ignore[arg-type]
    else:
        check_window_coverage(config, TransferRequest(**kwargs))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- get_block_ends and argument errors


@given(table=st.lists(st.lists(st.integers(0, 50), max_size=8), max_size=4), data=st.data())
def test_block_ends_are_first_block_plus_length_and_survive_clipping(
    table: list[list[int]], data: st.DataObject
) -> None:
    firsts = data.draw(st.lists(st.integers(0, 9), min_size=len(table), max_size=len(table)))
    budgets = data.draw(st.lists(st.integers(0, 5), min_size=len(table), max_size=len(table)))
    ends = get_block_ends(table, first_blocks=firsts)
    assert ends == tuple(f + len(g) for f, g in zip(firsts, table, strict=True))
    assert get_block_ends(table) == tuple(len(g) for g in table)
    if table:
        # Clipping keeps the tail: the clipped list starts later and ends at the same block (CLIP-1).
        clipped = get_exchange_clipped_blocks(table, budgets)
        later = [f + len(g) - len(c) for f, g, c in zip(firsts, table, clipped, strict=True)]
        assert get_block_ends(clipped, first_blocks=later) == ends


def test_bad_ends_and_recomputed_tokens_are_named() -> None:
    config = config_from_specs([fa(4)])
    base = {"num_tokens": 8, "prefix_hit_tokens": 0, "producer_block_ids": [[1, 2]], "consumer_block_ids": [[3, 4]]}
    with pytest.raises(ConfigError, match="recomputed_tokens"):
        check_window_coverage(config, TransferRequest(recomputed_tokens=-1, **base))  # type: ignore[arg-type]
    with pytest.raises(GroupCountError, match="producer block ids have 1 groups, its block ends 2"):
        check_window_coverage(config, TransferRequest(producer_block_ends=(2, 2), **base))  # type: ignore[arg-type]
    with pytest.raises(BlockAlignmentError, match="holds 2 blocks but says it ends at logical block 0"):
        check_window_coverage(config, TransferRequest(consumer_block_ends=(1,), **base))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"producer_block_ends\[0\]"):
        compute_block_pairs(BlockLists(producer_block_ids=[[1]], consumer_block_ids=[[2]], producer_block_ends=(-1,)))
    with pytest.raises(GroupCountError, match="first_blocks 2"):
        get_block_ends([[1]], first_blocks=[0, 0])
    with pytest.raises(ConfigError, match="recomputed_tokens"):
        get_consumer_block_counts(config, num_tokens=8, prefix_hit_tokens=0, recomputed_tokens=-2)


def test_a_consumer_list_ending_early_leaves_needed_blocks_uncovered() -> None:
    # An end before the request's last block is allowed by itself; coverage then judges what is missing.
    config = config_from_specs([fa(4)])
    with pytest.raises(WindowCoverageError, match=r"logical block 1 .* consumer has no block"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=8,
                prefix_hit_tokens=0,
                producer_block_ids=[[1, 2]],
                consumer_block_ids=[[3]],
                consumer_block_ends=(1,),
            ),
        )


def test_consumer_counts_hold_the_block_of_the_recomputed_token() -> None:
    # N = 33, B = 16: T = 32 needs blocks 0..1; C also holds block 2, where it writes token 32.
    config = config_from_specs([fa(16), sw(32, 16)])
    assert get_consumer_block_counts(config, num_tokens=32, prefix_hit_tokens=0) == (2, 2)
    assert get_consumer_block_counts(config, num_tokens=32, prefix_hit_tokens=0, recomputed_tokens=1) == (3, 3)
    pruned = get_pruned_block_ids(config, [[1, 2, 3], [4, 5, 6]], num_computed_tokens=32)
    assert pruned == BlockIds([[1, 2, 3], [4, 5, 6]])


def test_one_declared_end_off_the_last_block_is_refused_not_tail_paired() -> None:
    # C says its list ends at block 2 (positions 0, 1), P says nothing, so P sits at the last block 3
    # (positions 0..2). Coverage holds, but tail alignment would pair C's position 1 with P's position 2;
    # the undeclared side's end is the request's last block, and different ends are refused (ALIGN-1).
    config = config_from_specs([sw(2, 1)])
    kwargs: dict[str, object] = {
        "num_tokens": 2,
        "prefix_hit_tokens": 0,
        "recomputed_tokens": 1,
        "producer_block_ids": [[0, 2, 3]],
        "consumer_block_ids": [[4, 5]],
    }
    check_window_coverage(config, TransferRequest(consumer_block_ends=(2,), **kwargs))  # type: ignore[arg-type]
    with pytest.raises(BlockAlignmentError, match=r"producer's list ends at logical block 2, the consumer's at 1"):
        compute_transfer_pairs(config, TransferRequest(consumer_block_ends=(2,), **kwargs))  # type: ignore[arg-type]
    # Declared at the last block, the same lists pair by tail as before.
    pairs = compute_transfer_pairs(config, TransferRequest(consumer_block_ends=(3,), **kwargs))  # type: ignore[arg-type]
    assert pairs.producer_block_ids == BlockIds([[2, 3]])
    assert pairs.consumer_block_ids == BlockIds([[4, 5]])
