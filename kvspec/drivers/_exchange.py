"""The exchange driver: producer and consumer endpoints running requests end to end over a Transport.

Theory of operation
-------------------

An endpoint is one engine: a :class:`KVCacheConfig`, its engine role's
:class:`BlockAllocator` over its pool (block 0 is the null block and is
never handed out; :mod:`kvspec.drivers._engine` allocates every table), one
:class:`Transport` agent with the pool's regions registered, and one sans-IO
session per request (:class:`ProducerSession` / :class:`ConsumerSession`).
The endpoint is a thin role over the driver core (:mod:`kvspec.drivers._driver`),
which carries out what the sessions ask (send, post, cancel, free) and feeds
them what happens (transfer status, notifications, time); the endpoint adds
its block pool, its peers and the connector seam's planning.

1. :func:`connect` is the handshake: both sides' :class:`EngineDescriptor`
   travel through the codec, are checked for compatibility (HS-1) and for
   hybrid admission (ADM-1, ADM-2), then each side loads the other's
   transport metadata. The peer's layout (its ``KVCacheConfig``) is handed
   over here too: a real engine ships it with its transport metadata.
2. :meth:`ProducerEndpoint.prefill` has its engine allocate the request's block table
   for ``T`` tokens, prunes the sliding-window groups with leading null ids as
   vLLM does, clips (CLIP-1), pins the advertised blocks (SM-1) and returns the
   :class:`TransferParams` the router forwards (as vLLM's dict).
3. :meth:`ConsumerEndpoint.begin` allocates the uncached suffix after a prefix
   hit ``H`` (clipped, CLIP-1), checks WIN-1 and ALIGN-1 and plans every byte
   (PLAN-1) before anything moves; a failed check ends the request FAILED
   with a typed reason and its one release (REL-1).
4. :meth:`poll` on both endpoints moves things forward: transfer status,
   notifications (control messages are ``kvspec.encode`` bytes), deadlines.
   READ: C posts the read; on DONE it is LOADED and releases P. WRITE: C sends
   its block offer; P posts the write with the Completion as its notification;
   C is LOADED when the Completion arrives, then releases P.

Every phase has a deadline derived from the lease (FAIL-1), read from an
injectable clock, so :func:`run_request` never hangs. Blocks return to their
allocator only when a session frees them, which is never while a transfer
that touches them is in flight (SM-1, SM-2).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Generic

import attrs

from kvspec.core._enums import FailureReason, StateProfile, TransferMode
from kvspec.core._errors import (
    ConfigError,
    LocalProtocolError,
    PlanError,
    TransportError,
)
from kvspec.core._models import BlockIds, KVCacheConfig
from kvspec.drivers._connector import Connector, ReferenceConnector
from kvspec.drivers._driver import (
    CONSUMER,
    PRODUCER,
    Driver,
    DriverFault,
    LiveRequest,
    Operation,
    Role,
    S,
    poll_until,
)
from kvspec.drivers._engine import BlockAllocator, ConsumerEngine, ProducerEngine
from kvspec.protocol._codec import decode, encode
from kvspec.protocol._handshake import check_compatibility
from kvspec.protocol._session import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_RELEASE_GRACE,
    ConsumerSession,
    ConsumerState,
    FailureInfo,
    ProducerSession,
    ProducerState,
)
from kvspec.reference._integrity import PageDigester
from kvspec.reference._messages import BlockOffer, EngineDescriptor, Failure, Message, ReleaseOutcome, TransferParams
from kvspec.reference._reference import (
    BlockPairs,
    check_hybrid_support,
    is_hma_required,
)
from kvspec.spec.digest import get_offered_algorithms
from kvspec.spec.state import get_state_group_indices
from kvspec.transport._base import MemoryRegion, Transport

__all__ = [
    "DEFAULT_LEASE_DURATION",
    "BlockAllocator",
    "ConsumerEndpoint",
    "ConsumerResult",
    "ExchangeResult",
    "ProducerEndpoint",
    "ProducerResult",
    "connect",
    "run_request",
]

Clock = Callable[[], float]

DEFAULT_LEASE_DURATION = 30.0
"""Seconds a producer pins a request's blocks for its consumer (SM-1)."""


# --------------------------------------------------------------------------- results


@attrs.frozen(kw_only=True)
class ConsumerResult:
    """How one consumer request ended (SM-2); ``failure`` is set exactly when FAILED (FAIL-1)."""

    request_id: str
    mode: TransferMode
    state: ConsumerState
    consumer_block_ids: BlockIds
    producer_block_ids: BlockIds
    pairs: BlockPairs | None
    num_bytes: int
    failure: FailureInfo | None
    release: ReleaseOutcome | None


@attrs.frozen(kw_only=True)
class ProducerResult:
    """How one producer request ended (SM-1)."""

    request_id: str
    mode: TransferMode
    state: ProducerState
    producer_block_ids: BlockIds


@attrs.frozen(kw_only=True)
class ExchangeResult:
    """Both sides of one request run by :func:`run_request`."""

    params: TransferParams
    consumer: ConsumerResult
    producer: ProducerResult
    elapsed: float

    @property
    def state(self) -> ConsumerState:
        """The consumer's final state."""
        return self.consumer.state


# --------------------------------------------------------------------------- endpoints


@attrs.define(eq=False)
class _Peer:
    engine_id: str
    agent: str
    config: KVCacheConfig
    descriptor: EngineDescriptor


class _Endpoint(Generic[S]):
    """What both roles share: config, transport, peers, clock, the driver core, and the engine's allocator."""

    role = "engine"
    engine: ProducerEngine | ConsumerEngine

    def __init__(
        self,
        *,
        side: Role[S],
        engine_id: str,
        config: KVCacheConfig,
        transport: Transport,
        regions: Sequence[MemoryRegion],
        mode: TransferMode,
        clock: Clock = time.monotonic,
        disable_hybrid_kv_cache_manager: bool = False,
        on_free: Callable[[list[int]], None] | None = None,
        connector: Connector | None = None,
        integrity: bool = False,
        state_profile: StateProfile | str | None = None,
    ) -> None:
        if not isinstance(engine_id, str) or not engine_id:
            raise ConfigError(f"{type(self).__name__}.engine_id: expected a non-empty str, got {engine_id!r}")
        if len(regions) != len(config.kv_cache_tensors):
            raise ConfigError(
                f"{type(self).__name__}.regions: expected {len(config.kv_cache_tensors)} regions "
                f"(one per KV-cache tensor), got {len(regions)}"
            )
        for index, (region, tensor) in enumerate(zip(regions, config.kv_cache_tensors, strict=True)):
            if region.nbytes < tensor.size:
                raise ConfigError(
                    f"{type(self).__name__}.regions[{index}]: expected at least {tensor.size} bytes, "
                    f"got {region.nbytes}"
                )
        self.engine_id = engine_id
        self.config = config
        self.mode = TransferMode(mode)
        self.clock = clock
        self.connector: Connector = ReferenceConnector() if connector is None else connector
        self.hma_enabled = is_hma_required(config, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager)
        self.disable_hybrid_kv_cache_manager = disable_hybrid_kv_cache_manager
        # Where this engine's transferred state stands; only an engine with state groups has one (STATE-1).
        self.state_profile: StateProfile | None = None
        if get_state_group_indices(config):
            try:
                self.state_profile = StateProfile(state_profile or StateProfile.RECOMPUTE)
            except ValueError:
                raise ConfigError(
                    f"{type(self).__name__}.state_profile: expected one of {[p.value for p in StateProfile]}, "
                    f"got {state_profile!r}"
                ) from None
        self._on_free_ids = on_free  # the engine's allocator calls it (kvspec.drivers._engine)
        self._peers: dict[str, _Peer] = {}
        self.driver: Driver[S] = Driver(
            role=side,
            transport=transport,
            clock=clock,
            on_free=self._on_free,
            on_end=self._on_end,
            fallback_peer=self._only_peer,
            integrity=PageDigester(config, [r.buffer for r in regions]) if integrity else None,
        )
        transport.register_memory(regions)

    @property
    def allocator(self) -> BlockAllocator:
        """This engine's block pool: the engine role's allocator (kvspec.drivers._engine)."""
        return self.engine.allocator

    @property
    def transport(self) -> Transport:
        """This engine's transport agent (the driver's)."""
        return self.driver.transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        self.driver.transport = transport

    @property
    def errors(self) -> list[DriverFault]:
        """What went wrong while driving, as typed records (FAIL-1)."""
        return self.driver.faults

    # -- handshake

    def describe(self) -> EngineDescriptor:
        """This engine's self-description, with its transport metadata (HS-1)."""
        return EngineDescriptor.from_config(
            engine_id=self.engine_id,
            config=self.config,
            mode=self.mode,
            hma_enabled=self.hma_enabled,
            transport_metadata=self.transport.get_agent_metadata(),
            state_profile=self.state_profile,
        )

    def add_peer(self, descriptor: EngineDescriptor, config: KVCacheConfig) -> str:
        """Load a compatible peer's transport metadata; return its agent name."""
        if descriptor.num_blocks != config.num_blocks:
            raise PlanError(
                f"peer {descriptor.engine_id!r}: descriptor says {descriptor.num_blocks} blocks, "
                f"layout {config.num_blocks}"
            )
        if self.driver.integrity is not None:
            # The block digests use the algorithm both sides chose; a 1.2 peer keeps BLAKE2b-128 (INT-1, INT-2).
            self.driver.integrity.choose(
                descriptor.engine_id,
                [a.value for a in get_offered_algorithms()],
                descriptor.digest_algorithms,
                peer_version=descriptor.protocol_version,
            )
        agent = self.transport.add_remote_agent(descriptor.transport_metadata)
        self._peers[descriptor.engine_id] = _Peer(
            engine_id=descriptor.engine_id, agent=agent, config=config, descriptor=descriptor
        )
        return agent

    def _only_peer(self) -> str | None:
        # The consumer has not spoken yet (a READ lease ran out first): tell the one peer, if there is one.
        if len(self._peers) == 1:
            (peer,) = self._peers.values()
            return peer.agent
        return None

    def _peer_by_agent(self, agent: str) -> _Peer:
        for peer in self._peers.values():
            if peer.agent == agent:
                return peer
        raise TransportError(
            f"{self.role} {self.engine_id!r}: no handshake with agent {agent!r}",
            reason=FailureReason.PEER_DISCONNECTED.value,
        )

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in this engine's pool (the null block excluded)."""
        return self.allocator.num_free

    @property
    def active_requests(self) -> tuple[str, ...]:
        """Requests not yet ended on this side."""
        return tuple(self.driver.requests)

    def poll(self) -> None:
        """Progress transfers, handle notifications, fire deadlines."""
        self.driver.poll()

    def close(self) -> None:
        """Close the transport agent."""
        self.transport.close()

    # -- role hooks for the driver

    def _on_free(self, request: LiveRequest[S], block_ids: BlockIds) -> None:
        self.engine.free_blocks(block_ids)

    def _on_end(self, request: LiveRequest[S]) -> None:
        raise NotImplementedError


class ProducerEndpoint(_Endpoint[ProducerSession]):
    """The prefill engine: pins blocks per request and serves READs or posts WRITEs (SM-1).

    ``connector`` is the connector seam it clips and plans through (default
    :class:`kvspec_conformance.ReferenceConnector`, kvspec's reference
    functions); ``errors`` lists what went wrong as typed driver faults.
    ``integrity`` turns INT-1 on: the transfer parameters (READ) and the
    Completion (WRITE) carry the digests of the blocks sent.
    """

    role = "producer"
    engine: ProducerEngine

    def __init__(
        self,
        *,
        engine_id: str,
        config: KVCacheConfig,
        transport: Transport,
        regions: Sequence[MemoryRegion],
        mode: TransferMode,
        clock: Clock = time.monotonic,
        disable_hybrid_kv_cache_manager: bool = False,
        on_free: Callable[[list[int]], None] | None = None,
        connector: Connector | None = None,
        integrity: bool = False,
        state_profile: StateProfile | str | None = None,
        lease_duration: float = DEFAULT_LEASE_DURATION,
        release_grace: float = DEFAULT_RELEASE_GRACE,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        super().__init__(
            side=PRODUCER,
            engine_id=engine_id,
            config=config,
            transport=transport,
            regions=regions,
            mode=mode,
            clock=clock,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            on_free=on_free,
            connector=connector,
            integrity=integrity,
            state_profile=state_profile,
        )
        self.lease_duration = lease_duration
        self.release_grace = release_grace
        self.drain_timeout = drain_timeout
        self._results: dict[str, ProducerResult] = {}
        # The engine role clips, holds and plans; the peer's layout comes from the handshake.
        self.engine = ProducerEngine(
            engine_id=engine_id,
            config=config,
            connector=self.connector,
            driver=self.driver,
            peer_config=lambda request: self._peer_by_agent(request.peer or "").config,
            on_free=self._on_free_ids,
        )
        self.driver.on_message = self._refuse_offer_for_no_request

    def _refuse_offer_for_no_request(self, request_id: str, peer: str, message: Message) -> None:
        """An offer for a request this producer does not hold is a stale reference: answer Failure (SM-1).

        Released, expired or never created: P writes nothing, and tells C at
        once (``lease_expired``: P's hold on those blocks has ended), so C does
        not wait out the lease with its blocks allocated (vLLM #52234).
        """
        if not isinstance(message, BlockOffer) or request_id in self.driver.requests:
            return
        failure = Failure(
            request_id=request_id,
            producer_engine_id=self.engine_id,
            reason=FailureReason.LEASE_EXPIRED,
            detail=f"producer {self.engine_id!r} holds no request {request_id!r} (released, expired or never "
            "created): a stale transfer reference (SM-1)",
        )
        try:
            self.transport.send_notification(peer, encode(failure))
        except TransportError as exc:
            self.driver.fault(Operation.SEND, exc, request_id, peer)

    def prefill(
        self,
        request_id: str,
        *,
        num_tokens: int,
        fill: Callable[[BlockIds], None] | None = None,
        state_tokens: int | None = None,
    ) -> TransferParams:
        """Allocate, prune and clip the request's table, pin it, and return what the router forwards (CLIP-1, SM-1).

        ``fill`` receives the advertised block ids and writes the prefill's
        pages; with integrity on, the parameters carry the digests of the pages
        as they are once it returns (INT-1). Without ``fill`` the caller fills
        the pages of :meth:`block_table` before the consumer begins.
        With state groups the parameters say how many tokens the state
        absorbed: ``state_tokens``, by default ``num_tokens`` (STATE-1); a
        test passes another value to play a producer that got it wrong.
        """
        if request_id in self.driver.requests or request_id in self._results:
            raise LocalProtocolError(f"producer request {request_id!r} already exists")
        # Only what is advertised: the table pruned and clipped (WIN-1, CLIP-1), kept by the engine.
        advertised = self.engine.allocate_table(request_id, num_tokens=num_tokens)
        if fill is not None:
            fill(advertised)
        request = self.engine.hold(
            request_id,
            advertised=advertised,
            # The unclipped table starts at logical block 0 and holds every block of the request (ALIGN-1).
            producer_block_ends=self.engine.get_table_ends(num_tokens),
            num_tokens=num_tokens,
            mode=self.mode,
            now=self.clock(),
            lease_duration=self.lease_duration,
            release_grace=self.release_grace,
            drain_timeout=self.drain_timeout,
            state_tokens=self.engine.get_state_tokens(num_tokens, given=state_tokens),
        )
        return request.session.params

    def block_table(self, request_id: str) -> BlockIds:
        """The advertised (pruned, clipped) block ids of a live request."""
        return self.engine.tables[request_id]

    def abort(self, request_id: str) -> None:
        """The producer engine gives up on a request (SM-1)."""
        request = self.driver.requests.get(request_id)
        if request is not None:
            self.driver.execute(request, request.session.abort(now=self.clock()))

    def result(self, request_id: str) -> ProducerResult | None:
        """The outcome of a finished request, or None while it is live."""
        return self._results.get(request_id)

    def _on_end(self, request: LiveRequest[ProducerSession]) -> None:
        session = request.session
        self.engine.tables.pop(request.request_id, None)
        self._results[request.request_id] = ProducerResult(
            request_id=request.request_id,
            mode=session.mode,
            state=ProducerState(session.state),
            producer_block_ids=session.params.producer_block_ids,
        )


class ConsumerEndpoint(_Endpoint[ConsumerSession]):
    """The decode engine: allocates the uncached suffix, loads it, releases the producer once (SM-2, REL-1).

    ``connector`` is the connector seam it clips, pairs and plans through
    (default: kvspec's reference functions); ``errors`` lists what went wrong
    as typed driver faults. ``integrity`` turns INT-1 on: every block received
    is checked against the sender's digests before the request is LOADED.
    """

    role = "consumer"
    engine: ConsumerEngine

    def __init__(
        self,
        *,
        engine_id: str,
        config: KVCacheConfig,
        transport: Transport,
        regions: Sequence[MemoryRegion],
        mode: TransferMode,
        clock: Clock = time.monotonic,
        disable_hybrid_kv_cache_manager: bool = False,
        on_free: Callable[[list[int]], None] | None = None,
        connector: Connector | None = None,
        integrity: bool = False,
        state_profile: StateProfile | str | None = None,
        transfer_timeout: float | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        start_margin: float = 0.0,
    ) -> None:
        super().__init__(
            side=CONSUMER,
            engine_id=engine_id,
            config=config,
            transport=transport,
            regions=regions,
            mode=mode,
            clock=clock,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            on_free=on_free,
            connector=connector,
            integrity=integrity,
            state_profile=state_profile,
        )
        self.transfer_timeout = transfer_timeout
        self.drain_timeout = drain_timeout
        self.start_margin = start_margin
        # The engine role plays each request's steps: allocate, clip, session, check, pair, plan, start.
        self.engine = ConsumerEngine(
            engine_id=engine_id,
            config=config,
            mode=self.mode,
            connector=self.connector,
            driver=self.driver,
            state_profile=self.state_profile,
            transfer_timeout=transfer_timeout,
            drain_timeout=drain_timeout,
            start_margin=start_margin,
            on_free=self._on_free_ids,
        )
        self._results: dict[str, ConsumerResult] = {}
        self._loaded: dict[str, BlockIds] = {}

    def begin(self, params: TransferParams, *, prefix_hit_tokens: int = 0) -> None:
        """Start loading a request: allocate, clip, check WIN-1, plan, then post or offer (CLIP-1, WIN-1, PLAN-1).

        A failed check ends the request FAILED with its typed reason before
        any byte moves; a full prefix hit only releases the producer (REL-1).
        """
        request_id = params.request_id
        if request_id in self.driver.requests or request_id in self._results:
            raise LocalProtocolError(f"consumer request {request_id!r} already exists")
        peer = self._peers.get(params.producer_engine_id)

        def suffix() -> BlockIds:
            # Not kept by request: the driver frees the clipped suffix the session holds.
            return self.engine.allocate_suffix(
                None,
                num_tokens=params.num_tokens,
                prefix_hit_tokens=prefix_hit_tokens,
                recomputed_tokens=params.recomputed_tokens,
            )

        self.engine.begin(
            params,
            prefix_hit_tokens=prefix_hit_tokens,
            peer=None if peer is None else peer.agent,
            peer_config=None if peer is None else peer.config,
            suffix=suffix,
            # C's suffix ends at the request's last block, T + R tokens (ALIGN-1, protocol 1.1).
            consumer_block_ends=self.engine.get_suffix_ends(params, prefix_hit_tokens=prefix_hit_tokens),
            now=self.clock(),
        )

    def abort(self, request_id: str) -> None:
        """The consumer engine gives up; blocks wait for the drain before reuse (SM-2)."""
        request = self.driver.requests.get(request_id)
        if request is not None:
            self.driver.execute(request, request.session.abort(now=self.clock()))

    def finish(self, request_id: str) -> None:
        """The request's decode ended: return its loaded blocks to the pool."""
        ids = self._loaded.pop(request_id, None)
        if ids is not None:
            self.engine.free_blocks(ids)

    def result(self, request_id: str) -> ConsumerResult | None:
        """The outcome of a finished request, or None while it is live."""
        return self._results.get(request_id)

    def _on_end(self, request: LiveRequest[ConsumerSession]) -> None:
        session = request.session
        request_id = request.request_id
        if session.state is ConsumerState.LOADED and not request.freed:
            self._loaded[request_id] = session.consumer_block_ids
        self._results[request_id] = ConsumerResult(
            request_id=request_id,
            mode=session.mode,
            state=session.state,
            consumer_block_ids=session.consumer_block_ids,
            producer_block_ids=session.params.producer_block_ids,
            pairs=None
            if request.pairs is None
            else BlockPairs(
                producer_block_ids=request.pairs.producer_block_ids,
                consumer_block_ids=request.pairs.consumer_block_ids,
            ),
            num_bytes=0 if request.plan is None else request.plan.total_bytes,
            failure=session.failure,
            release=None if session.release is None else session.release.outcome,
        )


# --------------------------------------------------------------------------- one call


def _through_codec(descriptor: EngineDescriptor) -> EngineDescriptor:
    # The descriptor crosses the wire as codec bytes, as it would between two processes (HS-1, VER-1).
    decoded = decode(encode(descriptor))
    if not isinstance(decoded, EngineDescriptor):
        raise LocalProtocolError(f"handshake: decoded a {type(decoded).__name__}, not an EngineDescriptor")
    return decoded


def connect(producer: ProducerEndpoint, consumer: ConsumerEndpoint) -> None:
    """The handshake: exchange descriptors through the codec, check them, add each other (HS-1, ADM-1).

    Raises :class:`kvspec.IncompatiblePeerError` listing every differing
    field, or :class:`kvspec.UnsupportedHybridError`, before any transfer.
    """
    producer_desc = _through_codec(producer.describe())
    consumer_desc = _through_codec(consumer.describe())
    check_compatibility(producer=producer_desc, consumer=consumer_desc)
    for endpoint in (producer, consumer):
        # State groups are checked with the flag too: state without the hybrid manager is refused (ADM-1).
        if endpoint.hma_enabled or endpoint.state_profile is not None:
            check_hybrid_support(
                endpoint.config,
                mode=endpoint.mode,
                disable_hybrid_kv_cache_manager=endpoint.disable_hybrid_kv_cache_manager,
            )
    producer.add_peer(consumer_desc, consumer.config)
    consumer.add_peer(producer_desc, producer.config)


def run_request(
    producer: ProducerEndpoint,
    consumer: ConsumerEndpoint,
    *,
    request_id: str,
    num_tokens: int,
    prefix_hit_tokens: int = 0,
    fill: Callable[[BlockIds], None] | None = None,
    finish: bool = True,
    idle: Callable[[], None] | None = None,
) -> ExchangeResult:
    """Run one whole request in the endpoints' mode and return both sides' outcomes.

    ``fill`` receives the producer's advertised block ids to write the
    prefill's pages; the transfer parameters go through the router as vLLM's
    dict. The loop polls both endpoints until both sessions are terminal;
    every session deadline derives from the lease, so it ends in bounded
    time (FAIL-1). ``idle`` runs between polls (default: a 0.2 ms sleep).
    ``finish`` frees a LOADED request's consumer blocks at the end, as the
    end of decoding would.
    """
    start = producer.clock()
    params = producer.prefill(request_id, num_tokens=num_tokens, fill=fill)
    routed = TransferParams.from_kv_transfer_params(params.to_kv_transfer_params())
    consumer.begin(routed, prefix_hit_tokens=prefix_hit_tokens)

    def both() -> None:
        consumer.poll()
        producer.poll()

    poll_until(
        both,
        done=lambda: producer.result(request_id) is not None and consumer.result(request_id) is not None,
        pause=idle if idle is not None else (lambda: time.sleep(0.0002)),
        clock=producer.clock,
    )
    consumer_result, producer_result = consumer.result(request_id), producer.result(request_id)
    if consumer_result is None or producer_result is None:  # pragma: no cover - the loop above waits for both
        raise LocalProtocolError(f"request {request_id!r} did not end on both sides")
    if finish:
        consumer.finish(request_id)
    return ExchangeResult(
        params=params, consumer=consumer_result, producer=producer_result, elapsed=producer.clock() - start
    )
