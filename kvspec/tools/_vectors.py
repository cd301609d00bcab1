"""Language-neutral test vectors: the JSON encoding of inputs and outputs, and one registry entry per function.

Theory of operation
-------------------

A *vector* is one JSON object: ``rule``, ``function``, ``case``, ``input`` and
either ``output`` or ``error``. :data:`FUNCTIONS` holds one
:class:`VectorFunction` per reference function (and per codec, handshake and
session entry point): how to decode its JSON input into kvspec values, how to
call the reference, and how to encode what comes back. :func:`answer_vector`
is kvspec's own implementation of the contract an external implementation
follows (one vector in, ``{"output": ...}`` or ``{"error": {...}}`` out); the
writer (:mod:`kvspec.tools._vector_cases`) computes every expected answer with it,
so the vectors are generated from the reference, never edited by hand.

Everything is encoded generically from the value: attrs classes by their
fields, enums by their value, block ids as lists of lists, protocol messages
by the wire codec. A new function takes one :class:`VectorFunction` here and
one case set in :mod:`kvspec.tools._vector_cases`; a renamed one, one line of
:data:`PUBLIC_NAMES`.
"""

from __future__ import annotations

import base64
import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvspec.core._errors import ConfigError, IncompatiblePeerError, KVSpecError, MalformedMessageError
from kvspec.core._models import (
    BlockIds,
    CacheDeclaration,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    DType,
    FailureReason,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SpecKind,
    TransferMode,
)
from kvspec.core._rules import RULES
from kvspec.protocol._codec import MESSAGE_TYPES, decode, encode, field_codec
from kvspec.protocol._handshake import check_compatibility
from kvspec.protocol._plan import TransferPlan, plan_transfer
from kvspec.protocol._session import ConsumerSession, Output, ProducerSession
from kvspec.protocol._summary import blocks_needed_for, summarize_plan
from kvspec.reference._messages import PROTOCOL_VERSION, EngineDescriptor, TransferParams
from kvspec.reference._offload import (
    OffloadConfig,
    OffloadKey,
    StoreSet,
    check_offload_support,
    get_chunk_sizes,
    get_load_set,
    get_offload_hit_tokens,
    get_offload_keys,
    get_retained_chunk_starts,
    get_store_set,
    get_sub_block_offset,
    map_sub_blocks,
)
from kvspec.reference._reference import (
    check_hybrid_support,
    check_window_coverage,
    compute_block_pairs,
    compute_transfer_pairs,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_logical_block_count,
    get_needed_block_range,
    get_needed_token_range,
    get_num_skipped_tokens,
    get_pruned_block_ids,
    get_token_basis_group,
    is_full_attention_spec,
    is_hma_required,
)
from kvspec.spec.coverage import BlockLists, TransferRequest
from kvspec.spec.digest import DigestPolicy, digest_rank_page, format_digest, is_request_sampled
from kvspec.spec.guard import check_request_blocks
from kvspec.spec.parallel import (
    CanonicalPage,
    PageTensor,
    ParallelLayout,
    RankCopy,
    RankLayout,
    SubBlock,
    check_coverage,
    check_page_sliceable,
    compute_dcp_copies,
    compute_rank_copies,
    elect_source_rank,
    get_completion_count,
    get_dcp_token_position,
    get_layout_mismatch,
    get_owned_units,
    get_rank_page_map,
    pair_stage_layers,
)
from kvspec.spec.state import (
    check_state_position,
    check_state_prefix_hit,
    get_state_clipped_blocks,
    get_state_differences,
    get_state_prefix_hit,
    pair_state_slots,
)

__all__ = [
    "FORMAT_VERSION",
    "FUNCTIONS",
    "PUBLIC_NAMES",
    "Arg",
    "VectorFunction",
    "answer_schema",
    "answer_vector",
    "decode_config",
    "decode_spec",
    "error_to_json",
    "same_json",
    "to_json",
    "vector_schema",
]

FORMAT_VERSION = 1
"""Version of the vector file format (the keys of a vector and of an answer), not of the protocol."""

Json = Any  # a value json.dumps accepts; private to the vectors

_RULE_ID = re.compile(r"\b([A-Z]{2,5}-\d+)\b")
_KNOWN_RULES = frozenset(rule.id for rule in RULES)


# --------------------------------------------------------------------------- encoding values


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _spec_to_json(spec: KVCacheSpec) -> dict[str, Json]:
    # The kind names the class; page_size_bytes is derived, carried so that no implementation needs dtype tables.
    body = {f.name: to_json(getattr(spec, f.name)) for f in attrs.fields(type(spec)) if f.init}
    return {"kind": spec.kind.value, **body, "page_size_bytes": spec.page_size_bytes}


def to_json(value: object) -> Json:
    """The language-neutral JSON value of a kvspec value, derived from its type.

    ``None``, bools, ints, floats and strings are themselves; enums their
    value; :class:`BlockIds` a list of per-group lists; a ``range`` the object
    ``{"start", "stop"}`` (half open); bytes base64; protocol messages their
    canonical wire object; specs their fields plus ``kind`` and
    ``page_size_bytes``; a :class:`TransferPlan` its ``copies`` and ``groups``;
    a session :class:`Output` its ``actions`` in order, each tagged with
    ``"type"`` (``send``, ``post``, ``cancel``, ``free``), and its ``steps``;
    an :class:`OffloadKey` its fields plus ``bytes``, its wire form; a
    :class:`StoreSet` its fields plus ``partial_chunks`` and
    ``complete_chunks`` (OFF-4); other attrs classes their init fields; tuples
    and lists lists; mappings objects.
    """
    if value is None or isinstance(value, (bool, int, str, float)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, BlockIds):
        return value.to_lists()
    if isinstance(value, DType):
        return value.name
    if isinstance(value, range):
        return {"start": value.start, "stop": value.stop}
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if type(value) in _MESSAGE_CLASSES:
        return json.loads(encode(value))  # type: ignore[arg-type]
    if isinstance(value, KVCacheSpec):
        return _spec_to_json(value)
    special = _SPECIAL.get(type(value))
    if special is not None:
        return special(value)
    kind: Any = type(value)
    if attrs.has(kind):
        return _fields(value)
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    raise ConfigError(f"vectors: no JSON encoding for {type(value).__name__}")


def _fields(value: Any) -> dict[str, Json]:
    return {f.name: to_json(getattr(value, f.name)) for f in attrs.fields(type(value)) if f.init}


def _plan_to_json(plan: Any) -> Json:
    # The plan holds columns; the vectors keep the language-neutral list of copies (PLAN-1).
    return {"copies": to_json(plan.copies), "groups": to_json(plan.groups)}


def _output_to_json(output: Any) -> Json:
    # The actions in the order the driver must carry them out, each tagged with its type (SM-1, SM-2).
    actions = [{"type": _snake(type(a).__name__), **_fields(a)} for a in output.actions]
    return {"actions": actions, "steps": [_fields(step) for step in output.steps]}


def _key_to_json(key: Any) -> Json:
    return {**_fields(key), "bytes": to_json(key.to_bytes())}  # the wire form carries the group (OFF-2)


def _store_set_to_json(store: Any) -> Json:
    return {
        **_fields(store),
        "partial_chunks": to_json(store.partial_chunks),
        "complete_chunks": to_json(store.complete_chunks),
    }


def _config_to_json(config: KVCacheConfig) -> Json:
    # A config's declared caches (CACHE-1) appear only when it declares some: older vectors stay as they were.
    body = _fields(config)
    if not config.caches:
        del body["caches"]
    return body


_SPECIAL: Mapping[type, Callable[[Any], Json]] = {
    KVCacheConfig: _config_to_json,
    TransferPlan: _plan_to_json,
    Output: _output_to_json,
    OffloadKey: _key_to_json,
    StoreSet: _store_set_to_json,
}


_MESSAGE_CLASSES = frozenset(MESSAGE_TYPES.values())


def error_to_json(error: KVSpecError, *, rule: str) -> dict[str, Json]:
    """``{"class", "rule", "message"}`` plus the error's structured details (``field``, ``differences``).

    ``rule`` is the last known rule id the message cites, else the vector's own rule. Written
    vectors leave the message out: it is informative, and rewording it must not change a vector.
    """
    cited = [r for r in _RULE_ID.findall(str(error)) if r in _KNOWN_RULES]
    out: dict[str, Json] = {"class": type(error).__name__, "rule": cited[-1] if cited else rule}
    if isinstance(error, IncompatiblePeerError):
        out["differences"] = {k: [to_json(p), to_json(c)] for k, (p, c) in error.differences.items()}
    if isinstance(error, MalformedMessageError) and error.field is not None:
        out["field"] = error.field
    out["message"] = str(error)
    return out


# --------------------------------------------------------------------------- decoding inputs

_SPEC_CLASSES: Mapping[SpecKind, type[KVCacheSpec]] = {
    SpecKind.FULL_ATTENTION: FullAttentionSpec,
    SpecKind.MLA: MLAAttentionSpec,
    SpecKind.SLIDING_WINDOW: SlidingWindowSpec,
    SpecKind.SLIDING_WINDOW_MLA: SlidingWindowMLASpec,
    SpecKind.CHUNKED_LOCAL: ChunkedLocalAttentionSpec,
    SpecKind.INDEXER: IndexerSpec,
    SpecKind.CROSS_ATTENTION: CrossAttentionSpec,
    SpecKind.MAMBA: MambaSpec,
    SpecKind.UNKNOWN: KVCacheSpec,
}


def _object(data: Json, what: str) -> Mapping[str, Json]:
    if not isinstance(data, dict):
        raise ConfigError(f"vectors: {what}: expected a JSON object, got {data!r}")
    return data


def decode_spec(data: Json) -> KVCacheSpec:
    """A spec from its vector encoding; ``page_size_bytes`` is derived and ignored."""
    body = _object(data, "spec")
    try:
        cls = _SPEC_CLASSES[SpecKind(body.get("kind"))]
    except ValueError:
        raise ConfigError(f"vectors: spec.kind: expected one of {[k.value for k in SpecKind]}") from None
    kwargs = {k: v for k, v in body.items() if k not in ("kind", "page_size_bytes")}
    return cls(**kwargs)


def decode_config(data: Json) -> KVCacheConfig:
    """A :class:`KVCacheConfig` from its vector encoding."""
    body = _object(data, "config")
    return KVCacheConfig(
        num_blocks=body["num_blocks"],
        kv_cache_tensors=[KVCacheTensor(**_object(t, "tensor")) for t in body["kv_cache_tensors"]],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=g["layer_names"], kv_cache_spec=decode_spec(g["kv_cache_spec"]))
            for g in body["kv_cache_groups"]
        ],
        caches=[CacheDeclaration(**_object(c, "cache")) for c in body.get("caches", [])],
    )


def _decode_message(data: Json) -> Any:
    body = _object(data, "message")
    kind: Any = MESSAGE_TYPES[body["type"]]
    return field_codec(kind).decode(body, "")


def _decode_descriptor(data: Json) -> EngineDescriptor:
    descriptor: EngineDescriptor = field_codec(EngineDescriptor).decode(_object(data, "descriptor"), "")
    return descriptor


def _same(value: Json) -> Json:
    return value


@attrs.frozen(kw_only=True)
class Arg:
    """One input field of a function: how it decodes and the JSON Schema of its encoding."""

    decode: Callable[[Json], Any] = _same
    schema: Mapping[str, Json]


def _ref(name: str) -> dict[str, Json]:
    return {"$ref": f"#/$defs/{name}"}


CONFIG = Arg(decode=decode_config, schema=_ref("config"))
SPEC = Arg(decode=decode_spec, schema=_ref("spec"))
BLOCK_IDS = Arg(decode=BlockIds, schema=_ref("block_ids"))
INT = Arg(schema={"type": "integer"})
INTS = Arg(decode=tuple, schema={"type": "array", "items": {"type": "integer"}})
BOOL = Arg(schema={"type": "boolean"})
STR = Arg(schema={"type": "string"})
NUMBER = Arg(schema={"type": "number"})
OBJECT = Arg(schema={"type": "object"})
MESSAGE = Arg(decode=_decode_message, schema=_ref("message"))
DESCRIPTOR = Arg(decode=_decode_descriptor, schema=_ref("message"))
BYTES = Arg(decode=lambda text: base64.b64decode(text, validate=True), schema={"type": "string"})
EVENTS = Arg(schema={"type": "array", "items": _ref("event")})
OPTIONAL_INT = Arg(schema={"type": ["integer", "null"]})
HASHES = Arg(
    decode=lambda texts: [base64.b64decode(text, validate=True) for text in texts],
    schema={"type": "array", "items": {"type": "string"}, "description": "block hashes, base64"},
)
PRESENT = Arg(schema={"type": "array", "items": {"type": "array", "items": {"type": "boolean"}}})


def _build(cls: Any, body: Json, what: str, **decoded: object) -> Any:
    fields = {**_object(body, what), **decoded}
    try:
        return cls(**fields)
    except TypeError as error:  # an unknown or missing field: a kvspec error, never a bare TypeError (VER-1)
        raise ConfigError(f"vectors: {what}: {error}") from None


def _decode_sub_block(body: Json) -> SubBlock:
    return _build(SubBlock, body, "sub_block")  # type: ignore[no-any-return]


def _list(body: Json, what: str) -> list[Json]:
    if not isinstance(body, list):
        raise ConfigError(f"vectors: {what}: expected a JSON array, got {body!r}")
    return body


def _decode_page(body: Json) -> CanonicalPage:
    tensors = []
    for tensor in _list(_object(body, "page").get("tensors"), "page.tensors"):
        blocks = [
            _decode_sub_block(b) for b in _list(_object(tensor, "page.tensors[]").get("sub_blocks"), "sub_blocks")
        ]
        tensors.append(_build(PageTensor, tensor, "page.tensors[]", sub_blocks=blocks))
    return CanonicalPage(tensors=tensors)


def _decode_layout(body: Json) -> ParallelLayout:
    layout = _object(body, "layout")
    rank = _build(RankLayout, layout.get("rank"), "layout.rank")
    return ParallelLayout(rank=rank, pages=[_decode_page(p) for p in _list(layout.get("pages"), "layout.pages")])


SUB_BLOCK = Arg(decode=_decode_sub_block, schema={"type": "object"})
LAYOUT = Arg(decode=_decode_layout, schema={"type": "object"})
PAGE = Arg(decode=_decode_page, schema={"type": "object"})
COPIES = Arg(
    decode=lambda body: [_build(RankCopy, c, "copies[]") for c in _list(body, "copies")],
    schema={"type": "array", "items": {"type": "object"}},
)
STAGES = Arg(schema={"type": "array", "items": {"type": "array", "items": {"type": "string"}}})
OFFLOAD = Arg(decode=lambda body: OffloadConfig(**_object(body, "offload")), schema=_ref("offload"))


# --------------------------------------------------------------------------- the registry


@attrs.frozen(kw_only=True)
class VectorFunction:
    """One function the vectors cover: its public name, its input fields, and how to call the reference."""

    name: str
    inputs: Mapping[str, Arg]
    call: Callable[[Mapping[str, Any]], object]
    encode_output: Callable[[object], Json] = to_json

    def run(self, data: Mapping[str, Json]) -> Json:
        """Decode ``data``, call the reference and encode its result; kvspec errors propagate."""
        missing = sorted(set(self.inputs) - set(data))
        if missing:
            raise ConfigError(f"vectors: {self.name}: input lacks {missing}")
        args = {name: arg.decode(data[name]) for name, arg in self.inputs.items()}
        return self.encode_output(self.call(args))


# Reference callable -> the public name vectors carry in "function" and in their path. A rename is one line.
PUBLIC_NAMES: Mapping[object, str] = {
    is_hma_required: "is_hma_required",
    is_full_attention_spec: "is_full_attention_spec",
    check_hybrid_support: "check_hybrid_support",
    check_state_position: "check_state_position",
    get_state_clipped_blocks: "get_state_clipped_blocks",
    pair_state_slots: "pair_state_slots",
    check_state_prefix_hit: "check_state_prefix_hit",
    get_state_prefix_hit: "get_state_prefix_hit",
    get_state_differences: "get_state_differences",
    get_blocks_per_sw: "get_blocks_per_sw",
    get_exchange_clipped_blocks: "get_exchange_clipped_blocks",
    get_token_basis_group: "get_token_basis_group",
    compute_block_pairs: "compute_block_pairs",
    get_logical_block_count: "get_logical_block_count",
    get_needed_token_range: "get_needed_token_range",
    get_needed_block_range: "get_needed_block_range",
    get_num_skipped_tokens: "get_num_skipped_tokens",
    get_pruned_block_ids: "get_pruned_block_ids",
    get_consumer_block_counts: "get_consumer_block_counts",
    check_window_coverage: "check_window_coverage",
    compute_transfer_pairs: "compute_transfer_pairs",
    plan_transfer: "plan_transfer",
    summarize_plan: "summarize_plan",
    blocks_needed_for: "blocks_needed_for",
    encode: "encode",
    decode: "decode",
    TransferParams.from_kv_transfer_params: "TransferParams.from_kv_transfer_params",
    TransferParams.to_kv_transfer_params: "TransferParams.to_kv_transfer_params",
    check_compatibility: "check_compatibility",
    ProducerSession: "ProducerSession",
    ConsumerSession: "ConsumerSession",
    check_offload_support: "check_offload_support",
    get_chunk_sizes: "get_chunk_sizes",
    get_offload_keys: "get_offload_keys",
    get_store_set: "get_store_set",
    get_offload_hit_tokens: "get_offload_hit_tokens",
    get_load_set: "get_load_set",
    map_sub_blocks: "map_sub_blocks",
    get_sub_block_offset: "get_sub_block_offset",
    get_retained_chunk_starts: "get_retained_chunk_starts",
    get_owned_units: "get_owned_units",
    get_rank_page_map: "get_rank_page_map",
    check_coverage: "check_coverage",
    compute_rank_copies: "compute_rank_copies",
    compute_dcp_copies: "compute_dcp_copies",
    elect_source_rank: "elect_source_rank",
    check_page_sliceable: "check_page_sliceable",
    get_completion_count: "get_completion_count",
    get_layout_mismatch: "get_layout_mismatch",
    pair_stage_layers: "pair_stage_layers",
    get_dcp_token_position: "get_dcp_token_position",
    digest_rank_page: "digest_rank_page",
    is_request_sampled: "is_request_sampled",
    check_request_blocks: "check_request_blocks",
}


@attrs.frozen(kw_only=True)
class _Pairs:
    """Pairs as the planner reads them, built without BlockPairs' checks so PLAN-1's own checks are reached."""

    producer_block_ids: BlockIds
    consumer_block_ids: BlockIds


def _plan(a: Mapping[str, Any]) -> object:
    pairs = _Pairs(producer_block_ids=a["producer_block_ids"], consumer_block_ids=a["consumer_block_ids"])
    return plan_transfer(producer_config=a["producer_config"], consumer_config=a["consumer_config"], pairs=pairs)


def _canonical(message: object) -> Json:
    return json.loads(encode(message))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- sessions


def _reason(event: Mapping[str, Json]) -> FailureReason:
    return FailureReason(event["reason"])


def _session_call(session: ProducerSession | ConsumerSession, event: Mapping[str, Json]) -> object:
    call, now = event["call"], event["now"]
    if call == "receive":
        return session.receive(_decode_message(event["message"]), now=now)
    if call == "transfer_failed":
        return session.transfer_failed(_reason(event), now=now, detail=event.get("detail", ""))
    if call == "fail" and isinstance(session, ConsumerSession):
        return session.fail(_reason(event), now=now, detail=event.get("detail", ""))
    if call == "abort" and isinstance(session, ProducerSession):
        return session.abort(now=now, detail=event.get("detail", ""))
    if call == "start" and isinstance(session, ConsumerSession):
        return session.start(now=now)
    if call in ("abort", "transfer_done", "tick"):
        method: Callable[..., object] = getattr(session, call)
        return method(now=now)
    raise ConfigError(f"vectors: {type(session).__name__} has no event {call!r}")


def _run_events(session: ProducerSession | ConsumerSession, events: Sequence[Mapping[str, Json]]) -> Json:
    steps: list[Json] = []
    for event in events:
        step: dict[str, Json] = {}
        try:
            step["output"] = to_json(_session_call(session, event))
        except KVSpecError as error:  # a protocol error leaves the session unchanged (SM-1, SM-2)
            step["error"] = {"class": type(error).__name__}  # compared as part of the output: the class only
        step["state"] = session.state.value
        step["next_deadline"] = session.next_deadline
        if isinstance(session, ConsumerSession):
            step["failure"] = to_json(session.failure)
        steps.append(step)
    return {"steps": steps}


def _producer(a: Mapping[str, Any]) -> object:
    session = ProducerSession(params=a["params"], **a["options"])
    return _run_events(session, a["events"])


def _consumer(a: Mapping[str, Any]) -> object:
    session = ConsumerSession(
        params=a["params"],
        consumer_engine_id=a["consumer_engine_id"],
        consumer_block_ids=a["consumer_block_ids"],
        **a["options"],
    )
    return _run_events(session, a["events"])


def _entry(fn: object, inputs: Mapping[str, Arg], call: Callable[[Mapping[str, Any]], object]) -> VectorFunction:
    return VectorFunction(name=PUBLIC_NAMES[fn], inputs=inputs, call=call)


def _with_tokens(**extra: Arg) -> dict[str, Arg]:
    return {"config": CONFIG, "num_tokens": INT, "prefix_hit_tokens": INT, **extra}


_PAIR_INPUTS = {"producer_block_ids": BLOCK_IDS, "consumer_block_ids": BLOCK_IDS}


def _request(args: Mapping[str, Any], *other: str) -> tuple[KVCacheConfig, TransferRequest]:
    """A vector's config and the request its other inputs (but ``other``) describe (WIN-1)."""
    fields = {name: value for name, value in args.items() if name != "config" and name not in other}
    return args["config"], TransferRequest(**fields)


_FLAG = "disable_hybrid_kv_cache_manager"

_ENTRIES: tuple[VectorFunction, ...] = (
    # HMA-1, ADM-1, ADM-2
    _entry(
        is_hma_required, {"config": CONFIG, _FLAG: BOOL}, lambda a: is_hma_required(a["config"], **{_FLAG: a[_FLAG]})
    ),
    _entry(is_full_attention_spec, {"spec": SPEC}, lambda a: is_full_attention_spec(a["spec"])),
    _entry(
        check_hybrid_support,
        {"config": CONFIG, "mode": STR, "read_only_hma": BOOL, _FLAG: BOOL},
        lambda a: check_hybrid_support(
            a["config"], mode=a["mode"], read_only_hma=a["read_only_hma"], **{_FLAG: a[_FLAG]}
        ),
    ),
    # STATE-1 .. STATE-5
    _entry(
        check_state_position,
        {"config": CONFIG, "state_tokens": OPTIONAL_INT, "num_tokens": INT, "recomputed_tokens": INT, "profile": STR},
        lambda a: check_state_position(
            a["config"],
            state_tokens=a["state_tokens"],
            num_tokens=a["num_tokens"],
            recomputed_tokens=a["recomputed_tokens"],
            profile=a["profile"],
        ),
    ),
    _entry(
        get_state_clipped_blocks,
        {"config": CONFIG, "block_ids": BLOCK_IDS},
        lambda a: get_state_clipped_blocks(a["config"], a["block_ids"]),
    ),
    _entry(
        pair_state_slots,
        {"producer_slots": INTS, "consumer_slots": INTS},
        lambda a: pair_state_slots(a["producer_slots"], a["consumer_slots"]),
    ),
    _entry(
        check_state_prefix_hit,
        {"config": CONFIG, "prefix_hit_tokens": INT},
        lambda a: check_state_prefix_hit(a["config"], prefix_hit_tokens=a["prefix_hit_tokens"]),
    ),
    _entry(
        get_state_prefix_hit,
        {"config": CONFIG, "group_hits": INTS},
        lambda a: get_state_prefix_hit(a["config"], a["group_hits"]),
    ),
    _entry(
        get_state_differences,
        {"producer": SPEC, "consumer": SPEC},
        lambda a: get_state_differences(a["producer"], a["consumer"]),
    ),
    # SW-1, CLIP-1, TOK-1
    _entry(get_blocks_per_sw, {"config": CONFIG}, lambda a: get_blocks_per_sw(a["config"])),
    _entry(
        get_exchange_clipped_blocks,
        {"block_ids": BLOCK_IDS, "budgets": INTS},
        lambda a: get_exchange_clipped_blocks(a["block_ids"], a["budgets"]),
    ),
    _entry(get_token_basis_group, {"config": CONFIG}, lambda a: get_token_basis_group(a["config"])),
    # ALIGN-1, NULL-1
    _entry(compute_block_pairs, _PAIR_INPUTS, lambda a: compute_block_pairs(BlockLists(**a))),
    # WIN-1
    _entry(
        get_logical_block_count,
        {"spec": SPEC, "num_tokens": INT},
        lambda a: get_logical_block_count(a["spec"], num_tokens=a["num_tokens"]),
    ),
    _entry(
        get_needed_token_range,
        {"spec": SPEC, "num_tokens": INT, "prefix_hit_tokens": INT},
        lambda a: get_needed_token_range(
            a["spec"], num_tokens=a["num_tokens"], prefix_hit_tokens=a["prefix_hit_tokens"]
        ),
    ),
    _entry(
        get_needed_block_range,
        {"spec": SPEC, "num_tokens": INT, "prefix_hit_tokens": INT},
        lambda a: get_needed_block_range(
            a["spec"], num_tokens=a["num_tokens"], prefix_hit_tokens=a["prefix_hit_tokens"]
        ),
    ),
    _entry(
        get_num_skipped_tokens,
        {"spec": SPEC, "num_computed_tokens": INT},
        lambda a: get_num_skipped_tokens(a["spec"], num_computed_tokens=a["num_computed_tokens"]),
    ),
    _entry(
        get_pruned_block_ids,
        {"config": CONFIG, "block_ids": BLOCK_IDS, "num_computed_tokens": INT},
        lambda a: get_pruned_block_ids(a["config"], a["block_ids"], num_computed_tokens=a["num_computed_tokens"]),
    ),
    _entry(get_consumer_block_counts, _with_tokens(), lambda a: get_consumer_block_counts(**a)),
    _entry(check_window_coverage, _with_tokens(**_PAIR_INPUTS), lambda a: check_window_coverage(*_request(a))),
    _entry(compute_transfer_pairs, _with_tokens(**_PAIR_INPUTS), lambda a: compute_transfer_pairs(*_request(a))),
    # PLAN-1
    _entry(plan_transfer, {"producer_config": CONFIG, "consumer_config": CONFIG, **_PAIR_INPUTS}, _plan),
    _entry(
        summarize_plan,
        {**_with_tokens(), "mode": STR},
        lambda a: summarize_plan(**{**a, "mode": TransferMode(a["mode"])}),
    ),
    _entry(
        blocks_needed_for,
        {"config": CONFIG, "num_tokens": INT},
        lambda a: blocks_needed_for(a["config"], num_tokens=a["num_tokens"]),
    ),
    # VER-1, TOK-1: the wire codec and vLLM's dict
    _entry(encode, {"message": MESSAGE}, lambda a: encode(a["message"]).decode("ascii")),
    _entry(decode, {"bytes": BYTES}, lambda a: _canonical(decode(a["bytes"]))),
    _entry(
        TransferParams.from_kv_transfer_params,
        {"kv_transfer_params": OBJECT},
        lambda a: _canonical(TransferParams.from_kv_transfer_params(a["kv_transfer_params"])),
    ),
    _entry(
        TransferParams.to_kv_transfer_params,
        {"message": MESSAGE},
        lambda a: a["message"].to_kv_transfer_params(),
    ),
    # HS-1
    _entry(
        check_compatibility,
        {"producer": DESCRIPTOR, "consumer": DESCRIPTOR},
        lambda a: check_compatibility(producer=a["producer"], consumer=a["consumer"]),
    ),
    # SM-1, SM-2, REL-1, FAIL-1, DONE-1
    _entry(ProducerSession, {"params": MESSAGE, "options": OBJECT, "events": EVENTS}, _producer),
    _entry(
        ConsumerSession,
        {
            "params": MESSAGE,
            "consumer_engine_id": STR,
            "consumer_block_ids": BLOCK_IDS,
            "options": OBJECT,
            "events": EVENTS,
        },
        _consumer,
    ),
    # OFF-1 ... OFF-9: offloading chunks to a slower tier
    _entry(check_offload_support, {"config": CONFIG}, lambda a: check_offload_support(a["config"])),
    _entry(
        get_chunk_sizes,
        {"config": CONFIG, "blocks_per_chunk": INT, "hash_block_size": OPTIONAL_INT},
        lambda a: get_chunk_sizes(
            a["config"], blocks_per_chunk=a["blocks_per_chunk"], hash_block_size=a["hash_block_size"]
        ),
    ),
    _entry(
        get_offload_keys,
        {"config": CONFIG, "block_hashes": HASHES, "offload": OFFLOAD},
        lambda a: get_offload_keys(a["config"], a["block_hashes"], offload=a["offload"]),
    ),
    _entry(
        get_store_set,
        {
            "config": CONFIG,
            "block_ids": BLOCK_IDS,
            "num_offloadable_tokens": INT,
            "next_chunk": INTS,
            "offload": OFFLOAD,
        },
        lambda a: get_store_set(
            a["config"],
            a["block_ids"],
            num_offloadable_tokens=a["num_offloadable_tokens"],
            next_chunk=a["next_chunk"],
            offload=a["offload"],
        ),
    ),
    _entry(
        get_offload_hit_tokens,
        {"config": CONFIG, "present": PRESENT, "num_tokens": INT, "local_hit_tokens": INT, "offload": OFFLOAD},
        lambda a: get_offload_hit_tokens(
            a["config"],
            a["present"],
            num_tokens=a["num_tokens"],
            local_hit_tokens=a["local_hit_tokens"],
            offload=a["offload"],
        ),
    ),
    _entry(
        get_load_set,
        {"config": CONFIG, "block_ids": BLOCK_IDS, "num_tokens": INT, "local_hit_tokens": INT, "offload": OFFLOAD},
        lambda a: get_load_set(
            a["config"],
            a["block_ids"],
            num_tokens=a["num_tokens"],
            local_hit_tokens=a["local_hit_tokens"],
            offload=a["offload"],
        ),
    ),
    _entry(
        map_sub_blocks,
        {"first_block_index": INT, "num_blocks": INT, "blocks_per_chunk": INT},
        lambda a: map_sub_blocks(a["first_block_index"], a["num_blocks"], blocks_per_chunk=a["blocks_per_chunk"]),
    ),
    _entry(
        get_sub_block_offset,
        {"chunk_row": INT, "sub_block": INT, "page_size": INT, "blocks_per_chunk": INT},
        lambda a: get_sub_block_offset(
            a["chunk_row"], a["sub_block"], page_size=a["page_size"], blocks_per_chunk=a["blocks_per_chunk"]
        ),
    ),
    _entry(
        get_retained_chunk_starts,
        {"config": CONFIG, "num_computed_tokens": INT, "offload": OFFLOAD},
        lambda a: get_retained_chunk_starts(
            a["config"], num_computed_tokens=a["num_computed_tokens"], offload=a["offload"]
        ),
    ),
)

_TP_PAIR = {"producer_tp": INT, "consumer_tp": INT}
_ENTRIES += (
    # PAR-1 .. PAR-8
    _entry(
        get_owned_units,
        {"sub_block": SUB_BLOCK, "tp_size": INT, "tp_rank": INT},
        lambda a: get_owned_units(a["sub_block"], tp_size=a["tp_size"], tp_rank=a["tp_rank"]),
    ),
    _entry(
        get_rank_page_map,
        {"page": PAGE, "tp_size": INT, "tp_rank": INT},
        lambda a: get_rank_page_map(a["page"], tp_size=a["tp_size"], tp_rank=a["tp_rank"]),
    ),
    _entry(
        check_coverage,
        {"page": PAGE, **_TP_PAIR, "consumer_rank": INT, "copies": COPIES},
        lambda a: check_coverage(
            a["page"],
            producer_tp=a["producer_tp"],
            consumer_tp=a["consumer_tp"],
            consumer_rank=a["consumer_rank"],
            copies=a["copies"],
        ),
    ),
    _entry(
        compute_rank_copies,
        {"page": PAGE, **_TP_PAIR, "consumer_rank": INT},
        lambda a: compute_rank_copies(
            a["page"], producer_tp=a["producer_tp"], consumer_tp=a["consumer_tp"], consumer_rank=a["consumer_rank"]
        ),
    ),
    _entry(
        elect_source_rank,
        {"sub_block": SUB_BLOCK, "unit": INT, **_TP_PAIR, "consumer_rank": INT},
        lambda a: elect_source_rank(
            a["sub_block"],
            a["unit"],
            producer_tp=a["producer_tp"],
            consumer_tp=a["consumer_tp"],
            consumer_rank=a["consumer_rank"],
        ),
    ),
    _entry(
        check_page_sliceable,
        {"page": PAGE, **_TP_PAIR},
        lambda a: check_page_sliceable(a["page"], producer_tp=a["producer_tp"], consumer_tp=a["consumer_tp"]),
    ),
    _entry(
        get_completion_count,
        {**_TP_PAIR, "producer_rank": INT},
        lambda a: get_completion_count(
            producer_tp=a["producer_tp"], consumer_tp=a["consumer_tp"], producer_rank=a["producer_rank"]
        ),
    ),
    _entry(
        get_layout_mismatch,
        {"producer": LAYOUT, "consumer": LAYOUT},
        lambda a: get_layout_mismatch(producer=a["producer"], consumer=a["consumer"]),
    ),
    _entry(
        pair_stage_layers,
        {"producer_stages": STAGES, "consumer_stages": STAGES},
        lambda a: pair_stage_layers(a["producer_stages"], a["consumer_stages"]),
    ),
    _entry(
        compute_dcp_copies,
        {"page": PAGE, **_TP_PAIR, "consumer_rank": INT, "dcp_size": INT, "dcp_rank": INT, "interleave": INT},
        lambda a: compute_dcp_copies(
            a["page"],
            producer_tp=a["producer_tp"],
            consumer_tp=a["consumer_tp"],
            consumer_rank=a["consumer_rank"],
            dcp_size=a["dcp_size"],
            dcp_rank=a["dcp_rank"],
            interleave=a["interleave"],
        ),
    ),
    _entry(
        get_dcp_token_position,
        {"local_index": INT, "dcp_size": INT, "dcp_rank": INT, "interleave": INT},
        lambda a: get_dcp_token_position(
            a["local_index"], dcp_size=a["dcp_size"], dcp_rank=a["dcp_rank"], interleave=a["interleave"]
        ),
    ),
)

POLICY = Arg(decode=lambda body: DigestPolicy(**_object(body, "policy")), schema={"type": "object"})
_ENTRIES += (
    # INT-2, INT-3
    _entry(
        digest_rank_page,
        {
            "policy": POLICY,
            "page": PAGE,
            "data": BYTES,
            "layer": STR,
            "position": INT,
            "tp_size": INT,
            "tp_rank": INT,
            "split": INT,
            "granule": INT,
        },
        # Positions as object keys and 128-bit sums as 32 hex characters: JSON numbers stop at 2**53 in many readers.
        lambda a: {
            str(position): format_digest(value)
            for position, value in digest_rank_page(
                a["policy"],
                a["page"],
                a["data"],
                layer=a["layer"],
                position=a["position"],
                tp_size=a["tp_size"],
                tp_rank=a["tp_rank"],
                split=a["split"],
                granule=a["granule"],
            ).items()
        },
    ),
    _entry(
        is_request_sampled,
        {"policy": POLICY, "request_id": STR},
        lambda a: is_request_sampled(a["policy"], a["request_id"]),
    ),
    _entry(
        check_request_blocks,
        _with_tokens(**_PAIR_INPUTS, recomputed_tokens=INT, state_tokens=OPTIONAL_INT),
        lambda a: check_request_blocks(*_request(a, "state_tokens"), state_tokens=a["state_tokens"]),
    ),
)

FUNCTIONS: Mapping[str, VectorFunction] = {entry.name: entry for entry in _ENTRIES}
"""Public function name -> its registry entry."""


# --------------------------------------------------------------------------- answering


def answer_vector(vector: Mapping[str, Json]) -> dict[str, Json]:
    """kvspec's answer to one vector: ``{"output": ...}``, ``{"error": {...}}`` or ``{"unsupported": true}``.

    This is the contract an external implementation follows, run by the reference.
    """
    entry = FUNCTIONS.get(vector.get("function"))  # type: ignore[arg-type]
    if entry is None:
        return {"unsupported": True}
    try:
        return {"output": entry.run(vector["input"])}
    except KVSpecError as error:
        return {"error": error_to_json(error, rule=str(vector.get("rule", "")))}


def same_json(expected: Json, found: Json) -> bool:
    """JSON equality as implementations see it: numbers by value (``1 == 1.0``), booleans never numbers."""
    if isinstance(expected, bool) or isinstance(found, bool):
        return isinstance(expected, bool) and isinstance(found, bool) and expected == found
    if isinstance(expected, (int, float)) and isinstance(found, (int, float)):
        return expected == found
    if isinstance(expected, dict) and isinstance(found, dict):
        return expected.keys() == found.keys() and all(same_json(v, found[k]) for k, v in expected.items())
    if isinstance(expected, list) and isinstance(found, list):
        return len(expected) == len(found) and all(same_json(e, f) for e, f in zip(expected, found, strict=True))
    return type(expected) is type(found) and bool(expected == found)


# --------------------------------------------------------------------------- schemas

_SCHEMA_BASE = "https://kvspec.invalid/vectors/"
_DIALECT = "https://json-schema.org/draft/2020-12/schema"

_ERROR_SCHEMA: dict[str, Json] = {
    "type": "object",
    "properties": {
        "class": {"type": "string", "description": "the kvspec error class name, e.g. WindowCoverageError"},
        "rule": {"type": "string", "pattern": "^[A-Z]{2,5}-[0-9]+$", "description": "the rule it enforces"},
        "message": {"type": "string", "description": "informative; never compared"},
        "field": {"type": "string", "description": "MalformedMessageError: the offending field"},
        "differences": {
            "type": "object",
            "additionalProperties": {"type": "array", "minItems": 2, "maxItems": 2},
            "description": "IncompatiblePeerError: field -> [producer value, consumer value]",
        },
    },
    "required": ["class"],
}

_DEFS: dict[str, Json] = {
    "block_ids": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "description": "one list of block ids per KV-cache group, in group order; 0 is the null block",
    },
    "spec": {
        "type": "object",
        "properties": {
            "kind": {"enum": [k.value for k in SpecKind]},
            "block_size": {"type": "integer", "minimum": 1},
            "page_size_bytes": {"type": "integer", "minimum": 0},
        },
        "required": ["kind", "block_size", "page_size_bytes"],
    },
    "tensor": {
        "type": "object",
        "properties": {
            "size": {"type": "integer"},
            "layers": {"type": "array", "items": {"type": "string"}},
            "layer_stride": {"type": "integer"},
            "block_stride": {"type": "integer"},
            "offset": {"type": "integer"},
        },
        "required": ["size", "layers", "layer_stride", "block_stride", "offset"],
        "additionalProperties": False,
    },
    "config": {
        "type": "object",
        "properties": {
            "num_blocks": {"type": "integer", "minimum": 1},
            "kv_cache_tensors": {"type": "array", "items": {"$ref": "#/$defs/tensor"}},
            "kv_cache_groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "layer_names": {"type": "array", "items": {"type": "string"}},
                        "kv_cache_spec": {"$ref": "#/$defs/spec"},
                    },
                    "required": ["layer_names", "kv_cache_spec"],
                    "additionalProperties": False,
                },
            },
            "caches": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "kind": {"type": "string"},
                        "layer_names": {"type": "array", "items": {"type": "string"}},
                        "draft": {"type": "boolean"},
                        "ephemeral": {"type": "boolean"},
                    },
                    "required": ["name", "kind", "layer_names", "draft", "ephemeral"],
                    "additionalProperties": False,
                },
                "description": "CACHE-1 (protocol 1.3): every cache the model keeps; absent: the groups alone",
            },
        },
        "required": ["num_blocks", "kv_cache_tensors", "kv_cache_groups"],
        "additionalProperties": False,
    },
    "message": {
        "type": "object",
        "properties": {"type": {"enum": sorted(MESSAGE_TYPES)}, "v": {"type": "array", "items": {"type": "integer"}}},
        "required": ["type", "v"],
        "description": "a protocol message as its wire object (docs/schema/<type>.schema.json)",
    },
    "event": {
        "type": "object",
        "properties": {
            "call": {"enum": ["start", "receive", "abort", "fail", "transfer_done", "transfer_failed", "tick"]},
            "now": {"type": "number"},
            "message": {"$ref": "#/$defs/message"},
            "reason": {"enum": [r.value for r in FailureReason]},
            "detail": {"type": "string"},
        },
        "required": ["call", "now"],
        "additionalProperties": False,
    },
    "offload": {
        "type": "object",
        "properties": {
            "blocks_per_chunk": {"type": "integer", "minimum": 1},
            "hash_block_size": {"type": "integer", "minimum": 1},
        },
        "required": ["blocks_per_chunk", "hash_block_size"],
        "additionalProperties": False,
        "description": "OffloadConfig: f GPU blocks per chunk, keys from hashes of h tokens (OFF-1)",
    },
    "error": _ERROR_SCHEMA,
}


def _input_schema(entry: VectorFunction) -> dict[str, Json]:
    return {
        "if": {"properties": {"function": {"const": entry.name}}, "required": ["function"]},
        "then": {
            "properties": {
                "input": {
                    "type": "object",
                    "properties": {name: dict(arg.schema) for name, arg in entry.inputs.items()},
                    "required": list(entry.inputs),
                    "additionalProperties": False,
                }
            }
        },
    }


def vector_schema() -> dict[str, Json]:
    """The JSON Schema (draft 2020-12) of one vector file, with each function's input fields."""
    return {
        "$schema": _DIALECT,
        "$id": _SCHEMA_BASE + "vector.schema.json",
        "title": "kvspec test vector",
        "description": f"One vector of kvspec's language-neutral test vectors (format {FORMAT_VERSION}, protocol "
        f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}): call `function` with `input`; the answer must equal "
        "`output`, or raise the error class in `error`.",
        "type": "object",
        "properties": {
            "rule": {"type": "string", "pattern": "^[A-Z]{2,5}-[0-9]+$"},
            "function": {"type": "string", "minLength": 1},
            "case": {"type": "string", "pattern": "^[a-z0-9_]+$"},
            "description": {"type": "string"},
            "input": {"type": "object"},
            "output": {},
            "error": {"$ref": "#/$defs/error"},
        },
        "required": ["rule", "function", "case", "input"],
        "oneOf": [{"required": ["output"]}, {"required": ["error"]}],
        "additionalProperties": False,
        "allOf": [_input_schema(entry) for entry in _ENTRIES],
        "$defs": _DEFS,
    }


def answer_schema() -> dict[str, Json]:
    """The JSON Schema of what an implementation prints for one vector."""
    return {
        "$schema": _DIALECT,
        "$id": _SCHEMA_BASE + "answer.schema.json",
        "title": "kvspec test vector answer",
        "description": "What an implementation prints on stdout for one vector: its output, the error it raised, "
        "or that it does not implement the function.",
        "type": "object",
        "properties": {"output": {}, "error": {"$ref": "#/$defs/error"}, "unsupported": {"const": True}},
        "oneOf": [{"required": ["output"]}, {"required": ["error"]}, {"required": ["unsupported"]}],
        "$defs": {"error": _ERROR_SCHEMA},
    }
