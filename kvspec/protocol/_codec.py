"""The canonical wire codec: every protocol message to and from compact, sorted-key JSON bytes (VER-1).

An encoded message is one JSON object: ``"type"`` names the message,
``"v"`` is ``[major, minor]`` of :data:`kvspec.PROTOCOL_VERSION`, and every
field of the message follows under its own name. Keys are sorted and the
text is compact ASCII, so equal messages encode to equal bytes.

Decoding follows VER-1: another major raises
:class:`kvspec.UnsupportedVersionError`; fields this side does not know
(added by a newer minor) are ignored; a missing field without a default, or a
field of the wrong type or value, raises :class:`kvspec.MalformedMessageError`
naming the field; any other input raises a kvspec error too, never another
exception and never a half-built message.

The conversion is derived from the message classes' typed attrs fields, so
adding a field to a message needs no codec change; the JSON Schema of
:mod:`kvspec.protocol._schema` comes from the same converters.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import math
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, Union

import attrs

from kvspec.core._errors import (
    ConfigError,
    FieldError,
    KVSpecError,
    MalformedMessageError,
    UnsupportedVersionError,
    shown,
)
from kvspec.core._models import BlockIds
from kvspec.reference._messages import (
    PROTOCOL_VERSION,
    Abort,
    BlockOffer,
    Completion,
    EngineDescriptor,
    Failure,
    GroupDescriptor,
    Message,
    Release,
    TransferParams,
)
from kvspec.spec.parallel import CanonicalPage, PageTensor, ParallelLayout, RankLayout, SubBlock
from kvspec.spec.versions import check_added_fields, decode_fields, is_compatible_version

__all__ = ["MESSAGE_TYPES", "PEER_BOUNDS", "decode", "encode", "field_codec", "message_type_name"]

MESSAGE_TYPES: Mapping[str, type[Any]] = types.MappingProxyType(
    {
        "engine_descriptor": EngineDescriptor,
        "transfer_params": TransferParams,
        "block_offer": BlockOffer,
        "completion": Completion,
        "failure": Failure,
        "release": Release,
        "abort": Abort,
    }
)
"""Wire ``"type"`` name -> message class."""

_NAMES: dict[type[Any], str] = {cls: name for name, cls in MESSAGE_TYPES.items()}

# Every field a minor version added has a default, so older peers' messages still decode (VER-1).
check_added_fields(
    {
        cls.__name__: {f.name: f.default is not attrs.NOTHING for f in attrs.fields(cls)}
        for cls in (*MESSAGE_TYPES.values(), GroupDescriptor)
    }
)

PEER_BOUNDS: Mapping[tuple[type[Any], str], int] = types.MappingProxyType(
    {
        # The parallel layout (protocol 1.3): the handshake derives byte maps from these sizes (PAR-9), and the
        # planner loops over ranks, units and rows, so a peer may not name more than a real engine has.
        (ParallelLayout, "pages"): 64,
        (RankLayout, "tp_size"): 128,
        (RankLayout, "dcp_size"): 128,
        (RankLayout, "dcp_interleave"): 1 << 16,
        (RankLayout, "dp_rank"): 1 << 16,
        (RankLayout, "layers"): 1 << 16,
        (CanonicalPage, "tensors"): 16,
        (PageTensor, "sub_blocks"): 16,
        (PageTensor, "rows"): 1 << 16,
        (PageTensor, "element_bytes"): 1 << 24,
        (SubBlock, "extent"): 1 << 16,
        (SubBlock, "width"): 1 << 24,
    }
)
"""(class, field) -> the largest value (an int) or length (a list) a peer may send there; more is malformed."""

JSON = Any  # a value json.dumps accepts; private to the codec


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(path: str, expected: str, found: object) -> MalformedMessageError:
    return MalformedMessageError(f"expected {expected}, got {shown(found, 80)}", field=path or None)


_UNDECODABLE = (ValueError, TypeError, OverflowError, RecursionError, MemoryError)
"""What a builtin raises on hostile input (huge ints, deep nesting); a decode turns it into a named error."""


# --------------------------------------------------------------------------- field converters


class FieldCodec:
    """Converts one field between its typed value and its JSON value, and describes it as JSON Schema."""

    def encode(self, value: Any) -> JSON:
        """Typed value -> JSON value."""
        raise NotImplementedError

    def decode(self, data: JSON, path: str) -> Any:
        """JSON value -> typed value; raises MalformedMessageError naming ``path``."""
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of the JSON value."""
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        """True when ``value`` is a typed value of this converter (for unions)."""
        raise NotImplementedError


class _Scalar(FieldCodec):
    def __init__(self, kind: type, json_type: str) -> None:
        self.kind, self.json_type = kind, json_type

    def accepts(self, value: Any) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        return isinstance(value, self.kind) and not isinstance(value, bool)

    def encode(self, value: Any) -> JSON:
        return value

    def decode(self, data: JSON, path: str) -> Any:
        if not self.accepts(data):
            raise _bad(path, f"a JSON {self.json_type}", data)
        return data

    def schema(self) -> dict[str, Any]:
        return {"type": self.json_type}


class _Float(FieldCodec):
    def accepts(self, value: Any) -> bool:
        return isinstance(value, float)

    def encode(self, value: Any) -> JSON:
        return value

    def decode(self, data: JSON, path: str) -> Any:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise _bad(path, "a finite JSON number", data)
        try:
            value = float(data)  # an int beyond the float range raises OverflowError
        except OverflowError:
            raise _bad(path, "a finite JSON number", data) from None
        if not math.isfinite(value):
            raise _bad(path, "a finite JSON number", data)
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "number"}


class _Enum(FieldCodec):
    def __init__(self, kind: type[enum.Enum]) -> None:
        self.kind = kind

    def accepts(self, value: Any) -> bool:
        return isinstance(value, self.kind)

    def encode(self, value: Any) -> JSON:
        return value.value

    def decode(self, data: JSON, path: str) -> Any:
        for member in self.kind:
            if isinstance(data, str) and member.value == data:
                return member
        raise _bad(path, f"one of {[m.value for m in self.kind]}", data)

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "enum": [m.value for m in self.kind]}


class _Bytes(FieldCodec):
    def accepts(self, value: Any) -> bool:
        return isinstance(value, bytes)

    def encode(self, value: Any) -> JSON:
        return base64.b64encode(value).decode("ascii")

    def decode(self, data: JSON, path: str) -> Any:
        if not isinstance(data, str):
            raise _bad(path, "a base64 string", data)
        try:
            return base64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise _bad(path, "a base64 string", data) from None

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "contentEncoding": "base64"}


class _BlockIds(FieldCodec):
    def accepts(self, value: Any) -> bool:
        return isinstance(value, BlockIds)

    def encode(self, value: Any) -> JSON:
        return value.to_lists()

    def decode(self, data: JSON, path: str) -> Any:
        if not isinstance(data, list):
            raise _bad(path, "a list of per-group lists of block ids", data)
        for g, group in enumerate(data):
            if not isinstance(group, list):
                raise _bad(f"{path}[{g}]", "a list of block ids", group)
            for i, block_id in enumerate(group):
                if not _is_int(block_id) or block_id < 0:
                    raise _bad(f"{path}[{g}][{i}]", "a non-negative integer block id", block_id)
        return BlockIds(data)

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}}}


class _Tuple(FieldCodec):
    def __init__(self, items: tuple[FieldCodec, ...]) -> None:
        self.items = items

    def accepts(self, value: Any) -> bool:
        return isinstance(value, tuple) and len(value) == len(self.items)

    def encode(self, value: Any) -> JSON:
        return [c.encode(v) for c, v in zip(self.items, value, strict=True)]

    def decode(self, data: JSON, path: str) -> Any:
        if not isinstance(data, list) or len(data) != len(self.items):
            raise _bad(path, f"a list of {len(self.items)} items", data)
        return tuple(c.decode(v, f"{path}[{i}]") for i, (c, v) in enumerate(zip(self.items, data, strict=True)))

    def schema(self) -> dict[str, Any]:
        n = len(self.items)
        return {"type": "array", "prefixItems": [c.schema() for c in self.items], "minItems": n, "maxItems": n}


class _Sequence(FieldCodec):
    def __init__(self, item: FieldCodec) -> None:
        self.item = item

    def accepts(self, value: Any) -> bool:
        return isinstance(value, tuple)

    def encode(self, value: Any) -> JSON:
        return [self.item.encode(v) for v in value]

    def decode(self, data: JSON, path: str) -> Any:
        if not isinstance(data, list):
            raise _bad(path, "a list", data)
        return tuple(self.item.decode(v, f"{path}[{i}]") for i, v in enumerate(data))

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "items": self.item.schema()}


class _Mapping(FieldCodec):
    def __init__(self, value: FieldCodec) -> None:
        self.value = value

    def accepts(self, value: Any) -> bool:
        return isinstance(value, Mapping)

    def encode(self, value: Any) -> JSON:
        return {str(k): self.value.encode(v) for k, v in value.items()}

    def decode(self, data: JSON, path: str) -> Any:
        if not isinstance(data, dict):
            raise _bad(path, "a JSON object", data)
        return {k: self.value.decode(v, f"{path}[{k!r}]") for k, v in data.items()}

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": self.value.schema()}


class _Optional(FieldCodec):
    def __init__(self, inner: FieldCodec) -> None:
        self.inner = inner

    def accepts(self, value: Any) -> bool:
        return value is None or self.inner.accepts(value)

    def encode(self, value: Any) -> JSON:
        return None if value is None else self.inner.encode(value)

    def decode(self, data: JSON, path: str) -> Any:
        return None if data is None else self.inner.decode(data, path)

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [self.inner.schema(), {"type": "null"}]}


class _Union(FieldCodec):
    """Alternatives told apart by their JSON type (e.g. transport data: object or base64 string)."""

    def __init__(self, options: tuple[FieldCodec, ...]) -> None:
        self.options = options

    def accepts(self, value: Any) -> bool:
        return any(o.accepts(value) for o in self.options)

    def encode(self, value: Any) -> JSON:
        for option in self.options:
            if option.accepts(value):
                return option.encode(value)
        raise ConfigError(f"no encoding for {value!r}")

    def decode(self, data: JSON, path: str) -> Any:
        errors: list[MalformedMessageError] = []
        for option in self.options:
            try:
                return option.decode(data, path)
            except MalformedMessageError as exc:
                errors.append(exc)
        raise errors[0] if errors else _bad(path, "a value", data)

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [o.schema() for o in self.options]}


class _Bounded(FieldCodec):
    """An int at most ``limit``, or a list of at most ``limit`` items: a size a peer gives (PEER_BOUNDS)."""

    def __init__(self, inner: FieldCodec, limit: int) -> None:
        self.inner, self.limit = inner, limit

    def accepts(self, value: Any) -> bool:
        return self.inner.accepts(value)

    def encode(self, value: Any) -> JSON:
        return self.inner.encode(value)

    def decode(self, data: JSON, path: str) -> Any:
        # Checked before the items are decoded, so a long list costs no more than its JSON text did.
        if isinstance(data, list) and len(data) > self.limit:
            raise _bad(path, f"at most {self.limit} items", f"{len(data)} items")
        if _is_int(data) and data > self.limit:
            raise _bad(path, f"at most {self.limit}", data)
        return self.inner.decode(data, path)

    def schema(self) -> dict[str, Any]:
        body = self.inner.schema()
        key = "maxItems" if body.get("type") == "array" else "maximum"
        return {**body, key: self.limit}


def _bounded(kind: type[Any], name: str, codec: FieldCodec) -> FieldCodec:
    limit = PEER_BOUNDS.get((kind, name))
    return codec if limit is None else _Bounded(codec, limit)


class _Object(FieldCodec):
    """An attrs class, field by field; unknown keys are ignored (VER-1)."""

    def __init__(self, kind: type[Any]) -> None:
        self.kind = kind
        self._fields: list[tuple[attrs.Attribute[Any], FieldCodec]] | None = None

    @property
    def fields(self) -> list[tuple[attrs.Attribute[Any], FieldCodec]]:
        if self._fields is None:
            hints = typing.get_type_hints(self.kind)
            self._fields = [
                (f, _bounded(self.kind, f.name, field_codec(hints[f.name]))) for f in attrs.fields(self.kind) if f.init
            ]
        return self._fields

    def accepts(self, value: Any) -> bool:
        return isinstance(value, self.kind)

    def encode(self, value: Any) -> JSON:
        return {f.name: codec.encode(getattr(value, f.name)) for f, codec in self.fields}

    def decode(self, data: JSON, path: str) -> Any:
        if not isinstance(data, dict):
            raise _bad(path, f"a JSON object ({self.kind.__name__})", data)
        codecs = {f.name: codec for f, codec in self.fields}

        def decode(name: str, value: JSON) -> Any:
            sub = f"{path}.{name}" if path else name
            try:
                return codecs[name].decode(value, sub)
            except KVSpecError:
                raise
            except _UNDECODABLE as exc:
                raise MalformedMessageError(f"undecodable value ({type(exc).__name__})", field=sub) from None

        # VER-1: unknown keys ignored, an absent field with a default takes it, one without is malformed.
        known = [(f.name, f.default is not attrs.NOTHING) for f, _ in self.fields]
        kwargs = decode_fields(data, known, decode, path=path)
        try:
            return self.kind(**kwargs)
        except FieldError as exc:
            raise MalformedMessageError(str(exc), field=f"{path}.{exc.field}" if path else exc.field) from None
        except (ConfigError, *_UNDECODABLE) as exc:
            raise MalformedMessageError(str(exc), field=path or None) from None

    def schema(self) -> dict[str, Any]:
        properties = {f.name: codec.schema() for f, codec in self.fields}
        required = [f.name for f, _ in self.fields if f.default is attrs.NOTHING]
        return {"type": "object", "properties": properties, "required": required}


@cache
def field_codec(hint: Any) -> FieldCodec:
    """The converter for one resolved type hint of a message field."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        options = tuple(a for a in args if a is not type(None))
        inner = field_codec(options[0]) if len(options) == 1 else _Union(tuple(field_codec(a) for a in options))
        return _Optional(inner) if len(options) < len(args) else inner
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _Sequence(field_codec(args[0]))
        return _Tuple(tuple(field_codec(a) for a in args))
    if origin in (Mapping, dict):
        return _Mapping(field_codec(args[1]))
    if hint is BlockIds:
        return _BlockIds()
    if hint is bool:
        return _Scalar(bool, "boolean")
    if hint is int:
        return _Scalar(int, "integer")
    if hint is str:
        return _Scalar(str, "string")
    if hint is float:
        return _Float()
    if hint is bytes:
        return _Bytes()
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _Enum(hint)
    if isinstance(hint, type) and attrs.has(hint):
        return _Object(hint)
    raise ConfigError(f"the codec has no converter for {hint!r}")  # pragma: no cover - guards new fields


# --------------------------------------------------------------------------- messages


def message_type_name(cls: type[Any]) -> str:
    """The wire ``"type"`` of a message class."""
    try:
        return _NAMES[cls]
    except KeyError:
        raise ConfigError(f"{cls.__name__} is not a kvspec protocol message") from None


def encode(message: Message) -> bytes:
    """Canonical JSON bytes of one message, with its type and the protocol version (VER-1).

    >>> from kvspec import Release, ReleaseOutcome
    >>> encode(Release(request_id="r1", consumer_engine_id="c", outcome=ReleaseOutcome.LOADED))
    b'{"consumer_engine_id":"c","outcome":"loaded","request_id":"r1","type":"release","v":[1,3]}'
    """
    kind: Any = type(message)
    body = field_codec(kind).encode(message) if kind in _NAMES else None
    if body is None:
        raise ConfigError(f"encode: expected a kvspec protocol message, got {type(message).__name__}")
    body["type"] = _NAMES[kind]
    body["v"] = list(PROTOCOL_VERSION)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def decode(data: bytes) -> Message:
    """Parse bytes produced by :func:`encode` (of this or another minor version) into a message (VER-1).

    Raises only kvspec errors: :class:`kvspec.UnsupportedVersionError` for
    another major, :class:`kvspec.MalformedMessageError` (naming the field
    where there is one) for everything else.
    """
    try:
        return _decode(data)
    except KVSpecError:
        raise
    except Exception as exc:  # pragma: no cover - a safety net; the fuzz tests call _decode directly
        raise MalformedMessageError(f"undecodable message ({type(exc).__name__})") from exc


def _decode(data: bytes) -> Message:
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise MalformedMessageError(f"expected bytes, got {type(data).__name__}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MalformedMessageError(f"not JSON text: {str(exc)[:80]}") from None
    if not isinstance(obj, dict):
        raise _bad("", "a JSON object", obj)
    _check_version(obj.get("v"))
    name = obj.get("type")
    if not isinstance(name, str) or name not in MESSAGE_TYPES:
        raise _bad("type", f"one of {sorted(MESSAGE_TYPES)}", name)
    kind: Any = MESSAGE_TYPES[name]
    message: Message = field_codec(kind).decode(obj, "")
    return message


def _check_version(version: object) -> None:
    if not (isinstance(version, list) and len(version) == 2 and all(_is_int(v) and v >= 0 for v in version)):
        raise _bad("v", "[major, minor] non-negative integers", version)
    if not is_compatible_version((version[0], version[1])):
        raise UnsupportedVersionError(
            f"message speaks protocol {version[0]}.{version[1]}; this side speaks major {PROTOCOL_VERSION[0]} (VER-1)"
        )
