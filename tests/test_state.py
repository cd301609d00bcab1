"""State groups (Mamba, GDN, KDA): the plain definitions of STATE-1 .. STATE-5, admission, and exchanges end to end."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvspec_conformance import Request, Scenario, run_scenario
from kvspec_conformance.configs import full, gdn, make_config, mamba, sw

import kvspec.reference._reference as fast
from kvspec import (
    BlockAlignmentError,
    BlockIds,
    ConsumerState,
    EngineDescriptor,
    IncompatiblePeerError,
    KVCacheConfig,
    MambaSpec,
    StatePositionError,
    StateProfile,
    StateSlotError,
    TransferMode,
    TransferRequest,
    UnsupportedHybridError,
    check_compatibility,
    decode_error,
    encode_error,
)
from kvspec.exchange import ConsumerEndpoint, ProducerEndpoint, connect, run_request
from kvspec.spec import (
    check_hybrid_support,
    check_state_position,
    check_state_prefix_hit,
    compute_transfer_pairs,
    get_state_clipped_blocks,
    get_state_clipped_slots,
    get_state_differences,
    get_state_prefix_hit,
    pair_state_slots,
)
from kvspec.testing import allocate_pool, fill_producer_pages
from kvspec.transport.loopback import LoopbackBackend

FA_MAMBA = make_config(full(), mamba(), num_blocks=24)
FA_GDN_ALIGN = make_config(full(), gdn(cache_mode="align", num_speculative_blocks=2), num_blocks=32)


def _state(config: KVCacheConfig, group: int = 1) -> MambaSpec:
    spec = config.kv_cache_groups[group].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    return spec


def _with_state(config: KVCacheConfig, **changes: Any) -> KVCacheConfig:
    groups = [
        attrs.evolve(g, kv_cache_spec=attrs.evolve(g.kv_cache_spec, **changes))
        if isinstance(g.kv_cache_spec, MambaSpec)
        else g
        for g in config.kv_cache_groups
    ]
    # Room for a bigger state page (only descriptors are built from such a config, no pool).
    tensors = [attrs.evolve(t, size=t.size * 4) for t in config.kv_cache_tensors]
    return attrs.evolve(config, kv_cache_groups=groups, kv_cache_tensors=tensors)


# --------------------------------------------------------------------------- STATE-1


def test_state_position_accepts_t_equal_to_t_and_refuses_any_other_naming_both() -> None:
    check_state_position(FA_MAMBA, state_tokens=9, num_tokens=9, recomputed_tokens=1)
    for t in (8, 10):  # a state short of T misses a token; one past T double-applies a recomputed token
        with pytest.raises(StatePositionError, match=rf"t={t} .*T=num_tokens=9.*\(STATE-1\)"):
            check_state_position(FA_MAMBA, state_tokens=t, num_tokens=9, recomputed_tokens=1)


def test_a_missing_state_position_is_refused_by_name_only_where_there_is_state() -> None:
    with pytest.raises(StatePositionError, match=r"kvspec_state_tokens: missing.*1\.1"):
        check_state_position(FA_MAMBA, state_tokens=None, num_tokens=9)
    check_state_position(make_config(full(), sw(8)), state_tokens=None, num_tokens=9)  # no state: nothing to place


def test_the_prebuilt_profile_recomputes_nothing() -> None:
    check_state_position(FA_MAMBA, state_tokens=10, num_tokens=10, profile="prebuilt")
    with pytest.raises(StatePositionError, match=r"recomputed_tokens: expected 0 under the prebuilt"):
        check_state_position(FA_MAMBA, state_tokens=10, num_tokens=10, recomputed_tokens=1, profile="prebuilt")


def test_state_errors_cross_the_error_codec_as_themselves() -> None:
    for error in (StatePositionError("t=3 T=4"), StateSlotError("group 1")):
        back = decode_error(encode_error(error))
        assert type(back) is type(error)
        assert str(back) == str(error)
        assert isinstance(back, BlockAlignmentError)  # a request it ends fails with reason block_alignment


# --------------------------------------------------------------------------- STATE-2


@pytest.mark.parametrize(
    ("slots", "scratch", "kept"),
    [
        ((0, 0, 5, 8, 9), 2, (5,)),  # nulls are placeholders, the two scratch slots never travel
        ((7,), 3, (7,)),  # never below one slot
        ((4, 6), 0, (6,)),
        ((), 2, ()),  # nothing listed: nothing kept; pairing refuses it where state is needed
    ],
)
def test_clip_keeps_exactly_the_state_slot(slots: tuple[int, ...], scratch: int, kept: tuple[int, ...]) -> None:
    spec = attrs.evolve(_state(FA_MAMBA), num_speculative_blocks=scratch)
    assert get_state_clipped_slots(spec, slots) == kept


def test_clip_refuses_a_null_state_slot_and_leaves_attention_groups_alone() -> None:
    with pytest.raises(StateSlotError, match=r"group 1 \(mamba2\).*null block.*\(STATE-2\)"):
        get_state_clipped_slots(_state(FA_MAMBA), (3, 0), group=1)
    assert get_state_clipped_blocks(FA_GDN_ALIGN, BlockIds([[1, 2, 3], [0, 4, 5, 6]])) == BlockIds([[1, 2, 3], [4]])
    assert get_state_clipped_blocks(FA_GDN_ALIGN, BlockIds([])) == BlockIds([])


# --------------------------------------------------------------------------- STATE-3


def test_slots_pair_last_with_last_and_a_consumer_may_list_one_more() -> None:
    assert pair_state_slots((5,), (9,)) == (5, 9)
    assert pair_state_slots((0, 0, 5), (9,)) == (5, 9)  # producer longer: a consumer prefix hit, its tail
    assert pair_state_slots((5,), (0, 9)) == (5, 9)  # consumer longer by one: head-trimmed, its last receives
    with pytest.raises(StateSlotError, match=r"group 2: the consumer lists 3 state slots, the producer 1"):
        pair_state_slots((5,), (0, 0, 9), group=2)
    with pytest.raises(StateSlotError, match=r"the producer lists no state slot"):
        pair_state_slots((), (9,))
    with pytest.raises(StateSlotError, match=r"the consumer's state slot is the null block"):
        pair_state_slots((5,), (9, 0))


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 40),
    hit_blocks=st.integers(0, 10),
    recomputed=st.integers(0, 2),
    extra=st.integers(0, 1),
)
def test_pairs_of_a_state_hybrid_equal_between_the_definition_and_the_fast_path(
    tokens: int, hit_blocks: int, recomputed: int, extra: int
) -> None:
    # FA + GDN in align mode with two scratch slots: the state group pairs its one slot, FA by tail.
    hit = min(hit_blocks * 4, (tokens - 1) // 4 * 4)
    fa_total, slots = -(-(tokens + recomputed) // 4), -(-(tokens + recomputed) // 4)
    producer = [list(range(1, fa_total + 1)), [0] * (slots - 1) + [50, 51, 52]]
    consumer = [list(range(100, 100 + fa_total - hit // 4)), [0] * extra + [90, 91, 92]]
    args = {
        "num_tokens": tokens,
        "prefix_hit_tokens": hit,
        "producer_block_ids": producer,
        "consumer_block_ids": consumer,
        "recomputed_tokens": recomputed,
    }
    plain = compute_transfer_pairs(FA_GDN_ALIGN, TransferRequest(**args))  # type: ignore[arg-type]
    assert fast.compute_transfer_pairs(FA_GDN_ALIGN, TransferRequest(**args)) == plain  # type: ignore[arg-type]
    assert plain.producer_block_ids[1] == (50,)
    assert plain.consumer_block_ids[1] == (90,)


# --------------------------------------------------------------------------- STATE-4


def test_an_align_hit_ends_on_a_state_boundary_and_none_mode_caches_no_state() -> None:
    check_state_prefix_hit(FA_GDN_ALIGN, prefix_hit_tokens=8)
    with pytest.raises(BlockAlignmentError, match=r"prefix_hit_tokens=8 does not end on a state boundary.*\(STATE-4\)"):
        check_state_prefix_hit(_with_state(FA_GDN_ALIGN, block_size=16), prefix_hit_tokens=8)
    check_state_prefix_hit(FA_MAMBA, prefix_hit_tokens=0)
    with pytest.raises(BlockAlignmentError, match=r"cache mode 'none'.*expected 0 \(STATE-4\)"):
        check_state_prefix_hit(FA_MAMBA, prefix_hit_tokens=4)
    # The exchange checks it before WIN-1 and pairing.
    with pytest.raises(BlockAlignmentError, match=r"STATE-4"):
        fast.get_consumer_block_counts(FA_MAMBA, num_tokens=10, prefix_hit_tokens=4)


def test_group_hits_reconcile_to_their_minimum_on_every_boundary() -> None:
    config = make_config(full(4), gdn(8, cache_mode="align"))
    assert get_state_prefix_hit(config, [24, 16]) == 16
    assert get_state_prefix_hit(config, [12, 16]) == 8  # 12 is no state boundary of the B=8 group
    assert get_state_prefix_hit(config, [0, 16]) == 0


def test_a_full_hit_moves_nothing() -> None:
    assert fast.get_consumer_block_counts(FA_GDN_ALIGN, num_tokens=8, prefix_hit_tokens=8) == (0, 0)
    assert fast.get_consumer_block_counts(FA_GDN_ALIGN, num_tokens=9, prefix_hit_tokens=8) == (1, 1)


# --------------------------------------------------------------------------- STATE-5 and the handshake


def _descriptor(config: KVCacheConfig, profile: StateProfile | None = None) -> EngineDescriptor:
    return EngineDescriptor.from_config(
        engine_id="e", config=config, mode=TransferMode.READ, hma_enabled=True, state_profile=profile
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"conv_layout": "SD"}, "conv_layout"),
        ({"mamba_type": "kda"}, "mamba_type"),
        ({"shapes": [(2, 2), (2, 4)], "dtypes": ["int8", "int8"]}, "shapes"),
        ({"dtypes": ["int8", "uint8"]}, "dtypes"),
        ({"page_size_padded": 64}, "page_size_bytes"),
    ],
)
def test_state_layouts_must_match_naming_the_field(change: dict[str, object], field: str) -> None:
    other = _with_state(FA_GDN_ALIGN, **change)
    assert field in get_state_differences(_state(FA_GDN_ALIGN), _state(other))
    with pytest.raises(IncompatiblePeerError, match=r"groups\[1\]\.") as info:
        check_compatibility(producer=_descriptor(FA_GDN_ALIGN), consumer=_descriptor(other))
    assert any(key.startswith("groups[1].") for key in info.value.differences)
    # Cache mode and scratch slots are each side's own (STATE-5).
    assert get_state_differences(_state(FA_GDN_ALIGN), attrs.evolve(_state(FA_GDN_ALIGN), cache_mode="none")) == {}


def test_peers_of_different_state_profiles_are_refused_at_handshake() -> None:
    assert _descriptor(FA_MAMBA).state_profile is StateProfile.RECOMPUTE  # state groups carry a profile
    assert _descriptor(make_config(full())).state_profile is None
    with pytest.raises(IncompatiblePeerError, match=r"state_profile: producer='recompute' consumer='prebuilt'"):
        check_compatibility(producer=_descriptor(FA_MAMBA), consumer=_descriptor(FA_MAMBA, StateProfile.PREBUILT))


# --------------------------------------------------------------------------- ADM-1


@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "gdn_attn", "gdn_attention", "kda"])
def test_state_kinds_are_admitted_in_both_modes_with_full_and_sliding_window(kind: str) -> None:
    config = _with_state(make_config(full(), sw(8), mamba()), mamba_type=kind)
    for mode in TransferMode:
        check_hybrid_support(config, mode=mode)


def test_admission_still_refuses_by_name() -> None:
    with pytest.raises(UnsupportedHybridError, match=r"group 1 .*mamba_type 'short_conv'"):
        check_hybrid_support(_with_state(FA_MAMBA, mamba_type="short_conv"), mode="read")
    with pytest.raises(UnsupportedHybridError, match=r"pipeline_parallel_size: expected 1 with state groups, got 2"):
        check_hybrid_support(FA_MAMBA, mode="read", pipeline_parallel_size=2)
    check_hybrid_support(make_config(full(), sw(8)), mode="read", pipeline_parallel_size=2)  # no state: PP is fine
    with pytest.raises(UnsupportedHybridError, match=r"only under the hybrid KV-cache manager"):
        check_hybrid_support(FA_MAMBA, mode="write", disable_hybrid_kv_cache_manager=True)


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("config", [FA_MAMBA, FA_GDN_ALIGN], ids=["fa+mamba2", "fa+gdn-align-spec2"])
def test_endpoints_move_the_state_slot_byte_exactly(config: KVCacheConfig, mode: TransferMode) -> None:
    backend = LoopbackBackend()
    with allocate_pool(config, shared=False) as p_pool, allocate_pool(config, shared=False) as c_pool:
        producer = ProducerEndpoint(
            engine_id="P", config=config, transport=backend.create_agent("p"), regions=p_pool.regions, mode=mode
        )
        consumer = ConsumerEndpoint(
            engine_id="C", config=config, transport=backend.create_agent("c"), regions=c_pool.regions, mode=mode
        )
        connect(producer, consumer)
        fill = lambda ids: fill_producer_pages(p_pool, ids, num_tokens=10, salt="r")  # noqa: E731
        result = run_request(producer, consumer, request_id="r", num_tokens=10, fill=fill, finish=False)
        assert result.state is ConsumerState.LOADED, result.consumer.failure
        assert result.params.state_tokens == 10
        assert len(result.params.producer_block_ids[1]) == 1  # one slot travels, scratch never (STATE-2)
        pairs = result.consumer.pairs
        assert pairs is not None
        ((p_slot,), (c_slot,)) = pairs.producer_block_ids[1], pairs.consumer_block_ids[1]
        for layer in config.kv_cache_groups[1].layer_names:
            assert bytes(c_pool.page(layer, c_slot)) == bytes(p_pool.page(layer, p_slot))
        # A producer that says its state is one token past T: refused before any byte moves (STATE-1).
        bad = run_request(producer, consumer, request_id="bad", num_tokens=10, fill=fill)
        assert bad.state is ConsumerState.LOADED  # a correct one, as a control
        producer_prefill = producer.prefill
        producer.prefill = lambda rid, **kw: producer_prefill(rid, **kw, state_tokens=11)  # type: ignore[method-assign]
        free_before = consumer.allocator.num_free
        wrong = run_request(producer, consumer, request_id="wrong", num_tokens=10, fill=fill)
        assert wrong.state is ConsumerState.FAILED
        assert wrong.consumer.failure is not None
        assert "t=11" in wrong.consumer.failure.detail
        assert wrong.consumer.num_bytes == 0
        # The session held its suffix when the check refused it; its one release gave the blocks back (decision 182 in
        # decisions-protocol.md).
        assert len(wrong.consumer.consumer_block_ids)
        assert wrong.consumer.release is not None
        assert consumer.allocator.num_free == free_before
        backend.close()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_the_suite_scenario_carries_state_and_its_oracle_checks_the_slot(mode: str) -> None:
    requests = [
        Request(request_id="r", num_tokens=10, recomputed_tokens=1),
        Request(request_id="hit", num_tokens=10, prefix_hit_tokens=8),
        Request(request_id="late", num_tokens=10, state_tokens=11),
        Request(request_id="old", num_tokens=10, send_state_tokens=False),
    ]
    result = run_scenario(Scenario(config=FA_GDN_ALIGN, mode=mode, requests=requests), backend="loopback")
    assert result.ok, result.summary()
    assert result.outcomes["r"].loaded
    assert result.outcomes["hit"].loaded
    for refused in ("late", "old"):
        assert isinstance(result.outcomes[refused].error, StatePositionError)
