"""The offload scenarios' oracle: images of both pools, what their pages must hold, and checks of the hooks' answers.

Independent of the hooks under test and of the offload engine: after every
copy it compares both pools, byte for byte, with images it keeps itself,
naming each page it finds by what it is (a computed page, a partial page,
fresh noise, unwritten chunk-pool bytes). The expectations come from kvspec's
plain definitions (:mod:`kvspec.spec.offload`) and token arithmetic (OFF-6).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from kvspec import (
    NULL_BLOCK_ID,
    KVCacheConfig,
    KVSpecError,
    LoadSet,
    MambaSpec,
    OffloadConfig,
    SlidingWindowSpec,
    StoreSet,
)
from kvspec.connector import OffloadConnector
from kvspec.exchange import StorePlan
from kvspec.spec.offload import get_offload_hit_tokens
from kvspec.testing import PagePool, expected_page

__all__ = [
    "Finding",
    "PoolOracle",
    "call_hook",
    "check_hit",
    "check_offered",
    "check_state_tokens",
    "check_store_set",
    "check_transfer",
    "expected_load_positions",
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_of(config: KVCacheConfig, g: int) -> int | None:
    spec = config.kv_cache_groups[g].kv_cache_spec
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def is_state_group(config: KVCacheConfig, g: int) -> bool:
    # An align-mode state group: position p holds the state after (p + 1) * B tokens (OFF-9, STATE-4).
    return isinstance(config.kv_cache_groups[g].kv_cache_spec, MambaSpec)


def expected_load_positions(config: KVCacheConfig, *, num_tokens: int, local_hit_tokens: int) -> list[range]:
    """Per group, the GPU positions a load restores: ``[L, G)`` from token arithmetic (OFF-6).

    ``G = cdiv(T, B)``; the first needed token is ``C`` (full attention) or
    ``max(C, T - W + 1)`` (a window), and none when it is ``T`` or later; a
    state group restores the one slot at ``T / B - 1`` when ``T > C``.
    """
    ranges = []
    for g, group in enumerate(config.kv_cache_groups):
        block, window = group.kv_cache_spec.block_size, window_of(config, g)
        stop = cdiv(num_tokens, block)
        if is_state_group(config, g):
            ranges.append(range(stop - 1, stop) if num_tokens > local_hit_tokens else range(stop, stop))
            continue
        first = local_hit_tokens if window is None else max(local_hit_tokens, num_tokens - window + 1)
        ranges.append(range(stop, stop) if first >= num_tokens else range(first // block, stop))
    return ranges


def _digest(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class Finding(Exception):
    """The oracle found a problem; the scenario stops at the first batch."""


class _Image:
    """What one pool must hold, kept by the suite: its own writes and the copies the rules expect."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.regions = [bytearray(region.buffer) for region in pool.regions]

    def write(self, region: int, offset: int, data: bytes) -> None:
        """A write by the suite itself: to the pool and its image."""
        self.pool.regions[region].buffer[offset : offset + len(data)] = data
        self.regions[region][offset : offset + len(data)] = data

    def expect(self, region: int, offset: int, data: bytes) -> bytes:
        """A copy the rules call for: only the image changes; returns what it held before."""
        old = bytes(self.regions[region][offset : offset + len(data)])
        self.regions[region][offset : offset + len(data)] = data
        return old

    def changed_regions(self) -> list[int]:
        return [
            i
            for i, (region, image) in enumerate(zip(self.pool.regions, self.regions, strict=True))
            if region.buffer != image
        ]


class PoolOracle:
    """Images of the GPU pool and the chunk pool, the pages they must hold, and their comparison (OFF-6, OFF-7)."""

    def __init__(self, config: KVCacheConfig, chunk_config: KVCacheConfig, f: int, gpu: PagePool, chunks: PagePool):
        self.config, self.chunk_config, self.f = config, chunk_config, f
        self.gpu, self.chunks = _Image(gpu), _Image(chunks)
        self.labels: dict[bytes, str] = {}
        self.in_flight_pages: dict[tuple[int, int], int] = {}  # chunk-pool pages a pending store may be writing
        self.scrubs = 0
        self._label_background()

    def final_page(self, stream: str, g: int, layer: int, position: int) -> bytes:
        page = expected_page(self.config, group=g, layer_index=layer, position=position, salt=stream)
        self.labels.setdefault(
            _digest(page), f"the page of stream {stream!r}, group {g}, layer {layer}, position {position}"
        )
        return page

    def partial_page(self, stream: str, g: int, layer: int, position: int, tokens: int) -> bytes:
        page = expected_page(
            self.config, group=g, layer_index=layer, position=position, salt=f"{stream}~partial{tokens}"
        )
        self.labels.setdefault(
            _digest(page),
            f"the partial page of stream {stream!r}, group {g}, layer {layer}, position {position} "
            f"(only {tokens} tokens computed: the block was not complete)",
        )
        return page

    def scrub(self, g: int, block: int) -> None:
        """Fresh noise, so that a page a load should restore but did not never holds the right bytes by chance."""
        self.scrubs += 1
        for layer_index, layer in enumerate(self.config.kv_cache_groups[g].layer_names):
            region, offset = self.config.page_offset(layer, block)
            noise = expected_page(
                self.config, group=g, layer_index=layer_index, position=block, salt=f"fresh{self.scrubs}"
            )
            self.labels.setdefault(_digest(noise), f"fresh GPU noise (block {block} allocated to group {g})")
            self.gpu.write(region, offset, noise)

    def write_page(self, stream: str, g: int, block_id: int, position: int, *, tokens: int | None = None) -> None:
        """The suite computes a page: the final one, or a partial one with ``tokens`` tokens of the block."""
        for layer_index, layer in enumerate(self.config.kv_cache_groups[g].layer_names):
            page = (
                self.final_page(stream, g, layer_index, position)
                if tokens is None
                else self.partial_page(stream, g, layer_index, position, tokens)
            )
            region, offset = self.config.page_offset(layer, block_id)
            self.gpu.write(region, offset, page)

    def expect_stored(self, plan: StorePlan, addresses: Sequence[tuple[int, int]], *, deferred: bool) -> None:
        """A store landed: sub-block ``s`` of chunk ``k`` holds position ``k * f + s`` (OFF-7)."""
        for (key, _row, sub, g, layer), (region, offset) in zip(plan.writes, addresses, strict=True):
            if deferred:
                self.in_flight_pages[(region, offset)] -= 1
            layer_index = self.config.kv_cache_groups[g].layer_names.index(layer)
            self.chunks.expect(region, offset, self.final_page(key[0], g, layer_index, key[2] * self.f + sub))

    def expect_loaded(self, table: Sequence[Sequence[int]], stream: str, *, t: int, c: int) -> None:
        """Positions ``[L, G)`` of every group hold their computed pages; nothing else changes (OFF-6)."""
        for g, positions in enumerate(expected_load_positions(self.config, num_tokens=t, local_hit_tokens=c)):
            for position in positions:
                block_id = table[g][position]
                if block_id == NULL_BLOCK_ID:
                    raise Finding(f"the scenario's table has a null block at group {g} position {position}")
                for layer_index, layer in enumerate(self.config.kv_cache_groups[g].layer_names):
                    region, offset = self.config.page_offset(layer, block_id)
                    self.gpu.expect(region, offset, self.final_page(stream, g, layer_index, position))

    def _label_background(self) -> None:
        for group in self.config.kv_cache_groups:
            page = group.kv_cache_spec.page_size_bytes
            for layer in group.layer_names:
                region, _ = self.chunk_config.page_offset(layer, 0)
                data = self.chunks.regions[region]
                for index in range(self.chunk_config.num_blocks):
                    row, sub = divmod(index, self.f)
                    self.labels.setdefault(
                        _digest(data[index * page : (index + 1) * page]),
                        f"unwritten bytes of the chunk pool (row {row}, sub-block {sub}, layer {layer!r})",
                    )

    def check(self, when: str) -> None:
        found = self._compare(self.gpu, self.config, "GPU pool", when) + self._compare(
            self.chunks, self.chunk_config, "chunk pool", when
        )
        if found:
            shown = found[:8] + ([f"... and {len(found) - 8} more pages"] if len(found) > 8 else [])
            raise Finding("\n".join(shown))

    def _compare(self, image: _Image, config: KVCacheConfig, side: str, when: str) -> list[str]:
        changed = image.changed_regions()
        if not changed:
            return []
        found = []
        skipped = False
        for g, group in enumerate(config.kv_cache_groups):
            size = group.kv_cache_spec.page_size_bytes
            for layer in group.layer_names:
                for block in range(config.num_blocks):
                    region, offset = config.page_offset(layer, block)
                    if region not in changed:
                        continue
                    want = image.regions[region][offset : offset + size]
                    got = image.pool.regions[region].buffer[offset : offset + size]
                    if got == want:
                        continue
                    if image is self.chunks and self.in_flight_pages.get((region, offset)):
                        skipped = True  # a store in flight may have landed in part; it is checked once it is done
                        continue
                    where = (
                        f"block {block}"
                        if side == "GPU pool"
                        else f"chunk row {block // self.f}, sub-block {block % self.f}"
                    )
                    what_want = self.labels.get(_digest(want), "the bytes it held before (nothing may write it)")
                    what_got = self.labels.get(_digest(bytes(got)), "unrecognised bytes")
                    found.append(
                        f"{side} {when}: group {g}, layer {layer!r}, {where}: expected {what_want}, found {what_got}"
                    )
        if not found and not skipped:
            found.append(f"{side} {when}: bytes outside every page changed in regions {changed}")
        return found


# --------------------------------------------------------------------------- the hooks' answers


def call_hook(name: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except KVSpecError as exc:
        raise Finding(f"the connector's {name} raised {type(exc).__name__}: {exc}") from None


def check_transfer(
    hooks: OffloadConnector,
    config: KVCacheConfig,
    f: int,
    name: str,
    found: StoreSet | LoadSet,
    *,
    request_id: str,
    table: Sequence[Sequence[int]],
) -> list[tuple[tuple[int, int], ...]]:
    """The fields a connector returned, checked against the request's table; then its sub-block map."""
    if len(found.chunk_ranges) != config.num_groups:
        raise Finding(f"{name}: expected {config.num_groups} groups, got {len(found.chunk_ranges)}")
    held = {b for ids in table for b in ids if b != NULL_BLOCK_ID}
    maps = []
    for g, (ids, count, first) in enumerate(
        zip(found.block_ids, found.num_blocks, found.first_block_indices, strict=True)
    ):
        if count != len(ids):
            raise Finding(
                f"{name}.num_blocks[{g}]: expected {len(ids)} (one per block id, nulls never counted, #42945), "
                f"got {count} (OFF-3)"
            )
        stray = [b for b in ids if b not in held]
        if stray:
            raise Finding(
                f"{name}.block_ids[{g}]: names blocks {stray[:4]} that request {request_id!r} does not "
                f"hold (null, freed or another request's); its table is {list(table[g])}"
            )
        mapping = call_hook("map_sub_blocks", functools.partial(hooks.map_sub_blocks, first, count, blocks_per_chunk=f))
        if len(mapping) != count:
            raise Finding(f"map_sub_blocks({first}, {count}): expected {count} pairs, got {len(mapping)} (OFF-7)")
        maps.append(tuple(mapping))
    return maps


def check_store_set(
    config: KVCacheConfig,
    sizes: Sequence[int],
    store: StoreSet,
    maps: Sequence[Sequence[tuple[int, int]]],
    *,
    request_id: str,
    computed: int,
) -> None:
    """A store set offers only chunks ``[next, O // C_g)`` and maps inside them (OFF-3, OFF-7)."""
    if len(store.next_chunks) != config.num_groups:
        raise Finding(f"get_store_set.next_chunks: expected {config.num_groups} groups, got {store.next_chunks}")
    for g, ((first, stop), ids, mapping) in enumerate(zip(store.chunk_ranges, store.block_ids, maps, strict=True)):
        if stop * sizes[g] > computed:
            raise Finding(
                f"get_store_set: {request_id!r} offers chunk {stop - 1} of group {g} (tokens "
                f"[{(stop - 1) * sizes[g]}, {stop * sizes[g]})) when only {computed} tokens are computed "
                "(OFF-3: chunks [next, O // C_g))"
            )
        for _block_id, (entry, _sub) in zip(ids, mapping, strict=True):
            if not first <= first + entry < stop:
                raise Finding(f"map_sub_blocks: group {g} entry {entry} falls outside chunks [{first}, {stop}) (OFF-7)")


def check_state_tokens(config: KVCacheConfig, load: LoadSet, t: int, c: int) -> None:
    """Each state group's load says its state absorbed exactly T tokens (STATE-1, OFF-6; vLLM #51094)."""
    if t <= c:
        return
    given = tuple(getattr(load, "state_tokens", ()))
    for g in range(config.num_groups):
        if not is_state_group(config, g):
            continue
        got = given[g] if g < len(given) else None
        if got is None:
            raise Finding(
                f"get_load_set.state_tokens[{g}]: missing for state group {g}; the load must say how many tokens "
                f"the restored state absorbed (expected T={t}) (STATE-1, OFF-6)"
            )
        if got != t:
            raise Finding(
                f"get_load_set.state_tokens[{g}]: the restored state absorbed t={got} tokens but the request "
                f"resumes at T={t}; expected t == T, or tokens [{min(got, t)}, {max(got, t)}) are applied "
                "twice or never (STATE-1, OFF-6; vLLM #51094)"
            )


def check_hit(
    config: KVCacheConfig,
    offload: OffloadConfig,
    present: Sequence[Sequence[bool]],
    hit: object,
    *,
    request_id: str,
    num_tokens: int,
    local_hit_tokens: int,
) -> int:
    """The hit the chunks present support, by kvspec's plain OFF-5; a longer hit counts a chunk not there (OFF-5)."""
    n, c = num_tokens, local_hit_tokens
    try:
        want = get_offload_hit_tokens(config, present, num_tokens=n, local_hit_tokens=c, offload=offload)
    except KVSpecError as exc:
        raise Finding(f"get_offload_hit_tokens: answered {hit!r} where the rule refuses: {exc} (OFF-5)") from None
    if not isinstance(hit, int) or hit < 0 or c + hit > n:
        raise Finding(f"get_offload_hit_tokens: expected an int in [0, {n - c}], got {hit!r} (OFF-5)")
    if hit > want:
        raise Finding(
            f"get_offload_hit_tokens: {request_id!r} (N={n}, C={c}) got a hit of {hit} tokens, but the chunks present "
            f"support at most {want} (OFF-5); present keys per group: "
            + "; ".join(f"group {g}: {[k for k, p in enumerate(ps) if p]}" for g, ps in enumerate(present))
        )
    return want


def check_offered(
    config: KVCacheConfig,
    f: int,
    table: Sequence[Sequence[int]],
    offered: set[tuple[str, int, int]],
    *,
    request_id: str,
    stream: str,
    chunks: Sequence[range],
    windows_too: bool,
) -> None:
    """Every chunk a run computed whose last block is real was offered by some store (OFF-3).

    ``chunks[g]`` are the chunks of group ``g`` the run computed (not loaded).
    Windows are not clipped when storing: a later, longer request may need any chunk.
    """
    for g, ids in enumerate(table):
        # Windows and state groups: vLLM's retention stores only what a hit at the replay boundary reads (SHOULD).
        windowed = window_of(config, g) is not None or is_state_group(config, g)
        if windowed and not windows_too:
            continue
        size = config.kv_cache_groups[g].kv_cache_spec.block_size * f
        for k in chunks[g]:
            last = k * f + f - 1
            if ids[last] != NULL_BLOCK_ID and (stream, g, k) not in offered:
                raise Finding(
                    f"get_store_set: {request_id!r} computed chunk {k} of group {g} (tokens "
                    f"[{k * size}, {(k + 1) * size}), last block real) but no store set offered it (OFF-3: every "
                    "complete chunk whose last block is real is offered; windows are not clipped when storing)"
                )
