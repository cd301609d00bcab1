"""Exchanges across ranks: one agent and one pool per rank, the canonical page as the oracle (PAR-1 .. PAR-8).

Theory of operation. A :class:`ParScenario` names the layers (each with its
canonical page, :mod:`kvspec.spec.parallel`), both engines' TP sizes, the
producer's PP stages and the consumer's DCP size. :func:`run_par_scenario`
creates one agent per rank through the backend under test, gives each rank
its own regions (one per layer it holds, pages back to back), fills them with
noise, and projects keyed canonical content into the producer ranks' pages
for one request. Then it asks the connector under test, per consumer rank,
which bytes it reads from which producer rank and whom it notifies
(:class:`kvspec.connector.ParallelConnector`; kvspec's planner,
``compute_rank_copies`` / ``compute_dcp_copies``, when the connector has no
such hook), pairs layers with ``pair_stage_layers``, all before any byte
moves, and runs the exchange one consumer rank at a time: READ, each consumer
rank reads from the producer ranks it faces; WRITE, those producer ranks
write into it. Each consumer rank then notifies the producer ranks its plan
names, with the count its plan carries; a producer rank frees (overwrites)
its blocks when that many notifications have come.

The oracle is the case's own arithmetic, not the planner's: which units each
rank owns, where they sit in its page, which canonical token a DCP row holds.
It checks every consumer page against the projection of the canonical
content, every other byte of every pool unchanged (other blocks, the null
block), every consumer byte written exactly once, and every producer rank
freed after exactly the notifications of the consumer ranks that face it.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing import shared_memory

import attrs

import kvspec.spec.parallel as par
from kvspec import KVSpecError, ParallelismError, TransferMode, format_error
from kvspec.connector import ConsumerRankPlan, as_parallel_connector
from kvspec.spec.parallel import CanonicalPage, PageOrder
from kvspec.transport import Backend, Descriptor, MemoryRegion, TransferState, Transport

__all__ = ["ParLayer", "ParResult", "ParScenario", "pair_layers", "run_par_scenario"]

# A cell: (tensor, sub-block, unit, row) of a page; the oracle's unit of placement.
Cell = tuple[int, int, int, int]

_REQUEST = b"par-request"


@attrs.frozen(kw_only=True)
class ParLayer:
    """One layer of the exchange: its name (the pairing key, PAR-7) and its canonical page (PAR-2)."""

    name: str
    page: CanonicalPage


def _to_layers(value: Iterable[ParLayer]) -> tuple[ParLayer, ...]:
    return tuple(value)


def _to_stages(value: Iterable[Iterable[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(stage) for stage in value)


@attrs.frozen(kw_only=True)
class ParScenario:
    """One request between two engines of different parallelism; ``layers`` in the consumer's order.

    ``producer_stages`` lists each producer PP stage's layers (empty: one
    stage holding every layer); ``num_blocks`` is the consumer's blocks of the
    request; a consumer with DCP reads ``consumer_dcp`` producer blocks into
    each of its blocks (PAR-8).
    """

    layers: tuple[ParLayer, ...] = attrs.field(converter=_to_layers)
    producer_tp: int
    consumer_tp: int
    producer_stages: tuple[tuple[str, ...], ...] = attrs.field(default=(), converter=_to_stages)
    consumer_dcp: int = 1
    dcp_interleave: int = 1
    mode: TransferMode = TransferMode.READ
    num_blocks: int = 2
    deadline: float = 10.0

    @property
    def num_ranks(self) -> int:
        """Agents the scenario starts: every producer rank of every stage, every consumer rank of every DCP rank."""
        return self.producer_tp * len(self.stages) + self.consumer_tp * self.consumer_dcp

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        """The producer's stages, one holding every layer when none are given."""
        return self.producer_stages or (tuple(layer.name for layer in self.layers),)


@attrs.frozen(kw_only=True)
class ParResult:
    """What the oracle found: ``problems`` (empty when clean) and ``refused``, the error that stopped planning.

    ``unsupported`` is the capability the connector under test said it lacks
    (its :class:`NotImplementedError`): nothing was planned or moved.
    """

    problems: tuple[str, ...]
    refused: KVSpecError | None = None
    posted: int = 0
    unsupported: str | None = None


# --------------------------------------------------------------------------- the oracle's own arithmetic


def _owned(extent: int, replicated: bool, tp: int, rank: int) -> tuple[int, int]:
    """Units [start, end) of a sub-block rank ``rank`` of ``tp`` holds: all, an even share, or one replica."""
    if replicated or tp == 1:
        return 0, extent
    if extent >= tp:
        share = extent // tp
        return rank * share, rank * share + share
    unit = rank // (tp // extent)
    return unit, unit + 1


def _cells(page: CanonicalPage, tp: int, rank: int) -> tuple[dict[Cell, tuple[int, int]], int]:
    """Every cell a rank holds -> ``(offset in its page, nbytes)``, and the page's size, from the shapes alone."""
    cells: dict[Cell, tuple[int, int]] = {}
    base = 0
    for t, tensor in enumerate(page.tensors):
        spans = [_owned(b.extent, b.replicated, tp, rank) for b in tensor.sub_blocks]
        sizes = [b.width * tensor.element_bytes for b in tensor.sub_blocks]
        row = sum((end - start) * size for (start, end), size in zip(spans, sizes, strict=True))
        before = 0
        for b, ((start, end), size) in enumerate(zip(spans, sizes, strict=True)):
            for local, unit in enumerate(range(start, end)):
                for r in range(tensor.rows):
                    if tensor.order is PageOrder.NHD:
                        offset = r * row + before + local * size
                    else:  # hnd and opaque: a unit's rows are adjacent, a sub-block's units are adjacent
                        offset = tensor.rows * before + (local * tensor.rows + r) * size
                    cells[(t, b, unit, r)] = (base + offset, size)
            before += (end - start) * size
        base += tensor.rows * row
    return cells, base


def _token(page: CanonicalPage, cell: Cell, dcp: int, dcp_rank: int, interleave: int) -> tuple[int, Cell]:
    """Which producer page of the consumer's block, and which cell of it, a consumer cell holds (PAR-8)."""
    t, b, unit, r = cell
    if dcp == 1 or not page.tensors[t].token_rows:
        return 0, cell
    chunk, pos = divmod(r, interleave)
    position = (chunk * dcp + dcp_rank) * interleave + pos
    rows = page.tensors[t].rows
    return position // rows, (t, b, unit, position % rows)


def _keyed(nbytes: int, *parts: object) -> bytes:
    seed = int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")
    return random.Random(seed).randbytes(nbytes)


def _canonical(layer: ParLayer, position: int) -> bytes:
    """The canonical content of one layer's block at logical ``position``, keyed by layer name and position."""
    return _keyed(layer.page.nbytes, "canonical", layer.name, position)


def _project(layer: ParLayer, position: int, tp: int, rank: int) -> bytes:
    """A producer rank's page for the canonical block at ``position``: its cells from the canonical page (PAR-2)."""
    canonical, _ = _cells(layer.page, 1, 0)
    cells, size = _cells(layer.page, tp, rank)
    content = _canonical(layer, position)
    page = bytearray(size)
    for cell, (offset, nbytes) in cells.items():
        at = canonical[cell][0]
        page[offset : offset + nbytes] = content[at : at + nbytes]
    return bytes(page)


def _expected(scenario: ParScenario, layer: ParLayer, block: int, c_rank: int, d_rank: int) -> bytes:
    """Consumer rank (c_rank, DCP d_rank)'s page of its ``block``-th block: its cells, each from its token (PAR-8)."""
    canonical, _ = _cells(layer.page, 1, 0)
    cells, size = _cells(layer.page, scenario.consumer_tp, c_rank)
    page = bytearray(size)
    for cell, (offset, nbytes) in cells.items():
        which, source = _token(layer.page, cell, scenario.consumer_dcp, d_rank, scenario.dcp_interleave)
        content = _canonical(layer, block * scenario.consumer_dcp + which)
        at = canonical[source][0]
        page[offset : offset + nbytes] = content[at : at + nbytes]
    return bytes(page)


def _facing(producer_tp: int, consumer_tp: int, consumer_rank: int) -> range:
    """The producer ranks a consumer rank faces, by the oracle's own count (PAR-4, PAR-6)."""
    if producer_tp >= consumer_tp:
        ratio = producer_tp // consumer_tp
        return range(consumer_rank * ratio, consumer_rank * ratio + ratio)
    first = consumer_rank // (consumer_tp // producer_tp)
    return range(first, first + 1)


# --------------------------------------------------------------------------- the exchange under test


def pair_layers(producer_stages: Sequence[Sequence[str]], consumer_layers: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Consumer layer -> (producer stage, index of the layer in that stage's regions), paired by name (PAR-7)."""
    pairs = par.pair_stage_layers(producer_stages, [consumer_layers])
    return {
        name: (p.producer_stage, list(producer_stages[p.producer_stage]).index(name))
        for p in pairs
        for name in p.layers
    }


@attrs.define
class _Rank:
    """One rank: its agent, its layers' page sizes and regions (pages back to back, block-major)."""

    agent: Transport
    layers: list[ParLayer]
    page_sizes: list[int]
    regions: list[MemoryRegion]
    shms: list[shared_memory.SharedMemory]

    def page(self, index: int, block: int) -> memoryview:
        size = self.page_sizes[index]
        return self.regions[index].buffer[block * size : (block + 1) * size]


def _block_ids(scenario: ParScenario) -> tuple[list[int], list[int], int]:
    """Producer ids (even), consumer ids (odd, reversed) and the pool size; block 0 is the null block, never used."""
    n_p = scenario.num_blocks * scenario.consumer_dcp
    producer = [2 * i + 2 for i in range(n_p)]
    consumer = [2 * (scenario.num_blocks - i) - 1 for i in range(scenario.num_blocks)]
    return producer, consumer, 2 * n_p + 2


@contextlib.contextmanager
def _ranks(backend: Backend, scenario: ParScenario, num_blocks: int) -> Iterator[dict[str, _Rank]]:
    """Create every rank's agent and regions; close and unlink them all on the way out."""
    by_name = {layer.name: layer for layer in scenario.layers}
    layout: dict[str, tuple[list[ParLayer], int, int]] = {}
    for s, stage in enumerate(scenario.stages):
        for p in range(scenario.producer_tp):
            layout[f"p{s}.{p}"] = ([by_name[n] for n in stage], scenario.producer_tp, p)
    for c in range(scenario.consumer_tp):
        for d in range(scenario.consumer_dcp):
            layout[f"c{c}.{d}"] = (list(scenario.layers), scenario.consumer_tp, c)
    ranks: dict[str, _Rank] = {}
    try:
        for name, (layers, tp, rank) in layout.items():
            sizes = [_cells(layer.page, tp, rank)[1] for layer in layers]
            shms = [
                shared_memory.SharedMemory(name=f"kvpar_{secrets.token_hex(6)}", create=True, size=num_blocks * size)
                for size in sizes
            ]
            regions = [
                MemoryRegion(buffer=shm.buf[: num_blocks * size], shm_name=shm.name)  # type: ignore[index]
                for shm, size in zip(shms, sizes, strict=True)
            ]
            for i, region in enumerate(regions):
                region.buffer[:] = _keyed(region.nbytes, "background", name, i)
            ranks[name] = _Rank(
                agent=backend.create_agent(name), layers=layers, page_sizes=sizes, regions=regions, shms=shms
            )
            ranks[name].agent.register_memory(regions)
        yield ranks
    finally:
        for r in ranks.values():
            with contextlib.suppress(Exception):
                r.agent.close()
            for region in r.regions:
                with contextlib.suppress(BufferError):
                    region.buffer.release()
            for shm in r.shms:
                with contextlib.suppress(BufferError):
                    shm.close()
                with contextlib.suppress(FileNotFoundError):
                    shm.unlink()


def _plan(scenario: ParScenario, connector: object, c_rank: int, d_rank: int) -> ConsumerRankPlan:
    """The connector's plan for one consumer rank: its copies per layer and its notifications (PAR-3, PAR-4, PAR-6)."""
    return as_parallel_connector(connector).plan_consumer_rank(
        [layer.page for layer in scenario.layers],
        producer_tp=scenario.producer_tp,
        consumer_tp=scenario.consumer_tp,
        consumer_rank=c_rank,
        consumer_dcp=scenario.consumer_dcp,
        dcp_rank=d_rank,
        dcp_interleave=scenario.dcp_interleave,
        producer_pp=len(scenario.stages),
    )


# (consumer rank name, producer rank name) -> descriptors, local side the consumer's (READ) view
_Plans = dict[tuple[str, str], list[Descriptor]]


@attrs.frozen(kw_only=True)
class _Notices:
    """Consumer rank -> the producer ranks it notifies; producer rank -> the count it is told to wait for (PAR-6)."""

    notified: dict[str, set[str]]
    counts: dict[str, int]


def _plan_all(scenario: ParScenario, ranks: dict[str, _Rank], connector: object) -> tuple[_Plans, _Notices]:
    """Every pair's descriptors, planned before any byte moves (PAR-5), and whom each consumer rank notifies.

    A pair's key is (consumer rank, producer rank); a pair with no descriptors
    only notifies. The notices map each consumer rank to the producer ranks
    it notifies, and each notified producer rank to the count it was told.
    """
    producer_ids, consumer_ids, _ = _block_ids(scenario)
    pairing = pair_layers(scenario.stages, [layer.name for layer in scenario.layers])
    plans: _Plans = {}
    notices = _Notices(notified={}, counts={})
    for c in range(scenario.consumer_tp):
        for d in range(scenario.consumer_dcp):
            consumer = ranks[f"c{c}.{d}"]
            plan = _plan(scenario, connector, c, d)
            if len(plan.copies) != len(scenario.layers):
                raise ParallelismError(
                    f"ConsumerRankPlan.copies: expected {len(scenario.layers)} lists (one per layer), "
                    f"got {len(plan.copies)} (PAR-3)"
                )
            notices.notified[f"c{c}.{d}"] = set()
            for p, count in zip(plan.notified, plan.completion_counts, strict=True):
                for s in range(len(scenario.stages)):
                    plans.setdefault((f"c{c}.{d}", f"p{s}.{p}"), [])
                    notices.notified[f"c{c}.{d}"].add(f"p{s}.{p}")
                    notices.counts[f"p{s}.{p}"] = count
            for index, (layer, copies) in enumerate(zip(scenario.layers, plan.copies, strict=True)):
                stage, region = pairing[layer.name]
                for copy in copies:
                    producer = ranks.get(f"p{stage}.{copy.producer_rank}")
                    if producer is None:
                        raise ParallelismError(
                            f"RankCopy.producer_rank: expected below producer_tp {scenario.producer_tp}, "
                            f"got {copy.producer_rank} (PAR-4)"
                        )
                    key = (f"c{c}.{d}", f"p{stage}.{copy.producer_rank}")
                    for k, c_block in enumerate(consumer_ids):
                        p_block = producer_ids[k * scenario.consumer_dcp + copy.producer_page]
                        plans.setdefault(key, []).append(
                            Descriptor(
                                local_region=index,
                                local_offset=c_block * consumer.page_sizes[index] + copy.consumer_offset,
                                remote_region=region,
                                remote_offset=p_block * producer.page_sizes[region] + copy.producer_offset,
                                nbytes=copy.nbytes,
                            )
                        )
    return plans, notices


def _flip(descriptors: list[Descriptor]) -> list[Descriptor]:
    """The same copies seen from the producer (it posts a WRITE)."""
    return [
        Descriptor(
            local_region=d.remote_region,
            local_offset=d.remote_offset,
            remote_region=d.local_region,
            remote_offset=d.local_offset,
            nbytes=d.nbytes,
        )
        for d in descriptors
    ]


class _Stopped(Exception):
    """A transfer failed or a wait ran past the scenario's deadline; the message says which."""


class _Exchange:
    """Runs the planned copies over the agents and keeps the producer ranks' notification counts (PAR-6)."""

    def __init__(self, scenario: ParScenario, ranks: dict[str, _Rank], plans: _Plans, notices: _Notices) -> None:
        self.scenario, self.ranks, self.plans = scenario, ranks, plans
        self.notified, self.counts = notices.notified, notices.counts
        self.heard: dict[str, list[str]] = {name: [] for name in ranks if name.startswith("p")}
        self.sent = dict.fromkeys(self.heard, 0)
        self.freed_after: dict[str, int] = {}
        self.problems: list[str] = []
        self.posted = 0
        self.peers: dict[tuple[str, str], str] = {}
        self.names: dict[tuple[str, str], str] = {}
        self.deadline = time.monotonic() + scenario.deadline

    def connect(self) -> None:
        for c_name, p_name in self.plans:
            consumer, producer = self.ranks[c_name].agent, self.ranks[p_name].agent
            self.peers[(c_name, p_name)] = consumer.add_remote_agent(producer.get_agent_metadata())
            self.peers[(p_name, c_name)] = producer.add_remote_agent(consumer.get_agent_metadata())
            self.names[(p_name, self.peers[(p_name, c_name)])] = c_name  # how the producer's agent names it

    def _wait(self, agent: Transport, handle: object, what: str) -> None:
        while True:
            status = agent.check(handle)  # type: ignore[arg-type]
            if status.state is TransferState.DONE:
                agent.release(handle)  # type: ignore[arg-type]
                return
            if status.state is TransferState.FAILED:
                raise _Stopped(f"{what}: FAILED ({status.reason}, {status.detail})")
            if time.monotonic() > self.deadline:
                raise _Stopped(f"{what}: still {status.state.value} after {self.scenario.deadline}s")
            time.sleep(0.0005)

    def serve(self, c_name: str) -> None:
        """Move one consumer rank's pages, then notify the producer ranks its plan names."""
        pairs = [(key, descriptors) for key, descriptors in self.plans.items() if key[0] == c_name]
        consumer = self.ranks[c_name].agent
        for (_, p_name), descriptors in pairs:
            if not descriptors:
                continue
            self.posted += 1
            if self.scenario.mode is TransferMode.READ:
                handle = consumer.post(TransferMode.READ, descriptors, peer=self.peers[(c_name, p_name)])
                self._wait(consumer, handle, f"READ {c_name} <- {p_name}")
            else:
                producer = self.ranks[p_name].agent
                handle = producer.post(TransferMode.WRITE, _flip(descriptors), peer=self.peers[(p_name, c_name)])
                self._wait(producer, handle, f"WRITE {p_name} -> {c_name}")
        told = [p_name for (_, p_name), _descriptors in pairs if p_name in self.notified[c_name]]
        for p_name in told:
            consumer.send_notification(self.peers[(c_name, p_name)], _REQUEST)
            self.sent[p_name] += 1
        self.collect(set(told))

    def collect(self, producers: set[str]) -> None:
        """Each producer rank drains its notifications and frees at its completion count (PAR-6)."""
        waiting = set(producers)
        while waiting:
            for p_name in sorted(waiting):
                rank = self.ranks[p_name]
                for note in rank.agent.get_notifications():
                    if note.message != _REQUEST:
                        continue
                    if p_name in self.freed_after:
                        self.problems.append(
                            f"{p_name}: a notification from {note.peer} came after it freed the request's blocks "
                            f"at notification {self.freed_after[p_name]} (PAR-6)"
                        )
                    self.heard[p_name].append(self.names.get((p_name, note.peer), note.peer))
                self.maybe_free(p_name)
                if len(self.heard[p_name]) >= self.sent[p_name]:
                    waiting.discard(p_name)  # every notification sent to it so far has come
            if waiting and time.monotonic() > self.deadline:
                raise _Stopped(
                    f"producer ranks {sorted(waiting)} still wait for notifications after {self.scenario.deadline}s"
                )
            if waiting:
                time.sleep(0.0005)

    def maybe_free(self, p_name: str) -> None:
        # The count comes with the notifications; a rank no plan notifies never learns one and never frees.
        count = self.counts.get(p_name)
        if count is None or p_name in self.freed_after or len(self.heard[p_name]) < count:
            return
        self.freed_after[p_name] = len(self.heard[p_name])
        # Freed blocks go to the next request at once: any later read of them gets its bytes, not this request's.
        producer_ids, _, _ = _block_ids(self.scenario)
        rank = self.ranks[p_name]
        for index in range(len(rank.layers)):
            for block in producer_ids:
                page = rank.page(index, block)
                page[:] = _keyed(page.nbytes, "reused", p_name, index, block)


# --------------------------------------------------------------------------- the run


def run_par_scenario(scenario: ParScenario, *, backend: Backend, connector: object = None) -> ParResult:
    """Play one request across every rank pair over ``backend``; return what the oracle found.

    ``connector`` plans each consumer rank's copies and notifications when it
    has the parallel hook (:func:`kvspec.connector.as_parallel_connector`);
    kvspec's planner does otherwise.
    """
    producer_ids, consumer_ids, num_blocks = _block_ids(scenario)
    with _ranks(backend, scenario, num_blocks) as ranks:
        for s in range(len(scenario.stages)):
            for p in range(scenario.producer_tp):
                rank = ranks[f"p{s}.{p}"]
                for index, layer in enumerate(rank.layers):
                    for position, block in enumerate(producer_ids):
                        rank.page(index, block)[:] = _project(layer, position, scenario.producer_tp, p)
        before = {name: [bytes(r.buffer) for r in rank.regions] for name, rank in ranks.items()}
        try:
            plans, notices = _plan_all(scenario, ranks, connector)
        except NotImplementedError as exc:  # the connector lacks a capability the case needs: nothing planned
            return ParResult(problems=(), unsupported=str(exc))
        except KVSpecError as exc:
            changed = [name for name, rank in ranks.items() if [bytes(r.buffer) for r in rank.regions] != before[name]]
            moved = tuple(f"{name}: bytes changed although planning was refused (PAR-5)" for name in changed)
            return ParResult(problems=moved, refused=exc)
        exchange = _Exchange(scenario, ranks, plans, notices)
        exchange.connect()
        for p_name in exchange.heard:
            exchange.maybe_free(p_name)  # a rank that expects no notification frees now, before any byte moves
        problems: list[str] = []
        try:
            for c in range(scenario.consumer_tp):
                for d in range(scenario.consumer_dcp):
                    exchange.serve(f"c{c}.{d}")
        except (KVSpecError, _Stopped) as exc:
            problems.append(f"the exchange stopped: {format_error(exc) if isinstance(exc, KVSpecError) else exc}")
        problems += exchange.problems
        problems += _check_counts(scenario, exchange)
        problems += _check_writes(scenario, ranks, plans)
        problems += _check_pages(scenario, ranks, before, consumer_ids)
        problems += _check_producers(scenario, ranks, before, exchange.freed_after)
        return ParResult(problems=tuple(problems), posted=exchange.posted)


def _check_counts(scenario: ParScenario, exchange: _Exchange) -> list[str]:
    """Every producer rank freed once, after exactly the consumer ranks that face it, each once (PAR-6)."""
    problems = []
    for p_name, heard in exchange.heard.items():
        tp_rank = int(p_name.split(".")[1])
        facing = sorted(
            f"c{c}.{d}"
            for c in range(scenario.consumer_tp)
            for d in range(scenario.consumer_dcp)
            if tp_rank in _facing(scenario.producer_tp, scenario.consumer_tp, c)
        )
        freed = exchange.freed_after.get(p_name)
        if freed != len(facing):
            problems.append(
                f"{p_name}: freed the request's blocks after {freed} notifications, expected after {len(facing)}, "
                f"from {facing} (PAR-6)"
            )
        if sorted(heard) != facing:
            problems.append(f"{p_name}: notified by {sorted(heard)}, expected by {facing} (PAR-6)")
    return problems


def _check_writes(scenario: ParScenario, ranks: dict[str, _Rank], plans: _Plans) -> list[str]:
    """Every consumer byte the plans write is written once: one elected source per destination (PAR-3, PAR-4)."""
    problems = []
    for c_name in sorted({c for c, _ in plans}):
        rank = ranks[c_name]
        writers: list[dict[int, str]] = [{} for _ in rank.regions]
        twice: list[str] = []
        for (consumer, p_name), descriptors in sorted(plans.items()):
            if consumer != c_name:
                continue
            for d in descriptors:
                seen = writers[d.local_region]
                for at in range(d.local_offset, d.local_offset + d.nbytes):
                    if at in seen and len(twice) < 3:
                        twice.append(
                            f"{c_name}: byte {at} of layer {rank.layers[d.local_region].name} written by {seen[at]} "
                            f"and {p_name} (PAR-4)"
                        )
                    seen.setdefault(at, p_name)
        problems += twice
    return problems


def _cell_name(page: CanonicalPage, cell: Cell) -> str:
    t, b, unit, r = cell
    return f"{page.tensors[t].name}.{page.tensors[t].sub_blocks[b].name}[{unit}] row {r}"


def _labels(scenario: ParScenario, layer: ParLayer) -> dict[bytes, str]:
    """Canonical cells' bytes -> their names, to say what a wrong cell holds instead (unique ones only)."""
    canonical, _ = _cells(layer.page, 1, 0)
    found: dict[bytes, str] = {}
    for position in range(scenario.num_blocks * scenario.consumer_dcp):
        content = _canonical(layer, position)
        for cell, (at, nbytes) in canonical.items():
            key = content[at : at + nbytes]
            found[key] = "" if key in found else f"{_cell_name(layer.page, cell)} of canonical block {position}"
    return found


def _describe(
    page: CanonicalPage, cells: dict[Cell, tuple[int, int]], got: bytes, want: bytes, labels: dict[bytes, str]
) -> str:
    """Where the first wrong cell is and, when its bytes are one canonical cell's, which one it holds."""
    for cell, (offset, nbytes) in sorted(cells.items(), key=lambda kv: kv[1][0]):
        if got[offset : offset + nbytes] != want[offset : offset + nbytes]:
            held = labels.get(got[offset : offset + nbytes]) or "bytes of no canonical cell (stale, reused or noise)"
            return f"first wrong: {_cell_name(page, cell)} at byte {offset} ({nbytes} bytes) holds {held}"
    return "bytes outside every cell differ"


def _check_producers(
    scenario: ParScenario, ranks: dict[str, _Rank], before: dict[str, list[bytes]], freed: dict[str, int]
) -> list[str]:
    """No producer byte changed, but a freed rank's request blocks, which hold the next request's bytes (PAR-3)."""
    producer_ids, _, _ = _block_ids(scenario)
    problems = []
    for name, rank in ranks.items():
        if not name.startswith("p"):
            continue
        for index, layer in enumerate(rank.layers):
            want = bytearray(before[name][index])
            size = rank.page_sizes[index]
            for block in producer_ids if name in freed else ():
                want[block * size : (block + 1) * size] = _keyed(size, "reused", name, index, block)
            if bytes(rank.regions[index].buffer) != want:
                problems.append(f"{name}: layer {layer.name} changed on the producer side")
    return problems


def _check_pages(
    scenario: ParScenario, ranks: dict[str, _Rank], before: dict[str, list[bytes]], consumer_ids: list[int]
) -> list[str]:
    """Consumer pages equal the projection; nothing else in any consumer pool changed (PAR-2, PAR-3)."""
    problems: list[str] = []
    for c in range(scenario.consumer_tp):
        for d in range(scenario.consumer_dcp):
            name = f"c{c}.{d}"
            rank = ranks[name]
            for index, layer in enumerate(rank.layers):
                size = rank.page_sizes[index]
                want = bytearray(before[name][index])
                for k, block in enumerate(consumer_ids):
                    want[block * size : (block + 1) * size] = _expected(scenario, layer, k, c, d)
                got = bytes(rank.regions[index].buffer)
                if got == want:
                    continue
                for block in range(len(got) // size):
                    g, w = got[block * size : (block + 1) * size], want[block * size : (block + 1) * size]
                    if g == w:
                        continue
                    if block in consumer_ids:
                        cells, _ = _cells(layer.page, scenario.consumer_tp, c)
                        where = _describe(layer.page, cells, g, bytes(w), _labels(scenario, layer))
                        problems.append(
                            f"{name}: layer {layer.name} block {block} (request block {consumer_ids.index(block)}) "
                            f"differs from the canonical projection; {where}"
                        )
                    else:
                        what = "the null block" if block == 0 else "a block outside the request"
                        problems.append(f"{name}: layer {layer.name} block {block}, {what}, changed")
    return problems
