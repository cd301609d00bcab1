"""The engine roles: one object per side that plays a request's steps, for the endpoints and the suite alike.

Theory of operation
-------------------

The driver core (:mod:`kvspec.drivers._driver`) carries out what a session asks; it
does not decide which blocks a request gets, nor whether the request may
move at all. That is the engine's part, and it is written once, here, for
both kvspec's exchange endpoints (:mod:`kvspec.drivers._exchange`) and the
conformance suite's scenarios:

- :class:`ProducerEngine` clips the request's table (CLIP-1), creates its
  :class:`ProducerSession` with the digests of the advertised blocks (SM-1,
  INT-1) and, in WRITE mode, pairs the consumer's offer and plans the write
  (ALIGN-1, STATE-3, PLAN-1) when the driver asks for it.
- :class:`ConsumerEngine` plays a consumer request's steps in one order:
  the request arrives (a known peer, the same mode), its suffix is
  allocated and clipped (CLIP-1), the :class:`ConsumerSession` is created,
  and then, as steps of that session, the state position is checked
  (STATE-1, STATE-4), the lists are paired (WIN-1, ALIGN-1) and every byte
  is planned (PLAN-1). A step that refuses records a ``check`` fault and
  ends the session FAILED with the typed reason and its one release
  (FAIL-1, REL-1); otherwise the session starts.

Which blocks a request gets is the engines' too, through one
:class:`BlockAllocator` each (:mod:`kvspec.drivers._tables`, imported by
this module alone): the producer's table after prefill (pruned as vLLM
prunes, a state group's scratch slots at its tail), the consumer's uncached
suffix, and where each list ends. Each engine keeps the tables it handed out
(``tables``, by request id) and frees them when the driver frees the request.
An endpoint lets the engine allocate; a scenario whose case names its block
ids passes them as a claim (``claim=``), and the engine takes them from the
same free list. Only this module allocates request tables (tests/test_engine_seam.py).
What varies is passed in as a value or a callable, never decided by
branching on the caller: the allocator's reuse order, and the producer's
pairing of a WRITE offer (:func:`pair_offer_by_ends` for a producer that
does not know the consumer's prefix hit, :func:`pair_offer_by_connector`
for a harness that does).

- :class:`OffloadEngine` is the offload engine's part: lookup, load, store
  and evict over the OFF-4 chunk table (a key present only once its chunk
  is whole and nothing writes it, LRU eviction of idle keys), the GPU
  blocks of a request's table from its own allocator, and the copies, each
  an :class:`OffloadSession` the posting agent's driver carries out. What
  a store or a load should move is the caller's hooks' answer
  (``get_store_set``, ``get_load_set``); the engine turns it into copies.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvspec.core._enums import FailureReason, StateProfile, TransferMode
from kvspec.core._errors import IncompatiblePeerError, KVSpecError, TransportError
from kvspec.core._models import NULL_BLOCK_ID, BlockIds, KVCacheConfig
from kvspec.drivers._connector import Connector, pair_with
from kvspec.drivers._driver import OFFLOAD, Driver, LiveRequest, Operation, poll_until, reason_of
from kvspec.drivers._tables import (
    BlockAllocator,
    Reuse,
    get_lookup_table_shape,
    get_page_ends,
    get_producer_table_shape,
    get_suffix_counts,
    get_whole_table_ends,
)
from kvspec.protocol._offload_session import ChunkCopy, OffloadKind, OffloadSession
from kvspec.protocol._plan import TransferPlan
from kvspec.protocol._session import DEFAULT_DRAIN_TIMEOUT, ConsumerSession, ProducerSession
from kvspec.reference._integrity import BlockPairsLike
from kvspec.reference._messages import BlockOffer, TransferParams
from kvspec.reference._reference import compute_block_pairs
from kvspec.spec.coverage import BlockLists, TransferRequest
from kvspec.spec.offload import LoadSet, OffloadConfig, StoreSet, get_sub_block_offset, is_chunk_present
from kvspec.spec.state import check_state_position, get_state_group_indices, get_state_paired_lists
from kvspec.transport._base import Transport

__all__ = [
    "BlockAllocator",
    "ChunkKey",
    "ConsumerEngine",
    "GpuCopy",
    "OffloadEngine",
    "PairOffer",
    "ProducerEngine",
    "Reuse",
    "StorePlan",
    "pair_offer_by_connector",
    "pair_offer_by_ends",
]

PairOffer = Callable[[LiveRequest[ProducerSession], BlockOffer], BlockPairsLike]
"""How a producer pairs its list with a consumer's offer (ALIGN-1, STATE-3)."""


def pair_offer_by_ends(config: KVCacheConfig) -> PairOffer:
    """A producer's pairing that knows nothing of the consumer's prefix hit (ALIGN-1, STATE-3).

    The offer is aligned to the tail of the producer's own list and refused
    if both lists say where they end and the ends differ; a state group's one
    slot pairs by STATE-3, not by its list's end.
    """

    def pair(request: LiveRequest[ProducerSession], offer: BlockOffer) -> BlockPairsLike:
        params = request.session.params
        lists = BlockLists(
            producer_block_ids=params.producer_block_ids,
            consumer_block_ids=offer.consumer_block_ids,
            producer_block_ends=params.producer_block_ends,
            consumer_block_ends=offer.consumer_block_ends,
        )
        return compute_block_pairs(get_state_paired_lists(config, lists))

    return pair


def pair_offer_by_connector(
    connector: Connector, config: KVCacheConfig, prefix_hit_tokens: Callable[[str], int]
) -> PairOffer:
    """A producer's pairing that knows the consumer's prefix hit: the connector's own (WIN-1, ALIGN-1).

    A real producer does not know it (:func:`pair_offer_by_ends`); a test
    harness does (``prefix_hit_tokens`` by request id), and so puts the
    connector's own pairing under the WRITE it moves.
    """

    def pair(request: LiveRequest[ProducerSession], offer: BlockOffer) -> BlockPairsLike:
        params = request.session.params
        geometry = TransferRequest(
            num_tokens=params.num_tokens,
            prefix_hit_tokens=prefix_hit_tokens(request.request_id),
            producer_block_ids=params.producer_block_ids,
            consumer_block_ids=offer.consumer_block_ids,
            recomputed_tokens=params.recomputed_tokens,
            producer_block_ends=params.producer_block_ends,
            consumer_block_ends=offer.consumer_block_ends,
        )
        return pair_with(connector, config, geometry)

    return pair


class _TableOwner:
    """What both engine roles share: one allocator over the engine's pool, and the tables it handed out."""

    config: KVCacheConfig

    def _own_tables(self, on_free: Callable[[list[int]], None] | None, reuse: Reuse) -> None:
        self.allocator = BlockAllocator(self.config.num_blocks, on_free=on_free, reuse=reuse)
        self.tables: dict[str, BlockIds] = {}

    def _keep(self, request_id: str | None, table: BlockIds) -> BlockIds:
        if request_id is not None:
            self.tables[request_id] = table
        return table

    def free_blocks(self, block_ids: BlockIds, *, missing_ok: bool = False) -> None:
        """Return a request's blocks to the pool (SM-1, SM-2); ``missing_ok``: a claimed table may share blocks."""
        self.allocator.free_groups(block_ids, missing_ok=missing_ok)

    def free_table(self, request_id: str, *, missing_ok: bool = False) -> None:
        """Return the table handed out for ``request_id`` to the pool; the record stays for whoever judges it."""
        self.free_blocks(self.tables[request_id], missing_ok=missing_ok)


class ProducerEngine(_TableOwner):
    """The prefill engine's steps: clip, hold the blocks in a session, pair and plan a WRITE (CLIP-1, SM-1, PLAN-1).

    ``peer_config`` gives the layout of the consumer a request talks to;
    ``pair_offer`` pairs an offer (default: :func:`pair_offer_by_ends`, as a
    producer that does not know the consumer's prefix hit). The driver's
    ``plan_write`` is :meth:`plan_write`.
    """

    def __init__(
        self,
        *,
        engine_id: str,
        config: KVCacheConfig,
        connector: Connector,
        driver: Driver[ProducerSession],
        peer_config: Callable[[LiveRequest[ProducerSession]], KVCacheConfig],
        pair_offer: PairOffer | None = None,
        on_free: Callable[[list[int]], None] | None = None,
        reuse: Reuse = "lowest",
    ) -> None:
        self.engine_id = engine_id
        self.config = config
        self.connector = connector
        self.driver = driver
        self.peer_config = peer_config
        self.pair_offer: PairOffer = pair_offer_by_ends(config) if pair_offer is None else pair_offer
        self._own_tables(on_free, reuse)
        driver.plan_write = self.plan_write

    def allocate_table(
        self,
        request_id: str | None,
        *,
        num_tokens: int,
        recomputed_tokens: int = 0,
        claim: BlockIds | None = None,
        whole: bool = False,
    ) -> BlockIds:
        """The request's table after prefill of ``T + R`` tokens, pruned with ``T`` (WIN-1, CLIP-1, STATE-2).

        By default only what is advertised is allocated (the table clipped,
        CLIP-1), so the pool never needs the whole unpruned table; ``whole``
        allocates every real block vLLM holds, scratch slots included.
        ``claim`` is a table the caller names: its free ids are taken as they
        are. The table is kept under ``request_id`` (``None``: not kept).
        """
        if claim is not None:
            return self._keep(request_id, self.allocator.claim(claim))
        shape = get_producer_table_shape(self.config, num_tokens=num_tokens, recomputed_tokens=recomputed_tokens)
        if not whole:
            shape = self.clip(shape)
        real = self.allocator.allocate_groups([sum(1 for b in group if b != NULL_BLOCK_ID) for group in shape])
        table = []
        for group, ids in zip(shape, real, strict=True):
            fresh = iter(ids)
            table.append([NULL_BLOCK_ID if b == NULL_BLOCK_ID else next(fresh) for b in group])
        return self._keep(request_id, BlockIds(table))

    def get_table_ends(self, num_tokens: int) -> tuple[int, ...]:
        """Where an unclipped table for ``num_tokens`` tokens ends: it starts at logical block 0 (ALIGN-1)."""
        return get_whole_table_ends(self.config, num_tokens)

    def get_page_ends(
        self, table: BlockIds, *, num_tokens: int, declared: tuple[int, ...] | None
    ) -> tuple[int, ...] | None:
        """Where ``table``'s lists end for keying its pages: past a state group's scratch slots (STATE-2)."""
        return get_page_ends(self.config, table, num_tokens=num_tokens, declared=declared)

    def get_state_tokens(self, num_tokens: int, *, given: int | None = None, send: bool = True) -> int | None:
        """What P says its state absorbed: ``given``, else ``T``; ``None`` without state or unsent (STATE-1)."""
        if not send or not get_state_group_indices(self.config):
            return None
        return num_tokens if given is None else given

    def clip(self, block_ids: BlockIds) -> BlockIds:
        """The advertised form of a table: clipped through the connector seam (CLIP-1)."""
        return self.connector.clip_block_ids(self.config, block_ids)

    def hold(
        self,
        request_id: str,
        *,
        advertised: BlockIds,
        num_tokens: int,
        mode: TransferMode,
        now: float,
        lease_duration: float,
        release_grace: float,
        drain_timeout: float,
        peer: str | None = None,
        producer_block_ends: tuple[int, ...] | list[int] | None = None,
        recomputed_tokens: int = 0,
        state_tokens: int | None = None,
    ) -> LiveRequest[ProducerSession]:
        """Pin ``advertised`` (already clipped) in a new session the driver tracks (SM-1).

        With integrity on, the parameters carry the digests of the blocks as
        they are now, so the pages must be written first (INT-1).
        """
        session = ProducerSession.create(
            request_id=request_id,
            producer_engine_id=self.engine_id,
            producer_block_ids=advertised,
            producer_block_ends=producer_block_ends,
            num_tokens=num_tokens,
            mode=mode,
            now=now,
            lease_duration=lease_duration,
            release_grace=release_grace,
            drain_timeout=drain_timeout,
            producer_block_digests=self.driver.digests(advertised),
            recomputed_tokens=recomputed_tokens,
            state_tokens=state_tokens,
        )
        return self.driver.add(LiveRequest(session=session, peer=peer))

    def plan_write(self, request: LiveRequest[ProducerSession], offer: BlockOffer) -> TransferPlan:
        """Pair the offer, keep the pairs for INT-1, and plan every byte of the WRITE (ALIGN-1, PLAN-1)."""
        pairs = self.pair_offer(request, offer)
        request.pairs = pairs  # what the write moves, for the Completion's digests (INT-1)
        return self.connector.plan(producer_config=self.config, consumer_config=self.peer_config(request), pairs=pairs)


class ConsumerEngine(_TableOwner):
    """The decode engine's steps for one request: arrive, allocate, clip, session, check, pair, plan, start.

    ``state_profile`` is where this engine's transferred state stands (only
    with state groups, STATE-1); ``transfer_timeout``, ``drain_timeout`` and
    ``start_margin`` are the sessions' (SM-2); ``on_free`` and ``reuse``
    the allocator's (:class:`BlockAllocator`).
    """

    def __init__(
        self,
        *,
        engine_id: str,
        config: KVCacheConfig,
        mode: TransferMode,
        connector: Connector,
        driver: Driver[ConsumerSession],
        state_profile: StateProfile | None = None,
        transfer_timeout: float | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        start_margin: float = 0.0,
        on_free: Callable[[list[int]], None] | None = None,
        reuse: Reuse = "lowest",
    ) -> None:
        self.engine_id = engine_id
        self.config = config
        self.mode = mode
        self.connector = connector
        self.driver = driver
        self.state_profile = state_profile
        self.transfer_timeout = transfer_timeout
        self.drain_timeout = drain_timeout
        self.start_margin = start_margin
        self._own_tables(on_free, reuse)

    def allocate_suffix(
        self,
        request_id: str | None,
        *,
        num_tokens: int,
        prefix_hit_tokens: int,
        recomputed_tokens: int = 0,
        claim: BlockIds | None = None,
    ) -> BlockIds:
        """The uncached suffix after a prefix hit, before clipping; zero groups for a full hit (CLIP-1, WIN-1).

        ``claim`` is a suffix the caller names: its free ids are taken as they
        are. The suffix is kept under ``request_id`` (``None``: not kept).
        """
        if claim is not None:
            return self._keep(request_id, self.allocator.claim(claim))
        counts = get_suffix_counts(
            self.config,
            num_tokens=num_tokens,
            prefix_hit_tokens=prefix_hit_tokens,
            recomputed_tokens=recomputed_tokens,
        )
        return self._keep(request_id, BlockIds([]) if counts is None else self.allocator.allocate_groups(counts))

    def get_suffix_ends(self, params: TransferParams, *, prefix_hit_tokens: int) -> tuple[int, ...] | None:
        """Where C's suffix ends: the request's last block, ``T + R`` tokens; ``None`` when nothing moves (ALIGN-1)."""
        if prefix_hit_tokens >= params.num_tokens:
            return None
        return get_whole_table_ends(self.config, params.num_tokens + params.recomputed_tokens)

    def begin(
        self,
        params: TransferParams,
        *,
        prefix_hit_tokens: int,
        peer: str | None,
        peer_config: KVCacheConfig | None,
        suffix: Callable[[], BlockIds],
        consumer_block_ends: tuple[int, ...] | None,
        now: float,
    ) -> LiveRequest[ConsumerSession]:
        """Play a request's steps to its start, or to FAILED with a typed reason (CLIP-1, WIN-1, PLAN-1, FAIL-1).

        ``suffix`` allocates the uncached suffix (before clipping); it runs
        only once the peer and the mode are known to be right. ``peer`` is the
        producer's agent, ``peer_config`` its layout (``None``: no handshake).
        """
        refusal: KVSpecError | None = None
        consumer_ids = BlockIds([])
        if peer is None or peer_config is None:
            refusal = TransportError(
                f"no handshake with engine {params.producer_engine_id!r}", reason=FailureReason.PEER_DISCONNECTED.value
            )
        elif params.mode is not self.mode:
            refusal = IncompatiblePeerError({"mode": (params.mode.value, self.mode.value)})
        else:
            try:
                consumer_ids = self.connector.clip_block_ids(self.config, suffix())
            except KVSpecError as exc:
                refusal = exc
        # The session sees the request before any check of its contents: a refusal is its outcome.
        session = ConsumerSession(
            params=params,
            consumer_engine_id=self.engine_id,
            consumer_block_ids=consumer_ids,
            start_margin=self.start_margin,
            transfer_timeout=self.transfer_timeout,
            drain_timeout=self.drain_timeout,
            consumer_block_ends=consumer_block_ends if refusal is None else None,
        )
        request = self.driver.add(LiveRequest(session=session, peer=peer))
        if refusal is None and peer_config is not None and not session.is_prefix_hit:
            try:
                request.plan = self._check_pair_plan(
                    request, prefix_hit_tokens=prefix_hit_tokens, peer_config=peer_config
                )
            except KVSpecError as exc:
                refusal = exc
        if refusal is not None:
            self.refuse(request, refusal, now=now)
        else:
            self.driver.execute(request, session.start(now=now))
        return request

    def refuse(self, request: LiveRequest[ConsumerSession], error: KVSpecError, *, now: float) -> None:
        """A step refused the request: a ``check`` fault, then FAILED with the typed reason and one release (FAIL-1)."""
        self.driver.fault(Operation.CHECK, error, request.request_id)
        self.driver.execute(request, request.session.fail(reason_of(error), now=now, detail=str(error)))

    def _check_pair_plan(
        self, request: LiveRequest[ConsumerSession], *, prefix_hit_tokens: int, peer_config: KVCacheConfig
    ) -> TransferPlan:
        session = request.session
        params = session.params
        # The state that moves must stand where C resumes, or nothing moves (STATE-1, STATE-4).
        check_state_position(
            self.config,
            state_tokens=params.state_tokens,
            num_tokens=params.num_tokens,
            recomputed_tokens=params.recomputed_tokens,
            profile=self.state_profile or StateProfile.RECOMPUTE,
        )
        # WIN-1 and ALIGN-1 before any byte moves; then every byte is planned (PLAN-1).
        geometry = TransferRequest(
            num_tokens=params.num_tokens,
            prefix_hit_tokens=prefix_hit_tokens,
            producer_block_ids=params.producer_block_ids,
            consumer_block_ids=session.consumer_block_ids,
            recomputed_tokens=params.recomputed_tokens,
            producer_block_ends=params.producer_block_ends,
            consumer_block_ends=session.consumer_block_ends,
        )
        pairs = pair_with(self.connector, self.config, geometry)
        request.pairs = pairs  # what the transfer moves: digested and checked with INT-1 on
        return self.connector.plan(producer_config=peer_config, consumer_config=self.config, pairs=pairs)


# --------------------------------------------------------------------------- offload

ChunkKey = tuple[str, int, int]
"""What OFF-2's chained-hash key names: (prefix, group, chunk index)."""

GpuCopy = tuple[int, int, int, int, int]
"""(GPU region, GPU offset, chunk region, chunk offset, bytes): one page a copy moves (OFF-7)."""


@attrs.define(eq=False)
class StorePlan:
    """What one store moves: its copies, the sub-blocks they write, and the rows it holds in flight (OFF-3, OFF-4)."""

    copies: list[GpuCopy] = attrs.field(factory=list)
    writes: list[tuple[ChunkKey, int, int, int, str]] = attrs.field(factory=list)  # key, row, sub, group, layer
    rows: dict[ChunkKey, int] = attrs.field(factory=dict)


def _no_blocks(request: LiveRequest[OffloadSession], block_ids: BlockIds) -> None:
    """A copy frees no block: the offload engine's tables hold them."""


def _ended(request: LiveRequest[OffloadSession]) -> None:
    """The caller reads the copy's session where it waits for it."""


class OffloadEngine:
    """The offload engine's steps over the OFF-4 table: lookup, load, store and evict; its GPU blocks and copies.

    The chunk table is LRU over ``chunk_rows`` rows of the chunk pool; a key
    is present only once all ``f`` sub-blocks of its chunk were written and
    no copy into it is in flight (OFF-4, :func:`kvspec.spec.offload.is_chunk_present`);
    a key in flight is never evicted. GPU blocks come from one allocator
    (the block freed last first). Every copy is an
    :class:`OffloadSession` carried out by the driver of the agent that
    posts it: the GPU agent where the backend lets it, else the chunk agent.
    """

    def __init__(
        self,
        *,
        config: KVCacheConfig,
        chunk_config: KVCacheConfig,
        offload: OffloadConfig,
        chunk_rows: int,
        gpu: Transport,
        chunks: Transport,
        modes: Iterable[TransferMode],
        timeout: float,
    ) -> None:
        self.config = config
        self.chunk_config = chunk_config
        self.f = offload.blocks_per_chunk
        self.sizes = [group.kv_cache_spec.block_size * self.f for group in config.kv_cache_groups]
        self.timeout = timeout
        self.allocator = BlockAllocator(config.num_blocks, reuse="latest")
        self.free_rows = list(range(chunk_rows - 1, -1, -1))
        self.rows: OrderedDict[ChunkKey, int] = OrderedDict()
        self.written: dict[int, set[int]] = {}
        self.in_flight: dict[int, int] = {}
        self.evictions = 0
        self.posted = 0
        allowed = set(modes)
        self.write_ok, self.read_ok = TransferMode.WRITE in allowed, TransferMode.READ in allowed
        self.chunk_name = gpu.add_remote_agent(chunks.get_agent_metadata())
        self.gpu_name = chunks.add_remote_agent(gpu.get_agent_metadata())
        self.gpu_driver: Driver[OffloadSession] = Driver(
            role=OFFLOAD, transport=gpu, clock=time.monotonic, on_free=_no_blocks, on_end=_ended
        )
        self.chunk_driver: Driver[OffloadSession] = Driver(
            role=OFFLOAD, transport=chunks, clock=time.monotonic, on_free=_no_blocks, on_end=_ended
        )

    # -- the OFF-4 table

    def is_present(self, key: ChunkKey) -> bool:
        """The key's chunk is whole in the chunk pool and nothing writes it (OFF-4)."""
        row = self.rows.get(key)
        return row is not None and is_chunk_present(
            sub_blocks_written=len(self.written[row]),
            blocks_per_chunk=self.f,
            copies_in_flight=self.in_flight.get(row, 0),
        )

    def lookup(self, prefix: str, num_tokens: int) -> list[list[bool]]:
        """Per group, which chunks of ``[0, N)`` are present: what OFF-5's hit reads (OFF-4, OFF-5)."""
        return [
            [self.is_present((prefix, g, k)) for k in range(num_tokens // size)] for g, size in enumerate(self.sizes)
        ]

    def touch(self, key: ChunkKey) -> None:
        """A read or a repeated store makes the key the most recently used (OFF-4)."""
        if key in self.rows:
            self.rows.move_to_end(key)

    def evict(self, key: ChunkKey) -> bool:
        """Drop an idle key; its bytes stay, so a reader of an evicted row sees stale data (OFF-4)."""
        row = self.rows.get(key)
        if row is None or self.in_flight.get(row):
            return False
        del self.rows[key]
        self.written.pop(row, None)
        self.free_rows.append(row)
        self.evictions += 1
        return True

    def _row_for_store(self, key: ChunkKey) -> int | None:
        """The row a store of ``key`` writes into, evicting the LRU idle key when full; None when none is free."""
        row = self.rows.get(key)
        if row is not None:
            return None if self.in_flight.get(row) else row
        if not self.free_rows:
            victim = next((k for k, r in self.rows.items() if not self.in_flight.get(r)), None)
            if victim is None:
                return None
            self.evict(victim)
        row = self.free_rows.pop()
        self.rows[key] = row
        self.written[row] = set()
        return row

    def chunk_address(self, layer: str, row: int, sub: int, g: int) -> tuple[int, int]:
        """Where sub-block ``sub`` of chunk row ``row`` sits for ``layer`` (OFF-7)."""
        region, _ = self.chunk_config.page_offset(layer, 0)
        page = self.config.kv_cache_groups[g].kv_cache_spec.page_size_bytes
        return region, get_sub_block_offset(row, sub, page_size=page, blocks_per_chunk=self.f)

    def _copy(self, layer: str, block_id: int, row: int, sub: int, g: int) -> GpuCopy:
        gpu_region, gpu_offset = self.config.page_offset(layer, block_id)
        chunk_region, chunk_offset = self.chunk_address(layer, row, sub, g)
        page = self.config.kv_cache_groups[g].kv_cache_spec.page_size_bytes
        return gpu_region, gpu_offset, chunk_region, chunk_offset, page

    def plan_store(self, prefix: str, store: StoreSet, maps: Sequence[Sequence[tuple[int, int]]]) -> StorePlan:
        """The copies a store set calls for: keys present are touched, not stored again (OFF-3, OFF-4, OFF-7).

        Each row written is held in flight until :meth:`land`, so it is never
        evicted mid-store; a key already in flight, or a pool full of keys in
        flight, is not stored.
        """
        plan = StorePlan()
        for g, ((first, _stop), ids, mapping) in enumerate(zip(store.chunk_ranges, store.block_ids, maps, strict=True)):
            for block_id, (entry, sub) in zip(ids, mapping, strict=True):
                key = (prefix, g, first + entry)
                if self.is_present(key):
                    self.touch(key)
                    continue
                row = plan.rows.get(key)
                if row is None:
                    row = self._row_for_store(key)
                    if row is None:
                        continue
                    plan.rows[key] = row
                    self.in_flight[row] = self.in_flight.get(row, 0) + 1
                for layer in self.config.kv_cache_groups[g].layer_names:
                    plan.copies.append(self._copy(layer, block_id, row, sub, g))
                    plan.writes.append((key, row, sub, g, layer))
        return plan

    def land(self, plan: StorePlan) -> None:
        """A store landed: its sub-blocks are written and its rows leave flight (OFF-4)."""
        for _key, row, sub, _g, _layer in plan.writes:
            self.written[row].add(sub)
        for row in plan.rows.values():
            self.in_flight[row] -= 1

    def plan_load(
        self, prefix: str, load: LoadSet, maps: Sequence[Sequence[tuple[int, int]]]
    ) -> tuple[list[GpuCopy], tuple[int, int] | None]:
        """The copies a load set calls for, or the first (group, chunk) it reads that is not present (OFF-4, OFF-6)."""
        copies: list[GpuCopy] = []
        for g, ((first, _stop), ids, mapping) in enumerate(zip(load.chunk_ranges, load.block_ids, maps, strict=True)):
            for block_id, (entry, sub) in zip(ids, mapping, strict=True):
                key = (prefix, g, first + entry)
                if not self.is_present(key):
                    return copies, (g, first + entry)
                self.touch(key)
                row = self.rows[key]
                for layer in self.config.kv_cache_groups[g].layer_names:
                    copies.append(self._copy(layer, block_id, row, sub, g))
        return copies, None

    # -- GPU blocks

    def get_table_shape(self, num_tokens: int, *, computed_tokens: int, pruned: bool = True) -> BlockIds:
        """A request's GPU table at lookup, placeholder id 1 per block to allocate (WIN-1, OFF-6).

        Pruned, it holds the null block where vLLM skips once
        ``computed_tokens`` are computed; unpruned, every position gets a
        block (allowed: OFF-6 leaves them alone).
        """
        return get_lookup_table_shape(
            self.config, num_tokens=num_tokens, computed_tokens=computed_tokens if pruned else 0
        )

    def allocate_block(self) -> int | None:
        """One GPU block for a request's table, the one freed last first; None when the pool is empty."""
        return self.allocator.allocate(1)[0] if self.allocator.num_free else None

    def free_table(self, table: Sequence[Sequence[int]]) -> None:
        """Return a request's GPU blocks (nulls skipped)."""
        self.allocator.free((b for ids in table for b in ids), missing_ok=True)

    # -- copies

    def post(self, to_chunks: bool, copies: Sequence[GpuCopy], what: str) -> LiveRequest[OffloadSession]:
        """Post a store (``to_chunks``) or a load as one copy session; the GPU agent posts if it can (OFF-3, OFF-6)."""
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
            timeout=self.timeout,
        )
        request = driver.add(LiveRequest(session=session, peer=peer))
        driver.execute(request, session.start(now=time.monotonic()))
        return request

    def post_refusal(self, request: LiveRequest[OffloadSession]) -> KVSpecError | None:
        """The error the backend refused a copy's post with, if it did."""
        for driver in (self.gpu_driver, self.chunk_driver):
            for fault in driver.faults:
                if fault.request_id == request.request_id and fault.operation is Operation.POST:
                    return fault.error
        return None

    def poll(self) -> None:
        """Both agents: the passive one polls so that its backend can progress."""
        self.gpu_driver.poll()
        self.chunk_driver.poll()

    def wait(self, request: LiveRequest[OffloadSession]) -> OffloadSession:
        """Poll until the copy ends: DONE, or FAILED by the backend or by its own timeout (FAIL-1)."""
        session = request.session
        poll_until(self.poll, done=lambda: session.is_terminal, spin=10)
        return session
