"""Offload scenarios: a GPU pool and a chunk pool, requests that store, evict and load, then the oracle.

Theory of operation. An :class:`OffloadScenario` is plain data whose ``repr``
is valid Python, so a failing case prints it as a reproducer.
:func:`run_offload_scenario` plays it on a backend:

1. The suite owns two pools in shared memory: the GPU pool (the config's
   tensors) and the chunk pool, one region per layer holding ``rows`` chunk
   rows of ``f`` pages each, sub-block ``s`` of row ``r`` at
   ``get_sub_block_offset(r, s)`` (OFF-7). Both are filled with keyed noise.
   Two agents of the backend register them ("gpu" and "chunks"); every store
   and load is an offload session (:class:`kvspec.exchange.OffloadSession`)
   that the driver of the agent posting it carries out, as it carries out the
   exchange's sessions (:data:`kvspec.exchange.OFFLOAD`): posted through the
   backend (WRITE or READ, whichever mode the backend has), polled, and failed
   on its deadline.
2. Requests run one after another. Each belongs to a *stream*: requests of
   one stream share their prefix, so a chunk is named by (stream, group,
   chunk index), which is what OFF-2's chained-hash key identifies. A
   request first looks up its hit (the connector's
   ``get_offload_hit_tokens`` with the suite's present map), loads it
   (``get_load_set`` and ``map_sub_blocks``), then computes the rest of its
   prompt and its decoded tokens step by step, offering a store each step
   (``get_store_set``). A computed block's pages hold keyed bytes for
   (stream, group, layer, position); a block still being filled holds a
   "partial" page, so a store that copies it too early is seen.
3. The chunk manager is the suite's own: LRU over a fixed number of rows,
   a key present only once all ``f`` of its sub-blocks were written
   (OFF-4), forced evictions where a request asks for them.
4. The oracle is independent of the hooks: after every copy it compares
   both pools, byte for byte, with images it keeps itself. A stored
   sub-block must hold the page of the position its key names
   (``k * f + s``); a load must restore, for each group, exactly the
   positions ``[L, G)`` that token arithmetic gives for ``T = C + hit``
   (OFF-6), each equal to the page originally computed; every other byte of
   both pools stays as it was. The hit itself is checked against a naive
   token-by-token model of OFF-5: a longer hit is a MUST failure.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kvspec import (
    NULL_BLOCK_ID,
    BlockIds,
    FailureReason,
    KVCacheConfig,
    KVCacheTensor,
    KVSpecError,
    LoadSet,
    MambaSpec,
    OffloadConfig,
    SlidingWindowSpec,
    StoreSet,
    TransferMode,
    get_sub_block_offset,
)
from kvspec.connector import OffloadConnector, ReferenceOffloadConnector
from kvspec.exchange import (
    OFFLOAD,
    ChunkCopy,
    Driver,
    LiveRequest,
    OffloadKind,
    OffloadSession,
    OffloadState,
    Operation,
    poll_until,
)
from kvspec.spec.offload import is_chunk_present
from kvspec.testing import PagePool, allocate_pool, expected_page, fill_background
from kvspec.transport import Backend, Transport

from ._scenario import ConfigSource, PresetConfig, replay_call

__all__ = [
    "OffloadRequest",
    "OffloadResult",
    "OffloadScenario",
    "expected_hit_tokens",
    "expected_load_positions",
    "run_offload_scenario",
]

Key = tuple[str, int, int]  # (stream, group, chunk index): what OFF-2's key names


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _to_tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


def _to_pairs(value: Iterable[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(g), int(k)) for g, k in value)


@attrs.frozen(kw_only=True)
class OffloadRequest:
    """One request of an offload scenario.

    ``num_tokens`` is the prompt (N at lookup); ``local_hit_tokens`` (C) are
    found in the GPU prefix cache (a multiple of every block size). After
    its load the request computes the rest of the prompt in steps of
    ``prefill_step`` tokens (0: one step), then ``decode_tokens`` steps of one
    token, offering a store each step. ``evict_before`` lists (group, chunk)
    keys of its stream evicted from the chunk pool before its lookup.
    ``preempt_after_steps`` preempts it after that many steps with the last
    store still in flight (``finish_request`` is called, its blocks are held
    until the store lands), then it starts again from its lookup.
    ``defer_last_store`` posts the last step's store only after the request
    finished (as vLLM's worker does, one step late). ``after_stores_landed``
    waits, before its lookup, until every store in flight has landed (an
    engine that looks up again once the tier's "pending" resolved); without
    it the lookup sees what has landed by then, which depends on the
    backend's pace (decision: a store in flight is not present). ``allocate_skipped``
    gives real blocks where vLLM nulls a window's skipped blocks (allowed:
    OFF-6 leaves them alone).
    """

    request_id: str
    num_tokens: int
    stream: str = "s"
    local_hit_tokens: int = 0
    prefill_step: int = 0
    decode_tokens: int = 0
    evict_before: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_to_pairs)
    preempt_after_steps: int | None = None
    defer_last_store: bool = False
    after_stores_landed: bool = False
    allocate_skipped: bool = False


@attrs.frozen(kw_only=True)
class OffloadScenario:
    """Config, offload geometry (f, h), chunk-pool rows and the requests, in order.

    ``hash_block_size`` defaults to the gcd of the block sizes (OFF-1).
    ``chunk_rows`` bounds the chunk pool; when it is full the LRU key not in
    flight is evicted. Every complete chunk whose last block is real must be
    offered by some store; for window groups only with
    ``require_window_stores`` (a window chunk left out costs later hits, never
    data: decisions 56 and 53 in decisions-offload.md).
    """

    config: ConfigSource
    requests: tuple[OffloadRequest, ...] = attrs.field(converter=_to_tuple)
    blocks_per_chunk: int = 1
    hash_block_size: int | None = None
    chunk_rows: int = 64
    deadline: float = 5.0
    require_window_stores: bool = False

    def offload_config(self, config: KVCacheConfig) -> OffloadConfig:
        """The :class:`OffloadConfig` of this scenario for ``config``."""
        h = self.hash_block_size
        if h is None:
            h = math.gcd(*(group.kv_cache_spec.block_size for group in config.kv_cache_groups))
        return OffloadConfig(blocks_per_chunk=self.blocks_per_chunk, hash_block_size=h)

    def to_python(self, backend: str = "loopback", connector: str | tuple[str, str] | None = None) -> str:
        """A script that replays this scenario on ``backend`` and prints what the oracle found."""
        imports, call = replay_call("run_offload_scenario", backend, connector)
        return (
            "from kvspec import *\n"
            "from kvspec_conformance import OffloadRequest, OffloadScenario, PresetConfig, run_offload_scenario\n"
            f"{imports}\n"
            f"scenario = {self!r}\n"
            f"result = {call}\n"
            "print(result.summary())\n"
        )


@attrs.frozen(kw_only=True)
class OffloadResult:
    """What the oracle found: ``problems`` (empty when every page is right) and per-request figures."""

    problems: tuple[str, ...]
    hits: dict[str, tuple[int, ...]]
    expected_hits: dict[str, tuple[int, ...]]
    loaded_pages: int
    stored_pages: int
    evictions: int
    seconds: float

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def summary(self) -> str:
        """Human-readable findings."""
        lines = [
            f"{len(self.hits)} requests in {self.seconds:.3f}s: {self.stored_pages} pages stored, "
            f"{self.loaded_pages} loaded, {self.evictions} chunks evicted"
        ]
        for rid, hits in self.hits.items():
            lines.append(f"  {rid}: hits {list(hits)} (the rule's: {list(self.expected_hits.get(rid, ()))})")
        if self.problems:
            lines += ["problems:", *("  " + p for p in self.problems)]
        return "\n".join(lines)


# --------------------------------------------------------------------------- the oracle's arithmetic


def _window(config: KVCacheConfig, g: int) -> int | None:
    spec = config.kv_cache_groups[g].kv_cache_spec
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def _is_state(config: KVCacheConfig, g: int) -> bool:
    # An align-mode state group: position p holds the state after (p + 1) * B tokens (OFF-9, STATE-4).
    return isinstance(config.kv_cache_groups[g].kv_cache_spec, MambaSpec)


def expected_hit_tokens(
    config: KVCacheConfig, present: Sequence[Sequence[bool]], *, num_tokens: int, local_hit_tokens: int, f: int
) -> int:
    """OFF-5 by brute force: the largest end every group supports, scanned token by token (OFF-5).

    An end ``e`` is supported when, for every group, each chunk holding a
    token of ``[C, e)`` (full attention) or ``[max(C, e - W + 1), e)`` (a
    window) is present, and ``e - C`` is at least one chunk. It starts at
    ``N`` (``N - 1`` with a window or state group) and at most the keys so
    far. A state group supports ``e`` only when ``e`` ends one of its chunks
    and that chunk is present: the state after exactly ``e`` tokens.
    """
    c = local_hit_tokens
    sizes = [group.kv_cache_spec.block_size * f for group in config.kv_cache_groups]
    windows = [_window(config, g) for g in range(config.num_groups)]
    states = [_is_state(config, g) for g in range(config.num_groups)]
    end = num_tokens - 1 if any(w is not None for w in windows) or any(states) else num_tokens
    end = min([end, *(len(p) * size for p, size in zip(present, sizes, strict=True))])
    for e in range(end, c, -1):
        if any(e - c < size for size in sizes):
            return 0
        supported = True
        for g, (size, window) in enumerate(zip(sizes, windows, strict=True)):
            if states[g]:
                if e % size or not present[g][e // size - 1]:
                    supported = False
                    break
                continue
            first = c if window is None else max(c, e - window + 1)
            if first < e and not all(present[g][t // size] for t in range(first, e)):
                supported = False
                break
        if supported:
            return e - c
    return 0


def expected_load_positions(config: KVCacheConfig, *, num_tokens: int, local_hit_tokens: int) -> list[range]:
    """Per group, the GPU positions a load restores: ``[L, G)`` from token arithmetic (OFF-6).

    ``G = cdiv(T, B)``; the first needed token is ``C`` (full attention) or
    ``max(C, T - W + 1)`` (a window), and none when it is ``T`` or later; a
    state group restores the one slot at ``T / B - 1`` when ``T > C``.
    """
    ranges = []
    for g, group in enumerate(config.kv_cache_groups):
        block, window = group.kv_cache_spec.block_size, _window(config, g)
        stop = _cdiv(num_tokens, block)
        if _is_state(config, g):
            ranges.append(range(stop - 1, stop) if num_tokens > local_hit_tokens else range(stop, stop))
            continue
        first = local_hit_tokens if window is None else max(local_hit_tokens, num_tokens - window + 1)
        ranges.append(range(stop, stop) if first >= num_tokens else range(first // block, stop))
    return ranges


def _skipped_blocks(config: KVCacheConfig, g: int, computed: int) -> int:
    block = config.kv_cache_groups[g].kv_cache_spec.block_size
    if _is_state(config, g):  # vLLM nulls the slots of earlier states: only the one that resumes stays
        return max(0, computed - 1) // block
    window = _window(config, g)
    return 0 if window is None else max(0, computed - window + 1) // block


# --------------------------------------------------------------------------- pools and pages


def chunk_pool_config(config: KVCacheConfig, *, rows: int, blocks_per_chunk: int) -> KVCacheConfig:
    """The chunk pool as a config: one region per layer of ``rows * f`` GPU-sized pages (OFF-7)."""
    tensors = []
    for group in config.kv_cache_groups:
        page = group.kv_cache_spec.page_size_bytes
        for layer in group.layer_names:
            tensors.append(
                KVCacheTensor(size=rows * blocks_per_chunk * page, layers=[layer], layer_stride=0, block_stride=page)
            )
    return KVCacheConfig(
        num_blocks=rows * blocks_per_chunk, kv_cache_tensors=tensors, kv_cache_groups=config.kv_cache_groups
    )


def _digest(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class _Finding(Exception):
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


class _ChunkManager:
    """The suite's own chunk pool manager: LRU over rows, a key present once all f sub-blocks are written."""

    def __init__(self, rows: int, f: int) -> None:
        self.f = f
        self.free = list(range(rows - 1, -1, -1))
        self.rows: OrderedDict[Key, int] = OrderedDict()
        self.written: dict[int, set[int]] = {}
        self.in_flight: dict[int, int] = {}
        self.evictions = 0

    def present(self, key: Key) -> bool:
        row = self.rows.get(key)
        return row is not None and is_chunk_present(
            sub_blocks_written=len(self.written[row]),
            blocks_per_chunk=self.f,
            copies_in_flight=self.in_flight.get(row, 0),
        )

    def row_of(self, key: Key) -> int | None:
        return self.rows.get(key)

    def touch(self, key: Key) -> None:
        if key in self.rows:
            self.rows.move_to_end(key)

    def evict(self, key: Key) -> bool:
        row = self.rows.get(key)
        if row is None or self.in_flight.get(row):
            return False
        del self.rows[key]
        self.written.pop(row, None)
        self.free.append(row)  # its bytes stay: a reader of an evicted row sees stale data
        self.evictions += 1
        return True

    def row_for_store(self, key: Key) -> int | None:
        """The row a store of ``key`` writes into, evicting the LRU idle key when full; None when none is free."""
        row = self.rows.get(key)
        if row is not None:
            return None if self.in_flight.get(row) else row
        if not self.free:
            victim = next((k for k, r in self.rows.items() if not self.in_flight.get(r)), None)
            if victim is None:
                return None
            self.evict(victim)
        row = self.free.pop()
        self.rows[key] = row
        self.written[row] = set()
        return row


# --------------------------------------------------------------------------- playing a scenario


@attrs.define(eq=False)
class _Pending:
    request: LiveRequest[OffloadSession]
    what: str
    request_id: str
    on_done: Callable[[], None]


@attrs.define(eq=False)
class _Run:
    """One run of a request (a preempted request runs twice)."""

    spec: OffloadRequest
    table: list[list[int]]
    computed: int
    next_chunk: list[int]
    loaded_chunks: list[int] = attrs.field(factory=list)  # per group, chunks below this came from the load
    offered: set[Key] = attrs.field(factory=set)  # every chunk a store set of this run offered


_Copy = LiveRequest[OffloadSession]


def _no_blocks(request: _Copy, block_ids: BlockIds) -> None:
    """A copy frees no block: the scenario's own tables hold them."""


def _ended(request: _Copy) -> None:
    """The scenario reads the copy's session where it waits for it."""


class _OffloadPlay:
    def __init__(self, scenario: OffloadScenario, backend: Backend, connector: OffloadConnector) -> None:
        self.scenario = scenario
        self.backend = backend
        self.hooks = connector
        source = scenario.config
        self.config = source.build() if isinstance(source, PresetConfig) else source
        self.offload = scenario.offload_config(self.config)
        self.f = self.offload.blocks_per_chunk
        self.sizes = [group.kv_cache_spec.block_size * self.f for group in self.config.kv_cache_groups]
        self.manager = _ChunkManager(scenario.chunk_rows, self.f)
        self.free_blocks = list(range(self.config.num_blocks - 1, 0, -1))
        self.pending: list[_Pending] = []
        self.hits: dict[str, list[int]] = {}
        self.expected_hits: dict[str, list[int]] = {}
        self.problems: list[str] = []
        self.loaded_pages = 0
        self.stored_pages = 0
        self.scrubs = 0
        self.labels: dict[bytes, str] = {}
        self.in_flight_pages: dict[tuple[int, int], int] = {}  # chunk-pool pages a pending store may be writing
        self.posted = 0
        modes = backend.capabilities.modes
        self.write_ok, self.read_ok = TransferMode.WRITE in modes, TransferMode.READ in modes

    # -- setup and the run

    def run(self) -> OffloadResult:
        started = time.monotonic()
        chunk_config = chunk_pool_config(self.config, rows=self.scenario.chunk_rows, blocks_per_chunk=self.f)
        self.chunk_config = chunk_config
        with allocate_pool(self.config) as gpu, allocate_pool(chunk_config) as chunks:
            fill_background(gpu, seed="gpu")
            fill_background(chunks, seed="chunks")
            self.gpu, self.chunks = _Image(gpu), _Image(chunks)
            self._label_background()
            self.gpu_agent = self.backend.create_agent("gpu")
            try:
                self.chunk_agent = self.backend.create_agent("chunks")
            except BaseException:
                self.gpu_agent.close()
                raise
            try:
                self.gpu_agent.register_memory(gpu.regions)
                self.chunk_agent.register_memory(chunks.regions)
                self.chunk_name = self.gpu_agent.add_remote_agent(self.chunk_agent.get_agent_metadata())
                self.gpu_name = self.chunk_agent.add_remote_agent(self.gpu_agent.get_agent_metadata())
                # Every copy is an offload session, carried out by the driver of the agent that posts it.
                self.gpu_driver = self._driver(self.gpu_agent)
                self.chunk_driver = self._driver(self.chunk_agent)
                for spec in self.scenario.requests:
                    self._request(spec)
                self._drain()
                self._check("at the end")
            except _Finding as exc:
                self.problems.append(str(exc))
            finally:
                for agent in (self.gpu_agent, self.chunk_agent):
                    try:
                        agent.close()
                    except KVSpecError as exc:
                        self.problems.append(f"closing {agent.name}: {exc}")
        return OffloadResult(
            problems=tuple(self.problems),
            hits={rid: tuple(v) for rid, v in self.hits.items()},
            expected_hits={rid: tuple(v) for rid, v in self.expected_hits.items()},
            loaded_pages=self.loaded_pages,
            stored_pages=self.stored_pages,
            evictions=self.manager.evictions,
            seconds=time.monotonic() - started,
        )

    # -- pages

    def _layers(self, g: int) -> tuple[str, ...]:
        return self.config.kv_cache_groups[g].layer_names

    def _page_size(self, g: int) -> int:
        return self.config.kv_cache_groups[g].kv_cache_spec.page_size_bytes

    def _final_page(self, stream: str, g: int, layer: int, position: int) -> bytes:
        page = expected_page(self.config, group=g, layer_index=layer, position=position, salt=stream)
        self.labels.setdefault(
            _digest(page), f"the page of stream {stream!r}, group {g}, layer {layer}, position {position}"
        )
        return page

    def _partial_page(self, stream: str, g: int, layer: int, position: int, tokens: int) -> bytes:
        page = expected_page(
            self.config, group=g, layer_index=layer, position=position, salt=f"{stream}~partial{tokens}"
        )
        self.labels.setdefault(
            _digest(page),
            f"the partial page of stream {stream!r}, group {g}, layer {layer}, position {position} "
            f"(only {tokens} tokens computed: the block was not complete)",
        )
        return page

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

    def _chunk_address(self, layer: str, row: int, sub: int, g: int) -> tuple[int, int]:
        region, _ = self.chunk_config.page_offset(layer, 0)
        return region, get_sub_block_offset(row, sub, page_size=self._page_size(g), blocks_per_chunk=self.f)

    def _allocate(self, g: int) -> int:
        if not self.free_blocks:
            self._drain()
        if not self.free_blocks:
            raise _Finding("the scenario ran out of GPU blocks; give its config more num_blocks")
        block = self.free_blocks.pop()
        # Fresh noise, so that a page a load should restore but did not never holds the right bytes by chance.
        self.scrubs += 1
        for layer_index, layer in enumerate(self._layers(g)):
            region, offset = self.config.page_offset(layer, block)
            noise = expected_page(
                self.config, group=g, layer_index=layer_index, position=block, salt=f"fresh{self.scrubs}"
            )
            self.labels.setdefault(_digest(noise), f"fresh GPU noise (block {block} allocated to group {g})")
            self.gpu.write(region, offset, noise)
        return block

    def _release(self, table: list[list[int]]) -> None:
        for ids in table:
            self.free_blocks += [b for b in ids if b != NULL_BLOCK_ID]

    # -- copies through the backend

    def _driver(self, agent: Transport) -> Driver[OffloadSession]:
        return Driver(role=OFFLOAD, transport=agent, clock=time.monotonic, on_free=_no_blocks, on_end=_ended)

    def _post(self, to_chunks: bool, copies: list[tuple[int, int, int, int, int]], what: str) -> _Copy:
        """Post (gpu region, gpu offset, chunk region, chunk offset, nbytes) copies; the GPU agent posts if it can."""
        gpu_posts = self.write_ok if to_chunks else self.read_ok
        mode = TransferMode.WRITE if to_chunks == gpu_posts else TransferMode.READ
        driver, peer = (self.gpu_driver, self.chunk_name) if gpu_posts else (self.chunk_driver, self.gpu_name)
        self.posted += 1
        session = OffloadSession(
            request_id=f"{what} (copy {self.posted})",
            kind=OffloadKind.STORE if to_chunks else OffloadKind.LOAD,
            mode=mode,
            copies=[
                ChunkCopy(gpu_region=a, gpu_offset=b, chunk_region=c, chunk_offset=d, nbytes=n)
                for a, b, c, d, n in copies
            ],
            timeout=self.scenario.deadline,
        )
        request = driver.add(LiveRequest(session=session, peer=peer))
        driver.execute(request, session.start(now=time.monotonic()))
        for fault in driver.faults:
            if fault.request_id == session.request_id and fault.operation is Operation.POST:
                raise _Finding(f"the backend refused the {what}: {type(fault.error).__name__}: {fault.error}")
        return request

    def _poll(self) -> None:
        # Both agents: the passive one polls so that its backend can progress.
        self.gpu_driver.poll()
        self.chunk_driver.poll()

    def _wait(self, request: _Copy, what: str) -> None:
        session = request.session
        # The copy's own timeout (the scenario's deadline) bounds the wait (FAIL-1).
        poll_until(self._poll, done=lambda: session.is_terminal, spin=10)
        if session.state is OffloadState.DONE:
            return
        if session.reason is FailureReason.TIMEOUT:
            raise _Finding(f"the {what} did not complete within {self.scenario.deadline}s")
        reason = "" if session.reason is None else session.reason.value
        raise _Finding(f"the backend failed the {what}: {reason} {session.detail}")

    def _drain(self) -> None:
        pending, self.pending = self.pending, []
        for item in pending:
            self._wait(item.request, item.what)
            item.on_done()
            self._check(f"after the {item.what}")

    def _poll_pending(self) -> None:
        """Finish the pending copies that are done; keep the others (a deferred store lands when it lands)."""
        self._poll()
        for item in list(self.pending):
            if not item.request.session.is_terminal:
                continue
            self.pending.remove(item)
            self._wait(item.request, item.what)
            item.on_done()
            self._check(f"after the {item.what}")

    # -- the oracle

    def _check(self, when: str) -> None:
        found = self._compare(self.gpu, self.config, "GPU pool", when) + self._compare(
            self.chunks, self.chunk_config, "chunk pool", when
        )
        if found:
            shown = found[:8] + ([f"... and {len(found) - 8} more pages"] if len(found) > 8 else [])
            raise _Finding("\n".join(shown))

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

    # -- hooks

    def _hook(self, name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except KVSpecError as exc:
            raise _Finding(f"the connector's {name} raised {type(exc).__name__}: {exc}") from None

    def _check_transfer(self, name: str, found: StoreSet | LoadSet, run: _Run) -> list[tuple[tuple[int, int], ...]]:
        """The fields a connector returned, checked against the request's table; then its sub-block map."""
        if len(found.chunk_ranges) != self.config.num_groups:
            raise _Finding(f"{name}: expected {self.config.num_groups} groups, got {len(found.chunk_ranges)}")
        held = {b for ids in run.table for b in ids if b != NULL_BLOCK_ID}
        maps = []
        for g, (ids, count, first) in enumerate(
            zip(found.block_ids, found.num_blocks, found.first_block_indices, strict=True)
        ):
            if count != len(ids):
                raise _Finding(
                    f"{name}.num_blocks[{g}]: expected {len(ids)} (one per block id, nulls never counted, #42945), "
                    f"got {count} (OFF-3)"
                )
            stray = [b for b in ids if b not in held]
            if stray:
                raise _Finding(
                    f"{name}.block_ids[{g}]: names blocks {stray[:4]} that request {run.spec.request_id!r} does not "
                    f"hold (null, freed or another request's); its table is {run.table[g]}"
                )
            mapping = self._hook(
                "map_sub_blocks", functools.partial(self.hooks.map_sub_blocks, first, count, blocks_per_chunk=self.f)
            )
            if len(mapping) != count:
                raise _Finding(f"map_sub_blocks({first}, {count}): expected {count} pairs, got {len(mapping)} (OFF-7)")
            maps.append(tuple(mapping))
        return maps

    # -- a request

    def _request(self, spec: OffloadRequest) -> None:
        if spec.after_stores_landed:
            self._drain()
        else:
            self._poll_pending()
        for g, k in spec.evict_before:
            self.manager.evict((spec.stream, g, k))
        self._run(spec, preempt=spec.preempt_after_steps)

    def _run(self, spec: OffloadRequest, *, preempt: int | None) -> None:
        rid, stream = spec.request_id, spec.stream
        n, c = spec.num_tokens, spec.local_hit_tokens
        present = [
            [self.manager.present((stream, g, k)) for k in range(n // size)] for g, size in enumerate(self.sizes)
        ]
        hit = self._hook(
            "get_offload_hit_tokens",
            lambda: self.hooks.get_offload_hit_tokens(
                self.config, present, request_id=rid, num_tokens=n, local_hit_tokens=c, offload=self.offload
            ),
        )
        want = expected_hit_tokens(self.config, present, num_tokens=n, local_hit_tokens=c, f=self.f)
        self.hits.setdefault(rid, []).append(hit)
        self.expected_hits.setdefault(rid, []).append(want)
        if not isinstance(hit, int) or hit < 0 or c + hit > n:
            raise _Finding(f"get_offload_hit_tokens: expected an int in [0, {n - c}], got {hit!r} (OFF-5)")
        if hit > want:
            raise _Finding(
                f"get_offload_hit_tokens: {rid!r} (N={n}, C={c}) got a hit of {hit} tokens, but the chunks present "
                f"support at most {want} (OFF-5); present keys per group: "
                + "; ".join(f"group {g}: {[k for k, p in enumerate(ps) if p]}" for g, ps in enumerate(present))
            )
        t = c + hit
        run = _Run(spec=spec, table=self._table(spec, t), computed=t, next_chunk=[0] * self.config.num_groups)
        run.loaded_chunks = [_cdiv(t, size) if hit else 0 for size in self.sizes]
        if hit:
            self._load(run, t)
            run.next_chunk = list(run.loaded_chunks)  # loaded chunks are not stored again
        steps: list[int] = []
        while run.computed + sum(steps) < n:
            steps.append(min(spec.prefill_step or n, n - run.computed - sum(steps)))
        steps += [1] * spec.decode_tokens
        for index, tokens in enumerate(steps):
            last = index == len(steps) - 1
            self._step(run, tokens, defer=(last and spec.defer_last_store) or preempt == index + 1)
            if preempt == index + 1:
                self._finish(run)
                self._drain()  # rescheduled later, once its in-flight store landed and its blocks came back
                self._run(spec, preempt=None)  # it starts again from its lookup
                return
        if not steps:
            self._store(run, defer=spec.defer_last_store)
        self._finish(run)

    def _check_offered(self, run: _Run) -> None:
        """Every chunk the run computed whose last block is real was offered by some store (OFF-3).

        Windows are not clipped when storing: a later, longer request may need any chunk.
        """
        for g, (ids, size) in enumerate(zip(run.table, self.sizes, strict=True)):
            # Windows and state groups: vLLM's retention stores only what a hit at the replay boundary reads (SHOULD).
            windowed = _window(self.config, g) is not None or _is_state(self.config, g)
            if windowed and not self.scenario.require_window_stores:
                continue
            for k in range(run.loaded_chunks[g], run.computed // size):
                last = k * self.f + self.f - 1
                if ids[last] != NULL_BLOCK_ID and (run.spec.stream, g, k) not in run.offered:
                    raise _Finding(
                        f"get_store_set: {run.spec.request_id!r} computed chunk {k} of group {g} (tokens "
                        f"[{k * size}, {(k + 1) * size}), last block real) but no store set offered it (OFF-3: every "
                        "complete chunk whose last block is real is offered; windows are not clipped when storing)"
                    )

    def _finish(self, run: _Run) -> None:
        self._check_offered(run)
        rid = run.spec.request_id
        self._hook("finish_request", lambda: self.hooks.finish_request(rid))
        held = [item for item in self.pending if item.request_id == rid]
        if held:
            # Its blocks stay allocated until its in-flight stores landed (vLLM flushes them before reuse).
            last = held[-1]
            done = last.on_done
            table = run.table

            def release() -> None:
                done()
                self._release(table)

            last.on_done = release
        else:
            self._release(run.table)

    def _table(self, spec: OffloadRequest, computed: int) -> list[list[int]]:
        """The GPU block table at lookup: cached blocks below C, nulls where vLLM skips, fresh blocks above."""
        table: list[list[int]] = []
        for g, group in enumerate(self.config.kv_cache_groups):
            block = group.kv_cache_spec.block_size
            skipped = 0 if spec.allocate_skipped else _skipped_blocks(self.config, g, computed)
            ids = []
            for position in range(_cdiv(spec.num_tokens, block)):
                if position < skipped:
                    ids.append(NULL_BLOCK_ID)
                    continue
                block_id = self._allocate(g)
                if position < spec.local_hit_tokens // block:  # a GPU prefix-cache hit holds the computed page
                    for layer_index, layer in enumerate(self._layers(g)):
                        region, offset = self.config.page_offset(layer, block_id)
                        self.gpu.write(region, offset, self._final_page(spec.stream, g, layer_index, position))
                ids.append(block_id)
            table.append(ids)
        return table

    def _step(self, run: _Run, tokens: int, *, defer: bool) -> None:
        """Compute ``tokens`` more tokens (their pages), then offer a store (OFF-3)."""
        start, end = run.computed, run.computed + tokens
        for g, group in enumerate(self.config.kv_cache_groups):
            block = group.kv_cache_spec.block_size
            ids = run.table[g]
            while len(ids) < _cdiv(end, block):
                ids.append(self._allocate(g))
            for position in range(start // block, _cdiv(end, block)):
                complete = (position + 1) * block <= end
                for layer_index, layer in enumerate(self._layers(g)):
                    page = (
                        self._final_page(run.spec.stream, g, layer_index, position)
                        if complete
                        else self._partial_page(run.spec.stream, g, layer_index, position, end - position * block)
                    )
                    region, offset = self.config.page_offset(layer, ids[position])
                    self.gpu.write(region, offset, page)
        run.computed = end
        self._store(run, defer=defer)

    def _store(self, run: _Run, *, defer: bool) -> None:
        spec = run.spec
        rid, stream, o = spec.request_id, spec.stream, run.computed
        table = BlockIds(run.table)
        store = self._hook(
            "get_store_set",
            lambda: self.hooks.get_store_set(
                self.config,
                table,
                request_id=rid,
                num_offloadable_tokens=o,
                next_chunk=tuple(run.next_chunk),
                offload=self.offload,
            ),
        )
        maps = self._check_transfer("get_store_set", store, run)
        if len(store.next_chunks) != self.config.num_groups:
            raise _Finding(
                f"get_store_set.next_chunks: expected {self.config.num_groups} groups, got {store.next_chunks}"
            )
        copies: list[tuple[int, int, int, int, int]] = []
        writes: list[tuple[Key, int, int, int, str]] = []  # key, row, sub, group, layer
        rows: dict[Key, int] = {}
        for g, ((first, stop), ids, mapping) in enumerate(zip(store.chunk_ranges, store.block_ids, maps, strict=True)):
            if stop * self.sizes[g] > o:
                raise _Finding(
                    f"get_store_set: {rid!r} offers chunk {stop - 1} of group {g} (tokens "
                    f"[{(stop - 1) * self.sizes[g]}, {stop * self.sizes[g]})) when only {o} tokens are computed "
                    "(OFF-3: chunks [next, O // C_g))"
                )
            run.offered.update((stream, g, k) for k in range(first, stop))
            for block_id, (entry, sub) in zip(ids, mapping, strict=True):
                k = first + entry
                if not first <= k < stop:
                    raise _Finding(
                        f"map_sub_blocks: group {g} entry {entry} falls outside chunks [{first}, {stop}) (OFF-7)"
                    )
                key = (stream, g, k)
                if self.manager.present(key):
                    self.manager.touch(key)
                    continue
                row = rows.get(key)
                if row is None:
                    row = self.manager.row_for_store(key)
                    if row is None:
                        continue  # in flight already, or the pool is full of keys in flight: not stored
                    rows[key] = row
                    self.manager.in_flight[row] = self.manager.in_flight.get(row, 0) + 1  # never evicted mid-store
                for layer in self._layers(g):
                    gpu_region, gpu_offset = self.config.page_offset(layer, block_id)
                    chunk_region, chunk_offset = self._chunk_address(layer, row, sub, g)
                    copies.append((gpu_region, gpu_offset, chunk_region, chunk_offset, self._page_size(g)))
                    writes.append((key, row, sub, g, layer))
        run.next_chunk = list(store.next_chunks)
        if not copies:
            return
        what = f"store of {rid!r} at {o} tokens"
        request = self._post(True, copies, what)
        self.stored_pages += len(copies)

        addresses = [self._chunk_address(layer, row, sub, g) for _, row, sub, g, layer in writes]

        def landed() -> None:
            for (key, row, sub, g, layer), (region, offset) in zip(writes, addresses, strict=True):
                position = key[2] * self.f + sub  # the oracle: sub-block s of chunk k holds position k*f + s
                if defer:
                    self.in_flight_pages[(region, offset)] -= 1
                self.chunks.expect(region, offset, self._final_page(key[0], g, self._layers(g).index(layer), position))
                self.manager.written[row].add(sub)
            for row in rows.values():
                self.manager.in_flight[row] -= 1

        if defer:
            for address in addresses:
                self.in_flight_pages[address] = self.in_flight_pages.get(address, 0) + 1
            self.pending.append(_Pending(request=request, what=what, request_id=rid, on_done=landed))
            return
        self._wait(request, what)
        landed()
        self._check(f"after the {what}")

    def _load(self, run: _Run, t: int) -> None:
        spec = run.spec
        rid, stream, c = spec.request_id, spec.stream, spec.local_hit_tokens
        table = BlockIds(run.table)
        load = self._hook(
            "get_load_set",
            lambda: self.hooks.get_load_set(
                self.config, table, request_id=rid, num_tokens=t, local_hit_tokens=c, offload=self.offload
            ),
        )
        maps = self._check_transfer("get_load_set", load, run)
        self._check_state_tokens(load, t, c)
        copies: list[tuple[int, int, int, int, int]] = []
        for g, ((first, _stop), ids, mapping) in enumerate(zip(load.chunk_ranges, load.block_ids, maps, strict=True)):
            for block_id, (entry, sub) in zip(ids, mapping, strict=True):
                key = (stream, g, first + entry)
                if not self.manager.present(key):
                    raise _Finding(
                        f"get_load_set: {rid!r} reads chunk {first + entry} of group {g}, which the chunk pool does "
                        "not hold whole (never stored, written in part, or evicted): the hit counted a chunk that is "
                        "not present (OFF-4, OFF-5, OFF-6)"
                    )
                self.manager.touch(key)
                row = self.manager.row_of(key)
                assert row is not None
                for layer in self._layers(g):
                    gpu_region, gpu_offset = self.config.page_offset(layer, block_id)
                    chunk_region, chunk_offset = self._chunk_address(layer, row, sub, g)
                    copies.append((gpu_region, gpu_offset, chunk_region, chunk_offset, self._page_size(g)))
        # The oracle: positions [L, G) of every group hold their computed pages; nothing else changes.
        for g, positions in enumerate(expected_load_positions(self.config, num_tokens=t, local_hit_tokens=c)):
            for position in positions:
                block_id = run.table[g][position]
                if block_id == NULL_BLOCK_ID:
                    raise _Finding(f"the scenario's table has a null block at group {g} position {position}")
                for layer_index, layer in enumerate(self._layers(g)):
                    region, offset = self.config.page_offset(layer, block_id)
                    self.gpu.expect(region, offset, self._final_page(stream, g, layer_index, position))
        what = f"load of {rid!r} ({t - c} tokens past C={c})"
        if copies:
            self._wait(self._post(False, copies, what), what)
            self.loaded_pages += len(copies)
        self._check(f"after the {what}")

    def _check_state_tokens(self, load: LoadSet, t: int, c: int) -> None:
        """Each state group's load says its state absorbed exactly T tokens (STATE-1, OFF-6; vLLM #51094)."""
        if t <= c:
            return
        given = tuple(getattr(load, "state_tokens", ()))
        for g in range(self.config.num_groups):
            if not _is_state(self.config, g):
                continue
            got = given[g] if g < len(given) else None
            if got is None:
                raise _Finding(
                    f"get_load_set.state_tokens[{g}]: missing for state group {g}; the load must say how many tokens "
                    f"the restored state absorbed (expected T={t}) (STATE-1, OFF-6)"
                )
            if got != t:
                raise _Finding(
                    f"get_load_set.state_tokens[{g}]: the restored state absorbed t={got} tokens but the request "
                    f"resumes at T={t}; expected t == T, or tokens [{min(got, t)}, {max(got, t)}) are applied "
                    "twice or never (STATE-1, OFF-6; vLLM #51094)"
                )


def run_offload_scenario(
    scenario: OffloadScenario,
    *,
    backend: Backend | str = "loopback",
    connector: object | None = None,
) -> OffloadResult:
    """Play ``scenario`` on ``backend`` with ``connector``'s offload hooks (the reference when it has none).

    ``connector`` may be an :class:`OffloadConnector` or an exchange connector
    (its offload hooks are used when it has them, else kvspec's reference).
    """
    from kvspec.connector import as_offload_connector

    resolved: Backend
    if isinstance(backend, str):
        from kvspec.transport import load_backend

        resolved = load_backend(backend)
    else:
        resolved = backend
    hooks = ReferenceOffloadConnector() if connector is None else as_offload_connector(connector)
    try:
        return _OffloadPlay(scenario, resolved, hooks).run()
    finally:
        if isinstance(backend, str):
            resolved.close()
