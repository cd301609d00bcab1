"""Typed, frozen models of a KV cache: dtypes, per-group specs, memory layout and block ids."""

from __future__ import annotations

import enum
import math
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, overload

import attrs

from kvspec.core._enums import FailureReason, StateProfile, TransferMode
from kvspec.core._errors import ConfigError, shown

__all__ = [
    "DTYPE_SIZES",
    "AttentionSpec",
    "BlockIds",
    "CacheDeclaration",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "DType",
    "FailureReason",
    "FullAttentionSpec",
    "IndexerSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "SpecKind",
    "StateProfile",
    "TransferMode",
]

NULL_BLOCK_ID = 0


# --------------------------------------------------------------------------- enums


class SpecKind(str, enum.Enum):
    """What a KV-cache group holds; travels in the handshake (HS-1)."""

    FULL_ATTENTION = "full_attention"
    MLA = "mla"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    INDEXER = "indexer"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


# --------------------------------------------------------------------------- validators


def _fail(inst_or_cls: object, field: str, expected: str, found: object) -> ConfigError:
    cls = inst_or_cls if isinstance(inst_or_cls, type) else type(inst_or_cls)
    return ConfigError(f"{cls.__name__}.{field}: expected {expected}, got {shown(found)}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise _fail(inst, attribute.name, "a positive int", value)


def _non_negative_int(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise _fail(inst, attribute.name, "a non-negative int", value)


def _optional_positive_int(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive_int(inst, attribute, value)


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        # A bare string would silently become a tuple of characters.
        return (value,)
    return tuple(value)


# --------------------------------------------------------------------------- dtypes

_DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "uint8": 1,
    "int8": 1,
}
# Every dtype name DType accepts, with its width in bytes (read-only: DType's own table).
DTYPE_SIZES: Mapping[str, int] = types.MappingProxyType(_DTYPE_SIZES)

# Spellings engines use for the same dtypes (vLLM's cache_dtype strings, torch reprs).
_DTYPE_ALIASES: dict[str, str] = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp8_inc": "float8_e4m3fn",
}


def _dtype_name(value: object) -> str:
    if not isinstance(value, str):
        raise _fail(DType, "name", "a dtype name", value)
    name = value.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPE_SIZES:
        raise _fail(DType, "name", f"one of {sorted(_DTYPE_SIZES)}", value)
    return name


@attrs.frozen(kw_only=True)
class DType:
    """An element type of a KV cache, with its item size in bytes.

    >>> DType.from_name("bf16")
    DType(name='bfloat16')
    """

    name: str = attrs.field(converter=_dtype_name)

    @classmethod
    def from_name(cls, name: str) -> DType:
        """Build from a name such as ``"bfloat16"``, ``"torch.float16"`` or ``"fp8"``."""
        return cls(name=name)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _DTYPE_SIZES[self.name]

    def __str__(self) -> str:
        return self.name


def _to_dtype(value: object) -> DType:
    if isinstance(value, DType):
        return value
    return DType(name=value)


def _to_dtypes(value: Iterable[object]) -> tuple[DType, ...]:
    return tuple(_to_dtype(v) for v in value)


# --------------------------------------------------------------------------- specs


@attrs.frozen(kw_only=True)
class KVCacheSpec:
    """Base of every per-group spec: what one block of one layer holds.

    ``page_size_padded``, when set, replaces the real page size and must be at
    least as large.
    """

    kind: ClassVar[SpecKind] = SpecKind.UNKNOWN

    block_size: int = attrs.field(validator=_positive_int)
    page_size_padded: int | None = attrs.field(default=None, validator=_optional_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise _fail(
                self,
                "page_size_padded",
                f"at least the real page size {self.real_page_size_bytes}",
                self.page_size_padded,
            )

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block of one layer, before padding."""
        return 0

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, padding included."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@attrs.frozen(kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Fields every attention spec shares (vLLM's ``AttentionSpec``)."""

    num_kv_heads: int = attrs.field(validator=_positive_int)
    head_size: int = attrs.field(validator=_positive_int)
    dtype: DType = attrs.field(converter=_to_dtype)
    head_size_v: int | None = attrs.field(default=None, validator=_optional_positive_int)

    @property
    def value_head_size(self) -> int:
        """Head size of V, which defaults to the K head size."""
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def real_page_size_bytes(self) -> int:
        # K and V pages side by side.
        per_token = self.num_kv_heads * (self.head_size + self.value_head_size)
        return self.block_size * per_token * self.dtype.itemsize


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) attention.

    ``sliding_window`` or ``attention_chunk_size`` set here is how vLLM
    describes a local layer when the hybrid manager is off: every block is
    allocated and the window is applied by the kernel only.
    """

    kind: ClassVar[SpecKind] = SpecKind.FULL_ATTENTION

    sliding_window: int | None = attrs.field(default=None, validator=_optional_positive_int)
    attention_chunk_size: int | None = attrs.field(default=None, validator=_optional_positive_int)


def _mla_page(spec: AttentionSpec) -> int:
    # A single latent vector per token: no separate V.
    return spec.block_size * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize


@attrs.frozen(kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention; counts as full attention (HMA-1)."""

    kind: ClassVar[SpecKind] = SpecKind.MLA

    @property
    def real_page_size_bytes(self) -> int:
        return _mla_page(self)


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: the token at p attends ``[p - W + 1, p]`` (SW-1, WIN-1)."""

    kind: ClassVar[SpecKind] = SpecKind.SLIDING_WINDOW

    sliding_window: int = attrs.field(validator=_positive_int)


@attrs.frozen(kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention over an MLA page."""

    kind: ClassVar[SpecKind] = SpecKind.SLIDING_WINDOW_MLA

    @property
    def real_page_size_bytes(self) -> int:
        return _mla_page(self)


@attrs.frozen(kw_only=True)
class IndexerSpec(MLAAttentionSpec):
    """A sparse-attention indexer's key cache (DeepSeek V3.2, GLM-5): one row per token (CACHE-1).

    vLLM describes it as an MLA spec with one KV head (``DeepseekV32IndexerCache``);
    kvspec gives it a kind of its own so that it is its own group, with its own
    page geometry (e.g. 132 bytes a token: 128 fp8 values and one fp32 scale),
    exchanged like MLA: every position, replicated across ranks (CACHE-1, PAR-1).
    """

    kind: ClassVar[SpecKind] = SpecKind.INDEXER


@attrs.frozen(kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: the token at p attends ``[C * (p // C), p]`` (CACHE-1, SW-1, WIN-1)."""

    kind: ClassVar[SpecKind] = SpecKind.CHUNKED_LOCAL

    attention_chunk_size: int = attrs.field(validator=_positive_int)


@attrs.frozen(kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross attention; not admitted under HMA in v1 (ADM-1)."""

    kind: ClassVar[SpecKind] = SpecKind.CROSS_ATTENTION


def _to_shapes(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(shape) for shape in value)


STATE_CACHE_MODES = ("none", "align")
"""vLLM 0.33's ``mamba_cache_mode`` values (``"all"`` was removed after 0.30)."""

CONV_LAYOUTS = ("DS", "SD")
"""Conv-state layouts: ``DS`` (dim-major, what vLLM's NIXL path requires) or ``SD``."""


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise _fail(inst, attribute.name, f"one of {list(choices)}", value)

    return check


def _state_kind(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(MambaSpec, "mamba_type", "a non-empty state kind name such as 'mamba2'", value)
    return value.lower()


@attrs.frozen(kw_only=True)
class MambaSpec(KVCacheSpec):
    """One state group: Mamba, GDN, KDA or other linear-attention state (STATE-1 .. STATE-5).

    A request holds one state per group, in one slot: a page holding the
    group's state tensors (``shapes``/``dtypes``, e.g. conv then SSM) back to
    back, padded to ``page_size_padded``. ``block_size`` is the state's token
    granularity: in ``"align"`` cache mode slot ``p`` of a request's list holds
    the state after ``(p + 1) * block_size`` tokens (STATE-4); in ``"none"``
    mode vLLM sets it to ``max_model_len``. ``num_speculative_blocks`` scratch
    slots sit at the tail of a request's list and never travel (STATE-2).
    """

    kind: ClassVar[SpecKind] = SpecKind.MAMBA

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_to_shapes)
    dtypes: tuple[DType, ...] = attrs.field(converter=_to_dtypes)
    mamba_type: str = attrs.field(default="mamba2", converter=_state_kind)
    cache_mode: str = attrs.field(default="none", validator=_one_of(STATE_CACHE_MODES))
    num_speculative_blocks: int = attrs.field(default=0, validator=_non_negative_int)
    conv_layout: str = attrs.field(default="DS", validator=_one_of(CONV_LAYOUTS))

    @shapes.validator
    def _check_shapes(self, attribute: attrs.Attribute[Any], value: tuple[tuple[int, ...], ...]) -> None:
        if not value or any(not shape or not all(_is_int(d) and d > 0 for d in shape) for shape in value):
            raise _fail(self, "shapes", "non-empty shapes of positive ints", value)

    @dtypes.validator
    def _check_dtypes(self, attribute: attrs.Attribute[Any], value: tuple[DType, ...]) -> None:
        if len(value) != len(self.shapes):
            raise _fail(self, "dtypes", f"{len(self.shapes)} dtypes, one per shape", value)

    @property
    def real_page_size_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes, strict=True))


# --------------------------------------------------------------------------- declared caches


def _non_empty_str(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise _fail(inst, attribute.name, "a non-empty str", value)


def _bool(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(inst, attribute.name, "a bool", value)


@attrs.frozen(kw_only=True)
class CacheDeclaration:
    """One cache a model keeps, as the engine declares it: exchanged, or declared ephemeral (CACHE-1).

    ``kind`` is a cache kind name (``kvspec.spec.CACHE_KINDS``); it stays a
    string here so that a kind this side does not know is refused by the rule,
    by name, not lost in a decoder. ``layer_names`` are the layers holding it;
    the cache is exchanged when exchanged groups hold every one of them.
    ``draft`` marks a draft model's cache (EAGLE, MTP); ``ephemeral`` says the
    consumer rebuilds it itself, so it never travels.
    """

    name: str = attrs.field(validator=_non_empty_str)
    kind: str = attrs.field(validator=_non_empty_str)
    layer_names: tuple[str, ...] = attrs.field(converter=_str_tuple)
    draft: bool = attrs.field(default=False, validator=_bool)
    ephemeral: bool = attrs.field(default=False, validator=_bool)

    @layer_names.validator
    def _check_layers(self, attribute: attrs.Attribute[Any], value: tuple[object, ...]) -> None:
        _names_validator(self, attribute, value)


def _to_caches(value: Iterable[CacheDeclaration]) -> tuple[CacheDeclaration, ...]:
    return tuple(value)


# --------------------------------------------------------------------------- layout


def _spec_validator(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, KVCacheSpec):
        raise _fail(inst, attribute.name, "a KVCacheSpec", value)


def _names_validator(inst: object, attribute: attrs.Attribute[Any], value: tuple[object, ...]) -> None:
    if not value or not all(isinstance(v, str) and v for v in value):
        raise _fail(inst, attribute.name, "a non-empty sequence of non-empty layer names", value)
    if len(set(value)) != len(value):
        raise _fail(inst, attribute.name, "distinct layer names", value)


@attrs.frozen(kw_only=True)
class KVCacheTensor:
    """One registered buffer holding pages of one or more layers (PLAN-1).

    The page of ``layers[l]`` for block ``b`` starts at byte
    ``offset + l * layer_stride + b * block_stride`` of this buffer.
    """

    size: int = attrs.field(validator=_positive_int)
    layers: tuple[str, ...] = attrs.field(converter=_str_tuple, validator=_names_validator)
    layer_stride: int = attrs.field(validator=_non_negative_int)
    block_stride: int = attrs.field(validator=_positive_int)
    offset: int = attrs.field(default=0, validator=_non_negative_int)

    def page_offset(self, layer_index: int, block_id: int) -> int:
        """Byte offset of one page inside this tensor (PLAN-1)."""
        return self.offset + layer_index * self.layer_stride + block_id * self.block_stride


@attrs.frozen(kw_only=True)
class KVCacheGroupSpec:
    """An ordered KV-cache group: its layers share one spec and one block table."""

    layer_names: tuple[str, ...] = attrs.field(converter=_str_tuple, validator=_names_validator)
    kv_cache_spec: KVCacheSpec = attrs.field(validator=_spec_validator)


def _to_tensors(value: Iterable[KVCacheTensor]) -> tuple[KVCacheTensor, ...]:
    return tuple(value)


def _to_groups(value: Iterable[KVCacheGroupSpec]) -> tuple[KVCacheGroupSpec, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class LayerLocation:
    """Where one layer's pages live: which tensor and which slot inside it."""

    tensor_index: int
    layer_index: int


@attrs.frozen(kw_only=True)
class KVCacheConfig:
    """An engine's whole KV cache: block count, buffers and ordered groups.

    Construction checks that every grouped layer lives in exactly one tensor,
    that no layer is in two groups, and that every page of every block fits
    inside its tensor. Block id 0 is the null block (NULL-1) and is counted in
    ``num_blocks``.
    """

    num_blocks: int = attrs.field(validator=_positive_int)
    kv_cache_tensors: tuple[KVCacheTensor, ...] = attrs.field(converter=_to_tensors)
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = attrs.field(converter=_to_groups)
    caches: tuple[CacheDeclaration, ...] = attrs.field(default=(), converter=_to_caches)
    """Every cache the model keeps, each exchanged or declared ephemeral (CACHE-1); empty: the groups alone."""
    _locations: dict[str, LayerLocation] = attrs.field(init=False, repr=False, eq=False, hash=False)

    @kv_cache_tensors.validator
    def _check_tensors(self, attribute: attrs.Attribute[Any], value: tuple[object, ...]) -> None:
        if not value or not all(isinstance(t, KVCacheTensor) for t in value):
            raise _fail(self, "kv_cache_tensors", "a non-empty sequence of KVCacheTensor", value)

    @kv_cache_groups.validator
    def _check_groups(self, attribute: attrs.Attribute[Any], value: tuple[object, ...]) -> None:
        if not value or not all(isinstance(g, KVCacheGroupSpec) for g in value):
            raise _fail(self, "kv_cache_groups", "a non-empty sequence of KVCacheGroupSpec", value)

    @caches.validator
    def _check_caches(self, attribute: attrs.Attribute[Any], value: tuple[object, ...]) -> None:
        if not all(isinstance(c, CacheDeclaration) for c in value):
            raise _fail(self, "caches", "a sequence of CacheDeclaration", value)
        names = [c.name for c in value]  # type: ignore[attr-defined]
        if len(set(names)) != len(names):
            raise _fail(self, "caches", "distinct cache names", names)

    def __attrs_post_init__(self) -> None:
        locations: dict[str, LayerLocation] = {}
        for t_index, tensor in enumerate(self.kv_cache_tensors):
            for l_index, name in enumerate(tensor.layers):
                if name in locations:
                    raise _fail(self, "kv_cache_tensors", f"layer {name!r} in exactly one tensor", "two tensors")
                locations[name] = LayerLocation(tensor_index=t_index, layer_index=l_index)
        seen: set[str] = set()
        for g_index, group in enumerate(self.kv_cache_groups):
            page = group.kv_cache_spec.page_size_bytes
            for name in group.layer_names:
                if name in seen:
                    raise _fail(self, f"kv_cache_groups[{g_index}]", f"layer {name!r} in one group only", "two groups")
                seen.add(name)
                if name not in locations:
                    raise _fail(self, f"kv_cache_groups[{g_index}]", f"layer {name!r} in some tensor", "none")
                loc = locations[name]
                tensor = self.kv_cache_tensors[loc.tensor_index]
                end = tensor.page_offset(loc.layer_index, self.num_blocks - 1) + page
                if end > tensor.size:
                    raise _fail(
                        self,
                        f"kv_cache_tensors[{loc.tensor_index}].size",
                        f"at least {end} bytes to hold block {self.num_blocks - 1} of layer {name!r}",
                        tensor.size,
                    )
        object.__setattr__(self, "_locations", locations)

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return len(self.kv_cache_groups)

    def locate(self, layer_name: str) -> LayerLocation:
        """Which tensor holds ``layer_name``, and at which slot."""
        try:
            return self._locations[layer_name]
        except KeyError:
            raise ConfigError(f"KVCacheConfig: unknown layer {layer_name!r}") from None

    def page_offset(self, layer_name: str, block_id: int) -> tuple[int, int]:
        """``(tensor_index, byte_offset)`` of one page (PLAN-1)."""
        loc = self.locate(layer_name)
        tensor = self.kv_cache_tensors[loc.tensor_index]
        return loc.tensor_index, tensor.page_offset(loc.layer_index, block_id)


# --------------------------------------------------------------------------- block ids


def _check_ids_one_by_one(group: int, ids: Sequence[object], first: int) -> tuple[int, ...]:
    # The straightforward check: each id an int (not a bool), non-negative. Runs only when the bulk
    # check below cannot vouch for a group, so its messages name the first bad position.
    for i, block_id in enumerate(ids):
        if not _is_int(block_id) or block_id < 0:  # type: ignore[operator]
            raise _fail(BlockIds, f"groups[{group}][{first + i}]", "a non-negative int block id", block_id)
    return tuple(int(b) for b in ids)  # type: ignore[call-overload]


def _checked_group(group: int, value: object, first: int = 0) -> tuple[tuple[int, ...], int | None]:
    """One group's ids as a tuple of plain ints, and its lowest id (``None`` for an empty group).

    The bulk check does at C speed what the per-id loop does: ``set(map(type, ids)) == {int}``
    proves every id a plain int (so neither a bool nor a float), ``min`` proves none negative.
    ``first`` is the position of ``value[0]`` in the list the caller was given, for messages.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail(BlockIds, f"groups[{group}]", "a sequence of block ids", value)
    ids = value if type(value) is tuple else tuple(value)
    if not ids:
        return ids, None
    if type(value) is range:
        low = min(value[0], value[-1])  # a range holds plain ints; its extremes are its ends
    elif set(map(type, ids)) == {int}:
        low = min(ids)
    else:
        ids = _check_ids_one_by_one(group, ids, first)
        low = min(ids)
    if low < 0:
        _check_ids_one_by_one(group, ids, first)  # raises, naming the first negative id
    return ids, low


def _to_block_groups(value: object) -> tuple[tuple[tuple[int, ...], ...], tuple[int | None, ...]]:
    """Each group's ids checked, and each group's lowest id (``None`` where the group is empty or not known)."""
    if isinstance(value, BlockIds):
        return value.groups, (None,) * len(value.groups)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail(BlockIds, "groups", "a sequence of per-group sequences of block ids", value)
    checked = [_checked_group(g, group) for g, group in enumerate(value)]
    return tuple(ids for ids, _ in checked), tuple(low for _, low in checked)


@attrs.frozen(init=False)
class BlockIds(Sequence[tuple[int, ...]]):
    """Block ids per KV-cache group, ordered like the config's groups.

    Behaves like vLLM's ``tuple[list[int], ...]``: ``len`` is the number of
    groups, indexing gives one group's ids, iteration walks the groups. Zero
    groups means "nothing to transfer" (a full prefix hit, CLIP-1). Id 0 is the
    null block (NULL-1).

    Building one checks every id (a plain int, not negative) with whole-list
    operations: O(n) in the ids (docs/explanation/engine-cost.md).

    >>> ids = BlockIds([[10, 11, 12], [20, 21]])
    >>> len(ids), ids[1]
    (2, (20, 21))
    """

    groups: tuple[tuple[int, ...], ...]

    def __init__(self, groups: object) -> None:
        """Check and hold ``groups``: one sequence of non-negative int ids per KV-cache group."""
        checked, _ = _to_block_groups(groups)
        self.__attrs_init__(checked)

    @classmethod
    def from_lists(cls, groups: Iterable[Iterable[int]]) -> BlockIds:
        """Build from plain nested sequences, e.g. vLLM's ``tuple[list[int], ...]``."""
        return cls(groups)

    @classmethod
    def _from_trusted(cls, groups: Iterable[tuple[int, ...]]) -> BlockIds:
        """Build from tuples already known valid (slices of a validated BlockIds).

        Skips the per-id check, which would dominate a long request
        (docs/explanation/engine-cost.md). Internal: callers outside kvspec
        use the validating constructor.
        """
        ids = object.__new__(cls)
        ids.__attrs_init__(tuple(groups))
        return ids

    def to_lists(self) -> list[list[int]]:
        """Plain nested lists, as vLLM's ``kv_transfer_params`` carries them."""
        return [list(group) for group in self.groups]

    @property
    def num_blocks(self) -> int:
        """Total ids over all groups, null ids included."""
        return sum(len(group) for group in self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    @overload
    def __getitem__(self, index: int) -> tuple[int, ...]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[int, ...], ...]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        return self.groups[index]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self.groups)

    def __repr__(self) -> str:
        return f"BlockIds({[list(g) for g in self.groups]!r})"
