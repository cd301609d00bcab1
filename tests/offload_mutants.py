"""Offload mutants: connectors with one offload bug class each, and a backend that copies into the wrong row.

Each connector mutant is kvspec's reference connector with one offload hook
replaced (the seam :class:`kvspec_conformance.OffloadConnector`); the suite's
offload cases must fail it on the rule it breaks, through the oracle, never
by the mutant's own error. ``caught_by`` names the cases that must fail.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from kvspec_conformance import ReferenceConnector, ReferenceOffloadConnector
from mutants import MutantBackend, _Agent

from kvspec import (
    KVCacheConfig,
    LoadSet,
    MambaSpec,
    OffloadConfig,
    SlidingWindowSpec,
    StoreSet,
    TransferMode,
    get_blocks_per_sw,
)
from kvspec.reference._offload import BlockIdGroups, get_load_set, get_offload_hit_tokens, get_store_set
from kvspec.spec.offload import _trusted
from kvspec.transport import Descriptor, TransferHandle

__all__ = ["OFFLOAD_BACKEND_MUTANTS", "OFFLOAD_CONNECTOR_MUTANTS", "OffloadMutant"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class OffloadMutant(ReferenceConnector, ReferenceOffloadConnector):
    """The reference exchange and offload logic; each mutant overrides one offload hook."""

    breaks: str = ""
    caught_by: tuple[str, ...] = ()


class NullCountStore(OffloadMutant):
    """#42945: the store's per-group count is f per offered chunk, nulls included (an unchecked StoreSet)."""

    breaks = "OFF-3"
    caught_by = ("OFF-3/chunk-straddling-window-edge",)

    def get_store_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_offloadable_tokens: int,
        next_chunk: Sequence[int],
        offload: OffloadConfig,
    ) -> StoreSet:
        right = get_store_set(
            config, block_ids, num_offloadable_tokens=num_offloadable_tokens, next_chunk=next_chunk, offload=offload
        )
        f = offload.blocks_per_chunk
        counts = tuple((stop - first) * f for first, stop in right.chunk_ranges)
        return _trusted(
            StoreSet,
            blocks_per_chunk=f,
            chunk_ranges=right.chunk_ranges,
            block_ids=right.block_ids,
            first_block_indices=right.first_block_indices,
            num_blocks=counts,
            next_chunks=right.next_chunks,
        )


class StorePastEnd(OffloadMutant):
    """Offers the request's last, incomplete chunk too (cdiv instead of floor): its tokens were never all computed."""

    breaks = "OFF-3"
    caught_by = ("OFF-3/store-deferred-past-request-end",)

    def get_store_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_offloadable_tokens: int,
        next_chunk: Sequence[int],
        offload: OffloadConfig,
    ) -> StoreSet:
        groups = block_ids.groups if hasattr(block_ids, "groups") else block_ids
        f = offload.blocks_per_chunk
        size = config.kv_cache_groups[0].kv_cache_spec.block_size * f
        rounded = _cdiv(num_offloadable_tokens, size) * size
        sizes = [group.kv_cache_spec.block_size * f for group in config.kv_cache_groups]
        if any(len(ids) < rounded // s * f for ids, s in zip(groups, sizes, strict=True)):
            rounded = num_offloadable_tokens  # no block for the tail chunk yet: nothing to store past the end
        return get_store_set(config, block_ids, num_offloadable_tokens=rounded, next_chunk=next_chunk, offload=offload)


class ClipsWindowStores(OffloadMutant):
    """Clips each window group's list to its exchange budget (CLIP-1) before storing, as if offload were an exchange."""

    breaks = "OFF-3"
    caught_by = ("OFF-3/window-chunks-all-stored",)

    def get_store_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_offloadable_tokens: int,
        next_chunk: Sequence[int],
        offload: OffloadConfig,
    ) -> StoreSet:
        groups = [list(ids) for ids in (block_ids.groups if hasattr(block_ids, "groups") else block_ids)]
        for ids, budget in zip(groups, get_blocks_per_sw(config), strict=True):
            if budget and len(ids) > budget:
                ids[: len(ids) - budget] = [0] * (len(ids) - budget)
        return get_store_set(
            config, groups, num_offloadable_tokens=num_offloadable_tokens, next_chunk=next_chunk, offload=offload
        )


class StaleTableAfterPreemption(OffloadMutant):
    """#42761 class: keeps each request's first block table and ignores finish_request, so a preempted
    request's later stores read blocks it no longer holds at those positions (stale KV offloaded)."""

    breaks = "OFF-3"
    caught_by = ("OFF-3/preempted-mid-store",)

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def get_store_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_offloadable_tokens: int,
        next_chunk: Sequence[int],
        offload: OffloadConfig,
    ) -> StoreSet:
        groups = [list(ids) for ids in (block_ids.groups if hasattr(block_ids, "groups") else block_ids)]
        kept = self.tables.setdefault(request_id, groups)
        for old, new in zip(kept, groups, strict=True):
            old += new[len(old) :]  # new positions are appended; known positions keep their first id
        return get_store_set(
            config, kept, num_offloadable_tokens=num_offloadable_tokens, next_chunk=next_chunk, offload=offload
        )

    def finish_request(self, request_id: str) -> None:
        """Forgets nothing: the bug."""


class WindowLoadShort(OffloadMutant):
    """#48959: a window group loads at most cdiv(W, C_g) * f blocks, one short when W starts inside a block."""

    breaks = "OFF-6"
    caught_by = ("OFF-6/window-start-off-block-boundary",)

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        right = get_load_set(
            config, block_ids, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )
        return _clamp_windows(
            config, right, offload, lambda window, size: _cdiv(window, size) * offload.blocks_per_chunk
        )


class WindowLoadLong(OffloadMutant):
    """A window group loads one block more than it needs, before L, into a block nothing reads (OFF-6)."""

    breaks = "OFF-6"
    caught_by = ("OFF-6/blocks-before-the-window-left-alone",)

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        right = get_load_set(
            config, block_ids, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )
        groups = block_ids.groups if hasattr(block_ids, "groups") else block_ids
        f = offload.blocks_per_chunk
        firsts, ids, ranges = [], [], []
        for g, group in enumerate(config.kv_cache_groups):
            first, dest = right.first_block_indices[g], right.block_ids[g]
            window = isinstance(group.kv_cache_spec, SlidingWindowSpec)
            if window and dest and first > local_hit_tokens // group.kv_cache_spec.block_size and groups[g][first - 1]:
                first, dest = first - 1, (groups[g][first - 1], *dest)
            firsts.append(first)
            ids.append(dest)
            ranges.append((first // f, right.chunk_ranges[g][1]) if dest else (0, 0))
        return _trusted(
            LoadSet,
            blocks_per_chunk=f,
            chunk_ranges=tuple(ranges),
            block_ids=tuple(ids),
            first_block_indices=tuple(firsts),
            num_blocks=tuple(len(d) for d in ids),
        )


def _clamp_windows(config: KVCacheConfig, load: LoadSet, offload: OffloadConfig, bound: object) -> LoadSet:
    f = offload.blocks_per_chunk
    firsts, ids, ranges = [], [], []
    for g, group in enumerate(config.kv_cache_groups):
        first, dest = load.first_block_indices[g], load.block_ids[g]
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec) and dest:
            most = bound(spec.sliding_window, spec.block_size * f)  # type: ignore[operator]
            if len(dest) > most:
                first, dest = first + len(dest) - most, dest[len(dest) - most :]
        firsts.append(first)
        ids.append(dest)
        ranges.append((first // f, load.chunk_ranges[g][1]) if dest else (0, 0))
    return _trusted(
        LoadSet,
        blocks_per_chunk=f,
        chunk_ranges=tuple(ranges),
        block_ids=tuple(ids),
        first_block_indices=tuple(firsts),
        num_blocks=tuple(len(d) for d in ids),
    )


class NegativeResidue(OffloadMutant):
    """#41445's test helper: the sub-block skip is (-first) % f instead of first % f."""

    breaks = "OFF-7"
    caught_by = ("OFF-7/loads-at-every-residue",)

    def map_sub_blocks(
        self, first_block_index: int, num_blocks: int, *, blocks_per_chunk: int
    ) -> tuple[tuple[int, int], ...]:
        skip = (-first_block_index) % blocks_per_chunk
        return tuple(divmod(skip + i, blocks_per_chunk) for i in range(num_blocks))


class HitIgnoresEvictedWindowChunk(OffloadMutant):
    """The hit counts a window group's evicted chunks as present (it checks the full-attention prefix only)."""

    breaks = "OFF-5"
    caught_by = ("OFF-5/evicted-window-chunk",)

    def get_offload_hit_tokens(
        self,
        config: KVCacheConfig,
        present: Sequence[Sequence[bool]],
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> int:
        assumed = [
            [True] * len(keys) if isinstance(group.kv_cache_spec, SlidingWindowSpec) else list(keys)
            for keys, group in zip(present, config.kv_cache_groups, strict=True)
        ]
        return get_offload_hit_tokens(
            config, assumed, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )


class StateHitOffTheGrid(OffloadMutant):
    """vLLM before #44599: the state hit ends at N - 1 off the state's chunk grid, restoring a state past T."""

    breaks = "OFF-5"
    caught_by = ("OFF-5/state-hit-ends-on-a-state-chunk",)

    def get_offload_hit_tokens(
        self,
        config: KVCacheConfig,
        present: Sequence[Sequence[bool]],
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> int:
        right = get_offload_hit_tokens(
            config, present, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )
        # A state group as a window of one chunk: the chunk holding token N - 2 is enough; no rounding down.
        end = num_tokens - 1
        sizes = [group.kv_cache_spec.block_size * offload.blocks_per_chunk for group in config.kv_cache_groups]
        if end - local_hit_tokens >= max(sizes) and all(
            all(keys[: _cdiv(end, size)]) and len(keys) >= _cdiv(end, size)
            if not isinstance(group.kv_cache_spec, MambaSpec)
            else len(keys) > (end - 1) // size and keys[(end - 1) // size]
            for keys, size, group in zip(present, sizes, config.kv_cache_groups, strict=True)
        ):
            return end - local_hit_tokens
        return right


class StateLoadPastT(OffloadMutant):
    """vLLM #51094: the load restores the state chunk after T, which already absorbed tokens the engine recomputes."""

    breaks = "OFF-6"
    caught_by = ("OFF-6/state-slot-restored-at-the-resume-point",)

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        right = get_load_set(
            config, block_ids, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )
        ranges, states = list(right.chunk_ranges), list(right.state_tokens)
        for g, group in enumerate(config.kv_cache_groups):
            if isinstance(group.kv_cache_spec, MambaSpec) and right.block_ids[g]:
                first, stop = ranges[g]
                ranges[g] = (first + 1, stop + 1)  # the next state chunk: the state after T + C_g tokens
                states[g] = num_tokens + group.kv_cache_spec.block_size * offload.blocks_per_chunk
        return attrs.evolve(right, chunk_ranges=ranges, state_tokens=states)


def _state_groups(config: KVCacheConfig) -> list[int]:
    return [g for g, group in enumerate(config.kv_cache_groups) if isinstance(group.kv_cache_spec, MambaSpec)]


class StateHitFromFirstStateGroup(OffloadMutant):
    """Reads every state group's presence from the first state group's keys: a later group's eviction is unseen."""

    breaks = "OFF-5"
    caught_by = ("OFF-5/several-state-groups-hit-every-group",)

    def get_offload_hit_tokens(
        self,
        config: KVCacheConfig,
        present: Sequence[Sequence[bool]],
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> int:
        states = _state_groups(config)
        assumed = [list(present[states[0]]) if g in states else list(keys) for g, keys in enumerate(present)]
        return get_offload_hit_tokens(
            config, assumed, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )


class StateLoadFirstStateGroupOnly(OffloadMutant):
    """Restores the first state group's slot only; the later state groups keep a stale state, said to be at T."""

    breaks = "OFF-6"
    caught_by = ("OFF-6/several-state-groups-restored",)

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        right = get_load_set(
            config, block_ids, num_tokens=num_tokens, local_hit_tokens=local_hit_tokens, offload=offload
        )
        later = _state_groups(config)[1:]
        ranges = [(0, 0) if g in later else r for g, r in enumerate(right.chunk_ranges)]
        ids = [() if g in later else d for g, d in enumerate(right.block_ids)]
        return attrs.evolve(right, chunk_ranges=ranges, block_ids=ids, num_blocks=[len(d) for d in ids])


class StateAdmittedWithoutPrefixCaching(OffloadMutant):
    """Admits a state group in ``none`` cache mode, where no state is kept at a chunk end: no hit, nothing loaded."""

    breaks = "OFF-9"
    caught_by = ("OFF-9/state-group-without-prefix-caching-refused",)

    def get_offload_hit_tokens(
        self,
        config: KVCacheConfig,
        present: Sequence[Sequence[bool]],
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> int:
        return 0

    def get_load_set(
        self,
        config: KVCacheConfig,
        block_ids: BlockIdGroups,
        *,
        request_id: str,
        num_tokens: int,
        local_hit_tokens: int,
        offload: OffloadConfig,
    ) -> LoadSet:
        empty = tuple(() for _ in config.kv_cache_groups)
        zeros = tuple(0 for _ in config.kv_cache_groups)
        return LoadSet(
            blocks_per_chunk=offload.blocks_per_chunk,
            chunk_ranges=tuple((0, 0) for _ in config.kv_cache_groups),
            block_ids=empty,
            first_block_indices=zeros,
            num_blocks=zeros,
        )


class _WrongRowAgent(_Agent):
    """Copies each page one page past where the descriptor says, on the chunk side: the next sub-block or row."""

    def post(
        self, mode: TransferMode, descriptors: Sequence[Descriptor], *, peer: str, notification: bytes | None = None
    ) -> TransferHandle:
        if self.name == "gpu" and mode is TransferMode.WRITE:
            descriptors = [
                Descriptor(
                    local_region=d.local_region,
                    local_offset=d.local_offset,
                    remote_region=d.remote_region,
                    remote_offset=d.remote_offset + d.nbytes if d.remote_offset >= d.nbytes else d.remote_offset,
                    nbytes=d.nbytes,
                )
                for d in descriptors
            ]
        return self.inner.post(mode, descriptors, peer=peer, notification=notification)


class WrongChunkRow(MutantBackend):
    """A backend whose offload stores land one page off in the chunk pool."""

    agent_class = _WrongRowAgent
    breaks = "OFF-3"
    caught_by = ("OFF-3/two-groups-full-and-window", "OFF-7/loads-at-every-residue")


OFFLOAD_CONNECTOR_MUTANTS: tuple[type[OffloadMutant], ...] = (
    NullCountStore,
    ClipsWindowStores,
    StorePastEnd,
    StaleTableAfterPreemption,
    WindowLoadShort,
    WindowLoadLong,
    NegativeResidue,
    HitIgnoresEvictedWindowChunk,
    StateHitOffTheGrid,
    StateLoadPastT,
    StateAdmittedWithoutPrefixCaching,
    StateHitFromFirstStateGroup,
    StateLoadFirstStateGroupOnly,
)
OFFLOAD_BACKEND_MUTANTS: tuple[type[MutantBackend], ...] = (WrongChunkRow,)
