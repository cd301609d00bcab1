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
3. The chunk manager is kvspec's offload engine
   (:class:`kvspec.exchange.OffloadEngine`): LRU over a fixed number of
   rows, a key present only once all ``f`` of its sub-blocks were written
   (OFF-4); it also hands out the GPU blocks and posts the copies. Forced
   evictions come where a request asks for them.
4. The oracle is independent of the hooks: after every copy it compares
   both pools, byte for byte, with images it keeps itself. A stored
   sub-block must hold the page of the position its key names
   (``k * f + s``); a load must restore, for each group, exactly the
   positions ``[L, G)`` that token arithmetic gives for ``T = C + hit``
   (OFF-6), each equal to the page originally computed; every other byte of
   both pools stays as it was. The hit itself is checked against kvspec's
   plain OFF-5 (:func:`kvspec.spec.offload.get_offload_hit_tokens`): a
   longer hit is a MUST failure. The oracle is ``conformance/_offload_oracle.py``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from kvspec import (
    NULL_BLOCK_ID,
    BlockIds,
    FailureReason,
    KVCacheConfig,
    KVCacheTensor,
    KVSpecError,
    OffloadConfig,
)
from kvspec.connector import OffloadConnector, ReferenceOffloadConnector
from kvspec.exchange import ChunkKey, GpuCopy, LiveRequest, OffloadEngine, OffloadSession, OffloadState
from kvspec.testing import allocate_pool, fill_background
from kvspec.transport import Backend, Transport

from ._offload_oracle import (
    Finding,
    PoolOracle,
    call_hook,
    cdiv,
    check_hit,
    check_offered,
    check_state_tokens,
    check_store_set,
    check_transfer,
    expected_load_positions,
)
from ._scenario import ConfigSource, PresetConfig, replay_call

__all__ = [
    "OffloadRequest",
    "OffloadResult",
    "OffloadScenario",
    "chunk_pool_config",
    "expected_load_positions",
    "run_offload_scenario",
]


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


# --------------------------------------------------------------------------- the suite's tables


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
    offered: set[ChunkKey] = attrs.field(factory=set)  # every chunk a store set of this run offered

    def check_offered(self, config: KVCacheConfig, f: int, *, windows_too: bool) -> None:
        """Every complete chunk this run computed (not loaded) whose last block is real was offered (OFF-3)."""
        sizes = [group.kv_cache_spec.block_size * f for group in config.kv_cache_groups]
        chunks = [range(first, self.computed // size) for first, size in zip(self.loaded_chunks, sizes, strict=True)]
        spec = self.spec
        check_offered(
            config,
            f,
            self.table,
            self.offered,
            request_id=spec.request_id,
            stream=spec.stream,
            chunks=chunks,
            windows_too=windows_too,
        )


@contextlib.contextmanager
def _agents(backend: Backend, problems: list[str]) -> Iterator[tuple[Transport, Transport]]:
    """The GPU agent and the chunk agent of ``backend``, closed at the end (a failed close is a problem)."""
    gpu_agent = backend.create_agent("gpu")
    try:
        chunk_agent = backend.create_agent("chunks")
    except BaseException:
        gpu_agent.close()
        raise
    try:
        yield gpu_agent, chunk_agent
    finally:
        for agent in (gpu_agent, chunk_agent):
            try:
                agent.close()
            except KVSpecError as exc:
                problems.append(f"closing {agent.name}: {exc}")


class _Copies:
    """The copies in flight: posted by the offload engine, judged when they end; a deferred store lands later."""

    def __init__(self, engine: OffloadEngine, oracle: PoolOracle, deadline: float) -> None:
        self.engine, self.oracle, self.deadline = engine, oracle, deadline
        self.pending: list[_Pending] = []

    def post(self, to_chunks: bool, copies: list[GpuCopy], what: str) -> LiveRequest[OffloadSession]:
        request = self.engine.post(to_chunks, copies, what)
        refused = self.engine.post_refusal(request)
        if refused is not None:
            raise Finding(f"the backend refused the {what}: {type(refused).__name__}: {refused}")
        return request

    def wait(self, request: LiveRequest[OffloadSession], what: str) -> None:
        # The copy's own timeout (the scenario's deadline) bounds the wait (FAIL-1).
        session = self.engine.wait(request)
        if session.state is OffloadState.DONE:
            return
        if session.reason is FailureReason.TIMEOUT:
            raise Finding(f"the {what} did not complete within {self.deadline}s")
        reason = "" if session.reason is None else session.reason.value
        raise Finding(f"the backend failed the {what}: {reason} {session.detail}")

    def drain(self) -> None:
        pending, self.pending = self.pending, []
        for item in pending:
            self.wait(item.request, item.what)
            item.on_done()
            self.oracle.check(f"after the {item.what}")

    def poll_pending(self) -> None:
        """Finish the pending copies that are done; keep the others (a deferred store lands when it lands)."""
        self.engine.poll()
        for item in list(self.pending):
            if not item.request.session.is_terminal:
                continue
            self.pending.remove(item)
            self.wait(item.request, item.what)
            item.on_done()
            self.oracle.check(f"after the {item.what}")


class _OffloadPlay:
    """Plays one offload scenario: its data and fault timing over kvspec's offload engine, judged by the oracle.

    Lookup, load, store and evict over the OFF-4 table, the GPU blocks and
    the copies are :class:`kvspec.exchange.OffloadEngine`'s; the hit's model
    is kvspec's plain OFF-5 (:func:`kvspec.spec.offload.get_offload_hit_tokens`).
    """

    engine: OffloadEngine
    oracle: PoolOracle
    copies: _Copies

    def __init__(self, scenario: OffloadScenario, backend: Backend, connector: OffloadConnector) -> None:
        self.scenario = scenario
        self.backend = backend
        self.hooks = connector
        source = scenario.config
        self.config = source.build() if isinstance(source, PresetConfig) else source
        self.offload = scenario.offload_config(self.config)
        self.f = self.offload.blocks_per_chunk
        self.sizes = [group.kv_cache_spec.block_size * self.f for group in self.config.kv_cache_groups]
        self.hits: dict[str, list[int]] = {}
        self.expected_hits: dict[str, list[int]] = {}
        self.problems: list[str] = []
        self.loaded_pages = 0
        self.stored_pages = 0

    def run(self) -> OffloadResult:
        started = time.monotonic()
        chunk_config = chunk_pool_config(self.config, rows=self.scenario.chunk_rows, blocks_per_chunk=self.f)
        evictions = 0
        with allocate_pool(self.config) as gpu, allocate_pool(chunk_config) as chunks:
            fill_background(gpu, seed="gpu")
            fill_background(chunks, seed="chunks")
            self.oracle = PoolOracle(self.config, chunk_config, self.f, gpu, chunks)
            with _agents(self.backend, self.problems) as (gpu_agent, chunk_agent):
                gpu_agent.register_memory(gpu.regions)
                chunk_agent.register_memory(chunks.regions)
                self.engine = OffloadEngine(
                    config=self.config,
                    chunk_config=chunk_config,
                    offload=self.offload,
                    chunk_rows=self.scenario.chunk_rows,
                    gpu=gpu_agent,
                    chunks=chunk_agent,
                    modes=self.backend.capabilities.modes,
                    timeout=self.scenario.deadline,
                )
                self.copies = _Copies(self.engine, self.oracle, self.scenario.deadline)
                try:
                    for spec in self.scenario.requests:
                        self._request(spec)
                    self.copies.drain()
                    self.oracle.check("at the end")
                except Finding as exc:
                    self.problems.append(str(exc))
                evictions = self.engine.evictions
        return OffloadResult(
            problems=tuple(self.problems),
            hits={rid: tuple(v) for rid, v in self.hits.items()},
            expected_hits={rid: tuple(v) for rid, v in self.expected_hits.items()},
            loaded_pages=self.loaded_pages,
            stored_pages=self.stored_pages,
            evictions=evictions,
            seconds=time.monotonic() - started,
        )

    def _allocate(self, g: int) -> int:
        block = self.engine.allocate_block()
        if block is None:
            self.copies.drain()  # a preempted request's blocks come back once its stores landed
            block = self.engine.allocate_block()
        if block is None:
            raise Finding("the scenario ran out of GPU blocks; give its config more num_blocks")
        self.oracle.scrub(g, block)
        return block

    # -- a request

    def _request(self, spec: OffloadRequest) -> None:
        if spec.after_stores_landed:
            self.copies.drain()
        else:
            self.copies.poll_pending()
        for g, k in spec.evict_before:
            self.engine.evict((spec.stream, g, k))
        self._run(spec, preempt=spec.preempt_after_steps)

    def _run(self, spec: OffloadRequest, *, preempt: int | None) -> None:
        rid, n, c = spec.request_id, spec.num_tokens, spec.local_hit_tokens
        present = self.engine.lookup(spec.stream, n)
        hit = call_hook(
            "get_offload_hit_tokens",
            lambda: self.hooks.get_offload_hit_tokens(
                self.config, present, request_id=rid, num_tokens=n, local_hit_tokens=c, offload=self.offload
            ),
        )
        want = check_hit(self.config, self.offload, present, hit, request_id=rid, num_tokens=n, local_hit_tokens=c)
        self.hits.setdefault(rid, []).append(hit)
        self.expected_hits.setdefault(rid, []).append(want)
        t = c + hit
        run = _Run(spec=spec, table=self._table(spec, t), computed=t, next_chunk=[0] * self.config.num_groups)
        run.loaded_chunks = [cdiv(t, size) if hit else 0 for size in self.sizes]
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
                self.copies.drain()  # rescheduled later, once its in-flight store landed and its blocks came back
                self._run(spec, preempt=None)  # it starts again from its lookup
                return
        if not steps:
            self._store(run, defer=spec.defer_last_store)
        self._finish(run)

    def _finish(self, run: _Run) -> None:
        run.check_offered(self.config, self.f, windows_too=self.scenario.require_window_stores)
        rid = run.spec.request_id
        call_hook("finish_request", lambda: self.hooks.finish_request(rid))
        held = [item for item in self.copies.pending if item.request_id == rid]
        if held:
            # Its blocks stay allocated until its in-flight stores landed (vLLM flushes them before reuse).
            last = held[-1]
            done = last.on_done
            table = run.table

            def release() -> None:
                done()
                self.engine.free_table(table)

            last.on_done = release
        else:
            self.engine.free_table(run.table)

    def _table(self, spec: OffloadRequest, computed: int) -> list[list[int]]:
        """The GPU block table at lookup: cached blocks below C, nulls where vLLM skips, fresh blocks above."""
        shape = self.engine.get_table_shape(spec.num_tokens, computed_tokens=computed, pruned=not spec.allocate_skipped)
        table: list[list[int]] = []
        for g, slots in enumerate(shape):
            block = self.config.kv_cache_groups[g].kv_cache_spec.block_size
            ids = []
            for position, slot in enumerate(slots):
                if slot == NULL_BLOCK_ID:
                    ids.append(NULL_BLOCK_ID)
                    continue
                block_id = self._allocate(g)
                if position < spec.local_hit_tokens // block:  # a GPU prefix-cache hit holds the computed page
                    self.oracle.write_page(spec.stream, g, block_id, position)
                ids.append(block_id)
            table.append(ids)
        return table

    def _step(self, run: _Run, tokens: int, *, defer: bool) -> None:
        """Compute ``tokens`` more tokens (their pages), then offer a store (OFF-3)."""
        start, end = run.computed, run.computed + tokens
        for g, group in enumerate(self.config.kv_cache_groups):
            block = group.kv_cache_spec.block_size
            ids = run.table[g]
            while len(ids) < cdiv(end, block):
                ids.append(self._allocate(g))
            for position in range(start // block, cdiv(end, block)):
                complete = (position + 1) * block <= end
                partial = None if complete else end - position * block
                self.oracle.write_page(run.spec.stream, g, ids[position], position, tokens=partial)
        run.computed = end
        self._store(run, defer=defer)

    def _store(self, run: _Run, *, defer: bool) -> None:
        rid, stream, o = run.spec.request_id, run.spec.stream, run.computed
        table = BlockIds(run.table)
        store = call_hook(
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
        maps = check_transfer(self.hooks, self.config, self.f, "get_store_set", store, request_id=rid, table=run.table)
        check_store_set(self.config, self.sizes, store, maps, request_id=rid, computed=o)
        for g, (first, stop) in enumerate(store.chunk_ranges):
            run.offered.update((stream, g, k) for k in range(first, stop))
        plan = self.engine.plan_store(stream, store, maps)
        run.next_chunk = list(store.next_chunks)
        if not plan.copies:
            return
        what = f"store of {rid!r} at {o} tokens"
        request = self.copies.post(True, plan.copies, what)
        self.stored_pages += len(plan.copies)
        addresses = [self.engine.chunk_address(layer, row, sub, g) for _, row, sub, g, layer in plan.writes]

        def landed() -> None:
            self.oracle.expect_stored(plan, addresses, deferred=defer)
            self.engine.land(plan)

        if defer:
            for address in addresses:
                self.oracle.in_flight_pages[address] = self.oracle.in_flight_pages.get(address, 0) + 1
            self.copies.pending.append(_Pending(request=request, what=what, request_id=rid, on_done=landed))
            return
        self.copies.wait(request, what)
        landed()
        self.oracle.check(f"after the {what}")

    def _load(self, run: _Run, t: int) -> None:
        rid, stream, c = run.spec.request_id, run.spec.stream, run.spec.local_hit_tokens
        table = BlockIds(run.table)
        load = call_hook(
            "get_load_set",
            lambda: self.hooks.get_load_set(
                self.config, table, request_id=rid, num_tokens=t, local_hit_tokens=c, offload=self.offload
            ),
        )
        maps = check_transfer(self.hooks, self.config, self.f, "get_load_set", load, request_id=rid, table=run.table)
        check_state_tokens(self.config, load, t, c)
        copies, missing = self.engine.plan_load(stream, load, maps)
        if missing is not None:
            raise Finding(
                f"get_load_set: {rid!r} reads chunk {missing[1]} of group {missing[0]}, which the chunk pool does "
                "not hold whole (never stored, written in part, or evicted): the hit counted a chunk that is "
                "not present (OFF-4, OFF-5, OFF-6)"
            )
        self.oracle.expect_loaded(run.table, stream, t=t, c=c)
        what = f"load of {rid!r} ({t - c} tokens past C={c})"
        if copies:
            self.copies.wait(self.copies.post(False, copies, what), what)
            self.loaded_pages += len(copies)
        self.oracle.check(f"after the {what}")


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
