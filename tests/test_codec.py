"""The wire codec: round trips, canonical bytes, VER-1 evolution rules, and fuzzing the decoder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import example, given
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
    GroupDescriptor,
    KVSpecError,
    MalformedMessageError,
    Release,
    ReleaseOutcome,
    SpecKind,
    TransferMode,
    TransferParams,
    UnsupportedVersionError,
    decode,
    encode,
)
from kvspec.protocol._codec import MESSAGE_TYPES, PEER_BOUNDS, _decode
from kvspec.protocol._schema import message_schema, render_schema
from kvspec.reference._messages import TRANSFER_PARAMS_KEYS
from kvspec.spec.parallel import CanonicalPage, PageOrder, PageTensor, ParallelLayout, RankLayout, SubBlock

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- strategies

ids = st.text(min_size=1, max_size=10)
positive = st.integers(1, 2**40)
block_ids = st.lists(st.lists(st.integers(0, 2**31), max_size=5), max_size=4).map(BlockIds)
finite = st.floats(allow_nan=False, allow_infinity=False)
transport_data = st.one_of(
    st.binary(max_size=24),
    st.dictionaries(
        st.text(min_size=1, max_size=12).filter(lambda k: k not in TRANSFER_PARAMS_KEYS),
        st.one_of(st.text(max_size=12), st.integers(-(2**63), 2**63)),
        max_size=4,
    ),
)
groups = st.builds(
    GroupDescriptor,
    kind=st.sampled_from(SpecKind),
    block_size=positive,
    sliding_window=st.none() | positive,
    attention_chunk_size=st.none() | positive,
    dtype=st.none() | st.sampled_from(["bfloat16", "float16", "float8_e4m3fn"]),
    num_kv_heads=st.none() | positive,
    head_size=st.none() | positive,
    page_size_bytes=positive,
    layer_names=st.lists(ids, min_size=1, max_size=3, unique=True).map(tuple),
)
engine_descriptors = st.builds(
    EngineDescriptor,
    protocol_version=st.tuples(st.integers(0, 9), st.integers(0, 9)),
    engine_id=ids,
    mode=st.sampled_from(TransferMode),
    hma_enabled=st.booleans(),
    groups=st.lists(groups, min_size=1, max_size=3).map(tuple),
    num_blocks=positive,
    tp_size=positive,
    transport_metadata=st.binary(max_size=32),
)

sub_blocks = st.builds(
    SubBlock,
    name=ids,
    extent=st.integers(1, 2**16),
    width=st.integers(1, 2**24),
    replicated=st.booleans(),
)
page_tensors = st.builds(
    PageTensor,
    name=ids,
    sub_blocks=st.lists(sub_blocks, min_size=1, max_size=3),
    rows=st.integers(1, 2**16),
    element_bytes=st.integers(1, 2**24),
    order=st.sampled_from(PageOrder),
    token_rows=st.booleans(),
)
canonical_pages = st.builds(CanonicalPage, tensors=st.lists(page_tensors, min_size=1, max_size=3))


@st.composite
def with_parallel_layout(draw: st.DrawFn, descriptor: EngineDescriptor) -> EngineDescriptor:
    """The descriptor with a 1.3 parallel layout that describes it: its TP size, one page per group, its layers."""
    tp = draw(st.integers(1, 128))
    dcp = draw(st.integers(1, 128))
    names = sorted({n for g in descriptor.groups for n in g.layer_names})
    rank = RankLayout(
        tp_size=tp,
        tp_rank=draw(st.integers(0, tp - 1)),
        layers=tuple(draw(st.lists(st.sampled_from(names), unique=True))),
        dcp_size=dcp,
        dcp_rank=draw(st.integers(0, dcp - 1)),
        dcp_interleave=draw(st.integers(1, 2**16)),
        dp_rank=draw(st.integers(0, 2**16)),
    )
    pages = [draw(canonical_pages) for _ in descriptor.groups]
    return attrs.evolve(descriptor, tp_size=tp, parallel=ParallelLayout(rank=rank, pages=pages))


engine_descriptors = st.one_of(engine_descriptors, engine_descriptors.flatmap(with_parallel_layout))


def _with_ends(ids_block: BlockIds) -> st.SearchStrategy[tuple[BlockIds, tuple[int, ...] | None]]:
    """Block ids and, for protocol 1.1, valid ends (each at least its group's length), or None (1.0)."""
    ends = st.tuples(*(st.integers(len(g), len(g) + 2**20) for g in ids_block))
    return st.tuples(st.just(ids_block), st.none() | ends)


ids_and_ends = block_ids.flatmap(_with_ends)
transfer_params = st.builds(
    lambda ids_ends, **kwargs: TransferParams(
        producer_block_ids=ids_ends[0], producer_block_ends=ids_ends[1], **kwargs
    ),
    ids_ends=ids_and_ends,
    request_id=ids,
    producer_engine_id=ids,
    num_tokens=st.integers(0, 2**40),
    mode=st.sampled_from(TransferMode),
    lease_deadline=finite,
    transport_data=transport_data,
    recomputed_tokens=st.integers(0, 3),
)
block_offers = st.builds(
    lambda ids_ends, **kwargs: BlockOffer(consumer_block_ids=ids_ends[0], consumer_block_ends=ids_ends[1], **kwargs),
    ids_ends=ids_and_ends,
    request_id=ids,
    consumer_engine_id=ids,
)
messages: st.SearchStrategy[Any] = st.one_of(
    engine_descriptors,
    transfer_params,
    block_offers,
    st.builds(Completion, request_id=ids, producer_engine_id=ids),
    st.builds(
        Failure,
        request_id=ids,
        producer_engine_id=ids,
        reason=st.sampled_from(FailureReason),
        failed_consumer_block_ids=block_ids,
        detail=st.text(max_size=20),
    ),
    st.builds(Release, request_id=ids, consumer_engine_id=ids, outcome=st.sampled_from(ReleaseOutcome)),
    st.builds(Abort, request_id=ids, engine_id=ids, detail=st.text(max_size=20)),
)

RELEASE = Release(request_id="r1", consumer_engine_id="c", outcome=ReleaseOutcome.LOADED)
PARAMS = TransferParams(
    request_id="r1",
    producer_engine_id="p",
    producer_block_ids=[[1, 2, 3], [0, 7]],
    num_tokens=40,
    mode=TransferMode.READ,
    lease_deadline=123.5,
    transport_data={"remote_host": "127.0.0.1", "remote_port": 5600},
)

# --------------------------------------------------------------------------- round trips


@given(messages)
def test_every_message_round_trips(message: Any) -> None:
    data = encode(message)
    assert decode(data) == message
    assert encode(decode(data)) == data  # canonical: decoding and re-encoding is the identity


@given(messages)
def test_encoding_is_canonical_json(message: Any) -> None:
    data = encode(message)
    obj = json.loads(data)
    assert obj["v"] == list(PROTOCOL_VERSION)
    assert MESSAGE_TYPES[obj["type"]] is type(message)
    assert data == json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("ascii")


def test_release_encoding_is_pinned() -> None:
    # A change to these bytes is a wire change: it needs a protocol version bump (VER-1).
    expected = b'{"consumer_engine_id":"c","outcome":"loaded","request_id":"r1","type":"release","v":[1,3]}'
    assert encode(RELEASE) == expected


def test_transport_data_travels_as_object_or_base64() -> None:
    assert json.loads(encode(PARAMS))["transport_data"] == {"remote_host": "127.0.0.1", "remote_port": 5600}
    opaque = attrs.evolve(PARAMS, transport_data=b"\x00\xff")
    assert json.loads(encode(opaque))["transport_data"] == "AP8="
    assert decode(encode(opaque)) == opaque


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(ConfigError, match=r"encode: expected a kvspec protocol message, got dict"):
        encode({"type": "release"})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- VER-1


def _obj(message: Any) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(encode(message))
    return result


def _bytes(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_unknown_fields_from_a_newer_minor_are_ignored() -> None:
    obj = _obj(RELEASE) | {"v": [PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 3], "priority": 7, "trace": {"a": [1]}}
    assert decode(_bytes(obj)) == RELEASE


def test_an_older_minor_may_omit_fields_with_defaults() -> None:
    failure = Failure(request_id="r", producer_engine_id="p", reason=FailureReason.TIMEOUT)
    obj = _obj(failure)
    del obj["detail"], obj["failed_consumer_block_ids"]
    assert decode(_bytes(obj)) == failure


@pytest.mark.parametrize("version", [[PROTOCOL_VERSION[0] + 1, 0], [0, 9], [99, 0]])
def test_another_major_is_refused(version: list[int]) -> None:
    with pytest.raises(UnsupportedVersionError, match=r"this side speaks major 1 \(VER-1\)"):
        decode(_bytes(_obj(RELEASE) | {"v": version}))


@pytest.mark.parametrize("version", [None, "1.0", [1], [1, 0, 0], [1, -1], [True, 0], [1.0, 0]])
def test_a_malformed_version_names_v(version: object) -> None:
    obj = _obj(RELEASE) | {"v": version}
    if version is None:
        del obj["v"]
    with pytest.raises(MalformedMessageError, match=r"v: expected \[major, minor\] non-negative integers") as info:
        decode(_bytes(obj))
    assert info.value.field == "v"


@pytest.mark.parametrize("name", ["request_id", "consumer_engine_id", "outcome"])
def test_a_missing_field_is_named(name: str) -> None:
    obj = _obj(RELEASE)
    del obj[name]
    with pytest.raises(MalformedMessageError, match="missing") as info:
        decode(_bytes(obj))
    assert info.value.field == name


@pytest.mark.parametrize(
    ("message", "field", "value", "named"),
    [
        (PARAMS, "num_tokens", "40", "num_tokens"),
        (PARAMS, "num_tokens", 40.0, "num_tokens"),
        (PARAMS, "num_tokens", -1, "num_tokens"),
        (PARAMS, "num_tokens", True, "num_tokens"),
        (PARAMS, "mode", "pull", "mode"),
        (PARAMS, "lease_deadline", "soon", "lease_deadline"),
        (PARAMS, "producer_block_ids", [1, 2], "producer_block_ids[0]"),
        (PARAMS, "producer_block_ids", [[1, -2]], "producer_block_ids[0][1]"),
        (PARAMS, "producer_block_ids", [[1, "2"]], "producer_block_ids[0][1]"),
        (PARAMS, "request_id", "", "request_id"),
        (PARAMS, "transport_data", 5, "transport_data"),
        (PARAMS, "transport_data", "not base64!", "transport_data"),
        (RELEASE, "outcome", "done", "outcome"),
    ],
)
def test_a_mistyped_field_is_named(message: Any, field: str, value: object, named: str) -> None:
    with pytest.raises(MalformedMessageError, match=rf"^{re.escape(named)}: ") as info:
        decode(_bytes(_obj(message) | {field: value}))
    assert info.value.field == named


def test_nested_fields_are_named_with_their_path() -> None:
    descriptor = EngineDescriptor(
        engine_id="p",
        mode=TransferMode.READ,
        hma_enabled=True,
        groups=(
            GroupDescriptor(kind=SpecKind.FULL_ATTENTION, block_size=16, page_size_bytes=4096, layer_names=("l0",)),
        ),
        num_blocks=10,
    )
    obj = _obj(descriptor)
    obj["groups"][0]["block_size"] = 0
    with pytest.raises(
        MalformedMessageError,
        match=r"block_size: GroupDescriptor\.block_size: expected a positive int, got 0",
    ) as info:
        decode(_bytes(obj))
    assert info.value.field == "groups[0].block_size"
    obj["groups"][0]["block_size"] = "16"
    with pytest.raises(MalformedMessageError, match=r"block_size: expected a JSON integer, got '16'") as info:
        decode(_bytes(obj))
    assert info.value.field == "groups[0].block_size"


@pytest.mark.parametrize("kind", [None, "releas", 3, "Release"])
def test_an_unknown_type_is_named(kind: object) -> None:
    with pytest.raises(MalformedMessageError, match=r"type: expected one of \['abort', 'block_offer'") as info:
        decode(_bytes(_obj(RELEASE) | {"type": kind}))
    assert info.value.field == "type"


# --------------------------------------------------------------------------- fuzz


def _decodes_or_raises_kvspec_error(data: bytes) -> None:
    try:
        message = _decode(data)  # no safety net: a stray exception here is a codec bug
    except KVSpecError:
        return
    assert type(message) in MESSAGE_TYPES.values()  # never a half-built message


@given(st.binary(max_size=200))
@example(b"")
@example(b"\xff\xfe")
@example(b"[" * 50_000)
@example(b"1" * 5000)
@example(b'{"v":[1,0],"type":"release","request_id":"r","consumer_engine_id":"c","outcome":"loaded","v":[2,0]}')
@example(b'{"v":[1e400,0],"type":"abort"}')
@example(b'{"v":[1,0],"type":"transfer_params","lease_deadline":NaN}')
def test_random_bytes_raise_only_kvspec_errors(data: bytes) -> None:
    _decodes_or_raises_kvspec_error(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


@given(messages, st.data())
def test_mutated_fields_raise_only_kvspec_errors(message: Any, data: st.DataObject) -> None:
    obj = _obj(message)
    key = data.draw(st.sampled_from(sorted(obj)))
    action = data.draw(st.sampled_from(["delete", "replace", "add"]))
    if action == "delete":
        del obj[key]
    elif action == "replace":
        obj[key] = data.draw(json_values)
    else:
        obj[data.draw(st.text(max_size=6))] = data.draw(json_values)
    _decodes_or_raises_kvspec_error(json.dumps(obj).encode())


@given(messages, st.data())
def test_mutated_bytes_raise_only_kvspec_errors(message: Any, data: st.DataObject) -> None:
    raw = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["flip", "delete", "insert"]))
        if op == "flip":
            raw[index] ^= data.draw(st.integers(1, 255))
        elif op == "delete" and len(raw) > 1:
            del raw[index]
        else:
            raw.insert(index, data.draw(st.integers(0, 255)))
    _decodes_or_raises_kvspec_error(bytes(raw))


def test_decode_accepts_bytearray_and_memoryview_and_refuses_text() -> None:
    data = encode(RELEASE)
    assert decode(bytearray(data)) == RELEASE  # type: ignore[arg-type]
    assert decode(memoryview(data)) == RELEASE  # type: ignore[arg-type]
    with pytest.raises(MalformedMessageError, match=r"expected bytes, got str"):
        decode(data.decode())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("name", sorted(MESSAGE_TYPES))
def test_committed_schemas_are_current(name: str) -> None:
    path = ROOT / "docs" / "schema" / f"{name}.schema.json"
    assert path.exists(), f"run: python -m kvspec.protocol._schema docs/schema ({path} is missing)"
    assert path.read_text(encoding="utf-8") == render_schema(name), (
        f"{path} is stale; regenerate with: python -m kvspec.protocol._schema docs/schema"
    )


def test_no_stray_schema_files() -> None:
    committed = {p.name for p in (ROOT / "docs" / "schema").glob("*.schema.json")}
    assert committed == {f"{name}.schema.json" for name in MESSAGE_TYPES}


def _check(schema: dict[str, Any], value: Any, path: str = "$") -> None:
    """A small validator for the subset of JSON Schema the generator emits."""
    if "const" in schema:
        assert value == schema["const"], path
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                _check(option, value, path)
                return
            except AssertionError as exc:
                errors.append(exc)
        raise AssertionError(f"{path}: no option matched: {errors}")
    kind = schema.get("type")
    python: dict[str, type] = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool}
    if kind == "integer":
        assert isinstance(value, int), path
        assert not isinstance(value, bool), path
        assert value >= schema.get("minimum", value), path
    elif kind == "number":
        assert isinstance(value, (int, float)), path
        assert not isinstance(value, bool), path
    elif kind is not None:
        assert isinstance(value, python[kind]), path
    if "enum" in schema:
        assert value in schema["enum"], path
    if kind == "object":
        for name in schema.get("required", []):
            assert name in value, f"{path}.{name} is required"
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                _check(sub, value[name], f"{path}.{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                _check(extra, item, f"{path}[{name!r}]")
    if kind == "array":
        if "prefixItems" in schema:
            assert schema["minItems"] <= len(value) <= schema["maxItems"], path
            for i, (sub, item) in enumerate(zip(schema["prefixItems"], value, strict=False)):
                _check(sub, item, f"{path}[{i}]")
        if "items" in schema:
            for i, item in enumerate(value):
                _check(schema["items"], item, f"{path}[{i}]")


@given(messages)
def test_every_encoding_matches_its_schema(message: Any) -> None:
    obj = _obj(message)
    _check(message_schema(obj["type"]), obj)


def test_schemas_allow_unknown_fields_and_require_fields_without_defaults() -> None:
    schema = message_schema("failure")
    assert schema["additionalProperties"] is True
    assert set(schema["required"]) == {"type", "v", "request_id", "producer_engine_id", "reason"}


# --------------------------------------------------------------------------- protocol 1.1: list ends, recomputed tokens


def test_a_1_0_message_without_the_1_1_fields_decodes_to_their_defaults() -> None:
    # What a 1.0 peer sends: no ends, no recomputed tokens, "v": [1, 0] (VER-1: older minors decode).
    offer = {
        "type": "block_offer",
        "v": [1, 0],
        "request_id": "r",
        "consumer_engine_id": "c",
        "consumer_block_ids": [[4]],
    }
    decoded = decode(json.dumps(offer).encode())
    assert decoded == BlockOffer(request_id="r", consumer_engine_id="c", consumer_block_ids=[[4]])
    assert isinstance(decoded, BlockOffer)
    assert decoded.consumer_block_ends is None
    params = json.loads(encode(PARAMS))
    for key in ("producer_block_ends", "recomputed_tokens"):
        del params[key]
    params["v"] = [1, 0]
    old = decode(json.dumps(params).encode())
    assert isinstance(old, TransferParams)
    assert (old.producer_block_ends, old.recomputed_tokens) == (None, 0)


def test_the_1_1_fields_travel_and_a_1_0_reader_may_ignore_them() -> None:
    params = attrs.evolve(PARAMS, producer_block_ends=(3, 4), recomputed_tokens=1)
    body = json.loads(encode(params))
    assert body["v"] == [1, 3]
    assert (body["producer_block_ends"], body["recomputed_tokens"]) == ([3, 4], 1)
    assert decode(encode(params)) == params
    assert PROTOCOL_VERSION == (1, 3)


def test_a_1_1_message_without_the_1_2_fields_decodes_with_their_defaults() -> None:
    # A 1.1 peer omits state_tokens and state_profile: they decode as None, which STATE-1 refuses
    # where the config has state groups (VER-1, STATE-1).
    body = json.loads(encode(PARAMS)) | {"v": [1, 1]}
    del body["state_tokens"]
    decoded = decode(json.dumps(body).encode())
    assert isinstance(decoded, type(PARAMS))
    assert decoded.state_tokens is None
    assert decode(encode(attrs.evolve(PARAMS, state_tokens=9))) == attrs.evolve(PARAMS, state_tokens=9)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"consumer_block_ends": [1]}, "consumer_block_ends"),  # one end for two groups
        ({"consumer_block_ends": [2, -1]}, "consumer_block_ends"),
        ({"consumer_block_ends": [1, 5]}, "consumer_block_ends[0]"),  # ends before its own length
        ({"consumer_block_ends": "2,2"}, "consumer_block_ends"),
    ],
)
def test_bad_ends_are_malformed_naming_the_field(body: dict[str, object], field: str) -> None:
    offer = {"type": "block_offer", "v": [1, 1], "request_id": "r", "consumer_engine_id": "c"}
    data = json.dumps(offer | {"consumer_block_ids": [[4, 5], [6]]} | body).encode()
    with pytest.raises(MalformedMessageError, match="consumer_block_ends") as info:
        decode(data)
    assert info.value.field == field


# Values a hostile peer sends: ints past the float range and past repr's 4,300-digit limit, non-finite floats,
# nested junk. Every one must end in a kvspec error that names the field (issue 23, finding 7).
huge_ints = st.integers(300, 4000).map(lambda k: 10**k) | st.integers(300, 4000).map(lambda k: -(10**k))
hostile_values = st.one_of(
    huge_ints,
    st.floats(),
    json_values,
    st.lists(st.lists(huge_ints | st.integers(), max_size=2), max_size=2),
)


def _raises_kvspec_error_naming_a_field(obj: dict[str, Any]) -> None:
    error: MalformedMessageError | None = None
    try:
        message = _decode(_bytes(obj))  # no safety net: a stray exception here is a codec bug
    except MalformedMessageError as exc:
        error = exc
    except KVSpecError:
        return
    if error is None:
        assert type(message) in MESSAGE_TYPES.values()
        return
    assert error.field is not None, f"no field named: {error}"
    assert re.split(r"[.\[]", error.field)[0] in obj, f"{error.field!r} is not a field of the message"
    assert str(error).startswith(f"{error.field}: ")


@given(messages, st.data())
def test_hostile_field_values_raise_kvspec_errors_naming_the_field(message: Any, data: st.DataObject) -> None:
    obj = _obj(message)
    obj[data.draw(st.sampled_from(sorted(obj)))] = data.draw(hostile_values)
    _raises_kvspec_error_naming_a_field(obj)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lease_deadline", 10**400),  # the finding: OverflowError from math.isfinite
        ("lease_deadline", -(10**400)),
        ("num_tokens", -(10**4000)),  # repr() of an int past 4,300 digits raises ValueError
        ("producer_block_ids", [[-(10**4000)]]),
        ("producer_block_ends", [-(10**4000), 1]),
        ("request_id", 10**4000),
    ],
    ids=["deadline-1e400", "deadline--1e400", "tokens", "block-ids", "block-ends", "request-id"],
)
def test_a_huge_int_is_malformed_naming_the_field(field: str, value: object) -> None:
    params = TransferParams(
        request_id="r",
        producer_engine_id="p",
        producer_block_ids=[[1], [2]],
        num_tokens=1,
        mode=TransferMode.READ,
        lease_deadline=1.0,
    )
    obj = _obj(params) | {field: value}
    with pytest.raises(MalformedMessageError) as info:
        decode(_bytes(obj))
    assert info.value.field is not None
    assert info.value.field.startswith(field)
    _raises_kvspec_error_naming_a_field(obj)


# --------------------------------------------------------------------------- protocol 1.3: the parallel layout


def _layout_descriptor(**rank: Any) -> EngineDescriptor:
    page = CanonicalPage(
        tensors=[PageTensor(name="k", sub_blocks=[SubBlock(name="kv_heads", extent=8)], rows=16, element_bytes=256)]
    )
    group = GroupDescriptor(
        kind=SpecKind.FULL_ATTENTION, block_size=16, page_size_bytes=4096, layer_names=("l0", "l1"), num_kv_heads=2
    )
    layout = ParallelLayout(rank=RankLayout(**{"tp_size": 4, "tp_rank": 3, **rank}), pages=[page])
    return EngineDescriptor(
        engine_id="d",
        mode=TransferMode.READ,
        hma_enabled=False,
        groups=(group,),
        num_blocks=9,
        tp_size=4,
        parallel=layout,
    )


def test_the_parallel_layout_travels_and_a_1_2_message_without_it_decodes_to_none() -> None:
    descriptor = _layout_descriptor(layers=("l1",), dcp_size=2, dcp_rank=1, dcp_interleave=16)
    assert decode(encode(descriptor)) == descriptor
    obj = _obj(descriptor) | {"v": [1, 2]}
    del obj["parallel"]
    assert decode(_bytes(obj)) == attrs.evolve(descriptor, parallel=None)


def _set(obj: Any, path: list[str | int], value: object) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


# Where each bounded field sits in an encoded descriptor, and a valid value one past its bound would replace.
BOUNDED_PATHS: dict[tuple[type[Any], str], list[str | int]] = {
    (ParallelLayout, "pages"): ["parallel", "pages"],
    (RankLayout, "tp_size"): ["parallel", "rank", "tp_size"],
    (RankLayout, "dcp_size"): ["parallel", "rank", "dcp_size"],
    (RankLayout, "dcp_interleave"): ["parallel", "rank", "dcp_interleave"],
    (RankLayout, "dp_rank"): ["parallel", "rank", "dp_rank"],
    (RankLayout, "layers"): ["parallel", "rank", "layers"],
    (CanonicalPage, "tensors"): ["parallel", "pages", 0, "tensors"],
    (PageTensor, "sub_blocks"): ["parallel", "pages", 0, "tensors", 0, "sub_blocks"],
    (PageTensor, "rows"): ["parallel", "pages", 0, "tensors", 0, "rows"],
    (PageTensor, "element_bytes"): ["parallel", "pages", 0, "tensors", 0, "element_bytes"],
    (SubBlock, "extent"): ["parallel", "pages", 0, "tensors", 0, "sub_blocks", 0, "extent"],
    (SubBlock, "width"): ["parallel", "pages", 0, "tensors", 0, "sub_blocks", 0, "width"],
}


@pytest.mark.parametrize("bound", sorted(PEER_BOUNDS, key=str), ids=lambda b: f"{b[0].__name__}.{b[1]}")
def test_a_peer_given_size_past_its_bound_is_malformed_naming_the_field(bound: tuple[type[Any], str]) -> None:
    limit, path = PEER_BOUNDS[bound], BOUNDED_PATHS[bound]
    obj = _obj(_layout_descriptor())
    current: Any = obj
    for key in path:
        current = current[key]
    # A list one item longer than allowed (its items as they are), or an int one past the bound.
    _set(obj, path, [current[0]] * (limit + 1) if isinstance(current, list) and current else limit + 1)
    if isinstance(current, list) and not current:
        _set(obj, path, ["l0"] * (limit + 1))
    named = ".".join(str(k) for k in path).replace(".0", "[0]")
    with pytest.raises(MalformedMessageError, match=r"at most") as info:
        decode(_bytes(obj))
    assert info.value.field == named
    # The bound stands in the committed schema too.
    assert f'"maximum": {limit}' in render_schema("engine_descriptor") or f'"maxItems": {limit}' in render_schema(
        "engine_descriptor"
    )


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (["parallel", "rank", "tp_size"], 2, "parallel.rank"),  # rank 3 of 2: the layout itself is invalid
        (["tp_size"], 8, "parallel.rank.tp_size"),  # the layout says TP 4, the descriptor TP 8
        (["parallel", "rank", "layers"], ["l9"], "parallel.rank.layers"),  # a layer no group holds
        (["parallel", "pages"], [], "parallel"),  # the spec model names the rest: "ParallelLayout.pages: ..."
        (["parallel", "pages", 0, "tensors", 0, "order"], "dhn", "parallel.pages[0].tensors[0].order"),
    ],
)
def test_a_layout_that_does_not_describe_its_engine_is_malformed(
    path: list[str | int], value: object, named: str
) -> None:
    obj = _obj(_layout_descriptor())
    _set(obj, path, value)
    with pytest.raises(MalformedMessageError) as info:
        decode(_bytes(obj))
    assert info.value.field == named, info.value


def test_a_layout_of_more_sub_blocks_in_all_than_the_handshake_takes_is_malformed() -> None:
    # Two groups, each page at its bounds (16 tensors of 16 sub-blocks): 512 sub-blocks in all, past 256.
    tensor = {"name": "t", "rows": 1, "element_bytes": 1, "sub_blocks": [{"name": "b", "extent": 1}] * 16}
    obj = _obj(_layout_descriptor())
    obj["groups"] = [obj["groups"][0], {**obj["groups"][0], "layer_names": ["l2"]}]
    obj["parallel"]["pages"] = [{"tensors": [tensor] * 16}] * 2
    with pytest.raises(MalformedMessageError, match="at most 256 sub-blocks in all") as info:
        decode(_bytes(obj))
    assert info.value.field == "parallel.pages"
    obj["parallel"]["pages"] = [{"tensors": [tensor] * 8}] * 2  # 256 in all: accepted
    assert isinstance(decode(_bytes(obj)), EngineDescriptor)


# --------------------------------------------------------------------------- VER-1's field rules (kvspec.spec.versions)


def test_every_field_a_minor_version_added_has_a_default() -> None:
    """The message classes keep VER-1's table; a field added without a default is refused by name."""
    from kvspec.reference._messages import GroupDescriptor
    from kvspec.spec.versions import ADDED_FIELDS, check_added_fields

    classes = (*MESSAGE_TYPES.values(), GroupDescriptor)
    defaults = {c.__name__: {f.name: f.default is not attrs.NOTHING for f in attrs.fields(c)} for c in classes}
    check_added_fields(defaults)
    assert ADDED_FIELDS[(1, 1)]["TransferParams"] == (
        "producer_block_ends",
        "recomputed_tokens",
        "producer_block_digests",
    )
    required = {**defaults, "BlockOffer": {**defaults["BlockOffer"], "consumer_block_ends": False}}
    with pytest.raises(ConfigError, match=r"BlockOffer\.consumer_block_ends: added in protocol 1\.1"):
        check_added_fields(required)
    missing = {name: fields for name, fields in defaults.items() if name != "GroupDescriptor"}
    with pytest.raises(ConfigError, match=r"GroupDescriptor\.state_shapes: added in protocol 1\.2"):
        check_added_fields(missing)


def test_decode_fields_ignores_unknown_keys_defaults_absent_ones_and_names_a_missing_one() -> None:
    from kvspec.spec.versions import decode_fields

    fields = [("a", False), ("b", True)]
    assert decode_fields({"a": 1, "c": 3}, fields, lambda name, value: (name, value)) == {"a": ("a", 1)}
    assert decode_fields({"a": 1, "b": 2}, fields, lambda name, value: value) == {"a": 1, "b": 2}
    with pytest.raises(MalformedMessageError, match="missing") as info:
        decode_fields({"b": 2}, fields, lambda name, value: value, path="groups[1]")
    assert info.value.field == "groups[1].a"
