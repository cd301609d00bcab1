"""Every cache accounted for: each cache a model keeps is exchanged or declared ephemeral (CACHE-1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

from kvspec.core._errors import CacheAccountingError
from kvspec.core._models import CacheDeclaration, KVCacheConfig

__all__ = [
    "CACHE_KINDS",
    "EXCHANGED_KINDS",
    "SCRATCH_KINDS",
    "GroupKey",
    "check_cache_accounting",
    "get_cache_differences",
    "get_cache_disposition",
    "get_cache_problems",
    "get_declared_caches",
    "get_group_keys",
    "may_be_ephemeral",
]

EXCHANGED_KINDS: tuple[str, ...] = (
    "full_attention",
    "mla",
    "sliding_window",
    "sliding_window_mla",
    "chunked_local",
    "indexer",
    "mamba",
)
"""The kinds that may be exchanged: a rule places their blocks (the window rules, the state rules) (CACHE-1)."""

SCRATCH_KINDS: tuple[str, ...] = ("circular_buffer",)
"""Scratch kinds (vLLM's ``CircularBufferSpec``, not prefix-cacheable): no rule places them, so never exchanged."""

CACHE_KINDS: tuple[str, ...] = EXCHANGED_KINDS + SCRATCH_KINDS
"""Every cache kind a declaration may name; any other is refused by name (CACHE-1)."""

EXCHANGED = "exchanged"
"""The disposition of a cache the exchanged groups hold whole, as its kind (CACHE-1)."""

EPHEMERAL = "ephemeral"
"""The disposition of a cache declared ephemeral that may be: draft or scratch, not exchanged (CACHE-1)."""

GroupKey: TypeAlias = tuple[str, tuple[str, ...]]
"""One exchanged group as CACHE-1 sees it: its kind's name and its layer names."""


def get_group_keys(config: KVCacheConfig) -> tuple[GroupKey, ...]:
    """Each exchanged group of ``config`` as (kind, layer names) (CACHE-1)."""
    return tuple((group.kv_cache_spec.kind.value, group.layer_names) for group in config.kv_cache_groups)


def get_declared_caches(config: KVCacheConfig) -> tuple[CacheDeclaration, ...]:
    """The caches ``config`` declares; none declared means its groups, each exchanged (protocol 1.2) (CACHE-1)."""
    if config.caches:
        return config.caches
    return tuple(
        CacheDeclaration(name=f"group {g}", kind=kind, layer_names=layers)
        for g, (kind, layers) in enumerate(get_group_keys(config))
    )


def may_be_ephemeral(cache: CacheDeclaration) -> bool:
    """True for a draft model's cache and for scratch: the consumer can rebuild them itself (CACHE-1)."""
    # A target model's cache (attention, MLA, indexer, state) is read by the consumer's next token as it stands.
    return cache.draft or cache.kind in SCRATCH_KINDS


def _describe(cache: CacheDeclaration) -> str:
    draft = ", draft" if cache.draft else ""
    return f"cache {cache.name!r} (kind {cache.kind}{draft}, {len(cache.layer_names)} layers)"


def get_cache_disposition(cache: CacheDeclaration, groups: Sequence[GroupKey]) -> str:
    """``"exchanged"``, ``"ephemeral"``, or what is wrong with one declared cache (CACHE-1)."""
    # A kind no rule knows fails closed, by name, with the kinds that are known (CACHE-1).
    if cache.kind not in CACHE_KINDS:
        return f"kind: expected one of {list(CACHE_KINDS)}, got {cache.kind!r}"
    held = {name: kind for kind, layers in groups for name in layers}
    missing = [name for name in cache.layer_names if name not in held]
    if len(missing) == len(cache.layer_names):
        if not cache.ephemeral:
            return "neither exchanged nor declared ephemeral"
        # The consumer reads a target cache as it stands; nobody rebuilds it (ATOM #1368) (CACHE-1).
        if not may_be_ephemeral(cache):
            return f"declared ephemeral, but only draft and scratch ({list(SCRATCH_KINDS)}) caches may be"
        return EPHEMERAL
    if cache.ephemeral:
        return "declared ephemeral, yet exchanged"
    # Part of a cache left behind is as silent as all of it (CACHE-1).
    if missing:
        return f"layers {missing} are not exchanged"
    kinds = sorted({held[name] for name in cache.layer_names})
    if kinds != [cache.kind]:
        return f"exchanged as kind {kinds}, declared {cache.kind!r}"
    return EXCHANGED


def get_cache_problems(caches: Sequence[CacheDeclaration], groups: Sequence[GroupKey]) -> dict[str, str]:
    """Every declared cache that is not exchanged or ephemeral, and every group no cache declares (CACHE-1)."""
    problems: dict[str, str] = {}
    for i, cache in enumerate(caches):
        disposition = get_cache_disposition(cache, groups)
        if disposition not in (EXCHANGED, EPHEMERAL):
            problems[f"caches[{i}] {_describe(cache)}"] = disposition
    declared = {name for cache in caches for name in cache.layer_names}
    for g, (kind, layers) in enumerate(groups):
        # A group that no declaration holds means the declaration is not the model's whole set (CACHE-1).
        if not set(layers) <= declared:
            problems[f"groups[{g}] (kind {kind})"] = "exchanged, but no declared cache holds it"
    return problems


def check_cache_accounting(config: KVCacheConfig) -> None:
    """Raise :class:`CacheAccountingError` unless every cache is exchanged or declared ephemeral (CACHE-1)."""
    problems = get_cache_problems(get_declared_caches(config), get_group_keys(config))
    if problems:
        listed = "; ".join(f"{where}: {what}" for where, what in problems.items())
        raise CacheAccountingError(f"every cache is exchanged or declared ephemeral (CACHE-1): {listed}")


def get_cache_differences(
    producer: Mapping[str, CacheDeclaration], consumer: Mapping[str, CacheDeclaration]
) -> dict[str, tuple[object, object]]:
    """Per cache name, each field the two sides declare differently, or a cache one side lacks (CACHE-1)."""
    diffs: dict[str, tuple[object, object]] = {}
    for name in sorted(producer.keys() | consumer.keys()):
        p, c = producer.get(name), consumer.get(name)
        if p is None or c is None:
            # One side keeps a cache the other does not know of: its bytes would have nowhere to go (CACHE-1).
            diffs[f"caches[{name!r}]"] = ("declared" if p else "absent", "declared" if c else "absent")
            continue
        for field in ("kind", "layer_names", "draft", "ephemeral"):
            if getattr(p, field) != getattr(c, field):
                diffs[f"caches[{name!r}].{field}"] = (getattr(p, field), getattr(c, field))
    return diffs
