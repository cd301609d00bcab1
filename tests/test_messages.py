"""Protocol messages: validation on construction, engine descriptors, and vLLM's kv_transfer_params dict form."""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec import (
    PROTOCOL_VERSION,
    Abort,
    BlockIds,
    BlockOffer,
    Completion,
    ConfigError,
    EngineDescriptor,
    Failure,
    FailureReason,
    FieldError,
    GroupDescriptor,
    MalformedMessageError,
    Release,
    ReleaseOutcome,
    SpecKind,
    TransferMode,
    TransferParams,
    UnsupportedVersionError,
)
from kvspec.presets import get_preset
from kvspec.reference._messages import TRANSFER_PARAMS_KEYS

PARAMS = TransferParams(
    request_id="cmpl-1",
    producer_engine_id="prefill-0",
    producer_block_ids=[[1, 2, 3], [0, 7, 8]],
    num_tokens=40,
    mode=TransferMode.READ,
    lease_deadline=1_700_000_030.5,
    transport_data={"remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1},
)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Release(request_id="", consumer_engine_id="c", outcome=ReleaseOutcome.LOADED), "request_id"),
        (lambda: Release(request_id="r", consumer_engine_id=3, outcome=ReleaseOutcome.LOADED), "consumer_engine_id"),  # type: ignore[arg-type]
        (lambda: Release(request_id="r", consumer_engine_id="c", outcome="loaded"), "outcome"),  # type: ignore[arg-type]
        (lambda: Abort(request_id="r", engine_id="", detail=""), "engine_id"),
        (lambda: Abort(request_id="r", engine_id="p", detail=None), "detail"),  # type: ignore[arg-type]
        (lambda: Completion(request_id=None, producer_engine_id="p"), "request_id"),  # type: ignore[arg-type]
        (lambda: Failure(request_id="r", producer_engine_id="p", reason="timeout"), "reason"),  # type: ignore[arg-type]
        (
            lambda: Failure(
                request_id="r", producer_engine_id="p", reason=FailureReason.TIMEOUT, failed_consumer_block_ids=[[-1]]
            ),
            "failed_consumer_block_ids",
        ),
        (lambda: BlockOffer(request_id="r", consumer_engine_id="c", consumer_block_ids="12"), "consumer_block_ids"),
        (lambda: attrs.evolve(PARAMS, num_tokens=-1), "num_tokens"),
        (lambda: attrs.evolve(PARAMS, num_tokens=True), "num_tokens"),
        (lambda: attrs.evolve(PARAMS, lease_deadline=float("nan")), "lease_deadline"),
        (lambda: attrs.evolve(PARAMS, lease_deadline=float("inf")), "lease_deadline"),
        (lambda: attrs.evolve(PARAMS, lease_deadline="soon"), "lease_deadline"),
        (lambda: attrs.evolve(PARAMS, mode="read"), "mode"),  # type: ignore[arg-type]
        (lambda: attrs.evolve(PARAMS, transport_data=[1, 2]), "transport_data"),
        (lambda: attrs.evolve(PARAMS, transport_data={"remote_block_ids": "x"}), "transport_data['remote_block_ids']"),
        (lambda: attrs.evolve(PARAMS, transport_data={"host": 1.5}), "transport_data['host']"),
        (
            lambda: GroupDescriptor(kind=SpecKind.MLA, block_size=0, page_size_bytes=1, layer_names=("a",)),
            "block_size",
        ),
        (
            lambda: GroupDescriptor(kind=SpecKind.MLA, block_size=16, page_size_bytes=1, layer_names=("a", "a")),
            "layer_names",
        ),
        (
            lambda: GroupDescriptor(kind=SpecKind.MLA, block_size=16, page_size_bytes=1, layer_names=()),
            "layer_names",
        ),
        (
            lambda: EngineDescriptor(engine_id="p", mode=TransferMode.READ, hma_enabled=1, groups=(), num_blocks=4),  # type: ignore[arg-type]
            "hma_enabled",
        ),
        (
            lambda: EngineDescriptor(
                protocol_version=(1,), engine_id="p", mode=TransferMode.READ, hma_enabled=True, groups=(), num_blocks=4
            ),
            "protocol_version",
        ),
    ],
)
def test_construction_names_the_bad_field(build: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"\.{re.escape(field)}: expected ") as info:
        build()
    assert isinstance(info.value, FieldError)
    assert info.value.field == field
    assert field.split("[")[0] in str(info.value)


def test_messages_are_frozen_and_hashable() -> None:
    release = Release(request_id="r", consumer_engine_id="c", outcome=ReleaseOutcome.FAILED)
    with pytest.raises(attrs.exceptions.FrozenInstanceError, match=r"can't set attribute|cannot assign"):
        release.request_id = "x"  # type: ignore[misc]
    assert hash(release) == hash(Release(request_id="r", consumer_engine_id="c", outcome=ReleaseOutcome.FAILED))
    assert hash(PARAMS) == hash(attrs.evolve(PARAMS))


def test_block_ids_accept_nested_lists() -> None:
    offer = BlockOffer(request_id="r", consumer_engine_id="c", consumer_block_ids=[[4, 5], []])
    assert offer.consumer_block_ids == BlockIds([[4, 5], []])
    assert Failure(request_id="r", producer_engine_id="p", reason=FailureReason.TIMEOUT).failed_consumer_block_ids == (
        BlockIds([])
    )


def test_reprs_are_valid_python() -> None:
    namespace = {
        "Release": Release,
        "ReleaseOutcome": ReleaseOutcome,
        "TransferParams": TransferParams,
        "BlockIds": BlockIds,
        "TransferMode": TransferMode,
    }
    release = Release(request_id="r", consumer_engine_id="c", outcome=ReleaseOutcome.LOADED)
    text = repr(release).replace("<ReleaseOutcome.LOADED: 'loaded'>", "ReleaseOutcome.LOADED")
    assert eval(text, namespace) == release
    text = repr(PARAMS).replace("<TransferMode.READ: 'read'>", "TransferMode.READ")
    assert eval(text, namespace) == PARAMS


# --------------------------------------------------------------------------- engine descriptor


def test_engine_descriptor_from_a_hybrid_config() -> None:
    config = get_preset("gemma-3-1b").build_config(num_blocks=8, max_layers_per_group=2)
    descriptor = EngineDescriptor.from_config(
        engine_id="prefill-0", config=config, mode=TransferMode.WRITE, hma_enabled=True, transport_metadata=b"agent"
    )
    assert descriptor.protocol_version == PROTOCOL_VERSION
    assert descriptor.num_blocks == 8
    assert len(descriptor.groups) == config.num_groups
    for group, described in zip(config.kv_cache_groups, descriptor.groups, strict=True):
        spec = group.kv_cache_spec
        assert described.kind is spec.kind
        assert described.block_size == spec.block_size
        assert described.page_size_bytes == spec.page_size_bytes
        assert described.layer_names == group.layer_names
        assert described.sliding_window == getattr(spec, "sliding_window", None)
        assert described.dtype == "bfloat16"
    kinds = {g.kind for g in descriptor.groups}
    assert kinds == {SpecKind.SLIDING_WINDOW, SpecKind.FULL_ATTENTION}
    assert "agent" not in repr(descriptor)  # opaque transport bytes stay out of logs


def test_group_descriptor_of_a_mamba_group_has_no_attention_fields() -> None:
    config = get_preset("qwen3-next-80b").build_config(num_blocks=4, max_layers_per_group=1)
    mamba = [GroupDescriptor.from_group(g) for g in config.kv_cache_groups if g.kv_cache_spec.kind is SpecKind.MAMBA]
    assert mamba
    assert all(g.dtype is None and g.num_kv_heads is None and g.head_size is None for g in mamba)


# --------------------------------------------------------------------------- kv_transfer_params


def test_dict_form_uses_vllm_key_names() -> None:
    d = PARAMS.to_kv_transfer_params()
    assert d["do_remote_prefill"] is True
    assert d["do_remote_decode"] is False
    assert d["remote_request_id"] == "cmpl-1"
    assert d["remote_engine_id"] == "prefill-0"
    assert d["remote_block_ids"] == [[1, 2, 3], [0, 7, 8]]  # per-group lists, as under HMA
    assert d["remote_num_tokens"] == 40
    assert d["remote_blocks_expiry_time"] == 1_700_000_030.5
    assert d["remote_host"] == "127.0.0.1"
    assert d["remote_port"] == 5600
    assert d["tp_size"] == 1
    assert d["transfer_mode"] == "read"
    assert d["kvspec_version"] == f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}"


transport = st.one_of(
    st.binary(max_size=16),
    st.dictionaries(
        st.text(min_size=1, max_size=10).filter(lambda k: k not in TRANSFER_PARAMS_KEYS),
        st.one_of(st.text(max_size=10), st.integers()),
        max_size=4,
    ),
)


@given(
    st.builds(
        TransferParams,
        request_id=st.text(min_size=1, max_size=10),
        producer_engine_id=st.text(min_size=1, max_size=10),
        producer_block_ids=st.lists(st.lists(st.integers(0, 2**31), max_size=4), max_size=4).map(BlockIds),
        num_tokens=st.integers(0, 2**40),
        mode=st.sampled_from(TransferMode),
        lease_deadline=st.floats(allow_nan=False, allow_infinity=False),
        transport_data=transport,
    )
)
def test_dict_form_round_trips_also_through_json(params: TransferParams) -> None:
    d = params.to_kv_transfer_params()
    assert TransferParams.from_kv_transfer_params(d) == params
    # Routers often serialise the dict as JSON on the way.
    assert TransferParams.from_kv_transfer_params(json.loads(json.dumps(d))) == params


def test_a_router_dict_in_nixl_spelling_parses() -> None:
    # The shape vLLM's NIXL connector puts in kv_transfer_params (vllm_semantics.md section 3.5), plus kvspec's keys.
    d = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": ([1, 2], [5]),
        "remote_engine_id": "e0",
        "remote_request_id": "r0",
        "remote_host": "10.0.0.2",
        "remote_port": 5557,
        "tp_size": 1,
        "remote_num_tokens": 33,
        "remote_blocks_expiry_time": 50,
        "transfer_mode": "push",
        "kvspec_version": "1.4",
    }
    params = TransferParams.from_kv_transfer_params(d)
    assert params.mode is TransferMode.WRITE
    assert params.producer_block_ids == BlockIds([[1, 2], [5]])
    assert params.lease_deadline == 50.0
    assert params.transport_data == {"remote_host": "10.0.0.2", "remote_port": 5557, "tp_size": 1}


def _without(key: str) -> dict[str, object]:
    d = PARAMS.to_kv_transfer_params()
    del d[key]
    return d


@pytest.mark.parametrize(
    ("d", "field"),
    [
        (_without("remote_request_id"), "remote_request_id"),
        (_without("remote_engine_id"), "remote_engine_id"),
        (_without("remote_block_ids"), "remote_block_ids"),
        (_without("remote_num_tokens"), "remote_num_tokens"),
        (_without("remote_blocks_expiry_time"), "remote_blocks_expiry_time"),
        (_without("transfer_mode"), "transfer_mode"),
        (_without("kvspec_version"), "kvspec_version"),
        (_without("do_remote_prefill"), "do_remote_prefill"),
        (PARAMS.to_kv_transfer_params() | {"remote_block_ids": [1, 2, 3]}, "remote_block_ids[0]"),
        (PARAMS.to_kv_transfer_params() | {"remote_block_ids": [[1, "2"]]}, "remote_block_ids[0][1]"),
        (PARAMS.to_kv_transfer_params() | {"remote_num_tokens": "40"}, "remote_num_tokens"),
        (PARAMS.to_kv_transfer_params() | {"remote_num_tokens": -3}, "remote_num_tokens"),
        (PARAMS.to_kv_transfer_params() | {"remote_blocks_expiry_time": float("nan")}, "remote_blocks_expiry_time"),
        (PARAMS.to_kv_transfer_params() | {"transfer_mode": "sideways"}, "transfer_mode"),
        (PARAMS.to_kv_transfer_params() | {"kvspec_version": "one"}, "kvspec_version"),
        (PARAMS.to_kv_transfer_params() | {"remote_dp_size": None}, "remote_dp_size"),
        (PARAMS.to_kv_transfer_params() | {"kvspec_transport_data": "AA=="}, "kvspec_transport_data"),
    ],
)
def test_a_bad_dict_names_the_key(d: dict[str, object], field: str) -> None:
    with pytest.raises(MalformedMessageError, match=rf"^{re.escape(field)}: ") as info:
        TransferParams.from_kv_transfer_params(d)
    assert info.value.field == field


# Values a hostile router or peer puts in the dict: ints past the float range and past repr's 4,300-digit
# limit, non-finite floats, Unicode digits, nested junk (issue 23, finding 7).
_huge_ints = st.integers(300, 6000).map(lambda k: 10**k) | st.integers(300, 6000).map(lambda k: -(10**k))
_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | _huge_ints | st.floats() | st.text(max_size=6) | st.binary(max_size=4),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=2),
    max_leaves=6,
)
_KEYS = sorted(PARAMS.to_kv_transfer_params() | dict.fromkeys(["kvspec_block_ends", "kvspec_recomputed_tokens"]))


def _raises_only_malformed_naming_a_key(d: dict[Any, object]) -> None:
    error: MalformedMessageError | None = None
    try:
        TransferParams.from_kv_transfer_params(d)
    except MalformedMessageError as exc:
        error = exc
    except UnsupportedVersionError:
        return
    if error is not None:
        assert error.field is not None, f"no key named: {error}"
        assert error.field.partition("[")[0] in {str(k) for k in d} | {"transport_data"}, error.field
        assert str(error).startswith(f"{error.field}: ")


@given(st.sampled_from(_KEYS), _junk)
def test_hostile_dict_values_raise_only_malformed_naming_the_key(key: str, value: object) -> None:
    _raises_only_malformed_naming_a_key(PARAMS.to_kv_transfer_params() | {key: value})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_blocks_expiry_time", 10**400),  # OverflowError from math.isfinite
        ("remote_request_id", 10**5000),  # repr() of an int past 4,300 digits raises ValueError
        ("remote_num_tokens", -(10**5000)),
        ("remote_block_ids", [[-(10**5000)]]),
        ("kvspec_block_ends", [1]),  # FieldError (not MalformedMessageError) from the cross-field check
        ("kvspec_block_ends", [-(10**5000), 1]),
        ("kvspec_version", "\u00b2.1"),  # isdigit() but not int()
        ("transfer_mode", 10**5000),
        ("remote_port", 1.5),
        (7, "x"),  # a transport key that is not a str
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, (int, list)) else str(v)[:24],
)
def test_a_hostile_value_is_malformed_naming_the_key(key: Any, value: object) -> None:
    d = PARAMS.to_kv_transfer_params() | {key: value}
    with pytest.raises(MalformedMessageError):
        TransferParams.from_kv_transfer_params(d)
    _raises_only_malformed_naming_a_key(d)


def test_a_dict_of_another_major_is_refused() -> None:
    with pytest.raises(
        UnsupportedVersionError, match=r"kvspec_version: peer speaks protocol 2\.0, this side speaks major 1"
    ):
        TransferParams.from_kv_transfer_params(PARAMS.to_kv_transfer_params() | {"kvspec_version": "2.0"})


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(MalformedMessageError, match=r"expected a dict, got list"):
        TransferParams.from_kv_transfer_params([("remote_request_id", "r")])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the catalogue page stays honest


def test_the_message_catalogue_lists_every_field() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "spec" / "protocol-messages.md").read_text("utf-8")
    for cls in (EngineDescriptor, GroupDescriptor, TransferParams, BlockOffer, Completion, Failure, Release, Abort):
        section = page.split(f"### {cls.__name__}", 1)[-1] if cls is not GroupDescriptor else page
        for field in attrs.fields(cls):
            assert f"| `{field.name}` |" in section, f"{cls.__name__}.{field.name} is missing from the catalogue"
    for key in TRANSFER_PARAMS_KEYS:
        assert f"`{key}`" in page, f"kv_transfer_params key {key} is missing from the catalogue"


# --------------------------------------------------------------------------- protocol 1.1: list ends, recomputed tokens


def test_the_1_1_keys_travel_in_kv_transfer_params_only_when_they_say_something() -> None:
    plain = PARAMS.to_kv_transfer_params()
    assert "kvspec_block_ends" not in plain
    assert "kvspec_recomputed_tokens" not in plain
    assert plain["kvspec_version"] == "1.3"
    params = attrs.evolve(PARAMS, producer_block_ends=(3, 5), recomputed_tokens=1)
    d = params.to_kv_transfer_params()
    assert (d["kvspec_block_ends"], d["kvspec_recomputed_tokens"]) == ([3, 5], 1)
    assert TransferParams.from_kv_transfer_params(d) == params
    assert TransferParams.from_kv_transfer_params(json.loads(json.dumps(d))) == params


def test_the_1_2_state_tokens_travel_only_when_set() -> None:
    assert "kvspec_state_tokens" not in PARAMS.to_kv_transfer_params()  # no state groups: absent (STATE-1)
    params = attrs.evolve(PARAMS, state_tokens=PARAMS.num_tokens)
    d = params.to_kv_transfer_params()
    assert d["kvspec_state_tokens"] == PARAMS.num_tokens
    assert TransferParams.from_kv_transfer_params(json.loads(json.dumps(d))) == params
    for bad in (-1, "7", True):
        with pytest.raises(MalformedMessageError, match="kvspec_state_tokens"):
            TransferParams.from_kv_transfer_params(d | {"kvspec_state_tokens": bad})


def test_a_1_0_producer_dict_keeps_1_0_behaviour() -> None:
    # A 1.0 producer's dict: no 1.1 keys, version 1.0. Ends unknown, nothing recomputed (ALIGN-1, WIN-1).
    d = PARAMS.to_kv_transfer_params() | {"kvspec_version": "1.0"}
    parsed = TransferParams.from_kv_transfer_params(d)
    assert (parsed.producer_block_ends, parsed.recomputed_tokens) == (None, 0)
    assert parsed == PARAMS


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"kvspec_block_ends": 3}, "kvspec_block_ends"),
        ({"kvspec_block_ends": [3, "5"]}, "kvspec_block_ends[1]"),
        ({"kvspec_block_ends": [3, -1]}, "kvspec_block_ends[1]"),
        ({"kvspec_recomputed_tokens": -1}, "kvspec_recomputed_tokens"),
        ({"kvspec_recomputed_tokens": True}, "kvspec_recomputed_tokens"),
    ],
)
def test_bad_1_1_keys_name_the_key(extra: dict[str, object], field: str) -> None:
    with pytest.raises(MalformedMessageError, match="expected") as info:
        TransferParams.from_kv_transfer_params(PARAMS.to_kv_transfer_params() | extra)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("ends", "message"),
    [
        ((3,), r"TransferParams.producer_block_ends: expected one end per group of producer_block_ids \(2\)"),
        ((3, 2), r"TransferParams.producer_block_ends\[1\]: expected an end of at least 3"),
        ((3, -4), "a tuple of non-negative ints, or None"),
        ("3,3", "a tuple of non-negative ints, or None"),
    ],
)
def test_ends_must_fit_their_lists(ends: object, message: str) -> None:
    with pytest.raises(FieldError, match=message):
        attrs.evolve(PARAMS, producer_block_ends=ends)
    assert attrs.evolve(PARAMS, producer_block_ends=[3, 3]).producer_block_ends == (3, 3)
