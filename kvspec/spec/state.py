"""State groups (Mamba, GDN, KDA): where a state stands, which slot travels, how slots pair: STATE-1 .. STATE-5.

A state group holds one recurrent state per request, in one slot (a page of
the group's state tensors), not one block per ``block_size`` tokens. So the
attention rules (WIN-1, CLIP-1, ALIGN-1) do not place it: exactly one slot
travels per state group, and the transfer says how many tokens that state has
absorbed (docs/spec/state-groups.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvspec.core._errors import BlockAlignmentError, ConfigError, GroupCountError, StatePositionError, StateSlotError
from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig, KVCacheSpec, MambaSpec, StateProfile

if TYPE_CHECKING:
    from kvspec.spec.coverage import BlockLists  # coverage imports this module

__all__ = [
    "STATE_FIELDS",
    "STATE_KINDS",
    "check_state_position",
    "check_state_prefix_hit",
    "get_scratch_slot_count",
    "get_state_clipped_blocks",
    "get_state_clipped_slots",
    "get_state_differences",
    "get_state_group_indices",
    "get_state_paired_lists",
    "get_state_prefix_hit",
    "is_state_spec",
    "pair_state_slots",
]

STATE_KINDS: frozenset[str] = frozenset({"mamba1", "mamba2", "gdn", "gdn_attn", "gdn_attention", "kda"})
"""``MambaSpec.mamba_type`` values the exchange admits (ADM-1): Mamba-1, Mamba-2, Gated DeltaNet, KDA.

vLLM 0.33 names GDN ``GDN_ATTN`` (``MambaAttentionBackendEnum``); the other spellings are the same kind.
"""

STATE_FIELDS: tuple[str, ...] = ("shapes", "dtypes", "mamba_type", "conv_layout", "page_size_bytes")
"""Per state group, what both peers must agree on (STATE-5)."""


def is_state_spec(spec: KVCacheSpec) -> bool:
    """True for a state group: one state per request, not one block per ``block_size`` tokens (STATE-2)."""
    return isinstance(spec, MambaSpec)


def get_scratch_slot_count(spec: KVCacheSpec) -> int:
    """Speculative scratch slots at the tail of a state group's list; 0 for any other group (STATE-2)."""
    return spec.num_speculative_blocks if isinstance(spec, MambaSpec) else 0


def get_state_group_indices(config: KVCacheConfig) -> tuple[int, ...]:
    """The indices of the config's state groups, in order (STATE-2)."""
    return tuple(g for g, group in enumerate(config.kv_cache_groups) if is_state_spec(group.kv_cache_spec))


# --------------------------------------------------------------------------- STATE-1


def check_state_position(
    config: KVCacheConfig,
    *,
    state_tokens: int | None,
    num_tokens: int,
    recomputed_tokens: int = 0,
    profile: StateProfile | str = StateProfile.RECOMPUTE,
) -> None:
    """Raise :class:`StatePositionError` unless the state stands where the consumer resumes (STATE-1).

    The consumer resumes at ``T = num_tokens``: it takes the KV of the first T
    tokens and the state that absorbed exactly them, ``t = state_tokens``. So
    ``t`` must equal ``T``: a state past T would have the recomputed tokens
    applied twice, one before T would miss tokens. ``None`` (a protocol 1.1
    producer, which never says) is refused when the config has state groups.
    Under the ``prebuilt`` profile the consumer recomputes nothing, so
    ``recomputed_tokens`` must be 0. A config without state groups has no
    state to place: nothing is checked (STATE-1).
    """
    if not get_state_group_indices(config):
        return
    try:
        chosen = StateProfile(profile)
    except ValueError:
        raise ConfigError(f"profile: expected one of {[p.value for p in StateProfile]}, got {profile!r}") from None
    if state_tokens is None:
        raise StatePositionError(
            "kvspec_state_tokens: missing, but the config has state groups; the producer must say how many tokens "
            f"the state absorbed (protocol 1.2; a 1.1 peer cannot carry state) (STATE-1); num_tokens={num_tokens}"
        )
    # The prebuilt state already holds every prompt token: recomputing any would apply it twice (STATE-1).
    if chosen is StateProfile.PREBUILT and recomputed_tokens != 0:
        raise StatePositionError(
            f"recomputed_tokens: expected 0 under the prebuilt state profile, got {recomputed_tokens} (STATE-1)"
        )
    if state_tokens != num_tokens:
        raise StatePositionError(
            f"state_tokens: the state absorbed t={state_tokens} tokens but the consumer resumes at "
            f"T=num_tokens={num_tokens}; expected t == T (STATE-1)"
        )


# --------------------------------------------------------------------------- STATE-2


def get_state_clipped_slots(spec: MambaSpec, slots: Sequence[int], *, group: int = 0) -> tuple[int, ...]:
    """Drop the trailing scratch slots, then keep the last slot: one slot, or none from an empty list (STATE-2).

    ``min(num_speculative_blocks, len - 1)`` trailing slots are speculative
    scratch and never travel; of the rest only the last holds the state, and
    the null ids before it are placeholders. A kept slot that is null is a
    missing state: :class:`StateSlotError` (STATE-2).
    """
    scratch = min(spec.num_speculative_blocks, max(len(slots) - 1, 0))
    kept = tuple(slots[: len(slots) - scratch][-1:])
    # The one slot that travels is the state itself; a null there is a missing state, never skipped (STATE-2).
    if kept == (NULL_BLOCK_ID,):
        raise StateSlotError(
            f"group {group} ({spec.mamba_type}): the state slot kept after dropping {scratch} scratch slots "
            f"is the null block; expected a real slot holding the state (STATE-2)"
        )
    return kept


def get_state_clipped_blocks(config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
    """Clip every state group to its one state slot; other groups unchanged; zero groups stay zero (STATE-2)."""
    if len(block_ids) == 0:
        return block_ids  # a full prefix hit: nothing to exchange (STATE-4)
    # One list per group, or a state group would be clipped by another's spec (STATE-2).
    if len(block_ids) != config.num_groups:
        raise GroupCountError(f"block ids have {len(block_ids)} groups, the config {config.num_groups} (STATE-2)")
    clipped: list[tuple[int, ...]] = []
    for g, (group, ids) in enumerate(zip(config.kv_cache_groups, block_ids, strict=True)):
        spec = group.kv_cache_spec
        clipped.append(get_state_clipped_slots(spec, ids, group=g) if isinstance(spec, MambaSpec) else ids)
    return BlockIds(clipped)


# --------------------------------------------------------------------------- STATE-3


def pair_state_slots(
    producer_slots: Sequence[int], consumer_slots: Sequence[int], *, group: int = 0
) -> tuple[int, int]:
    """The producer's slot and the consumer's slot that receives it, from lists without scratch (STATE-3).

    The producer's last slot holds the state (a longer producer list is a
    consumer prefix hit: its tail). The consumer's list may be longer by at
    most 1 (it also lists the slot of the token it recomputes): it is
    head-trimmed and its last slot receives. Longer by more, an empty list or
    a null slot is refused with :class:`StateSlotError` (STATE-3).
    """
    for role, slots in (("producer", producer_slots), ("consumer", consumer_slots)):
        # A state is needed (this request transfers), so a side without a slot has lost it (STATE-3).
        if not slots:
            raise StateSlotError(f"group {group}: the {role} lists no state slot; expected exactly one (STATE-3)")
    if len(consumer_slots) > len(producer_slots) + 1:
        raise StateSlotError(
            f"group {group}: the consumer lists {len(consumer_slots)} state slots, the producer "
            f"{len(producer_slots)}; the consumer may list at most one more (STATE-3)"
        )
    producer_slot, consumer_slot = producer_slots[-1], consumer_slots[-1]
    for role, slot in (("producer", producer_slot), ("consumer", consumer_slot)):
        # The last slot is the state; a null there would move nothing and leave the consumer's state stale.
        if slot == NULL_BLOCK_ID:
            raise StateSlotError(f"group {group}: the {role}'s state slot is the null block (STATE-3)")
    return producer_slot, consumer_slot


def get_state_paired_lists(config: KVCacheConfig, lists: BlockLists) -> BlockLists:
    """Both lists with every state group reduced to its one pair, and its ends to 1 (STATE-3).

    What follows (ALIGN-1's tail pairing) then pairs the state slots as one
    pair and checks the other groups as before: a state slot has no logical
    block position, so its list "ends" at the one slot on both sides.
    Zero consumer groups (nothing to transfer) pass through (STATE-3, STATE-4).
    """
    producer, consumer = lists.producer_block_ids, lists.consumer_block_ids
    states = get_state_group_indices(config)
    if not states or len(consumer) == 0:
        return lists
    for role, ids in (("producer", producer), ("consumer", consumer)):
        if len(ids) != config.num_groups:
            raise GroupCountError(f"{role} block ids have {len(ids)} groups, the config {config.num_groups} (STATE-3)")
    p_groups, c_groups = list(producer.groups), list(consumer.groups)
    p_ends = None if lists.producer_block_ends is None else list(lists.producer_block_ends)
    c_ends = None if lists.consumer_block_ends is None else list(lists.consumer_block_ends)
    for g in states:
        spec = config.kv_cache_groups[g].kv_cache_spec
        assert isinstance(spec, MambaSpec)
        # Scratch slots never travel, whichever side forgot to clip them (STATE-2).
        p_slots = _without_scratch(spec, p_groups[g])
        c_slots = _without_scratch(spec, c_groups[g])
        p_slot, c_slot = pair_state_slots(p_slots, c_slots, group=g)
        p_groups[g], c_groups[g] = (p_slot,), (c_slot,)
        if p_ends is not None:
            p_ends[g] = 1
        if c_ends is not None:
            c_ends[g] = 1
    return attrs.evolve(
        lists,
        producer_block_ids=BlockIds(p_groups),
        consumer_block_ids=BlockIds(c_groups),
        producer_block_ends=p_ends,
        consumer_block_ends=c_ends,
    )


def _without_scratch(spec: MambaSpec, slots: Sequence[int]) -> tuple[int, ...]:
    scratch = min(spec.num_speculative_blocks, max(len(slots) - 1, 0))
    return tuple(slots[: len(slots) - scratch])


# --------------------------------------------------------------------------- STATE-4


def check_state_prefix_hit(config: KVCacheConfig, *, prefix_hit_tokens: int) -> None:
    """Raise :class:`BlockAlignmentError` unless every state group holds a state for the hit (STATE-4).

    In ``align`` cache mode slot ``p`` holds the state after ``(p + 1) * B``
    tokens, so a hit ``H`` must end on a state boundary, ``H % B == 0``. In
    ``none`` mode no state is cached for a prefix: only ``H == 0`` (STATE-4).
    """
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        if spec.cache_mode == "none" and prefix_hit_tokens != 0:
            raise BlockAlignmentError(
                f"prefix_hit_tokens={prefix_hit_tokens}: group {g} ({spec.mamba_type}) is in cache mode 'none' and "
                "caches no state for a prefix; expected 0 (STATE-4)"
            )
        if spec.cache_mode == "align" and prefix_hit_tokens % spec.block_size:
            raise BlockAlignmentError(
                f"prefix_hit_tokens={prefix_hit_tokens} does not end on a state boundary of group {g} "
                f"({spec.mamba_type}, block size {spec.block_size}); expected a multiple of {spec.block_size} (STATE-4)"
            )


def get_state_prefix_hit(config: KVCacheConfig, group_hits: Sequence[int]) -> int:
    """One hit for the request from per-group hits: their minimum, down to a boundary of every group (STATE-4).

    Each group can serve at most its own hit; the request resumes where every
    group can, which is the minimum rounded down to a multiple of every
    group's block size (the state boundaries among them, STATE-4; WIN-1).
    """
    if len(group_hits) != config.num_groups:
        raise GroupCountError(f"group_hits has {len(group_hits)} entries, the config {config.num_groups} (STATE-4)")
    for g, hit in enumerate(group_hits):
        if not isinstance(hit, int) or isinstance(hit, bool) or hit < 0:
            raise ConfigError(f"group_hits[{g}]: expected a non-negative int, got {hit!r}")
    step = math.lcm(*(group.kv_cache_spec.block_size for group in config.kv_cache_groups))
    return min(group_hits) // step * step


# --------------------------------------------------------------------------- STATE-5


def get_state_differences(producer: MambaSpec, consumer: MambaSpec) -> dict[str, tuple[object, object]]:
    """Every STATE-5 field on which two state groups differ, with ``(producer, consumer)`` values (STATE-5).

    The slot moves as bytes, so both sides must lay the state out alike:
    tensor shapes and dtypes, the kind, the conv layout and the padded page.
    Cache mode and scratch slots are each side's own business (STATE-5).
    """
    differences: dict[str, tuple[object, object]] = {}
    for name in STATE_FIELDS:
        p, c = getattr(producer, name), getattr(consumer, name)
        if name == "dtypes":
            p, c = tuple(d.name for d in p), tuple(d.name for d in c)
        if p != c:
            differences[name] = (p, c)
    return differences
