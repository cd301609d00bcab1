"""Typed protocol messages exchanged between a producer and a consumer engine.

Every message is a frozen attrs class validated on construction; a bad field
raises :class:`kvspec.ConfigError` naming the class and the field. Messages
carry no encoding logic: :mod:`kvspec.protocol._codec` turns them into canonical bytes.
The one exception is the dict form of :class:`TransferParams`, which is what
vLLM's router already passes around as ``kv_transfer_params``.

Every message of one exchange carries the same ``request_id``: the
producer's request id, which the consumer learns from the transfer
parameters (vLLM's ``remote_request_id``). Direction of each message:

- ``EngineDescriptor``: both ways, once per peer, at handshake (HS-1).
- ``TransferParams``: P -> router -> C, once per request.
- ``BlockOffer``: C -> P, WRITE mode only.
- ``Completion``: P -> C, WRITE mode, as the notification of P's write.
- ``Failure``: P -> C, when P's write failed or P's lease ran out.
- ``Abort``: either way: the sender gave up on the request.
- ``Release``: C -> P, exactly once per consumer request (REL-1).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import attrs

from kvspec.core._enums import FailureReason, StateProfile, TransferMode
from kvspec.core._errors import (
    ConfigError,
    FieldError,
    KVSpecError,
    MalformedMessageError,
    UnsupportedVersionError,
    shown,
)
from kvspec.core._models import (
    NULL_BLOCK_ID,
    AttentionSpec,
    BlockIds,
    CacheDeclaration,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SpecKind,
)
from kvspec.reference._integrity import DIGEST_HEX_LENGTH, BlockDigests, is_block_digest
from kvspec.spec.digest import get_offered_algorithms
from kvspec.spec.lifecycle import ReleaseOutcome
from kvspec.spec.parallel import ParallelLayout
from kvspec.spec.versions import PROTOCOL_VERSION, is_compatible_version

__all__ = [
    "PROTOCOL_VERSION",
    "TRANSFER_PARAMS_KEYS",
    "Abort",
    "BlockOffer",
    "Completion",
    "EngineDescriptor",
    "Failure",
    "GroupDescriptor",
    "Message",
    "Release",
    "ReleaseOutcome",
    "TransferParams",
    "TransportData",
]

MAX_LAYOUT_SUB_BLOCKS = 256
"""Sub-blocks a parallel layout may name over all its pages: the handshake's byte-map work grows with them (PAR-9)."""

TransportData: TypeAlias = Mapping[str, str | int] | bytes
"""The transport's own addressing data: named values (host, port...) or opaque bytes."""


# --------------------------------------------------------------------------- validators


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _non_empty_str(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise FieldError(type(inst), attribute.name, "a non-empty str", value)


def _str(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise FieldError(type(inst), attribute.name, "a str", value)


def _bool(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise FieldError(type(inst), attribute.name, "a bool", value)


def _positive_int(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise FieldError(type(inst), attribute.name, "a positive int", value)


def _non_negative_int(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise FieldError(type(inst), attribute.name, "a non-negative int", value)


def _optional_non_negative_int(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _non_negative_int(inst, attribute, value)


def _optional_positive_int(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive_int(inst, attribute, value)


def _optional_non_empty_str(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _non_empty_str(inst, attribute, value)


def _finite_float(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, float) or not math.isfinite(value):
        raise FieldError(type(inst), attribute.name, "a finite number", value)


def _to_float(value: object) -> object:
    # Accept ints for convenience; anything else is left for the validator to reject.
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _bytes(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bytes):
        raise FieldError(type(inst), attribute.name, "bytes", value)


def _instance_of(kind: type) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind):
            raise FieldError(type(inst), attribute.name, f"a {kind.__name__}", value)

    return check


def _to_block_ids(value: object) -> object:
    if isinstance(value, BlockIds):
        return value
    try:
        return BlockIds(value)
    except ConfigError:
        return value  # the validator names the message field


def _version(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(_is_int(v) and v >= 0 for v in value)):
        raise FieldError(type(inst), attribute.name, "a (major, minor) pair of non-negative ints", value)


def _block_ends_of(ids_field: str) -> Any:
    """Per-group ends of the list in ``ids_field``: one non-negative int per group, none shorter than its list."""

    def check(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None:
            return  # a 1.0 peer: where the list ends is not said (ALIGN-1)
        if not isinstance(value, tuple) or not all(_is_int(v) and v >= 0 for v in value):
            raise FieldError(type(inst), attribute.name, "a tuple of non-negative ints, or None", value)
        ids = getattr(inst, ids_field)
        if not isinstance(ids, BlockIds):
            return  # that field's own validator names it
        if len(value) != len(ids):
            raise FieldError(type(inst), attribute.name, f"one end per group of {ids_field} ({len(ids)})", value)
        for g, (end, group) in enumerate(zip(value, ids, strict=True)):
            if end < len(group):
                expected = f"an end of at least {len(group)} (the length of {ids_field}[{g}])"
                raise FieldError(type(inst), f"{attribute.name}[{g}]", expected, end)

    return check


def _to_tuple(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _to_digests(value: object) -> object:
    if isinstance(value, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in value):
        return tuple(tuple(g) for g in value)
    return value


def _digest_lists(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Per-group tuples of block digests (32 lowercase hex characters, or ``""``), or None (INT-1)."""
    if value is None:
        return  # INT-1 is off on the sender: no digests
    if not isinstance(value, tuple) or not all(isinstance(g, tuple) for g in value):
        raise FieldError(type(inst), attribute.name, "a tuple of per-group tuples of digests, or None", value)
    for g, group in enumerate(value):
        for i, digest in enumerate(group):
            if digest != "" and not is_block_digest(digest):
                raise FieldError(
                    type(inst),
                    f"{attribute.name}[{g}][{i}]",
                    f"{DIGEST_HEX_LENGTH} lowercase hex characters or ''",
                    digest,
                )


def _digests_of(ids_field: str) -> Any:
    """Digests parallel to the list in ``ids_field``: one per id, ``""`` exactly for the null block (INT-1)."""

    def check(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        _digest_lists(inst, attribute, value)
        ids = getattr(inst, ids_field)
        if not isinstance(value, tuple) or not isinstance(ids, BlockIds):
            return  # None, or that field's own validator names it
        if len(value) != len(ids) or any(len(d) != len(g) for d, g in zip(value, ids, strict=False)):
            raise FieldError(type(inst), attribute.name, f"one digest per id of {ids_field}", value)
        for g, (digests, group) in enumerate(zip(value, ids, strict=True)):
            for i, (digest, block_id) in enumerate(zip(digests, group, strict=True)):
                if (digest == "") != (block_id == NULL_BLOCK_ID):
                    expected = "'' (a null block)" if block_id == NULL_BLOCK_ID else "the digest of a real block"
                    raise FieldError(type(inst), f"{attribute.name}[{g}][{i}]", expected, digest)

    return check


# --------------------------------------------------------------------------- handshake


def _to_shapes(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(tuple(shape) if isinstance(shape, (list, tuple)) else shape for shape in value)
    return value


def _optional_shapes(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, tuple) or not value:
        raise FieldError(type(inst), attribute.name, "a non-empty tuple of shapes", value)
    for shape in value:
        if not isinstance(shape, tuple) or not shape or not all(_is_int(d) and d > 0 for d in shape):
            raise FieldError(type(inst), attribute.name, "shapes of positive ints", value)


def _optional_names(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value)):
        raise FieldError(type(inst), attribute.name, "a tuple of non-empty names", value)


MAX_DIGEST_ALGORITHMS = 8
"""The most digest algorithm names a peer may offer (INT-2); each is at most 32 characters."""


def _algorithm_names(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # Names this side does not know are kept (a newer peer's) but bounded: a peer's list is read into memory (INT-2).
    if (
        not isinstance(value, tuple)
        or len(value) > MAX_DIGEST_ALGORITHMS
        or not all(isinstance(v, str) and 0 < len(v) <= 32 for v in value)
    ):
        raise FieldError(
            type(inst), attribute.name, f"at most {MAX_DIGEST_ALGORITHMS} names of 1 to 32 characters", value
        )


def _optional_profile(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, StateProfile):
        raise FieldError(type(inst), attribute.name, f"one of {[p.value for p in StateProfile]} or None", value)


def _optional_parallel(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, ParallelLayout):
        raise FieldError(type(inst), attribute.name, "a ParallelLayout or None", value)


def _layer_names(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not value or not all(isinstance(v, str) and v for v in value):
        raise FieldError(type(inst), attribute.name, "a non-empty tuple of non-empty layer names", value)
    if len(set(value)) != len(value):
        raise FieldError(type(inst), attribute.name, "distinct layer names", value)


@attrs.frozen(kw_only=True)
class GroupDescriptor:
    """What one KV-cache group looks like, as a peer must know it (HS-1).

    ``dtype``, ``num_kv_heads`` and ``head_size`` are ``None`` for groups
    that are not attention (Mamba state), ``sliding_window`` and
    ``attention_chunk_size`` when the spec has none. ``state_shapes``,
    ``state_dtypes``, ``mamba_type`` and ``conv_layout`` (protocol 1.2) describe a
    state group's slot and are ``None`` for every other group (STATE-5).
    """

    kind: SpecKind = attrs.field(validator=_instance_of(SpecKind))
    block_size: int = attrs.field(validator=_positive_int)
    sliding_window: int | None = attrs.field(default=None, validator=_optional_positive_int)
    attention_chunk_size: int | None = attrs.field(default=None, validator=_optional_positive_int)
    dtype: str | None = attrs.field(default=None, validator=_optional_non_empty_str)
    num_kv_heads: int | None = attrs.field(default=None, validator=_optional_positive_int)
    head_size: int | None = attrs.field(default=None, validator=_optional_positive_int)
    page_size_bytes: int = attrs.field(validator=_positive_int)
    layer_names: tuple[str, ...] = attrs.field(converter=_to_tuple, validator=_layer_names)
    state_shapes: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=_to_shapes, validator=_optional_shapes
    )
    state_dtypes: tuple[str, ...] | None = attrs.field(default=None, converter=_to_tuple, validator=_optional_names)
    mamba_type: str | None = attrs.field(default=None, validator=_optional_non_empty_str)
    conv_layout: str | None = attrs.field(default=None, validator=_optional_non_empty_str)

    @classmethod
    def from_group(cls, group: KVCacheGroupSpec) -> GroupDescriptor:
        """Describe one group of a :class:`kvspec.KVCacheConfig` (HS-1)."""
        spec = group.kv_cache_spec
        attention = spec if isinstance(spec, AttentionSpec) else None
        state = spec if isinstance(spec, MambaSpec) else None
        return cls(
            kind=spec.kind,
            block_size=spec.block_size,
            sliding_window=getattr(spec, "sliding_window", None),
            attention_chunk_size=getattr(spec, "attention_chunk_size", None),
            dtype=None if attention is None else attention.dtype.name,
            num_kv_heads=None if attention is None else attention.num_kv_heads,
            head_size=None if attention is None else attention.head_size,
            page_size_bytes=spec.page_size_bytes,
            layer_names=group.layer_names,
            state_shapes=None if state is None else state.shapes,
            state_dtypes=None if state is None else tuple(d.name for d in state.dtypes),
            mamba_type=None if state is None else state.mamba_type,
            conv_layout=None if state is None else state.conv_layout,
        )


def _optional_caches(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, tuple) or not all(isinstance(c, CacheDeclaration) for c in value)):
        raise FieldError(type(inst), attribute.name, "None or a tuple of CacheDeclaration", value)


def _groups(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not value or not all(isinstance(g, GroupDescriptor) for g in value):
        raise FieldError(type(inst), attribute.name, "a non-empty tuple of GroupDescriptor", value)


@attrs.frozen(kw_only=True)
class EngineDescriptor:
    """One engine's self-description, exchanged at handshake and compared field by field (HS-1).

    ``transport_metadata`` is the backend's opaque agent metadata (NIXL's
    ``agent_metadata``), loaded only after the descriptors are found
    compatible. ``num_blocks`` bounds the block ids the peer may name.
    ``state_profile`` (protocol 1.2) is set exactly when the engine has state
    groups: where its transferred state stands (STATE-1).
    ``digest_algorithms`` (protocol 1.3) lists the digest algorithms the engine
    computes, in preference order; empty from a 1.2 peer (INT-2).
    ``parallel`` (protocol 1.3) is this rank's parallel layout; ``None`` (a
    1.2 peer, or an engine that does not say) means today's layout, which
    pairs with equal TP sizes only (PAR-9).
    ``caches`` (protocol 1.3) is every cache the model keeps, each exchanged or
    declared ephemeral (CACHE-1); ``None`` (a 1.2 peer, or nothing declared)
    means the groups are the whole set.
    """

    protocol_version: tuple[int, int] = attrs.field(default=PROTOCOL_VERSION, converter=_to_tuple, validator=_version)
    engine_id: str = attrs.field(validator=_non_empty_str)
    mode: TransferMode = attrs.field(validator=_instance_of(TransferMode))
    hma_enabled: bool = attrs.field(validator=_bool)
    groups: tuple[GroupDescriptor, ...] = attrs.field(converter=_to_tuple, validator=_groups)
    num_blocks: int = attrs.field(validator=_positive_int)
    tp_size: int = attrs.field(default=1, validator=_positive_int)
    transport_metadata: bytes = attrs.field(default=b"", validator=_bytes, repr=False)
    state_profile: StateProfile | None = attrs.field(default=None, validator=_optional_profile)
    digest_algorithms: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_algorithm_names)
    parallel: ParallelLayout | None = attrs.field(default=None, validator=_optional_parallel)

    caches: tuple[CacheDeclaration, ...] | None = attrs.field(
        default=None, converter=_to_tuple, validator=_optional_caches
    )

    def __attrs_post_init__(self) -> None:
        layout = self.parallel
        if layout is None:
            return
        # The layout describes this engine: its TP size, one page per group, layers the groups hold (PAR-9).
        if layout.rank.tp_size != self.tp_size:
            raise FieldError(type(self), "parallel.rank.tp_size", f"tp_size {self.tp_size}", layout.rank.tp_size)
        if len(layout.pages) != len(self.groups):
            raise FieldError(
                type(self), "parallel.pages", f"{len(self.groups)} pages, one per group", len(layout.pages)
            )
        count = sum(len(t.sub_blocks) for page in layout.pages for t in page.tensors)
        if count > MAX_LAYOUT_SUB_BLOCKS:
            raise FieldError(type(self), "parallel.pages", f"at most {MAX_LAYOUT_SUB_BLOCKS} sub-blocks in all", count)
        names = {name for g in self.groups for name in g.layer_names}
        unknown = [name for name in layout.rank.layers if name not in names]
        if unknown:
            raise FieldError(type(self), "parallel.rank.layers", "names of the groups' layers", unknown[0])

    @classmethod
    def from_config(
        cls,
        *,
        engine_id: str,
        config: KVCacheConfig,
        mode: TransferMode,
        hma_enabled: bool,
        tp_size: int = 1,
        transport_metadata: bytes = b"",
        state_profile: StateProfile | None = None,
        digest_algorithms: Sequence[str] | None = None,
        parallel: ParallelLayout | None = None,
    ) -> EngineDescriptor:
        """Describe an engine from its KV-cache config; one with state groups has a profile (HS-1, STATE-1).

        ``digest_algorithms`` defaults to every algorithm this install computes (INT-2).
        """
        has_state = any(isinstance(g.kv_cache_spec, MambaSpec) for g in config.kv_cache_groups)
        if has_state and state_profile is None:
            state_profile = StateProfile.RECOMPUTE
        return cls(
            engine_id=engine_id,
            mode=mode,
            hma_enabled=hma_enabled,
            groups=tuple(GroupDescriptor.from_group(g) for g in config.kv_cache_groups),
            num_blocks=config.num_blocks,
            tp_size=tp_size,
            transport_metadata=transport_metadata,
            state_profile=state_profile if has_state else None,
            digest_algorithms=tuple(a.value for a in get_offered_algorithms())
            if digest_algorithms is None
            else tuple(digest_algorithms),
            parallel=parallel,
            caches=config.caches or None,  # CACHE-1: protocol 1.3
        )


# --------------------------------------------------------------------------- transfer parameters

# vLLM's kv_transfer_params keys, plus kvspec's own (docs/spec/protocol-messages.md, kv_transfer_params).
_KEY_DO_REMOTE_PREFILL = "do_remote_prefill"
_KEY_DO_REMOTE_DECODE = "do_remote_decode"
_KEY_REQUEST_ID = "remote_request_id"
_KEY_ENGINE_ID = "remote_engine_id"
_KEY_BLOCK_IDS = "remote_block_ids"
_KEY_NUM_TOKENS = "remote_num_tokens"
_KEY_EXPIRY = "remote_blocks_expiry_time"
_KEY_MODE = "transfer_mode"
_KEY_VERSION = "kvspec_version"
_KEY_TRANSPORT_BYTES = "kvspec_transport_data"
_KEY_BLOCK_ENDS = "kvspec_block_ends"  # protocol 1.1 (ALIGN-1)
_KEY_RECOMPUTED = "kvspec_recomputed_tokens"  # protocol 1.1 (WIN-1)
_KEY_DIGESTS = "kvspec_block_digests"  # protocol 1.1, INT-1 (optional)
_KEY_STATE_TOKENS = "kvspec_state_tokens"  # protocol 1.2 (STATE-1)

TRANSFER_PARAMS_KEYS: frozenset[str] = frozenset(
    {
        _KEY_DO_REMOTE_PREFILL,
        _KEY_DO_REMOTE_DECODE,
        _KEY_REQUEST_ID,
        _KEY_ENGINE_ID,
        _KEY_BLOCK_IDS,
        _KEY_NUM_TOKENS,
        _KEY_EXPIRY,
        _KEY_MODE,
        _KEY_VERSION,
        _KEY_TRANSPORT_BYTES,
        _KEY_BLOCK_ENDS,
        _KEY_RECOMPUTED,
        _KEY_DIGESTS,
        _KEY_STATE_TOKENS,
    }
)
"""Keys :meth:`TransferParams.to_kv_transfer_params` owns; transport data may not reuse them."""

# NIXL's push/pull spelling of the mode (compute_nixl_compatibility_hash's transfer_mode).
_MODE_ALIASES = {"pull": TransferMode.READ, "push": TransferMode.WRITE}


def _to_transport_data(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(sorted(value.items(), key=lambda kv: str(kv[0])))
    return value


def _transport_data(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bytes):
        return
    if not isinstance(value, Mapping):
        raise FieldError(type(inst), attribute.name, "a mapping of str to str|int, or bytes", value)
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise FieldError(type(inst), attribute.name, "non-empty str keys", key)
        if key in TRANSFER_PARAMS_KEYS:
            raise FieldError(type(inst), f"{attribute.name}[{key!r}]", "a key kvspec does not reserve", key)
        if not (isinstance(item, str) or _is_int(item)):
            raise FieldError(type(inst), f"{attribute.name}[{key!r}]", "a str or int value", item)


@attrs.frozen(kw_only=True)
class TransferParams:
    """What the producer hands the consumer through the router, once per request.

    ``producer_block_ids`` are already clipped (CLIP-1); ``num_tokens`` is
    explicit and never inferred from a clipped group (TOK-1).
    ``producer_block_ends`` says where each group's list ends (the logical
    block just past its last entry, :func:`kvspec.get_block_ends`; ``None``
    from a 1.0 peer) so the consumer can refuse a shifted list (ALIGN-1).
    The lists cover ``num_tokens + recomputed_tokens`` tokens: C takes the KV
    of the first ``num_tokens`` and recomputes the rest (vLLM: 1, the last
    prompt token; WIN-1).
    ``state_tokens`` (protocol 1.2) is how many tokens the state groups'
    state absorbed; the consumer refuses any value but ``num_tokens``, and its
    absence when it has state groups (STATE-1).
    ``lease_deadline`` is an absolute time on a clock both engines share
    (SM-1, the lease rule). ``transport_data`` is the transport's addressing data:
    named values travel as top-level keys of the vLLM dict (``remote_host``,
    ``remote_port``, ``tp_size``...), opaque bytes as base64.
    """

    request_id: str = attrs.field(validator=_non_empty_str)
    producer_engine_id: str = attrs.field(validator=_non_empty_str)
    producer_block_ids: BlockIds = attrs.field(converter=_to_block_ids, validator=_instance_of(BlockIds))
    num_tokens: int = attrs.field(validator=_non_negative_int)
    mode: TransferMode = attrs.field(validator=_instance_of(TransferMode))
    lease_deadline: float = attrs.field(converter=_to_float, validator=_finite_float)
    transport_data: TransportData = attrs.field(
        factory=dict, converter=_to_transport_data, validator=_transport_data, eq=True, hash=False
    )
    producer_block_ends: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_tuple, validator=_block_ends_of("producer_block_ids")
    )
    recomputed_tokens: int = attrs.field(default=0, validator=_non_negative_int)
    producer_block_digests: BlockDigests | None = attrs.field(
        default=None, converter=_to_digests, validator=_digests_of("producer_block_ids")
    )
    state_tokens: int | None = attrs.field(default=None, validator=_optional_non_negative_int)

    def to_kv_transfer_params(self) -> dict[str, object]:
        """The plain dict vLLM's router carries as ``kv_transfer_params`` to the consumer.

        >>> params = TransferParams(request_id="r1", producer_engine_id="p", producer_block_ids=[[1, 2], [3]],
        ...     num_tokens=20, mode=TransferMode.READ, lease_deadline=100.0,
        ...     transport_data={"remote_host": "127.0.0.1", "remote_port": 5600})
        >>> d = params.to_kv_transfer_params()
        >>> d["remote_block_ids"], d["remote_port"]
        ([[1, 2], [3]], 5600)
        >>> TransferParams.from_kv_transfer_params(d) == params
        True
        """
        out: dict[str, object] = {
            _KEY_DO_REMOTE_PREFILL: True,
            _KEY_DO_REMOTE_DECODE: False,
            _KEY_REQUEST_ID: self.request_id,
            _KEY_ENGINE_ID: self.producer_engine_id,
            _KEY_BLOCK_IDS: self.producer_block_ids.to_lists(),
            _KEY_NUM_TOKENS: self.num_tokens,
            _KEY_EXPIRY: self.lease_deadline,
            _KEY_MODE: self.mode.value,
            _KEY_VERSION: f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}",
        }
        # 1.1 keys only when they say something, so a 1.0-shaped request stays as it was (VER-1).
        if self.producer_block_ends is not None:
            out[_KEY_BLOCK_ENDS] = list(self.producer_block_ends)
        if self.recomputed_tokens:
            out[_KEY_RECOMPUTED] = self.recomputed_tokens
        if self.producer_block_digests is not None:
            out[_KEY_DIGESTS] = [list(group) for group in self.producer_block_digests]
        if self.state_tokens is not None:
            out[_KEY_STATE_TOKENS] = self.state_tokens
        if isinstance(self.transport_data, bytes):
            out[_KEY_TRANSPORT_BYTES] = base64.b64encode(self.transport_data).decode("ascii")
        else:
            out.update(self.transport_data)
        return out

    @classmethod
    def from_kv_transfer_params(cls, params: Mapping[str, object]) -> TransferParams:
        """Parse vLLM's ``kv_transfer_params`` dict; keys kvspec does not own become transport data.

        Raises :class:`kvspec.MalformedMessageError` naming the key, or
        :class:`kvspec.UnsupportedVersionError` for another major (VER-1).
        """
        if not isinstance(params, Mapping):
            raise MalformedMessageError(f"expected a dict, got {type(params).__name__}")
        _parse(_KEY_VERSION, lambda: _check_dict_version(params.get(_KEY_VERSION)))
        if params.get(_KEY_DO_REMOTE_PREFILL) is not True:
            raise MalformedMessageError("expected True on the consumer's request", field=_KEY_DO_REMOTE_PREFILL)
        data: TransportData = _parse("transport_data", lambda: _dict_transport_data(params))
        fields = {
            "request_id": _parse(_KEY_REQUEST_ID, lambda: _need(params, _KEY_REQUEST_ID, str)),
            "producer_engine_id": _parse(_KEY_ENGINE_ID, lambda: _need(params, _KEY_ENGINE_ID, str)),
            "producer_block_ids": _parse(_KEY_BLOCK_IDS, lambda: _dict_block_ids(params)),
            "num_tokens": _parse(_KEY_NUM_TOKENS, lambda: _need(params, _KEY_NUM_TOKENS, int)),
            "mode": _parse(_KEY_MODE, lambda: _dict_mode(params)),
            "lease_deadline": _parse(_KEY_EXPIRY, lambda: _dict_deadline(params)),
            "producer_block_ends": _parse(_KEY_BLOCK_ENDS, lambda: _dict_block_ends(params)),
            "recomputed_tokens": _parse(_KEY_RECOMPUTED, lambda: _dict_recomputed(params)),
            "producer_block_digests": _parse(_KEY_DIGESTS, lambda: _dict_digests(params)),
            "state_tokens": _parse(_KEY_STATE_TOKENS, lambda: _dict_state_tokens(params)),
        }
        try:
            return cls(transport_data=data, **fields)  # type: ignore[arg-type]
        except FieldError as exc:
            # A check across fields (ends or digests per group of ids): name the dict key vLLM's router sees.
            key = _DICT_KEYS.get(exc.field.partition("[")[0], exc.field)
            raise MalformedMessageError(str(exc), field=key + exc.field[len(exc.field.partition("[")[0]) :]) from None
        except (ConfigError, *_UNDECODABLE) as exc:  # pragma: no cover - every field was checked above
            raise MalformedMessageError(str(exc), field=_KEY_BLOCK_IDS) from None


_T = TypeVar("_T")

_UNDECODABLE = (ValueError, TypeError, OverflowError, RecursionError, MemoryError)
"""What a builtin raises on hostile input (huge ints, deep nesting); a parse turns it into a named error."""

_DICT_KEYS = {
    "request_id": _KEY_REQUEST_ID,
    "producer_engine_id": _KEY_ENGINE_ID,
    "producer_block_ids": _KEY_BLOCK_IDS,
    "num_tokens": _KEY_NUM_TOKENS,
    "mode": _KEY_MODE,
    "lease_deadline": _KEY_EXPIRY,
    "producer_block_ends": _KEY_BLOCK_ENDS,
    "recomputed_tokens": _KEY_RECOMPUTED,
    "producer_block_digests": _KEY_DIGESTS,
    "state_tokens": _KEY_STATE_TOKENS,
}
"""TransferParams field -> its key in vLLM's ``kv_transfer_params`` dict."""


def _parse(key: str, parse: Callable[[], _T]) -> _T:
    """Run one key's parser; a builtin error from hostile input becomes a MalformedMessageError naming ``key``."""
    try:
        return parse()
    except ConfigError as exc:
        raise MalformedMessageError(str(exc), field=key) from None
    except KVSpecError:
        raise
    except _UNDECODABLE as exc:
        raise MalformedMessageError(f"undecodable value ({type(exc).__name__})", field=key) from None


def _dict_transport_data(params: Mapping[str, object]) -> TransportData:
    transport: dict[str, str | int] = {}
    for key, value in params.items():
        if key in TRANSFER_PARAMS_KEYS:
            continue
        if not isinstance(key, str) or not key:
            raise MalformedMessageError(f"expected a non-empty str key, got {shown(key, 80)}", field="transport_data")
        if not (isinstance(value, str) or _is_int(value)):
            raise MalformedMessageError(f"expected a str or int transport value, got {shown(value, 80)}", field=key)
        transport[key] = value  # type: ignore[assignment]
    if _KEY_TRANSPORT_BYTES in params:
        if transport:
            message = "opaque transport bytes and named transport keys both given"
            raise MalformedMessageError(message, field=_KEY_TRANSPORT_BYTES)
        return _b64(params[_KEY_TRANSPORT_BYTES], _KEY_TRANSPORT_BYTES)
    return transport


def _need(params: Mapping[str, object], key: str, kind: type) -> object:
    if key not in params:
        raise MalformedMessageError("missing", field=key)
    value = params[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MalformedMessageError(f"expected {kind.__name__}, got {shown(value, 80)}", field=key)
    if kind is str and not value:
        raise MalformedMessageError("expected a non-empty str", field=key)
    if kind is int and value < 0:  # type: ignore[operator]
        raise MalformedMessageError(f"expected a non-negative int, got {shown(value, 80)}", field=key)
    return value


def _dict_block_ids(params: Mapping[str, object]) -> BlockIds:
    value = _need(params, _KEY_BLOCK_IDS, object)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise MalformedMessageError(f"expected a list of per-group lists, got {shown(value, 80)}", field=_KEY_BLOCK_IDS)
    groups = list(value)
    for g, group in enumerate(groups):
        # A flat list[int] is the pre-HMA shape; under kvspec every group is its own list.
        if isinstance(group, (str, bytes)) or not isinstance(group, (list, tuple)):
            message = f"expected a list of block ids, got {shown(group, 80)}"
            raise MalformedMessageError(message, field=f"{_KEY_BLOCK_IDS}[{g}]")
        for i, block_id in enumerate(group):
            if not _is_int(block_id) or block_id < 0:
                field = f"{_KEY_BLOCK_IDS}[{g}][{i}]"
                raise MalformedMessageError(f"expected a non-negative int, got {shown(block_id, 80)}", field=field)
    return BlockIds(groups)


def _dict_block_ends(params: Mapping[str, object]) -> tuple[int, ...] | None:
    if _KEY_BLOCK_ENDS not in params:
        return None  # a 1.0 producer: where the lists end is not said (ALIGN-1)
    value = params[_KEY_BLOCK_ENDS]
    if not isinstance(value, (list, tuple)):
        raise MalformedMessageError(f"expected a list of per-group ends, got {shown(value, 80)}", field=_KEY_BLOCK_ENDS)
    for g, end in enumerate(value):
        if not _is_int(end) or end < 0:
            message = f"expected a non-negative int, got {shown(end, 80)}"
            raise MalformedMessageError(message, field=f"{_KEY_BLOCK_ENDS}[{g}]")
    return tuple(value)


def _dict_recomputed(params: Mapping[str, object]) -> int:
    if _KEY_RECOMPUTED not in params:
        return 0  # a 1.0 producer: C recomputes nothing the lists cover (WIN-1)
    value: int = _need(params, _KEY_RECOMPUTED, int)  # type: ignore[assignment]
    return value


def _dict_state_tokens(params: Mapping[str, object]) -> int | None:
    if _KEY_STATE_TOKENS not in params:
        return None  # no state groups, or a 1.1 producer: STATE-1 refuses the latter where state is needed
    value: int = _need(params, _KEY_STATE_TOKENS, int)  # type: ignore[assignment]
    return value


def _dict_digests(params: Mapping[str, object]) -> BlockDigests | None:
    if _KEY_DIGESTS not in params:
        return None  # the producer has integrity off (INT-1)
    value = params[_KEY_DIGESTS]
    if not isinstance(value, (list, tuple)):
        message = f"expected a list of per-group lists of digests, got {shown(value, 80)}"
        raise MalformedMessageError(message, field=_KEY_DIGESTS)
    for g, group in enumerate(value):
        if not isinstance(group, (list, tuple)):
            message = f"expected a list of digests, got {shown(group, 80)}"
            raise MalformedMessageError(message, field=f"{_KEY_DIGESTS}[{g}]")
        for i, digest in enumerate(group):
            if digest != "" and not is_block_digest(digest):
                field = f"{_KEY_DIGESTS}[{g}][{i}]"
                raise MalformedMessageError(
                    f"expected {DIGEST_HEX_LENGTH} hex characters or '', got {shown(digest, 80)}", field=field
                )
    return tuple(tuple(group) for group in value)


def _dict_mode(params: Mapping[str, object]) -> TransferMode:
    value = _need(params, _KEY_MODE, str)
    if value in _MODE_ALIASES:
        return _MODE_ALIASES[value]
    try:
        return TransferMode(value)
    except ValueError:
        raise MalformedMessageError(f"expected 'read' or 'write', got {shown(value, 80)}", field=_KEY_MODE) from None


def _dict_deadline(params: Mapping[str, object]) -> float:
    value = _need(params, _KEY_EXPIRY, object)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise MalformedMessageError(f"expected a finite number, got {shown(value, 80)}", field=_KEY_EXPIRY)
    try:
        number = float(value)  # an int beyond the float range raises OverflowError
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise MalformedMessageError(f"expected a finite number, got {shown(value, 80)}", field=_KEY_EXPIRY)
    return number


def _check_dict_version(value: object) -> None:
    if value is None:
        raise MalformedMessageError("missing", field=_KEY_VERSION)
    parts = value.split(".") if isinstance(value, str) and len(value) <= 32 else []
    # isdigit() alone admits '²', which int() refuses; a version is ASCII digits.
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise MalformedMessageError(f"expected 'MAJOR.MINOR', got {shown(value, 80)}", field=_KEY_VERSION)
    if not is_compatible_version((int(parts[0]), int(parts[1]))):
        raise UnsupportedVersionError(
            f"{_KEY_VERSION}: peer speaks protocol {value}, this side speaks major {PROTOCOL_VERSION[0]} (VER-1)"
        )


def _b64(value: object, field: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedMessageError(f"expected a base64 str, got {shown(value, 80)}", field=field)
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise MalformedMessageError("expected a base64 str", field=field) from None


# --------------------------------------------------------------------------- exchange messages


@attrs.frozen(kw_only=True)
class BlockOffer:
    """The consumer's blocks to write into, WRITE mode only (ADM-2, ALIGN-1).

    ``consumer_block_ids`` are C's clipped uncached suffix; P tail-aligns
    its own ids against them. ``consumer_block_ends`` says where each
    group's list ends (``None`` from a 1.0 peer), so P can refuse a list
    shifted against its own (ALIGN-1).
    """

    request_id: str = attrs.field(validator=_non_empty_str)
    consumer_engine_id: str = attrs.field(validator=_non_empty_str)
    consumer_block_ids: BlockIds = attrs.field(converter=_to_block_ids, validator=_instance_of(BlockIds))
    consumer_block_ends: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_tuple, validator=_block_ends_of("consumer_block_ids")
    )


@attrs.frozen(kw_only=True)
class Completion:
    """P's write landed: every paired byte is readable on C (WRITE mode; DONE-1).

    Travels as the notification of P's write, so the transport delivers it
    only after the data. ``consumer_block_digests`` (INT-1, optional): one
    digest per entry of the offer's ``consumer_block_ids``, of the producer
    block written into it (``""`` for an entry not written); a consumer with
    integrity on checks them before LOADED.
    """

    request_id: str = attrs.field(validator=_non_empty_str)
    producer_engine_id: str = attrs.field(validator=_non_empty_str)
    consumer_block_digests: BlockDigests | None = attrs.field(
        default=None, converter=_to_digests, validator=_digest_lists
    )


@attrs.frozen(kw_only=True)
class Failure:
    """P reports that the request failed, with the consumer blocks that may hold bad bytes (FAIL-1).

    Sent only once no write of P's touches C's blocks any more (SM-2, the drain rule).
    """

    request_id: str = attrs.field(validator=_non_empty_str)
    producer_engine_id: str = attrs.field(validator=_non_empty_str)
    reason: FailureReason = attrs.field(validator=_instance_of(FailureReason))
    failed_consumer_block_ids: BlockIds = attrs.field(
        factory=lambda: BlockIds([]), converter=_to_block_ids, validator=_instance_of(BlockIds)
    )
    detail: str = attrs.field(default="", validator=_str)


@attrs.frozen(kw_only=True)
class Release:
    """C is done with P's blocks: P may free them (REL-1). Sent exactly once per consumer request."""

    request_id: str = attrs.field(validator=_non_empty_str)
    consumer_engine_id: str = attrs.field(validator=_non_empty_str)
    outcome: ReleaseOutcome = attrs.field(validator=_instance_of(ReleaseOutcome))


@attrs.frozen(kw_only=True)
class Abort:
    """The sender (``engine_id``) gave up on the request (SM-1, SM-2).

    From P in WRITE mode it also confirms that no write of P's touches C's
    blocks any more (SM-2, the drain rule).
    """

    request_id: str = attrs.field(validator=_non_empty_str)
    engine_id: str = attrs.field(validator=_non_empty_str)
    detail: str = attrs.field(default="", validator=_str)


Message: TypeAlias = EngineDescriptor | TransferParams | BlockOffer | Completion | Failure | Release | Abort
"""Any protocol message the codec encodes."""
