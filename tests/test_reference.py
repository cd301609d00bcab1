"""Property tests and pinned examples for the reference functions (HMA-1 ... TOK-1)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from strategies import (
    ALL_KINDS,
    Scenario,
    block_lists,
    build_scenario,
    config_from_specs,
    configs,
    real_block_id,
    scenarios,
    specs,
)

from kvspec import (
    NULL_BLOCK_ID,
    BlockAlignmentError,
    BlockIds,
    BlockLists,
    BlockPairs,
    ChunkedLocalAttentionSpec,
    ConfigError,
    CrossAttentionSpec,
    FullAttentionSpec,
    GroupCountError,
    KVCacheConfig,
    KVCacheSpec,
    KVSpecError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TokenBasis,
    TransferMode,
    TransferRequest,
    UnsupportedHybridError,
    WindowCoverageError,
    check_hybrid_support,
    check_window_coverage,
    compute_block_pairs,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_needed_block_range,
    get_needed_token_range,
    get_num_skipped_tokens,
    get_pruned_block_ids,
    get_token_basis_group,
    is_hma_required,
)
from kvspec.spec.pins import Raises, pins_for

T = TypeVar("T", bound=Callable[..., None])


def fa(b: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=2, dtype="float16")


def sw(w: int, b: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=b, num_kv_heads=1, head_size=2, dtype="float16", sliding_window=w)


def chunked(c: int = 32, b: int = 16) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=b, num_kv_heads=1, head_size=2, dtype="float16", attention_chunk_size=c)


def mamba() -> MambaSpec:
    return MambaSpec(block_size=16, shapes=[(2, 3)], dtypes=["float32"])


# --------------------------------------------------------------------------- HMA-1


@given(config=configs(kinds=ALL_KINDS), flag=st.booleans())
def test_hma_required_iff_flag_off_and_some_group_not_full(config: KVCacheConfig, flag: bool) -> None:
    not_full = [not isinstance(g.kv_cache_spec, FullAttentionSpec) for g in config.kv_cache_groups]
    assert is_hma_required(config, disable_hybrid_kv_cache_manager=flag) == (not flag and any(not_full))


def test_hma_pins() -> None:
    # Peers' tests (test_is_hma_required; docs/spec/hybrid-admission.md, HMA-1):
    # SWA on -> True, SWA disabled -> False, FA only -> False.
    assert is_hma_required(config_from_specs([fa(), sw(32)]))
    assert not is_hma_required(config_from_specs([fa(), sw(32)]), disable_hybrid_kv_cache_manager=True)
    assert not is_hma_required(config_from_specs([fa()]))
    # MLA counts as full attention; a sliding-window-only model is hybrid (HMA-1).
    assert not is_hma_required(
        config_from_specs([MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16")])
    )
    assert is_hma_required(config_from_specs([sw(4096)]))
    # vLLM's HMA-off form of a local layer is a FullAttentionSpec with a window: not hybrid.
    local_as_full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype="fp16", sliding_window=128)
    assert not is_hma_required(config_from_specs([fa(), local_as_full]))


# --------------------------------------------------------------------------- ADM-1, ADM-2


@given(
    config=configs(kinds=ALL_KINDS),
    mode=st.sampled_from(list(TransferMode)),
    read_only=st.booleans(),
    flag=st.booleans(),
)
def test_admission_fails_closed(config: KVCacheConfig, mode: TransferMode, read_only: bool, flag: bool) -> None:
    spec_list = [g.kv_cache_spec for g in config.kv_cache_groups]
    hma = is_hma_required(config, disable_hybrid_kv_cache_manager=flag)
    # State groups are admitted under the hybrid manager and refused without it (ADM-1, STATE-1 .. STATE-5).
    state_refused = flag and any(isinstance(s, MambaSpec) for s in spec_list)
    admitted = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)
    refused = hma and any(not isinstance(s, admitted) for s in spec_list)
    write_refused = hma and read_only and mode is TransferMode.WRITE
    if state_refused or refused or write_refused:
        with pytest.raises(UnsupportedHybridError, match=r"\(ADM-[12]\)") as info:
            check_hybrid_support(config, mode=mode, read_only_hma=read_only, disable_hybrid_kv_cache_manager=flag)
        assert isinstance(info.value, NotImplementedError)
        assert "--disable-hybrid-kv-cache-manager" in str(info.value)
    else:
        check_hybrid_support(config, mode=mode, read_only_hma=read_only, disable_hybrid_kv_cache_manager=flag)


def test_cross_attention_is_rejected_naming_group_layers_kind_and_remedy() -> None:
    # Peer pin: a non-window hybrid raises (MoRIIO test_non_sliding_window_hybrid_is_rejected); chunked local,
    # the kind of that pin, is admitted since CACHE-1, so cross attention stands in for it.
    config = config_from_specs([fa(), CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype="fp16")])
    with pytest.raises(UnsupportedHybridError, match="group 1") as info:
        check_hybrid_support(config, mode="read")
    message = str(info.value)
    assert "layer.1" in message
    assert "cross_attention" in message
    assert "--disable-hybrid-kv-cache-manager" in message
    assert "layer.0" not in message  # the admitted group is not blamed
    check_hybrid_support(config, mode="read", disable_hybrid_kv_cache_manager=True)


def test_chunked_local_is_admitted_under_hma_in_both_modes() -> None:
    # CACHE-1: the window rules now stop a chunked-local group at its chunk boundary (SW-1, WIN-1).
    config = config_from_specs([fa(), chunked(32)])
    for mode in TransferMode:
        check_hybrid_support(config, mode=mode)


def test_mamba_is_admitted_under_hma_and_refused_with_the_flag() -> None:
    config = config_from_specs([fa(), mamba()])
    for mode in TransferMode:
        check_hybrid_support(config, mode=mode)  # ADM-1: state groups travel by STATE-1 .. STATE-5
    with pytest.raises(UnsupportedHybridError, match=r"group 1.*mamba.*--disable-hybrid-kv-cache-manager"):
        check_hybrid_support(config, mode=TransferMode.READ, disable_hybrid_kv_cache_manager=True)


def test_write_under_hma_is_rejected_only_for_read_only_connectors() -> None:
    # Peer pin: MoRIIO test_hybrid_write_mode_rejected (ADM-2).
    config = config_from_specs([fa(), sw(32)])
    check_hybrid_support(config, mode="write")
    check_hybrid_support(config, mode="read", read_only_hma=True)
    with pytest.raises(UnsupportedHybridError, match="READ mode"):
        check_hybrid_support(config, mode="write", read_only_hma=True)
    check_hybrid_support(config, mode="write", read_only_hma=True, disable_hybrid_kv_cache_manager=True)


def test_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mode"):
        check_hybrid_support(config_from_specs([fa()]), mode="push")


# --------------------------------------------------------------------------- SW-1


@given(config=configs(kinds=ALL_KINDS))
def test_blocks_per_sw_formula(config: KVCacheConfig) -> None:
    budgets = get_blocks_per_sw(config)
    assert len(budgets) == config.num_groups
    for budget, group in zip(budgets, config.kv_cache_groups, strict=True):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            assert budget == math.ceil(spec.sliding_window / spec.block_size) + 1
            # The budget always covers the blocks WIN-1 needs, whatever T.
            worst = max(len(get_needed_block_range(spec, num_tokens=t, prefix_hit_tokens=0)) for t in range(0, 300))
            assert worst <= budget
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            # A chunk boundary, not a window: the blocks the list's tail must keep, with R = 0, 1 or 2 (SW-1).
            c, b = spec.attention_chunk_size, spec.block_size
            assert budget == (c + b - math.gcd(c, b) - 1) // b + 2
            assert budget == c // b + 1 or c % b  # C / B + 1 when B divides C
            tails = [
                -(-(t + r) // b) - needed.start
                for t in range(0, 3 * c + 2 * b)
                for r in (0, 1, 2)
                if (needed := get_needed_block_range(spec, num_tokens=t, prefix_hit_tokens=0))
            ]
            assert max(tails, default=0) <= budget
        else:
            assert budget == 0


@pytest.mark.parametrize(
    ("window", "block_size", "expected"),
    [(p.inputs["window"], p.inputs["block_size"], *p.expected["get_blocks_per_sw"]) for p in pins_for("SW-1")],
)  # the SW-1 rows of kvspec/spec/pins.py, each with its source (MoRIIO, Mooncake, NIXL, Gemma 3 27B, SW-1)
def test_blocks_per_sw_pins(window: int, block_size: int, expected: int) -> None:
    assert get_blocks_per_sw(config_from_specs([fa(block_size), sw(window, block_size)])) == (0, expected)


def test_blocks_per_sw_counts_sw_mla_and_not_mla() -> None:
    swmla = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16", sliding_window=128)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bf16")
    # Chunked local (C=32, B=16) keeps its chunk's two blocks and one more for the recomputed tokens (SW-1).
    assert get_blocks_per_sw(config_from_specs([mla, swmla, chunked()])) == (0, 9, 3)
    # C=40: chunks start at offsets 0 and 8 of a block; 8 + 39 ends in the third block, and one more.
    assert get_blocks_per_sw(config_from_specs([chunked(40, 16), chunked(8192, 16)])) == (4, 513)


# --------------------------------------------------------------------------- CLIP-1


def clip_pin_examples(test: T) -> T:
    """An ``@example`` for every CLIP-1 pin of kvspec/spec/pins.py that clips (the refusals are tested apart)."""
    for pin in pins_for("CLIP-1"):
        if not isinstance(pin.expected["get_exchange_clipped_blocks"], Raises) and pin.inputs["block_ids"]:
            case = (BlockIds(pin.inputs["block_ids"]), list(pin.inputs["budgets"]))
            test = example(case=case).via(f"CLIP-1 pin {pin.name}")(test)
    return test


@st.composite
def ids_and_budgets(draw: st.DrawFn) -> tuple[BlockIds, list[int]]:
    n = draw(st.integers(1, 4))
    return draw(block_lists(n)), draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))


@given(case=ids_and_budgets())
@clip_pin_examples
@example(case=(BlockIds([[1, 2, 3, 4, 5]]), [0]))
@example(case=(BlockIds([[], [7]]), [3, 3]))
def test_clip_keeps_each_budgeted_tail(case: tuple[BlockIds, list[int]]) -> None:
    ids, budgets = case
    clipped = get_exchange_clipped_blocks(ids, budgets)
    assert len(clipped) == len(ids)
    for before, after, n in zip(ids, clipped, budgets, strict=True):
        if n == 0:
            assert after == before
        else:
            assert len(after) == min(n, len(before))
            assert tuple(before[len(before) - len(after) :]) == after  # a suffix: the tail
    # Clipping is idempotent, and plain nested lists give the same answer.
    assert get_exchange_clipped_blocks(clipped, budgets) == clipped
    assert get_exchange_clipped_blocks(ids.to_lists(), budgets) == clipped


def test_clip_pins() -> None:
    # MoRIIO peer pin (kvspec/spec/pins.py): W=32, B=16 -> budget 3; [20..24] -> [22, 23, 24]; FA keeps all five.
    (pin,) = [p for p in pins_for("CLIP-1") if p.name == "moriio_example"]
    config = config_from_specs([fa(), sw(32)])
    assert list(get_blocks_per_sw(config)) == pin.inputs["budgets"]
    clipped = get_exchange_clipped_blocks(pin.inputs["block_ids"], get_blocks_per_sw(config))
    assert clipped.to_lists() == pin.expected["get_exchange_clipped_blocks"]
    # HMA not required: identity ([[1..5]] -> [[1..5]]).
    assert get_exchange_clipped_blocks([[1, 2, 3, 4, 5]], (0,)) == BlockIds([[1, 2, 3, 4, 5]])


def test_clip_zero_groups_stay_zero_groups() -> None:
    assert len(get_exchange_clipped_blocks([], (0, 3))) == 0
    assert len(get_exchange_clipped_blocks(BlockIds([]), ())) == 0


def test_clip_group_count_mismatch_is_an_error() -> None:
    with pytest.raises(GroupCountError, match="2 groups"):
        get_exchange_clipped_blocks([[1], [2]], (0, 3, 3))
    with pytest.raises(GroupCountError, match=r"block ids have 2 groups, budgets have 1 \(CLIP-1\)"):
        get_exchange_clipped_blocks([[1], [2]], (0,))


def test_clip_rejects_negative_budgets() -> None:
    with pytest.raises(ConfigError, match=r"budgets\[1\]"):
        get_exchange_clipped_blocks([[1], [2]], (0, -1))


# --------------------------------------------------------------------------- ALIGN-1, NULL-1


@st.composite
def producer_and_consumer(draw: st.DrawFn) -> tuple[BlockIds, BlockIds]:
    n = draw(st.integers(1, 4))
    producer = draw(block_lists(n))
    consumer = [draw(st.lists(st.integers(0, 50), max_size=len(p))) for p in producer]
    return producer, BlockIds(consumer)


@given(case=producer_and_consumer())
@example(case=(BlockIds([[1, 2, 3, 4, 5, 6]]), BlockIds([[40, 41]])))  # partial prefix hit: tail pairs
@example(case=(BlockIds([[0, 0, 7, 8]]), BlockIds([[30, 31, 32]])))  # producer nulls are dropped
@example(case=(BlockIds([[5, 6]]), BlockIds([[]])))
def test_align_pairs_tails_and_drops_nulls(case: tuple[BlockIds, BlockIds]) -> None:
    producer, consumer = case
    pairs = compute_block_pairs(BlockLists(producer_block_ids=producer, consumer_block_ids=consumer))
    assert pairs.num_groups == len(consumer)
    for g, (p, c) in enumerate(zip(producer, consumer, strict=True)):
        expected = [
            (p[len(p) - len(c) + i], c[i])
            for i in range(len(c))
            if p[len(p) - len(c) + i] != NULL_BLOCK_ID and c[i] != NULL_BLOCK_ID
        ]
        got = list(zip(pairs.producer_block_ids[g], pairs.consumer_block_ids[g], strict=True))
        assert got == expected
    assert NULL_BLOCK_ID not in {x for group in pairs.producer_block_ids for x in group}
    assert NULL_BLOCK_ID not in {x for group in pairs.consumer_block_ids for x in group}
    assert pairs.num_pairs == sum(len(g) for g in pairs.consumer_block_ids)
    assert len(list(pairs.iter_pairs())) == pairs.num_pairs
    # Aligning the pairs again changes nothing.
    again = compute_block_pairs(
        BlockLists(producer_block_ids=pairs.producer_block_ids, consumer_block_ids=pairs.consumer_block_ids)
    )
    assert again == pairs


def test_tail_alignment_after_a_partial_prefix_hit() -> None:
    # C hit its first 3 blocks locally, so its list is the uncached suffix: the last 2 of P's 5.
    pairs = compute_block_pairs(BlockLists(producer_block_ids=[[11, 12, 13, 14, 15]], consumer_block_ids=[[91, 92]]))
    assert list(pairs.iter_pairs()) == [(0, 14, 91), (0, 15, 92)]


def test_align_handles_groups_independently() -> None:
    pairs = compute_block_pairs(
        BlockLists(producer_block_ids=[[1, 2, 3, 4, 5], [0, 0, 8, 9]], consumer_block_ids=[[21, 22, 23], [31, 32, 33]])
    )
    assert pairs.producer_block_ids == BlockIds([[3, 4, 5], [8, 9]])
    assert pairs.consumer_block_ids == BlockIds([[21, 22, 23], [32, 33]])


@given(producer=block_lists(2, max_len=5), extra=st.integers(1, 3))
def test_consumer_longer_than_producer_is_rejected(producer: BlockIds, extra: int) -> None:
    consumer = [list(producer[0]), [1] * (len(producer[1]) + extra)]
    with pytest.raises(BlockAlignmentError, match="group 1"):
        compute_block_pairs(BlockLists(producer_block_ids=producer, consumer_block_ids=consumer))


def test_empty_consumer_list_yields_no_pairs() -> None:
    pairs = compute_block_pairs(BlockLists(producer_block_ids=[[1, 2], [3]], consumer_block_ids=[]))
    assert pairs.num_groups == 0
    assert pairs.num_pairs == 0
    assert list(pairs.iter_pairs()) == []
    # Empty per-group lists keep the groups but pair nothing.
    assert compute_block_pairs(BlockLists(producer_block_ids=[[1, 2], [3]], consumer_block_ids=[[], []])).num_pairs == 0


def test_align_group_count_mismatch() -> None:
    with pytest.raises(GroupCountError, match=r"producer has 1 groups, consumer 2 \(ALIGN-1\)"):
        compute_block_pairs(BlockLists(producer_block_ids=[[1, 2]], consumer_block_ids=[[1], [2]]))


def test_block_pairs_validates_itself() -> None:
    with pytest.raises(BlockAlignmentError, match="NULL-1"):
        BlockPairs(producer_block_ids=[[0]], consumer_block_ids=[[5]])
    with pytest.raises(BlockAlignmentError, match=r"BlockPairs: group 0 pairs 2 producer with 1 consumer ids"):
        BlockPairs(producer_block_ids=[[1, 2]], consumer_block_ids=[[5]])
    with pytest.raises(GroupCountError, match=r"BlockPairs: 1 producer groups, 2 consumer groups \(ALIGN-1\)"):
        BlockPairs(producer_block_ids=[[1]], consumer_block_ids=[[5], [6]])
    assert BlockPairs(producer_block_ids=[], consumer_block_ids=[]).num_groups == 0


# --------------------------------------------------------------------------- TOK-1


@given(config=configs(kinds=ALL_KINDS))
def test_token_basis_is_the_first_full_attention_group(config: KVCacheConfig) -> None:
    basis = get_token_basis_group(config)
    full = [i for i, g in enumerate(config.kv_cache_groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    if not full:
        assert basis is None
    else:
        assert basis == TokenBasis(
            group_index=full[0], block_size=config.kv_cache_groups[full[0]].kv_cache_spec.block_size
        )


def test_token_basis_pins() -> None:
    # MoRIIO test_token_count_basis_uses_full_attention_group: idx 0, block size 16.
    assert get_token_basis_group(config_from_specs([fa(16), sw(32)])) == TokenBasis(group_index=0, block_size=16)
    # Never a clipped sliding-window group, even when it comes first.
    assert get_token_basis_group(config_from_specs([sw(32, 8), fa(32)])) == TokenBasis(group_index=1, block_size=32)
    assert get_token_basis_group(config_from_specs([sw(4096)])) is None


# --------------------------------------------------------------------------- WIN-1


def _oracle_covered(scenario_config: KVCacheConfig, t: int, h: int, producer: BlockIds, consumer: BlockIds) -> bool:
    """Walk every needed token position and look its block up on both sides (independent of the reference)."""
    if len(consumer) == 0:
        consumer = BlockIds([()] * scenario_config.num_groups)
    for g, group in enumerate(scenario_config.kv_cache_groups):
        spec = group.kv_cache_spec
        b = spec.block_size
        total = -(-t // b)
        start = h if not isinstance(spec, SlidingWindowSpec) else max(h, t - spec.sliding_window + 1)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            start = max(h, t - t % spec.attention_chunk_size)  # the token at t attends its own chunk only
        for position in range(start, t):
            logical = position // b
            for ids in (producer[g], consumer[g]):
                index = logical - (total - len(ids))
                if index < 0 or ids[index] == NULL_BLOCK_ID:
                    return False
    return True


@given(scenario=scenarios())
def test_vllm_built_lists_cover_the_window_and_pair_every_needed_block(scenario: Scenario) -> None:
    s = scenario
    assert _oracle_covered(s.config, s.num_tokens, s.prefix_hit_tokens, s.producer_block_ids, s.consumer_block_ids)
    pairs = compute_transfer_pairs(
        s.config,
        TransferRequest(
            num_tokens=s.num_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            producer_block_ids=s.producer_block_ids,
            consumer_block_ids=s.consumer_block_ids,
        ),
    )
    for g, group in enumerate(s.config.kv_cache_groups):
        needed = get_needed_block_range(
            group.kv_cache_spec, num_tokens=s.num_tokens, prefix_hit_tokens=s.prefix_hit_tokens
        )
        # Every needed block moves, and it moves from the producer block of the same logical position.
        assert len(pairs.consumer_block_ids[g]) >= len(needed)
        total = -(-s.num_tokens // group.kv_cache_spec.block_size)
        for k in needed:
            producer_id = s.producer_unclipped[g][k]
            consumer_id = s.consumer_block_ids[g][k - (total - len(s.consumer_block_ids[g]))]
            assert (producer_id, consumer_id) in set(
                zip(pairs.producer_block_ids[g], pairs.consumer_block_ids[g], strict=True)
            )


@given(scenario=scenarios(), data=st.data())
def test_coverage_agrees_with_a_position_by_position_oracle(scenario: Scenario, data: st.DataObject) -> None:
    s = scenario
    g = data.draw(st.integers(0, s.config.num_groups - 1))
    side = data.draw(st.sampled_from(["producer", "consumer"]))
    ids = s.producer_block_ids if side == "producer" else s.consumer_block_ids
    assume(len(ids[g]) > 0)
    i = data.draw(st.integers(0, len(ids[g]) - 1))
    broken = BlockIds(
        [[NULL_BLOCK_ID if (gg, j) == (g, i) else x for j, x in enumerate(grp)] for gg, grp in enumerate(ids)]
    )
    producer = broken if side == "producer" else s.producer_block_ids
    consumer = broken if side == "consumer" else s.consumer_block_ids
    expected = _oracle_covered(s.config, s.num_tokens, s.prefix_hit_tokens, producer, consumer)
    kwargs: dict[str, Any] = {"num_tokens": s.num_tokens, "prefix_hit_tokens": s.prefix_hit_tokens}
    if expected:
        check_window_coverage(
            s.config, TransferRequest(producer_block_ids=producer, consumer_block_ids=consumer, **kwargs)
        )
    else:
        with pytest.raises(WindowCoverageError, match=f"group {g}"):
            check_window_coverage(
                s.config, TransferRequest(producer_block_ids=producer, consumer_block_ids=consumer, **kwargs)
            )


@given(
    window=st.integers(2, 200),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    t=st.integers(1, 400),
    hit_blocks=st.integers(0, 30),
)
@example(window=32, block_size=16, t=46, hit_blocks=0)  # (T-W+2) % B == 0: the H2 hazard
@example(window=32, block_size=16, t=47, hit_blocks=0)  # (T-W+1) % B == 0: safe
@example(window=1024, block_size=16, t=131070, hit_blocks=0)
def test_producer_pruned_with_one_token_too_many_is_caught(
    window: int, block_size: int, t: int, hit_blocks: int
) -> None:
    # Research H2: vLLM prunes P with request.num_tokens (N+1 after one sampled token). That nulls the
    # block holding position T-W+1 exactly when (T-W+2) % B == 0 and that block is still needed.
    h = min(hit_blocks * block_size, (t // block_size) * block_size)
    config = config_from_specs([fa(block_size), sw(window, block_size)])
    scenario = build_scenario(config, t, h, prune_tokens=t + 1)
    first_needed = t - window + 1
    hazard = (t - window + 2) > 0 and (t - window + 2) % block_size == 0 and h <= first_needed
    kwargs: dict[str, Any] = {
        "num_tokens": t,
        "prefix_hit_tokens": h,
        "producer_block_ids": scenario.producer_block_ids,
        "consumer_block_ids": scenario.consumer_block_ids,
    }
    if hazard:
        with pytest.raises(WindowCoverageError, match=r"group 1.*producer has the null block"):
            check_window_coverage(config, TransferRequest(**kwargs))
    else:
        check_window_coverage(config, TransferRequest(**kwargs))


def _win_case(t: int, w: int = 32, b: int = 16) -> tuple[KVCacheConfig, range]:
    config = config_from_specs([fa(b), sw(w, b)])
    return config, get_needed_block_range(config.kv_cache_groups[1].kv_cache_spec, num_tokens=t, prefix_hit_tokens=0)


@pytest.mark.parametrize("t", [46, 47, 62, 63])
def test_window_boundaries_with_nulls_on_either_side(t: int) -> None:
    # W=32, B=16: t=47, 63 -> (T-W+1) % B == 0; t=46, 62 -> (T-W+2) % B == 0 (DESIGN WIN-1 boundaries).
    config, needed = _win_case(t)
    first = t - 32 + 1
    assert needed.start == first // 16
    scenario = build_scenario(config, t, 0)
    p, c = scenario.producer_block_ids, scenario.consumer_block_ids
    kwargs: dict[str, Any] = {"num_tokens": t, "prefix_hit_tokens": 0}
    check_window_coverage(config, TransferRequest(producer_block_ids=p, consumer_block_ids=c, **kwargs))
    total = -(-t // 16)

    def null_logical(ids: BlockIds, k: int) -> BlockIds:
        first_logical = total - len(ids[1])
        return BlockIds([ids[0], [0 if j + first_logical == k else x for j, x in enumerate(ids[1])]])

    # A null at the first needed block fails on either side ...
    for side in ("producer", "consumer"):
        bad_p = null_logical(p, needed.start) if side == "producer" else p
        bad_c = null_logical(c, needed.start) if side == "consumer" else c
        with pytest.raises(WindowCoverageError, match=f"{side} has the null block"):
            check_window_coverage(config, TransferRequest(producer_block_ids=bad_p, consumer_block_ids=bad_c, **kwargs))
    # ... and a null just before it is harmless on either side.
    if needed.start > 0:
        for side in ("producer", "consumer"):
            k = needed.start - 1
            if side == "consumer" and total - len(c[1]) > k:
                continue  # C holds no block there at all
            bad_p = null_logical(p, k) if side == "producer" else p
            bad_c = null_logical(c, k) if side == "consumer" else c
            check_window_coverage(config, TransferRequest(producer_block_ids=bad_p, consumer_block_ids=bad_c, **kwargs))


def test_window_boundary_positions_are_exact() -> None:
    spec = sw(32)
    # (T-W+1) % B == 0: the window starts exactly on a block boundary.
    assert get_needed_token_range(spec, num_tokens=47, prefix_hit_tokens=0) == range(16, 47)
    assert get_needed_block_range(spec, num_tokens=47, prefix_hit_tokens=0) == range(1, 3)
    # (T-W+2) % B == 0: the window starts on the last token of a block, which is still needed.
    assert get_needed_token_range(spec, num_tokens=46, prefix_hit_tokens=0) == range(15, 46)
    assert get_needed_block_range(spec, num_tokens=46, prefix_hit_tokens=0) == range(0, 3)


def test_win_with_zero_tokens_needs_nothing() -> None:
    config = config_from_specs([fa(), sw(32)])
    check_window_coverage(
        config, TransferRequest(num_tokens=0, prefix_hit_tokens=0, producer_block_ids=[[], []], consumer_block_ids=[])
    )
    check_window_coverage(
        config,
        TransferRequest(num_tokens=0, prefix_hit_tokens=0, producer_block_ids=[[], []], consumer_block_ids=[[], []]),
    )
    assert get_consumer_block_counts(config, num_tokens=0, prefix_hit_tokens=0) == (0, 0)


def test_full_prefix_hit_needs_nothing_and_zero_groups_pass() -> None:
    config = config_from_specs([fa(), sw(32)])
    check_window_coverage(
        config,
        TransferRequest(
            num_tokens=64, prefix_hit_tokens=64, producer_block_ids=[[1, 2, 3, 4], [3, 4]], consumer_block_ids=[]
        ),
    )
    assert (
        compute_transfer_pairs(
            config,
            TransferRequest(
                num_tokens=64, prefix_hit_tokens=64, producer_block_ids=[[1, 2, 3, 4], [3, 4]], consumer_block_ids=[]
            ),
        ).num_groups
        == 0
    )


def test_zero_consumer_groups_while_blocks_are_needed_fails() -> None:
    config = config_from_specs([fa(), sw(32)])
    with pytest.raises(WindowCoverageError, match="zero groups"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=64, prefix_hit_tokens=32, producer_block_ids=[[1, 2, 3, 4], [3, 4]], consumer_block_ids=[]
            ),
        )


def test_prefix_hit_must_be_whole_blocks_of_every_group() -> None:
    config = config_from_specs([fa(16), sw(64, 32)])
    with pytest.raises(BlockAlignmentError, match="group 1"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=100,
                prefix_hit_tokens=16,
                producer_block_ids=[[1] * 7, [2] * 4],
                consumer_block_ids=[[3] * 6, [4] * 3],
            ),
        )
    with pytest.raises(BlockAlignmentError, match="multiple"):
        get_consumer_block_counts(config, num_tokens=100, prefix_hit_tokens=5)


def test_bad_token_counts_are_config_errors() -> None:
    config = config_from_specs([fa()])
    with pytest.raises(ConfigError, match="prefix_hit_tokens"):
        check_window_coverage(
            config,
            TransferRequest(num_tokens=16, prefix_hit_tokens=32, producer_block_ids=[[1]], consumer_block_ids=[[2]]),
        )
    with pytest.raises(ConfigError, match="num_tokens"):
        check_window_coverage(
            config,
            TransferRequest(num_tokens=-1, prefix_hit_tokens=0, producer_block_ids=[[1]], consumer_block_ids=[[2]]),
        )


def test_lists_longer_than_the_request_are_rejected() -> None:
    # B4: one side counted a sampled token, so at a block boundary it holds one block too many.
    config = config_from_specs([fa()])
    with pytest.raises(BlockAlignmentError, match="producer lists 3 blocks"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=32, prefix_hit_tokens=0, producer_block_ids=[[1, 2, 3]], consumer_block_ids=[[4, 5]]
            ),
        )
    with pytest.raises(BlockAlignmentError, match="consumer lists 2 blocks"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=32, prefix_hit_tokens=16, producer_block_ids=[[1, 2]], consumer_block_ids=[[4, 5]]
            ),
        )


def test_missing_full_attention_block_is_reported() -> None:
    config = config_from_specs([fa()])
    with pytest.raises(WindowCoverageError, match="consumer has no block"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=48, prefix_hit_tokens=0, producer_block_ids=[[1, 2, 3]], consumer_block_ids=[[4, 5]]
            ),
        )


def test_coverage_group_count_mismatch() -> None:
    config = config_from_specs([fa(), sw(32)])
    with pytest.raises(GroupCountError, match=r"producer block ids have 1 groups, the config 2 \(WIN-1\)"):
        check_window_coverage(
            config,
            TransferRequest(
                num_tokens=16, prefix_hit_tokens=0, producer_block_ids=[[1]], consumer_block_ids=[[2], [3]]
            ),
        )


# --------------------------------------------------------------------------- engine helpers


@given(spec=st.sampled_from(["full", "sw", "chunked", "mamba"]).flatmap(specs), n=st.integers(0, 500))
def test_skipped_tokens(spec: KVCacheSpec, n: int) -> None:
    skipped = get_num_skipped_tokens(spec, num_computed_tokens=n)
    if isinstance(spec, SlidingWindowSpec):
        assert skipped == max(0, n - spec.sliding_window + 1)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        assert skipped == n - n % spec.attention_chunk_size
    elif isinstance(spec, MambaSpec):
        assert skipped == max(0, n - 1)
    else:
        assert skipped == 0


def test_skipped_token_pins() -> None:
    # vLLM's docstrings (docs/spec/alignment-and-coverage.md, WIN-1): W=4, n=7 -> 4; C=8: n=13 -> 8, n=8 -> 8, n=7 -> 0.
    assert get_num_skipped_tokens(sw(4, 1), num_computed_tokens=7) == 4
    assert [get_num_skipped_tokens(chunked(8), num_computed_tokens=n) for n in (13, 8, 7)] == [8, 8, 0]


@given(config=configs(kinds=("full", "sw", "chunked")), n=st.integers(0, 300), data=st.data())
def test_pruning_nulls_only_whole_skipped_leading_blocks(config: KVCacheConfig, n: int, data: st.DataObject) -> None:
    ids = data.draw(block_lists(config.num_groups, ids=real_block_id))
    pruned = get_pruned_block_ids(config, ids, num_computed_tokens=n)
    for before, after, group in zip(ids, pruned, config.kv_cache_groups, strict=True):
        spec = group.kv_cache_spec
        k = min(get_num_skipped_tokens(spec, num_computed_tokens=n) // spec.block_size, len(before))
        assert after == (NULL_BLOCK_ID,) * k + tuple(before[k:])
    assert get_pruned_block_ids(config, pruned, num_computed_tokens=n) == pruned


def test_pruning_stops_at_the_first_null_walking_back() -> None:
    config = config_from_specs([sw(4, 1)])
    # skipped(7) = 4 -> k = 4; walking back from index 3 stops at the null at index 2.
    assert get_pruned_block_ids(config, [[5, 6, 0, 8, 9, 10, 11]], num_computed_tokens=7) == BlockIds(
        [[5, 6, 0, 0, 9, 10, 11]]
    )


@given(scenario=scenarios())
def test_consumer_block_counts_match_what_is_needed(scenario: Scenario) -> None:
    s = scenario
    counts = get_consumer_block_counts(s.config, num_tokens=s.num_tokens, prefix_hit_tokens=s.prefix_hit_tokens)
    for count, group in zip(counts, s.config.kv_cache_groups, strict=True):
        spec = group.kv_cache_spec
        needed = get_needed_block_range(spec, num_tokens=s.num_tokens, prefix_hit_tokens=s.prefix_hit_tokens)
        assert count == len(needed)  # C allocates exactly what WIN-1 needs from its first needed block on
        budget = get_blocks_per_sw(config_from_specs([spec]))[0]
        if budget:
            assert count <= budget


def test_gemma3_27b_128k_request() -> None:
    from kvspec.presets import get_preset

    config = get_preset("gemma-3-27b").build_config(num_blocks=2, max_layers_per_group=1, head_size_divisor=128)
    t = 128 * 1024
    counts = get_consumer_block_counts(config, num_tokens=t, prefix_hit_tokens=0)
    assert counts == (64,) * 6 + (8192,)
    scenario = build_scenario(config, t, 0)
    assert [len(g) for g in scenario.producer_block_ids] == [65] * 6 + [8192]
    pairs = compute_transfer_pairs(
        config,
        TransferRequest(
            num_tokens=t,
            prefix_hit_tokens=0,
            producer_block_ids=scenario.producer_block_ids,
            consumer_block_ids=scenario.consumer_block_ids,
        ),
    )
    assert pairs.num_pairs == 6 * 64 + 8192


def test_all_errors_share_the_root() -> None:
    for error in (BlockAlignmentError, GroupCountError, WindowCoverageError, UnsupportedHybridError, ConfigError):
        assert issubclass(error, KVSpecError)


def test_worked_example_in_the_spec() -> None:
    """docs/explanation/worked-example.md: every number on that page."""
    config = config_from_specs([sw(48), fa()])
    assert is_hma_required(config)
    check_hybrid_support(config, mode="write")
    assert get_blocks_per_sw(config) == (4, 0)
    assert get_token_basis_group(config) == TokenBasis(group_index=1, block_size=16)
    sw_spec, fa_spec = (g.kv_cache_spec for g in config.kv_cache_groups)
    assert get_needed_token_range(sw_spec, num_tokens=100, prefix_hit_tokens=32) == range(53, 100)
    assert get_needed_block_range(sw_spec, num_tokens=100, prefix_hit_tokens=32) == range(3, 7)
    assert get_needed_block_range(fa_spec, num_tokens=100, prefix_hit_tokens=32) == range(2, 7)
    held = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]]
    pruned = get_pruned_block_ids(config, held, num_computed_tokens=100)
    assert pruned == BlockIds([[0, 0, 0, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]])
    producer = get_exchange_clipped_blocks(pruned, get_blocks_per_sw(config))
    assert producer == BlockIds([[14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]])
    assert get_consumer_block_counts(config, num_tokens=100, prefix_hit_tokens=32) == (4, 5)
    consumer = [[41, 42, 43, 44], [51, 52, 53, 54, 55]]
    pairs = compute_transfer_pairs(
        config,
        TransferRequest(num_tokens=100, prefix_hit_tokens=32, producer_block_ids=producer, consumer_block_ids=consumer),
    )
    assert pairs.producer_block_ids == BlockIds([[14, 15, 16, 17], [23, 24, 25, 26, 27]])
    assert pairs.consumer_block_ids == BlockIds(consumer)
    # Section 6: T = 94, (T - W + 2) % B == 0.
    held6 = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]]
    c6 = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    good = get_exchange_clipped_blocks(get_pruned_block_ids(config, held6, num_computed_tokens=94), (4, 0))
    assert good[0] == (13, 14, 15, 16)
    check_window_coverage(
        config, TransferRequest(num_tokens=94, prefix_hit_tokens=0, producer_block_ids=good, consumer_block_ids=c6)
    )
    bad = get_exchange_clipped_blocks(get_pruned_block_ids(config, held6, num_computed_tokens=95), (4, 0))
    assert bad[0] == (0, 14, 15, 16)
    with pytest.raises(
        WindowCoverageError, match=r"logical block 2 \(tokens \[32, 47\]\).*producer has the null block"
    ):
        check_window_coverage(
            config, TransferRequest(num_tokens=94, prefix_hit_tokens=0, producer_block_ids=bad, consumer_block_ids=c6)
        )
