"""The handshake's compatibility check: two engine descriptors compared field by field, HS-1.

What must live here
-------------------

This module is HS-1's definition; everything else only carries it out. It holds
the fields two peers must agree on (:data:`GROUP_FIELDS`, and with two parallel
layouts of unequal TP the per-rank fields that stop counting, :data:`RANK_FIELDS`),
the comparison that lists **every** difference with both values
(:func:`get_differences`), and the check a peer runs before it loads the other's
transport metadata or accepts a request (:func:`check_compatibility`, then the
declared caches, :func:`check_cache_compatibility`). The drivers, connectors and
adapters import the check from here; the descriptors it reads are
:class:`kvspec.EngineDescriptor` and :class:`kvspec.GroupDescriptor`, described here by
the attributes HS-1 reads (:class:`EngineDescriptorLike`, :class:`GroupDescriptorLike`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvspec.core._enums import TransferMode
from kvspec.core._errors import CacheAccountingError, ConfigError, IncompatiblePeerError
from kvspec.core._models import CacheDeclaration, SpecKind, StateProfile
from kvspec.spec.caches import GroupKey, get_cache_differences, get_cache_problems
from kvspec.spec.parallel import ParallelLayout, get_layout_mismatch

__all__ = [
    "GROUP_FIELDS",
    "RANK_FIELDS",
    "EngineDescriptorLike",
    "GroupDescriptorLike",
    "check_cache_compatibility",
    "check_compatibility",
    "get_differences",
]

GROUP_FIELDS: tuple[str, ...] = (
    "kind",
    "block_size",
    "sliding_window",
    "attention_chunk_size",
    "dtype",
    "num_kv_heads",
    "head_size",
    "page_size_bytes",
    "layer_names",
    "state_shapes",
    "state_dtypes",
    "mamba_type",
    "conv_layout",
)
"""Per-group fields both peers must agree on (HS-1); the last four are a state group's layout (STATE-5)."""

RANK_FIELDS: tuple[str, ...] = ("num_kv_heads", "page_size_bytes", "state_shapes")
"""Per-group fields that are one rank's share: with two parallel layouts and unequal TP, not compared (PAR-9, HS-1)."""


@runtime_checkable
class GroupDescriptorLike(Protocol):
    """What HS-1 reads of one group's descriptor: its kind, its layers, every field of :data:`GROUP_FIELDS` (HS-1)."""

    @property
    def kind(self) -> SpecKind: ...

    @property
    def layer_names(self) -> tuple[str, ...]: ...


@runtime_checkable
class EngineDescriptorLike(Protocol):
    """What HS-1 reads of an engine's descriptor (:class:`kvspec.EngineDescriptor`) (HS-1)."""

    @property
    def protocol_version(self) -> tuple[int, int]: ...

    @property
    def mode(self) -> TransferMode: ...

    @property
    def hma_enabled(self) -> bool: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def groups(self) -> Sequence[GroupDescriptorLike]: ...

    @property
    def state_profile(self) -> StateProfile | None: ...

    @property
    def parallel(self) -> ParallelLayout | None: ...

    @property
    def caches(self) -> tuple[CacheDeclaration, ...] | None: ...


def _plain(value: object) -> object:
    # Enums travel as their wire values so the error message reads like the config.
    return getattr(value, "value", value)


def get_differences(producer: EngineDescriptorLike, consumer: EngineDescriptorLike) -> dict[str, tuple[object, object]]:
    """Every field the two descriptors must agree on but do not, with (producer, consumer) values (HS-1)."""
    for role, value in (("producer", producer), ("consumer", consumer)):
        if not isinstance(value, EngineDescriptorLike):
            raise ConfigError(f"check_compatibility: expected the {role}'s EngineDescriptor, got {value!r}")
    diffs: dict[str, tuple[object, object]] = {}

    def compare(field: str, p: object, c: object) -> None:
        if p != c:
            diffs[field] = (_plain(p), _plain(c))

    compare("protocol_version.major", producer.protocol_version[0], consumer.protocol_version[0])
    compare("mode", producer.mode, consumer.mode)
    compare("hma_enabled", producer.hma_enabled, consumer.hma_enabled)
    shared = GROUP_FIELDS
    if producer.parallel is None or consumer.parallel is None:
        # A peer that does not say its layout (1.2) has today's: equal TP sizes only (PAR-9).
        compare("tp_size", producer.tp_size, consumer.tp_size)
    else:
        # Both say their layout: the byte maps it implies must compose, sizes need not be equal (PAR-9).
        mismatch = get_layout_mismatch(producer=producer.parallel, consumer=consumer.parallel)
        if mismatch is not None:
            field, p_value, c_value = mismatch
            diffs[f"parallel.{field}"] = (p_value, c_value)
        if producer.tp_size != consumer.tp_size:
            # Each rank's heads, page size and state shapes are its share of the pages compared above.
            shared = tuple(name for name in GROUP_FIELDS if name not in RANK_FIELDS)
    compare("num_groups", len(producer.groups), len(consumer.groups))
    # Where a transferred state stands differs between profiles; no rule converts one into the other (STATE-1).
    compare("state_profile", producer.state_profile, consumer.state_profile)
    p_order = tuple(g.layer_names for g in producer.groups)
    c_order = tuple(g.layer_names for g in consumer.groups)
    if p_order != c_order and sorted(p_order) == sorted(c_order):
        # Same groups, another order: block ids would land in the wrong group.
        diffs["groups.order"] = (p_order, c_order)
    for index, (p_group, c_group) in enumerate(zip(producer.groups, consumer.groups, strict=False)):
        for name in shared:
            compare(f"groups[{index}].{name}", getattr(p_group, name), getattr(c_group, name))
    return diffs


def check_compatibility(*, producer: EngineDescriptorLike, consumer: EngineDescriptorLike) -> None:
    """Raise :class:`kvspec.IncompatiblePeerError` listing every difference, or return None (HS-1).

    Peers must agree on the protocol major version, mode, HMA flag, TP size,
    group count and order, and every per-group field: kind, block size
    (block-size ratios are out of v1), window, chunk size, dtype, KV heads,
    head size, page size and ordered layer names; for a state group also its
    state shapes, dtypes, kind and conv layout (STATE-5), and both engines'
    state profile (STATE-1). When both descriptors carry a parallel layout
    (protocol 1.3), the TP sizes may differ: the layouts must compose
    (:func:`kvspec.spec.parallel.get_layout_mismatch`), and with unequal TP
    the per-rank fields (:data:`RANK_FIELDS`) are not compared (PAR-9). Then every
    declared cache is accounted for and
    both sides declare the same caches (:func:`check_cache_compatibility`,
    CACHE-1).
    """
    diffs = get_differences(producer, consumer)
    if diffs:
        raise IncompatiblePeerError(diffs)
    check_cache_compatibility(producer=producer, consumer=consumer)


def _group_keys(descriptor: EngineDescriptorLike) -> tuple[GroupKey, ...]:
    return tuple((group.kind.value, group.layer_names) for group in descriptor.groups)


def check_cache_compatibility(*, producer: EngineDescriptorLike, consumer: EngineDescriptorLike) -> None:
    """Each side's declared caches accounted for, and both sides' cache sets equal (CACHE-1, HS-1).

    A side that declares its caches (protocol 1.3) has each exchanged by its
    groups or declared ephemeral, of a known kind, else
    :class:`kvspec.CacheAccountingError` naming the side and the cache. When
    both sides declare, the sets must be equal cache by cache (name, kind,
    layers, draft, ephemeral), else :class:`kvspec.IncompatiblePeerError`
    naming each cache. A side without declarations (a 1.2 peer) means its
    groups are the whole set: HS-1's group comparison is all there is.
    """
    for role, side in (("producer", producer), ("consumer", consumer)):
        if side.caches is None:
            continue
        problems = get_cache_problems(side.caches, _group_keys(side))
        if problems:
            listed = "; ".join(f"{where}: {what}" for where, what in problems.items())
            raise CacheAccountingError(f"{role}: every cache is exchanged or declared ephemeral (CACHE-1): {listed}")
    if producer.caches is None or consumer.caches is None:
        return
    diffs = get_cache_differences({c.name: c for c in producer.caches}, {c.name: c for c in consumer.caches})
    if diffs:
        raise IncompatiblePeerError(diffs)
