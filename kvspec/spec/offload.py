"""Offload: chunk geometry, keys, store sets, key lifecycle, hits, load sets, sub-blocks, retention, admission.

Rules OFF-1 ... OFF-9. What must live here
------------------------------------------

This module is the offload tier's definition; everything else only carries it
out. It holds every offload rule as a plain function or a small table:

- the geometry of chunks (OFF-1, :func:`get_chunk_sizes`) and their keys
  (OFF-2, :func:`get_offload_keys`, :class:`OffloadKey`);
- what one store step writes (OFF-3, :func:`get_store_set`, :class:`StoreSet`);
- the lifecycle of a key in the chunk pool, as one table (OFF-4,
  :data:`KEY_TRANSITIONS`): a key is *present*, and may be loaded, only once
  every sub-block of its chunk landed, and is evicted only while no copy
  touches it; and the lifecycle of one copy (:data:`COPY_TRANSITIONS`);
- the hit a later request may take (OFF-5, :func:`get_offload_hit_tokens`),
  what a load reads (OFF-6, :func:`get_load_set`), where each page lands
  (OFF-7, :func:`map_sub_blocks`, :func:`get_sub_block_offset`), which keys a
  request keeps alive (OFF-8, :func:`get_retained_chunk_starts`) and which
  groups the tier admits (OFF-9, :func:`check_offload_support`).

The offload reference, the offload sessions, the driver's offload role and the
suite's chunk pool import their tables and checks from here, as h11's
``_state.py`` is the one place h11's states are written;
``kvspec.fast.get_offload_hit_tokens`` is a faster twin of OFF-5's, tested equal to it.
The rules model vLLM's ``OffloadingConnector`` with HMA (PR #41445 and
later); every function is pure: per-group data goes in and out as tuples of
ints, so test vectors can be written out.

A GPU engine offloads a request's KV cache to a slower tier (CPU memory) in
*chunks*: chunk ``k`` of group ``g`` holds the ``f = blocks_per_chunk`` GPU
blocks ``k*f ... k*f + f - 1`` of that group, so it covers tokens
``[k*C_g, (k+1)*C_g)`` with ``C_g = B_g * f``. Each chunk is named by a key:
the chained block hash of the chunk's last token plus the group index.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs

from kvspec.core._errors import (
    ConfigError,
    GroupCountError,
    StatePositionError,
    UnsupportedHybridError,
    WindowCoverageError,
)
from kvspec.core._models import (
    NULL_BLOCK_ID,
    BlockIds,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvspec.spec.coverage import get_needed_token_range

__all__ = [
    "COPY_TRANSITIONS",
    "KEY_TRANSITIONS",
    "BlockIdGroups",
    "KeyEvent",
    "KeyState",
    "LoadSet",
    "OffloadConfig",
    "OffloadEvent",
    "OffloadKey",
    "OffloadKind",
    "OffloadState",
    "StoreSet",
    "check_offload_support",
    "get_chunk_sizes",
    "get_load_set",
    "get_next_key_state",
    "get_offload_hit_tokens",
    "get_offload_keys",
    "get_retained_chunk_starts",
    "get_store_set",
    "get_sub_block_offset",
    "is_chunk_present",
    "map_sub_blocks",
]

BlockIdGroups = BlockIds | Sequence[Sequence[int]]
"""Per-group block ids: a checked ``BlockIds`` or plain sequences taken as they are (OFF-3, OFF-6)."""

_T = TypeVar("_T")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        expected = "a positive int" if minimum == 1 else "a non-negative int"
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")
    return value  # type: ignore[return-value]


def _positive(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _check_int(f"{type(inst).__name__}.{attribute.name}", value, minimum=1)


def _int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


def _int_tuples(value: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in value)


# --------------------------------------------------------------------------- models


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """How a connector offloads: ``blocks_per_chunk`` GPU blocks per chunk, keys from ``hash_block_size`` hashes.

    ``blocks_per_chunk`` is vLLM's ``blocks_per_chunk`` (``block_size_factor``
    before #48150), ``f`` in the spec; ``hash_block_size`` is the token span
    of one request block hash (vLLM's ``cache_config.block_size``), ``h``
    (OFF-1).

    >>> OffloadConfig(blocks_per_chunk=3, hash_block_size=4)
    OffloadConfig(blocks_per_chunk=3, hash_block_size=4)
    """

    blocks_per_chunk: int = attrs.field(validator=_positive)
    hash_block_size: int = attrs.field(validator=_positive)


@attrs.frozen(kw_only=True)
class OffloadKey:
    """The name of one stored chunk: the block hash of its last token and its group (OFF-2).

    Two groups whose chunks end at the same token share the hash and differ in
    ``group``. :meth:`to_bytes` is vLLM's wire form: the hash, then the group
    as a 4-byte big-endian unsigned int.
    """

    block_hash: bytes = attrs.field()
    group: int = attrs.field()

    @block_hash.validator
    def _check_hash(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, bytes):
            raise ConfigError(f"OffloadKey.block_hash: expected bytes, got {value!r}")

    @group.validator
    def _check_group(self, attribute: attrs.Attribute[Any], value: object) -> None:
        # The wire form carries the group in 4 bytes.
        if not _is_int(value) or not 0 <= value < 2**32:  # type: ignore[operator]
            raise ConfigError(f"OffloadKey.group: expected an int in [0, 2**32), got {value!r}")

    def to_bytes(self) -> bytes:
        """The hash followed by the group index as 4 big-endian bytes (OFF-2)."""
        return self.block_hash + self.group.to_bytes(4, "big")


def _state_tuple(value: Sequence[int | None]) -> tuple[int | None, ...]:
    return tuple(value)


def _int_pairs(value: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    pairs = []
    for g, pair in enumerate(value):
        if len(pair) != 2:
            raise ConfigError(f"chunk_ranges[{g}]: expected a (first, stop) pair, got {pair!r}")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def _check_groups_of(inst: object, fields: dict[str, Sequence[object]]) -> None:
    lengths = {name: len(value) for name, value in fields.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"{type(inst).__name__}: expected one entry per group in every field, got lengths {lengths}")


def _check_transfer(inst: _GroupTransfers) -> None:
    """Shared checks of StoreSet and LoadSet: per-group lengths, chunk ranges, counts without nulls."""
    name = type(inst).__name__
    _check_groups_of(
        inst,
        {
            "chunk_ranges": inst.chunk_ranges,
            "block_ids": inst.block_ids,
            "first_block_indices": inst.first_block_indices,
            "num_blocks": inst.num_blocks,
        },
    )
    for g, (first, stop) in enumerate(inst.chunk_ranges):
        if not (_is_int(first) and _is_int(stop) and 0 <= first <= stop):
            raise ConfigError(
                f"{name}.chunk_ranges[{g}]: expected (first, stop) with 0 <= first <= stop, got {(first, stop)}"
            )
    for g, (count, ids) in enumerate(zip(inst.num_blocks, inst.block_ids, strict=True)):
        # The count must equal the number of block ids (vLLM's sum(group_sizes) == len(block_ids), #42945).
        if count != len(ids):
            raise ConfigError(
                f"{name}.num_blocks[{g}]: expected {len(ids)} (the blocks, nulls never counted), got {count}"
            )
        if NULL_BLOCK_ID in ids:
            raise ConfigError(f"{name}.block_ids[{g}]: expected no null block id 0, got {list(ids)}")


@attrs.frozen(kw_only=True)
class _GroupTransfers:
    """What StoreSet and LoadSet share: per group a chunk range, GPU block ids, a first position and a count."""

    blocks_per_chunk: int = attrs.field(validator=_positive)
    chunk_ranges: tuple[tuple[int, int], ...] = attrs.field(converter=_int_pairs)
    block_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_int_tuples)
    first_block_indices: tuple[int, ...] = attrs.field(converter=_int_tuple)
    num_blocks: tuple[int, ...] = attrs.field(converter=_int_tuple)

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return len(self.chunk_ranges)

    @property
    def chunks(self) -> tuple[tuple[int, ...], ...]:
        """Per group, the chunk indices, ``chunk_ranges`` spelled out."""
        return tuple(tuple(range(first, stop)) for first, stop in self.chunk_ranges)

    @property
    def sub_blocks(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per group, the (chunk entry, sub-block) each GPU block pairs with (OFF-7)."""
        return tuple(
            map_sub_blocks(first, count, blocks_per_chunk=self.blocks_per_chunk)
            for first, count in zip(self.first_block_indices, self.num_blocks, strict=True)
        )


def _trusted(cls: type[_T], **fields: object) -> _T:
    """Build a StoreSet or LoadSet from values the reference just computed, without checking them again.

    The checks scan every id, which would dominate a 128k-token request
    (benchmarks/bench_offload.py); public construction always checks.
    """
    inst = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(inst, name, value)
    return inst


@attrs.frozen(kw_only=True)
class StoreSet(_GroupTransfers):
    """What one store step writes, per group (OFF-3, OFF-4).

    ``chunk_ranges[g]`` is ``(first, stop)``: chunks ``first ... stop - 1``
    are offered (``chunks`` spells them out). ``block_ids[g]`` are the GPU
    source blocks in order (nulls dropped), ``first_block_indices[g]`` the
    per-group position of the first source (0 when there is none),
    ``num_blocks[g]`` their count, which must equal ``len(block_ids[g])``
    (#42945 counted null sub-blocks here), and ``next_chunks[g]`` the first
    chunk the next step may offer.
    """

    next_chunks: tuple[int, ...] = attrs.field(converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        _check_transfer(self)
        _check_groups_of(self, {"chunk_ranges": self.chunk_ranges, "next_chunks": self.next_chunks})

    @property
    def partial_chunks(self) -> tuple[tuple[int, ...], ...]:
        """Per group, the offered chunks this store writes only in part; never present for a hit (OFF-4).

        Nulls form a prefix of a group's list (OFF-3), so only the first
        offered chunk can miss sub-blocks: those before the first source.
        """
        f = self.blocks_per_chunk
        return tuple(
            (first,) if first < stop and start != first * f else ()
            for (first, stop), start in zip(self.chunk_ranges, self.first_block_indices, strict=True)
        )

    @property
    def complete_chunks(self) -> tuple[tuple[int, ...], ...]:
        """Per group, the offered chunks whose every sub-block this store writes (OFF-4)."""
        return tuple(
            tuple(range(first + len(partial), stop))
            for (first, stop), partial in zip(self.chunk_ranges, self.partial_chunks, strict=True)
        )


@attrs.frozen(kw_only=True)
class LoadSet(_GroupTransfers):
    """What one load restores, per group (OFF-6).

    ``chunk_ranges[g]`` is ``(first, stop)``: chunks ``first ... stop - 1``
    are read (``chunks`` spells them out). ``block_ids[g]`` are the GPU
    destination blocks in order, ``first_block_indices[g]`` the per-group
    position ``L`` of the first destination and ``num_blocks[g]`` the count
    ``G - L``. The ``i``-th destination reads the sub-block
    :func:`map_sub_blocks` names (OFF-7). ``state_tokens[g]`` is, for a
    state group that loads, ``t``: the tokens the restored state absorbed,
    which must be ``T`` (STATE-1); ``None`` for other groups. An empty
    tuple says nothing, which a config with state groups refuses (OFF-6).
    """

    state_tokens: tuple[int | None, ...] = attrs.field(default=(), converter=_state_tuple)

    def __attrs_post_init__(self) -> None:
        _check_transfer(self)
        if self.state_tokens:
            _check_groups_of(self, {"chunk_ranges": self.chunk_ranges, "state_tokens": self.state_tokens})
        for g, t in enumerate(self.state_tokens):
            if t is not None and (not _is_int(t) or t < 0):
                raise ConfigError(f"LoadSet.state_tokens[{g}]: expected None or a non-negative int, got {t!r}")


# --------------------------------------------------------------------------- OFF-9 admission


def check_offload_support(config: KVCacheConfig, *, blocks_per_chunk: int = 1) -> None:
    """Raise :class:`UnsupportedHybridError` unless every group is attention or an aligned state group (OFF-9).

    Full attention includes MLA; sliding window includes SW-MLA. A state group
    (Mamba, GDN, KDA: a ``MambaSpec``) is admitted in ``align`` cache mode with
    one GPU block per chunk: then chunk ``k`` is the state slot that holds the
    state after exactly ``(k + 1) * C_g`` tokens (STATE-4), so a hit can say
    which state it restores. In ``none`` mode no state is kept at any chunk
    end, and with ``blocks_per_chunk > 1`` a chunk holds one state and
    ``f - 1`` null slots (decisions 161, 162 in decisions-offload.md). Chunked-local attention, cross
    attention and unknown kinds fail closed too, naming the group, its kind and
    the remedy. (OFF-9)
    """
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        # A state group stands at chunk ends only in align mode, one slot per chunk (OFF-9, decision 161 in
        # decisions-offload.md).
        if isinstance(spec, MambaSpec):
            if spec.cache_mode != "align":
                raise UnsupportedHybridError(
                    f"offload: group {g} (kind mamba, {spec.mamba_type}) has cache_mode={spec.cache_mode!r}; expected "
                    "'align' (OFF-9): without prefix caching no state is kept at a chunk end, so no hit can say which "
                    "state it restores; remedy: enable prefix caching (mamba cache mode align)"
                )
            if blocks_per_chunk != 1:
                raise UnsupportedHybridError(
                    f"offload: group {g} (kind mamba, {spec.mamba_type}) with blocks_per_chunk={blocks_per_chunk}; "
                    "expected 1 (OFF-9): a state chunk is one state slot; remedy: leave blocks_per_chunk at 1"
                )
            continue
        # Only kinds whose chunks are a function of token positions are specified (OFF-9).
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise UnsupportedHybridError(
                f"offload: group {g} (kind {spec.kind.value}, layers {list(group.layer_names)[:4]}) is not admitted "
                "(OFF-9): only full-attention (incl. MLA), sliding-window (incl. SW-MLA) and align-mode state groups "
                "are specified; remedy: disable the offloading connector for this model"
            )


def _check_support(config: KVCacheConfig, offload: OffloadConfig) -> None:
    f = offload.blocks_per_chunk if isinstance(offload, OffloadConfig) else 1
    check_offload_support(config, blocks_per_chunk=f)


def _window(spec: KVCacheSpec) -> int | None:
    # SW-MLA is a SlidingWindowSpec; a FullAttentionSpec with a window set (HMA off) allocates every block.
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


# --------------------------------------------------------------------------- OFF-1 geometry


def get_chunk_sizes(
    config: KVCacheConfig, *, blocks_per_chunk: int, hash_block_size: int | None = None
) -> tuple[int, ...]:
    """Tokens per chunk of each group: ``C_g = B_g * blocks_per_chunk`` (OFF-1).

    ``blocks_per_chunk > 1`` is legal only when every group has the same
    block size (vLLM asserts it); with ``hash_block_size`` given, it must
    divide every group's block size. Either failure raises
    :class:`ConfigError` naming the group. (OFF-1)
    """
    f = _check_int("get_chunk_sizes.blocks_per_chunk", blocks_per_chunk, minimum=1)
    sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
    if f > 1 and len(set(sizes)) > 1:
        g = next(i for i, size in enumerate(sizes) if size != sizes[0])
        raise ConfigError(
            f"get_chunk_sizes.blocks_per_chunk: expected 1 when groups differ in block size "
            f"(group 0 has {sizes[0]}, group {g} has {sizes[g]}), got {f}"
        )
    if hash_block_size is not None:
        h = _check_int("get_chunk_sizes.hash_block_size", hash_block_size, minimum=1)
        for g, size in enumerate(sizes):
            if size % h:
                raise ConfigError(
                    f"get_chunk_sizes.hash_block_size: expected a divisor of every block size, "
                    f"got {h}, which does not divide group {g}'s block size {size}"
                )
    return tuple(size * f for size in sizes)


def _chunk_sizes(config: KVCacheConfig, offload: OffloadConfig) -> tuple[int, ...]:
    if not isinstance(offload, OffloadConfig):
        raise ConfigError(f"offload: expected an OffloadConfig, got {offload!r}")
    return get_chunk_sizes(config, blocks_per_chunk=offload.blocks_per_chunk, hash_block_size=offload.hash_block_size)


def _check_groups(name: str, config: KVCacheConfig, value: Sequence[object]) -> None:
    if len(value) != config.num_groups:
        raise GroupCountError(f"{name}: expected {config.num_groups} groups (one per KV-cache group), got {len(value)}")


def _block_groups(name: str, config: KVCacheConfig, block_ids: BlockIdGroups) -> Sequence[Sequence[int]]:
    # A BlockIds is already validated; plain sequences are taken as they are (the benchmark's 128k lists).
    groups: Sequence[Sequence[int]] = block_ids.groups if isinstance(block_ids, BlockIds) else block_ids
    _check_groups(name, config, groups)
    return groups


# --------------------------------------------------------------------------- OFF-2 keys


def get_offload_keys(
    config: KVCacheConfig, block_hashes: Sequence[bytes], *, offload: OffloadConfig
) -> tuple[tuple[OffloadKey, ...], ...]:
    """Per group, the keys of the request's complete chunks so far (OFF-2).

    With ``m_g = C_g / h`` hashes per chunk, group ``g`` has
    ``len(block_hashes) // m_g`` keys; key ``k`` is the hash at index
    ``(k + 1) * m_g - 1`` with the group index. (OFF-2)
    """
    chunk_sizes = _chunk_sizes(config, offload)
    h = offload.hash_block_size
    keys = []
    for g, size in enumerate(chunk_sizes):
        per_chunk = size // h
        count = len(block_hashes) // per_chunk
        keys.append(tuple(OffloadKey(block_hash=block_hashes[(k + 1) * per_chunk - 1], group=g) for k in range(count)))
    return tuple(keys)


# --------------------------------------------------------------------------- OFF-3 store


def _copy(ids: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    """``tuple(ids[start:stop])`` with one copy instead of two where the input allows it."""
    if isinstance(ids, tuple):
        return ids[start:stop]
    if start == 0 and stop == len(ids):
        return tuple(ids)
    return tuple(ids[start:stop])


def _leading_nulls(name: str, ids: Sequence[int]) -> int:
    """How many null ids open the list (OFF-3); a real id among them is an error.

    Nulls form a prefix, so a binary search finds its end; only the prefix
    itself is scanned, and the caller checks the ids it copies.
    """
    if not ids or ids[0] != NULL_BLOCK_ID:
        return 0
    nulls = bisect.bisect_left(ids, True, key=bool)
    if list(ids[:nulls]).count(NULL_BLOCK_ID) != nulls:
        raise ConfigError(f"{name}: expected null ids (0) only as a prefix, got a real id among the first {nulls}")
    return nulls


def get_store_set(
    config: KVCacheConfig,
    block_ids: BlockIdGroups,
    *,
    num_offloadable_tokens: int,
    next_chunk: Sequence[int],
    offload: OffloadConfig,
) -> StoreSet:
    """The chunks one store step offers and the GPU blocks it copies, per group (OFF-3).

    For group ``g`` the candidates are chunks ``[next_chunk[g], O // C_g)``
    with ``O = num_offloadable_tokens``; a candidate is offered only when its
    last GPU block (position ``k*f + f - 1``) is real. The sources are the
    offered chunks' real blocks in order, their count never includes a null
    (#42945), and the next step starts at ``max(next_chunk[g], O // C_g)``.
    Null ids may only open a group's list. Window groups are not clipped to
    the window when storing. A chunk whose leading sub-blocks are null is
    written in part and never counts as present (OFF-4). (OFF-3)
    """
    _check_support(config, offload)
    chunk_sizes = _chunk_sizes(config, offload)
    groups = _block_groups("get_store_set.block_ids", config, block_ids)
    _check_groups("get_store_set.next_chunk", config, next_chunk)
    tokens = _check_int("get_store_set.num_offloadable_tokens", num_offloadable_tokens, minimum=0)
    f = offload.blocks_per_chunk
    ranges, sources, firsts, nexts = [], [], [], []
    for g, (ids, size) in enumerate(zip(groups, chunk_sizes, strict=True)):
        start = _check_int(f"get_store_set.next_chunk[{g}]", next_chunk[g], minimum=0)
        stop = tokens // size
        if len(ids) < stop * f:
            raise ConfigError(
                f"get_store_set.block_ids[{g}]: expected at least {stop * f} ids to cover {tokens} tokens, "
                f"got {len(ids)}"
            )
        nulls = _leading_nulls(f"get_store_set.block_ids[{g}]", ids)
        # Chunk k's last block k*f + f - 1 is real iff k >= nulls // f (nulls form a prefix).
        first = min(max(start, nulls // f), max(start, stop))
        first_block = max(nulls, first * f) if first < stop else 0
        ranges.append((first, max(first, stop)))
        source = _copy(ids, first_block, stop * f) if first < stop else ()
        if not all(source):  # a null after a real id (all() is the fastest scan of ints)
            index = first_block + source.index(NULL_BLOCK_ID)
            raise ConfigError(
                f"get_store_set.block_ids[{g}]: expected null ids (0) only as a prefix, got 0 at index {index} "
                "after a real id"
            )
        sources.append(source)
        firsts.append(first_block)
        nexts.append(max(start, stop))
    return _trusted(
        StoreSet,
        blocks_per_chunk=f,
        chunk_ranges=tuple(ranges),
        block_ids=tuple(sources),
        first_block_indices=tuple(firsts),
        num_blocks=tuple(len(source) for source in sources),
        next_chunks=tuple(nexts),
    )


# --------------------------------------------------------------------------- OFF-4 key and copy lifecycles


class KeyState(str, enum.Enum):
    """Where one key stands in the chunk pool (OFF-4); only a ``present`` key is seen by a lookup (OFF-5)."""

    ABSENT = "absent"  # no chunk-pool row holds it (never stored, or evicted)
    STORING = "storing"  # a row holds it and a store into it is in flight
    PARTIAL = "partial"  # a row holds it, but a sub-block of the chunk was never written
    PRESENT = "present"  # every sub-block landed and no copy is in flight: a lookup sees it
    LOADING = "loading"  # present, and a load reads it: not evictable until the load ends


class KeyEvent(str, enum.Enum):
    """What happens to a key (OFF-4, OFF-8): a store or load posted or ended, a touch, an eviction."""

    STORE = "store"  # a store step offers its chunk (OFF-3)
    STORED = "stored"  # the store landed and every sub-block of the chunk is now written
    STORED_IN_PART = "stored_in_part"  # the store landed or failed, and a sub-block is still unwritten
    LOAD = "load"  # a load reads it (OFF-6)
    LOADED = "loaded"  # that load ended, landed or failed
    TOUCH = "touch"  # a request keeps it alive (OFF-8)
    EVICT = "evict"  # the pool frees its row


KEY_TRANSITIONS: tuple[tuple[KeyState, KeyEvent, KeyState], ...] = (
    (KeyState.ABSENT, KeyEvent.STORE, KeyState.STORING),
    (KeyState.STORING, KeyEvent.STORED, KeyState.PRESENT),
    (KeyState.STORING, KeyEvent.STORED_IN_PART, KeyState.PARTIAL),
    (KeyState.PARTIAL, KeyEvent.STORE, KeyState.STORING),
    (KeyState.PARTIAL, KeyEvent.EVICT, KeyState.ABSENT),
    (KeyState.PRESENT, KeyEvent.LOAD, KeyState.LOADING),
    (KeyState.PRESENT, KeyEvent.TOUCH, KeyState.PRESENT),
    (KeyState.PRESENT, KeyEvent.EVICT, KeyState.ABSENT),
    (KeyState.LOADING, KeyEvent.LOADED, KeyState.PRESENT),
    (KeyState.LOADING, KeyEvent.TOUCH, KeyState.LOADING),
)
"""The lifecycle of one key, ``(state, event, next state)`` (OFF-4, OFF-8).

A partial chunk never becomes present, and a key is evicted only while no copy
touches it; an event with no row (a load of a key not present, an eviction
under a copy) is a chunk pool's error.
"""


def is_chunk_present(*, sub_blocks_written: int, blocks_per_chunk: int, copies_in_flight: int) -> bool:
    """True when a stored key may be reported present: all ``f`` sub-blocks written, no store in flight (OFF-4)."""
    return sub_blocks_written == blocks_per_chunk and copies_in_flight == 0


def get_next_key_state(state: KeyState, event: KeyEvent) -> KeyState:
    """The state ``event`` takes a key to by :data:`KEY_TRANSITIONS`; :class:`ConfigError` without a row (OFF-4)."""
    for source, on, target in KEY_TRANSITIONS:
        if source is state and on is event:
            return target
    raise ConfigError(f"offload key in state {state.value}: expected no {event.value!r} here (OFF-4)")


class OffloadKind(str, enum.Enum):
    """Which way a copy goes: a store writes the chunk pool (OFF-3), a load reads it back (OFF-6)."""

    STORE = "store"
    LOAD = "load"


class OffloadState(str, enum.Enum):
    """Where one copy of a store or a load is (OFF-4): posted once, then landed or failed."""

    PENDING = "pending"
    COPYING = "copying"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        """True once the copy landed or failed."""
        return self in (OffloadState.DONE, OffloadState.FAILED)


class OffloadEvent(str, enum.Enum):
    """What happens to one copy (OFF-4): its post, its end reported by the backend, or its deadline."""

    START = "start"
    TRANSFER_DONE = "transfer_done"
    TRANSFER_FAILED = "transfer_failed"
    DEADLINE = "deadline"


COPY_TRANSITIONS: tuple[tuple[OffloadState, OffloadEvent, OffloadState, str], ...] = (
    (OffloadState.PENDING, OffloadEvent.START, OffloadState.COPYING, "post"),
    (OffloadState.COPYING, OffloadEvent.TRANSFER_DONE, OffloadState.DONE, ""),
    (OffloadState.COPYING, OffloadEvent.TRANSFER_FAILED, OffloadState.FAILED, ""),
    (OffloadState.COPYING, OffloadEvent.DEADLINE, OffloadState.FAILED, "cancel"),
)
"""The lifecycle of one copy, ``(state, event, next state, action)`` (OFF-4).

A store's copy that ends ``done`` lands its sub-blocks (:class:`KeyEvent`
``stored`` or ``stored_in_part``). A report in a terminal state is ignored
(a late report of a cancelled copy); any other event with no row is the
local driver's error.
"""

# --------------------------------------------------------------------------- OFF-5 hit


def _check_tokens(
    config: KVCacheConfig, num_tokens: int, local_hit_tokens: int, where: str = "get_offload_hit_tokens"
) -> tuple[int, int]:
    # Token counts index chunks: a negative or non-int count would index from the end (OFF-5).
    n = _check_int(f"{where}.num_tokens", num_tokens, minimum=0)
    c = _check_int(f"{where}.local_hit_tokens", local_hit_tokens, minimum=0)
    # The local hit is part of the request (OFF-5).
    if c > n:
        raise ConfigError(f"{where}.local_hit_tokens: expected at most num_tokens={n}, got {c}")
    for g, group in enumerate(config.kv_cache_groups):
        # The GPU caches whole blocks, so its hit ends on every group's block boundary (OFF-5).
        if c % group.kv_cache_spec.block_size:
            raise ConfigError(
                f"{where}.local_hit_tokens: expected a multiple of group {g}'s block size "
                f"{group.kv_cache_spec.block_size}, got {c}"
            )
    return n, c


def _check_hit_inputs(
    config: KVCacheConfig,
    present: Sequence[Sequence[bool]],
    num_tokens: int,
    local_hit_tokens: int,
    offload: OffloadConfig,
) -> tuple[int, ...]:
    """OFF-5's inputs checked, in order; each group's chunk size ``C_g`` (OFF-1, OFF-5, OFF-9)."""
    _check_support(config, offload)
    chunk_sizes = _chunk_sizes(config, offload)
    # One list of present chunks per group (OFF-5).
    _check_groups("get_offload_hit_tokens.present", config, present)
    _check_tokens(config, num_tokens, local_hit_tokens)
    for g, (keys, size) in enumerate(zip(present, chunk_sizes, strict=True)):
        # Only complete chunks have keys (OFF-2).
        if len(keys) > num_tokens // size:
            raise ConfigError(
                f"get_offload_hit_tokens.present[{g}]: expected at most {num_tokens // size} keys (complete chunks of "
                f"{num_tokens} tokens), got {len(keys)}"
            )
    return chunk_sizes


def get_offload_hit_tokens(
    config: KVCacheConfig,
    present: Sequence[Sequence[bool]],
    *,
    num_tokens: int,
    local_hit_tokens: int,
    offload: OffloadConfig,
) -> int:
    """Tokens past the local hit ``C`` the tier can supply for a request of ``num_tokens`` (``N``) (OFF-5).

    ``present[g][k]`` says whether chunk ``k`` of group ``g`` is stored whole
    (OFF-4); ``C_g`` is group ``g``'s chunk size (OFF-1, :func:`get_chunk_sizes`
    with ``offload``). The
    hit ends at the largest ``M`` with ``M <= N`` (``N - 1`` when a window
    group exists: the last token is recomputed) and ``M <= len(present[g]) *
    C_g`` such that every position each group needs for the token at ``M``
    (WIN-1's ranges with ``H = C``, ``T = M``) lies in a present chunk. The
    hit is 0 when any group would load less than one chunk. A state group
    (OFF-9) forces ``N - 1`` as a window does, and supports ``M`` only when
    ``M`` is a multiple of ``C_g`` and chunk ``M / C_g - 1`` is present: that
    chunk is the state after exactly ``M`` tokens, so the recomputed tokens
    are never applied twice (vLLM #44599, #51094) (OFF-5).
    """
    chunk_sizes = _check_hit_inputs(config, present, num_tokens, local_hit_tokens, offload)
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    has_window = any(isinstance(spec, (SlidingWindowSpec, MambaSpec)) for spec in specs)
    last = num_tokens - 1 if has_window else num_tokens  # a window or state group recomputes the last token (OFF-5)
    last = min([last, *(len(keys) * size for keys, size in zip(present, chunk_sizes, strict=True))])
    for end in range(last, local_hit_tokens, -1):
        # Less than one chunk to load in some group: no hit (OFF-5).
        if any(end - local_hit_tokens < size for size in chunk_sizes):
            return 0
        # The token at `end` reads WIN-1's positions of every group; each must lie in a present chunk (OFF-5).
        needed = [get_needed_token_range(spec, num_tokens=end, prefix_hit_tokens=local_hit_tokens) for spec in specs]
        states = [g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec)]
        # A state group restores the one chunk whose state absorbed exactly `end` tokens (OFF-5).
        if any(end % chunk_sizes[g] or not present[g][end // chunk_sizes[g] - 1] for g in states):
            continue
        if all(present[g][t // chunk_sizes[g]] for g in range(len(specs)) if g not in states for t in needed[g]):
            return end - local_hit_tokens
    return 0


# --------------------------------------------------------------------------- OFF-6 load


def get_load_set(
    config: KVCacheConfig,
    block_ids: BlockIdGroups,
    *,
    num_tokens: int,
    local_hit_tokens: int,
    offload: OffloadConfig,
) -> LoadSet:
    """The chunks a hit reads and the GPU blocks they land in, per group (OFF-6).

    ``num_tokens`` is ``T``, the tokens computed once the load lands (local
    hit ``C`` plus the offload hit). Group ``g`` restores GPU positions
    ``[L, G)`` with ``G = cdiv(T, B_g)`` and ``L = C // B_g`` for full
    attention, ``max(C, T - W + 1) // B_g`` for a window (so
    ``G - L <= cdiv(W + B_g - 1, B_g)``, #48959), from chunks
    ``[L // f, cdiv(T, C_g))``. Every destination must be a real block, or
    :class:`WindowCoverageError` names it. A state group (OFF-9) restores
    one block, at position ``T / B_g - 1``, from chunk ``T / C_g - 1``: the
    state after exactly ``T`` tokens, and ``state_tokens[g] = T`` says so
    (STATE-1); ``T`` off its grid is a :class:`StatePositionError`. (OFF-6)
    """
    _check_support(config, offload)
    chunk_sizes = _chunk_sizes(config, offload)
    groups = _block_groups("get_load_set.block_ids", config, block_ids)
    t, local = _check_tokens(config, num_tokens, local_hit_tokens, "get_load_set")
    f = offload.blocks_per_chunk
    ranges, dests, firsts, states = [], [], [], []
    for g, (ids, size, group) in enumerate(zip(groups, chunk_sizes, config.kv_cache_groups, strict=True)):
        block, window = group.kv_cache_spec.block_size, _window(group.kv_cache_spec)
        stop = _cdiv(t, block)
        first_token = local if window is None else max(local, t - window + 1)
        first = stop if first_token >= t else first_token // block  # nothing to restore: no blocks
        state: int | None = None
        if isinstance(group.kv_cache_spec, MambaSpec) and t > local:
            # One state slot, the one that absorbed exactly T tokens; T off the grid has no such slot (OFF-6).
            if t % block:
                raise StatePositionError(
                    f"get_load_set.num_tokens: group {g} is a state group of block size {block}; expected T a "
                    f"multiple of it (a state is kept only at chunk ends), got T={t} (OFF-6, STATE-1)"
                )
            first, state = stop - 1, t
        if len(ids) < stop:
            raise ConfigError(
                f"get_load_set.block_ids[{g}]: expected at least {stop} ids for {t} tokens, got {len(ids)}"
            )
        dest = _copy(ids, first, stop)
        if not all(dest):  # a null destination
            position = first + dest.index(NULL_BLOCK_ID)
            raise WindowCoverageError(
                f"get_load_set.block_ids[{g}][{position}]: expected a real block to restore tokens "
                f"[{position * block}, {(position + 1) * block}) (OFF-6), got the null block 0"
            )
        ranges.append((first // f, _cdiv(t, size)) if dest else (0, 0))
        dests.append(dest)
        firsts.append(first)
        states.append(state)
    return _trusted(
        LoadSet,
        blocks_per_chunk=f,
        chunk_ranges=tuple(ranges),
        block_ids=tuple(dests),
        first_block_indices=tuple(firsts),
        num_blocks=tuple(len(dest) for dest in dests),
        state_tokens=tuple(states),
    )


# --------------------------------------------------------------------------- OFF-7 sub-blocks


def map_sub_blocks(first_block_index: int, num_blocks: int, *, blocks_per_chunk: int) -> tuple[tuple[int, int], ...]:
    """Which (chunk entry, sub-block) each of a group's GPU blocks pairs with (OFF-7).

    With ``s = first_block_index % f``, the ``i``-th block pairs with entry
    ``(s + i) // f`` of the group's chunk list and sub-block ``(s + i) % f``.
    The same map serves stores (chunks are the destination) and loads (the
    source). Never ``(-first_block_index) % f``: the two agree only when
    ``2 * first_block_index % f == 0``. (OFF-7)
    """
    first = _check_int("map_sub_blocks.first_block_index", first_block_index, minimum=0)
    count = _check_int("map_sub_blocks.num_blocks", num_blocks, minimum=0)
    f = _check_int("map_sub_blocks.blocks_per_chunk", blocks_per_chunk, minimum=1)
    skip = first % f
    return tuple(divmod(skip + i, f) for i in range(count))


def get_sub_block_offset(chunk_row: int, sub_block: int, *, page_size: int, blocks_per_chunk: int) -> int:
    """Byte offset of one sub-block in a chunk tensor: ``chunk_row * f * page_size + sub_block * page_size`` (OFF-7).

    One chunk row of a tensor holds ``f`` GPU-sized pages side by side;
    ``page_size`` is the page of one GPU block in that tensor. (OFF-7)
    """
    row = _check_int("get_sub_block_offset.chunk_row", chunk_row, minimum=0)
    f = _check_int("get_sub_block_offset.blocks_per_chunk", blocks_per_chunk, minimum=1)
    page = _check_int("get_sub_block_offset.page_size", page_size, minimum=1)
    if not _is_int(sub_block) or not 0 <= sub_block < f:
        raise ConfigError(f"get_sub_block_offset.sub_block: expected an int in [0, {f}), got {sub_block!r}")
    return row * f * page + sub_block * page


# --------------------------------------------------------------------------- OFF-8 retention


def get_retained_chunk_starts(
    config: KVCacheConfig, *, num_computed_tokens: int, offload: OffloadConfig
) -> tuple[int, ...]:
    """Per group, the first chunk a request keeps alive (touches) for a later hit of itself (OFF-8).

    ``num_computed_tokens`` is ``E = C + hit`` at the request's first lookup.
    Full attention keeps every key (start 0); a window group keeps keys from
    ``max(0, E - W + 1) // C_g`` on, the chunks a hit ending at ``E`` reads,
    plus every later key. vLLM at #41445 kept keys from ``max(0, E // C_g - cdiv(W, C_g))``,
    never later than this. (OFF-8)
    """
    chunk_sizes = _chunk_sizes(config, offload)
    e = _check_int("get_retained_chunk_starts.num_computed_tokens", num_computed_tokens, minimum=0)
    starts = []
    for group, size in zip(config.kv_cache_groups, chunk_sizes, strict=True):
        window = _window(group.kv_cache_spec)
        starts.append(0 if window is None else max(0, e - window + 1) // size)
    return tuple(starts)
