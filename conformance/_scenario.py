"""Scenarios: two agents over suite-owned shared-memory pools, requests driven to the end, then the oracle.

Theory of operation. A :class:`Scenario` is plain data whose ``repr`` is valid
Python, so a failing case prints it as a reproducer. :func:`run_scenario`
plays it on a backend:

1. Both pools are allocated in shared memory and filled with keyed noise;
   each request's producer blocks get pages keyed by (request, group, layer,
   logical position) (:mod:`kvspec.testing`).
2. Each side's engine role allocates the request's tables from its one
   allocator (:meth:`kvspec.exchange.ProducerEngine.allocate_table`,
   :meth:`kvspec.exchange.ConsumerEngine.allocate_suffix`); a case that
   names its block ids passes them as a claim. The suite's allocators hand
   out the block freed last first, so that a block freed too early is reused
   at once and a late write into it is seen.
3. Each request is one :class:`kvspec.ProducerSession` and one
   :class:`kvspec.ConsumerSession` (SM-1, SM-2), played by kvspec's engine
   roles (:class:`kvspec.exchange.ProducerEngine`,
   :class:`kvspec.exchange.ConsumerEngine`: clip, session, check, pair,
   plan, start) and carried out by two :class:`kvspec.exchange.Driver`
   cores, one per agent: the same code that runs kvspec's exchange
   endpoints (the stage, ``_Stage``). The engines allocate the tables; for
   a WRITE the producer pairs through the connector under test with the
   request's prefix hit (:func:`kvspec.exchange.pair_offer_by_connector`).
   The connector under test clips, pairs and plans (the
   connector seam); the scenario's deadline is the consumer's transfer
   timeout, its lease and drain the sessions' lease and drain.
4. What is the scenario's own (``_Play``, ``_Oracle``): its data, its fault timing (a consumer abort
   or the initiator forgetting its peer after so many polls), and the
   oracle. Polling runs until every request ended on both sides, wave by
   wave, with a hard bound; then a short quiet period so that late writes
   land (four drain bounds after the last cancel, where
   ``Scenario.watch_late_writes`` asks for it).
5. The moment a consumer is LOADED, the request's pages are checked
   (DONE-1); at the end every page of both pools is checked, and both
   free-block counts must be back to their baseline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvspec import (
    BlockIds,
    CacheAccountingError,
    ConsumerSession,
    ConsumerState,
    EngineDescriptor,
    FailureReason,
    IncompatiblePeerError,
    KVCacheConfig,
    KVSpecError,
    MalformedMessageError,
    Message,
    PageDigester,
    ProducerSession,
    ProducerState,
    Release,
    StateProfile,
    TransferMode,
    TransferParams,
    UnsupportedVersionError,
    decode,
    encode,
    format_error,
    get_blocks_per_sw,
    get_exchange_clipped_blocks,
    is_hma_required,
)
from kvspec.exchange import (
    CONSUMER,
    PRODUCER,
    ConsumerEngine,
    Driver,
    LiveRequest,
    Operation,
    ProducerEngine,
    pair_offer_by_connector,
    poll_until,
)
from kvspec.presets import get_preset
from kvspec.remote import PeerBackend, RemoteAgent, RemotePool
from kvspec.spec.digest import get_offered_algorithms
from kvspec.spec.state import (
    get_state_clipped_blocks,
    get_state_group_indices,
)
from kvspec.testing import (
    ExpectedLoad,
    PageMismatch,
    PagePool,
    PoolSnapshot,
    allocate_pool,
    check_loaded_pages,
    check_pools,
    fill_background,
    fill_producer_pages,
    format_mismatches,
)
from kvspec.transport import Backend, FaultInjector, FaultPlan, InjectedFault, PacedBackend, PacedTransport, Transport

from ._clock import PollClock
from ._connector import Connector, ReferenceConnector

__all__ = [
    "PresetConfig",
    "Request",
    "RequestOutcome",
    "Scenario",
    "ScenarioRefused",
    "ScenarioResult",
    "run_scenario",
]


def _to_requests(value: Iterable[Request]) -> tuple[Request, ...]:
    return tuple(value)


def _to_overrides(value: Iterable[tuple[str, object]]) -> tuple[tuple[str, object], ...]:
    return tuple((str(k), v) for k, v in value)


def _one_of(*allowed: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in allowed:
            raise ValueError(f"Scenario.{attribute.name}: expected one of {list(allowed)}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class PresetConfig:
    """A model preset shrunk for tests: real group structure, few layers, small pages."""

    name: str
    num_blocks: int = 48
    layout: str = "blocks_first"
    max_layers_per_group: int = 2
    head_size_divisor: int = 16
    block_size: int = 16

    def build(self) -> KVCacheConfig:
        """The :class:`KVCacheConfig` this describes."""
        return get_preset(self.name).build_config(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            layout=self.layout,  # type: ignore[arg-type]
            max_layers_per_group=self.max_layers_per_group,
            head_size_divisor=self.head_size_divisor,
        )


ConfigSource = KVCacheConfig | PresetConfig


def _build(source: ConfigSource) -> KVCacheConfig:
    return source.build() if isinstance(source, PresetConfig) else source


def _optional_ids(value: object) -> BlockIds | None:
    return None if value is None else BlockIds(value)


def _optional_ends(value: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


# A request that must load gets this deadline and (by default) this lease, in seconds before --time-scale: far
# above what a correct backend needs, paced too, as the sessions' clock does not count what a busy machine took
# from the suite (_clock.py). Fault cases keep short ones for the requests a fault must end (cases/lifecycle.py).
LOAD_DEADLINE = 1.0
LOAD_LEASE = 2.0


@attrs.frozen(kw_only=True)
class Request:
    """One request of a scenario.

    ``producer_block_ids`` is P's block table for ``num_tokens`` tokens before
    clipping (nulls where vLLM prunes); ``consumer_block_ids`` is C's uncached
    suffix before clipping. Either may be left ``None`` to let the scenario
    allocate fresh blocks as vLLM does. Requests of wave ``k`` start once every
    request of the earlier waves is over on both sides (the agents handshake
    again before each wave). ``abort_after_polls`` makes the consumer abort
    that many polls after the transfer started; ``disconnect_after_polls``
    makes the initiator forget its peer then (a native peer loss);
    ``kill_peer_after_polls`` kills the agent on the agent server then
    (``kvspec conform --peer``: a host lost without a goodbye).

    ``recomputed_tokens`` (R) are tokens after the first ``num_tokens`` that
    both lists cover but C recomputes (vLLM: 1); generated tables are built
    for ``num_tokens + R`` tokens and pruned with ``num_tokens`` (WIN-1).
    ``producer_block_ends`` / ``consumer_block_ends`` are the ends each side
    declares for its list (protocol 1.1, ALIGN-1); ``None`` is a 1.0 side
    that declares none.

    ``state_tokens`` (protocol 1.2, STATE-1) is how many tokens the producer
    says its state absorbed; ``None`` means ``num_tokens`` (a correct
    producer) where the config has state groups. ``send_state_tokens=False``
    is a 1.1 producer that omits the key. Generated tables give each state
    group ``cdiv(T + R, B)`` slots (null but the last, as vLLM prunes) plus
    its ``num_speculative_blocks`` scratch slots; C gets one slot (STATE-2).

    ``deadline`` and ``lease`` (seconds) replace the scenario's for this
    request alone: a fault case keeps its short ones for the requests a fault
    must end, and gives the requests that must load :data:`LOAD_DEADLINE`, so
    that a correct backend that is slow, paced or on a busy machine is never
    failed for taking its time (FAIL-1).
    """

    request_id: str
    num_tokens: int
    prefix_hit_tokens: int = 0
    producer_block_ids: BlockIds | None = attrs.field(default=None, converter=_optional_ids)
    consumer_block_ids: BlockIds | None = attrs.field(default=None, converter=_optional_ids)
    wave: int = 0
    abort_after_polls: int | None = None
    disconnect_after_polls: int | None = None
    recomputed_tokens: int = 0
    producer_block_ends: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_ends)
    consumer_block_ends: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_ends)
    kill_peer_after_polls: int | None = None
    state_tokens: int | None = None
    send_state_tokens: bool = True
    deadline: float | None = None
    lease: float | None = None

    @property
    def listed_tokens(self) -> int:
        """The tokens both lists cover: T plus the recomputed ones (WIN-1)."""
        return self.num_tokens + self.recomputed_tokens


def connector_replay(connector: object) -> tuple[str, str] | None:
    """How a reproducer rebuilds ``connector``: (import lines, expression); None for kvspec's reference.

    A connector with a ``kvspec_replay()`` method (the vLLM adapters, a
    factory loaded by ``--connector MODULE:FACTORY``) says so itself, with
    its arguments; any other is its class, built without arguments.
    """
    from kvspec.connector import ReferenceConnector

    kind = type(connector)
    if kind is ReferenceConnector:
        return None
    replay = getattr(connector, "kvspec_replay", None)
    if callable(replay):
        imports, expression = replay()
        return str(imports), str(expression)
    return f"from {kind.__module__} import {kind.__qualname__} as ConnectorUnderTest\n", "ConnectorUnderTest()"


def replay_call(runner: str, backend: str, connector: str | tuple[str, str] | None) -> tuple[str, str]:
    """The import line and the call a reproducer script needs: ``runner(scenario, backend=..., connector=...)``.

    ``connector`` is ``"module:Class"`` of a connector under test built without arguments, or
    (import lines, expression) from :func:`connector_replay`.
    """
    if connector is None:
        return "", f"{runner}(scenario, backend={backend!r})"
    if isinstance(connector, tuple):
        return connector[0], f"{runner}(scenario, backend={backend!r}, connector={connector[1]})"
    module, _, name = connector.partition(":")
    imports = f"from {module} import {name} as ConnectorUnderTest\n"
    return imports, f"{runner}(scenario, backend={backend!r}, connector=ConnectorUnderTest())"


@attrs.frozen(kw_only=True)
class Scenario:
    """A whole exchange: configs, mode, requests, injected faults and deadlines (seconds).

    ``drain`` is the drain bound: a transfer released while PENDING may move
    bytes for that long, so its blocks are reused only after it (SM-2).
    ``handshake_overrides`` replaces fields of the consumer's handshake
    descriptor, e.g. ``(("mode", "write"),)`` or ``(("protocol_version", (2, 0)),)``.
    ``watch_late_writes`` keeps polling for four drain bounds after the last
    cancelled transfer, so that one that outlives the drain bound is seen
    landing (SM-2); only cases about late writes pay for that quiet period.
    ``settle`` keeps both agents polled that long after the last request ended
    before the oracle reads the pools again, so a stray copy landing late
    (after DONE, after a release) is seen (DONE-1, SM-2). ``integrity`` turns
    INT-1 on in both drivers: the sender's block digests travel with the
    transfer parameters (READ) or the Completion (WRITE) and the consumer checks
    them before LOADED. ``state_profile`` is both engines' state profile
    where the configs have state groups (STATE-1).
    """

    config: ConfigSource
    requests: tuple[Request, ...] = attrs.field(converter=_to_requests)
    mode: str = attrs.field(default="read", validator=_one_of("read", "write"))
    consumer_config: ConfigSource | None = None
    faults: FaultPlan | None = None
    fault_side: str = attrs.field(default="both", validator=_one_of("producer", "consumer", "both"))
    deadline: float = LOAD_DEADLINE
    lease: float = LOAD_LEASE
    drain: float = 0.1
    handshake_overrides: tuple[tuple[str, object], ...] = attrs.field(default=(), converter=_to_overrides)
    watch_late_writes: bool = False
    settle: float = 0.0
    integrity: bool = False
    state_profile: str = attrs.field(default="recompute", validator=_one_of("recompute", "prebuilt"))

    def scaled(self, factor: float) -> Scenario:
        """This scenario with every time multiplied by ``factor`` (``--time-scale``).

        Deadlines, leases, the drain bound, the quiet period, each request's
        own deadline and lease, and the fault plan's delays (FaultPlan.scaled).
        """
        return attrs.evolve(
            self,
            deadline=self.deadline * factor,
            lease=self.lease * factor,
            drain=self.drain * factor,
            settle=self.settle * factor,
            requests=tuple(_scaled_request(r, factor) for r in self.requests),
            faults=None if self.faults is None else self.faults.scaled(factor),
        )

    def deadline_of(self, request: Request) -> float:
        """The consumer's transfer timeout for ``request``: its own, else the scenario's (FAIL-1)."""
        return self.deadline if request.deadline is None else request.deadline

    def lease_of(self, request: Request) -> float:
        """The producer's lease for ``request``: its own, else the scenario's (SM-1)."""
        return self.lease if request.lease is None else request.lease

    def to_python(self, backend: str = "loopback", connector: str | tuple[str, str] | None = None) -> str:
        """A script that replays this scenario on ``backend`` and prints what the oracle found.

        ``connector`` is ``"module:Class"`` of a connector under test built without arguments.
        """
        imports, call = replay_call("run_scenario", backend, connector)
        return (
            "from kvspec import *\n"
            "from kvspec.transport.faults import FaultPlan\n"
            "from kvspec_conformance import PresetConfig, Request, Scenario, run_scenario\n"
            f"{imports}\n"
            f"scenario = {self!r}\n"
            f"result = {call}\n"
            "print(result.summary())\n"
        )


def _scaled_request(request: Request, factor: float) -> Request:
    """``request`` with its own deadline and lease, where it has them, multiplied by ``factor``."""
    if request.deadline is None and request.lease is None:
        return request
    return attrs.evolve(
        request,
        deadline=None if request.deadline is None else request.deadline * factor,
        lease=None if request.lease is None else request.lease * factor,
    )


@attrs.frozen(kw_only=True)
class RequestOutcome:
    """How one request ended on both sides, as the sessions the scenario drove ended it.

    ``error`` is the kvspec error that stopped the request before any byte
    moved (the object the driver caught: test it with ``isinstance``);
    ``posted`` is true once a transport accepted a post for it.
    """

    request_id: str
    consumer_state: ConsumerState
    producer_state: ProducerState
    reason: FailureReason | None = None
    error: KVSpecError | None = None
    detail: str = ""
    posted: bool = False
    releases_sent: int = 0
    releases_received: int = 0
    seconds: float = 0.0

    @property
    def loaded(self) -> bool:
        """True when the consumer ended LOADED."""
        return self.consumer_state is ConsumerState.LOADED


class ScenarioRefused(AssertionError):
    """A case asked for a request of a scenario the connector refused at admission or handshake.

    An ``AssertionError``, so the suite reports the case FAILED with the refusal text, not as an error.
    """


@attrs.frozen(kw_only=True)
class ScenarioResult:
    """What the oracle and the driver found. ``ok`` means no page, timing or leak problem."""

    outcomes: dict[str, RequestOutcome]
    mismatches: tuple[PageMismatch, ...]
    early_completions: tuple[str, ...]
    problems: tuple[str, ...]
    injected: tuple[InjectedFault, ...]
    seconds: float
    refused: KVSpecError | None = None  # the error admission or the handshake refused the pair with
    lost_messages: tuple[str, ...] = ()  # control messages the transport refused to send (after a disconnect)

    @property
    def ok(self) -> bool:
        """No mismatch, no early completion, no leak or hang."""
        return not (self.mismatches or self.early_completions or self.problems)

    def outcome(self, request_id: str) -> RequestOutcome:
        """The outcome of one request; :class:`ScenarioRefused` if the scenario was refused before it ran."""
        if request_id not in self.outcomes and self.refused is not None:
            refused = format_error(self.refused)
            raise ScenarioRefused(f"request {request_id!r} never ran: the scenario was refused: {refused}")
        return self.outcomes[request_id]

    def summary(self) -> str:
        """Human-readable findings."""
        lines = [f"{len(self.outcomes)} requests in {self.seconds:.3f}s"]
        if self.refused is not None:
            lines.append(f"refused before setup: {format_error(self.refused)}")
        for o in self.outcomes.values():
            why = f" reason={o.reason.value}" if o.reason else ""
            err = f" error={type(o.error).__name__}" if o.error is not None else ""
            lines.append(
                f"  {o.request_id}: consumer {o.consumer_state.value}, producer {o.producer_state.value}{why}{err}, "
                f"releases sent {o.releases_sent} received {o.releases_received}"
            )
        if self.early_completions:
            lines += ["completion before data was visible (DONE-1):", *("  " + e for e in self.early_completions)]
        if self.mismatches:
            lines += ["pages that differ from the oracle:", format_mismatches(self.mismatches)]
        if self.problems:
            lines += ["problems:", *("  " + p for p in self.problems)]
        if self.injected:
            lines.append("injected faults: " + ", ".join(f"{f.agent}:{f.kind}" for f in self.injected))
        if self.lost_messages:
            lines.append("control messages not sent: " + "; ".join(self.lost_messages[:5]))
        return "\n".join(lines)


# --------------------------------------------------------------------------- playing a scenario


class _ScenarioError(Exception):
    """The scenario itself is inconsistent (not a backend failure)."""


# Errors that stop a request before any byte moves, as RequestOutcome.error names them.
_STOPPED_BEFORE_MOVING = (Operation.CHECK, Operation.PLAN, Operation.POST)


@attrs.define(eq=False)
class _Played:
    """One request as the scenario played it: its data and timing (the engines keep its tables)."""

    spec: Request
    started: float
    ended: float | None = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id


class _Oracle:
    """The scenario's oracle: what each request's pages must hold, how it ended, and what leaked (DONE-1, SM-1).

    Its expectations come from the reference, never from the connector under test.
    """

    def __init__(self, play: _Play) -> None:
        self.play = play

    def moved_nothing(self, request_id: str) -> bool:
        return not (self.play.consumers[request_id].posted or self.play.producers[request_id].posted)

    def expected(self, request_id: str, *, loaded: bool) -> ExpectedLoad:
        play = self.play
        tables = play.tables[request_id]
        producer = play.p_engine.tables[request_id]
        consumer = BlockIds([]) if not loaded and self.moved_nothing(request_id) else play.c_engine.tables[request_id]
        return ExpectedLoad(
            # A state group's one slot lands in C's one slot, both at the list's last position (STATE-2).
            producer_block_ids=get_state_clipped_blocks(
                play.p_config, get_exchange_clipped_blocks(producer, get_blocks_per_sw(play.p_config))
            ),
            consumer_block_ids=get_state_clipped_blocks(
                play.c_config, get_exchange_clipped_blocks(consumer, get_blocks_per_sw(play.c_config))
            ),
            num_tokens=tables.spec.listed_tokens,
            salt=request_id,
            loaded=loaded,
            # Pages are placed by where each list really ends, so a shifted pairing shows (ALIGN-1).
            producer_block_ends=tables.spec.producer_block_ends,
            consumer_block_ends=tables.spec.consumer_block_ends,
        )

    def outcome(self, request_id: str) -> RequestOutcome:
        play = self.play
        consumer = play.consumers[request_id].session
        producer = play.producers[request_id].session
        reason: FailureReason | None = None
        detail = ""
        if consumer.failure is not None:
            reason, detail = consumer.failure.reason, consumer.failure.detail
        elif consumer.state is ConsumerState.ABORTED:
            reason, detail = FailureReason.ABORTED, "aborted by the consumer"
        stopped = [
            f.error
            for f in (*play.c_driver.faults, *play.p_driver.faults)
            if f.request_id == request_id and f.operation in _STOPPED_BEFORE_MOVING
        ]
        tables = play.tables[request_id]
        return RequestOutcome(
            request_id=request_id,
            consumer_state=consumer.state,
            producer_state=producer.state,
            reason=reason,
            error=stopped[0] if stopped else None,
            detail=detail,
            posted=not self.moved_nothing(request_id),
            releases_sent=0 if consumer.release is None else 1,
            releases_received=play.received.get(request_id, 0),
            seconds=0.0 if tables.ended is None else max(0.0, tables.ended - tables.started),
        )

    def judge_pools(self, consumer_before: PoolSnapshot) -> tuple[list[str], list[PageMismatch]]:
        """Completions before the data was visible, then every page of both pools (DONE-1, SM-2)."""
        play = self.play
        early = self._judge_early_completions()
        loads = [
            self.expected(rid, loaded=play.consumers[rid].session.state is ConsumerState.LOADED) for rid in play.tables
        ]
        producer_pool = play.producer_pool
        mismatches = check_pools(
            # A pool on another host is compared by digests; its bytes are read only when they differ.
            producer=producer_pool.verified() if isinstance(producer_pool, RemotePool) else producer_pool,
            consumer=play.consumer_pool,
            producer_before=play.producer_expected,
            consumer_before=consumer_before,
            loads=loads,
        )
        return early, mismatches

    def _judge_early_completions(self) -> list[str]:
        early = []
        for request_id, load, at_completion in self.play.completed_early:
            still_wrong = {(m.layer, m.block) for m in check_loaded_pages(self.play.consumer_pool, load)}
            late = [m for m in at_completion if (m.layer, m.block) not in still_wrong]
            if late:
                early.append(
                    f"{request_id}: reported complete while {len(late)} paired pages had not landed yet, "
                    f"e.g. group {late[0].group}, layer {late[0].layer!r}, block {late[0].block}"
                )
        return early

    def result(
        self, *, refused: KVSpecError | None, mismatches: list[PageMismatch], early: list[str], started: float
    ) -> ScenarioResult:
        """The findings, once every block is back: a leak is a problem (SM-1, SM-2), so is an undecodable message."""
        play = self.play
        for rid, request in play.consumers.items():
            if not request.freed:
                play.c_engine.free_table(rid, missing_ok=True)  # the engine finishes every request
        c_alloc, p_alloc = play.c_engine.allocator, play.p_engine.allocator
        if c_alloc.num_free != c_alloc.baseline:
            play.problems.append(f"consumer free blocks {c_alloc.num_free}, baseline {c_alloc.baseline}")
        if p_alloc.num_free != p_alloc.baseline:
            play.problems.append(f"producer free blocks {p_alloc.num_free}, baseline {p_alloc.baseline} (leaked, SM-1)")
        faults = [*play.c_driver.faults, *play.p_driver.faults]
        play.problems += [f"undecodable notification: {f} (VER-1)" for f in faults if f.operation is Operation.DECODE]
        return ScenarioResult(
            refused=refused,
            outcomes={rid: self.outcome(rid) for rid in play.tables},
            mismatches=tuple(mismatches),
            early_completions=tuple(early),
            problems=tuple(play.problems),
            injected=tuple(f for injector in play.injectors for f in injector.injected),
            lost_messages=tuple(str(f) for f in faults if f.operation is Operation.SEND),
            seconds=time.monotonic() - started,
        )


class _Stage:
    """The stage of a scenario: both pools, both agents, two driver cores and kvspec's two engine roles.

    The engine roles are the endpoints' own: they allocate every table and
    play each request's steps; the stage wires them to the suite's pools and
    agents, and plays the handshake (HS-1).
    """

    producer: Transport
    consumer: Transport
    producer_name: str
    consumer_name: str
    producer_pool: PagePool
    consumer_pool: PagePool
    p_engine: ProducerEngine
    c_engine: ConsumerEngine
    tables: dict[str, _Played]

    def __init__(self, scenario: Scenario, backend: Backend, connector: Connector) -> None:
        self.scenario = scenario
        self.backend = backend
        self.connector = connector
        self.mode = TransferMode(scenario.mode)
        self.p_config = _build(scenario.config)
        self.c_config = _build(scenario.consumer_config) if scenario.consumer_config is not None else self.p_config
        self.injectors: list[FaultInjector] = []
        # The sessions' clock: a starved process's lost time does not count against a deadline (FAIL-1).
        self.clock = PollClock()

    def _pool(self, role: str, config: KVCacheConfig) -> PagePool:
        """The suite's shared-memory pool, or, with ``--peer``, the producer's pool on the agent server."""
        base = self.backend.inner if isinstance(self.backend, PacedBackend) else self.backend  # --peer --pace
        if isinstance(base, PeerBackend):
            return base.allocate_pool(role, config)
        return allocate_pool(config)

    def _agent(self, role: str) -> Transport:
        agent: Transport = self.backend.create_agent(role)
        plan = self.scenario.faults
        if plan is not None and self.scenario.fault_side in (role, "both"):
            injector = FaultInjector(agent, plan)
            self.injectors.append(injector)
            return injector
        return agent

    def _drivers(self) -> None:
        self.p_driver = Driver(
            role=PRODUCER,
            transport=self.producer,
            clock=self.clock,
            on_free=lambda request, _: self.p_engine.free_table(request.request_id, missing_ok=True),
            on_end=lambda request: None,
            on_message=self._on_producer_message,
            integrity=self._digester(self.p_config, self.producer_pool),
        )
        self.c_driver = Driver(
            role=CONSUMER,
            transport=self.consumer,
            clock=self.clock,
            on_free=self._free_consumer,
            on_end=self._consumer_ended,
            integrity=self._digester(self.c_config, self.consumer_pool),
        )
        # The engine roles are kvspec's, the endpoints' own: they allocate every table, the case's named ids as
        # claims; the most recently freed block is reused first, so a block freed too early is seen (SM-2).
        self.p_engine = ProducerEngine(
            engine_id="producer",
            config=self.p_config,
            connector=self.connector,
            driver=self.p_driver,
            peer_config=lambda request: self.c_config,
            # The suite knows the prefix hit: a WRITE moves the connector's own pairing (WIN-1, ALIGN-1).
            pair_offer=pair_offer_by_connector(
                self.connector, self.p_config, lambda request_id: self.tables[request_id].spec.prefix_hit_tokens
            ),
            reuse="latest",
        )
        self.c_engine = ConsumerEngine(
            engine_id="consumer",
            config=self.c_config,
            mode=self.mode,
            connector=self.connector,
            driver=self.c_driver,
            state_profile=StateProfile(self.scenario.state_profile),
            transfer_timeout=self.scenario.deadline,
            drain_timeout=self.scenario.drain,
            reuse="latest",
        )

    def _digester(self, config: KVCacheConfig, pool: PagePool) -> PageDigester | None:
        if not self.scenario.integrity:
            return None
        # Both drivers are this process's: they digest with what a 1.3 handshake would choose (INT-2).
        return PageDigester(config, [r.buffer for r in pool.regions], algorithm=get_offered_algorithms()[0])

    def _free_consumer(self, request: LiveRequest[ConsumerSession], block_ids: BlockIds) -> None:
        self.c_engine.free_table(request.request_id, missing_ok=True)

    def _on_producer_message(self, request_id: str, peer: str, message: Message) -> None:
        raise NotImplementedError

    def _consumer_ended(self, request: LiveRequest[ConsumerSession]) -> None:
        raise NotImplementedError

    def _connect(self, producer_pool: PagePool, consumer_pool: PagePool) -> None:
        self.producer.register_memory(producer_pool.regions)
        self.consumer.register_memory(consumer_pool.regions)
        self._check_peers()
        self._handshake()

    def _descriptor(self, role: str, config: KVCacheConfig, agent: Transport) -> EngineDescriptor:
        return EngineDescriptor.from_config(
            engine_id=role,
            config=config,
            mode=self.mode,
            hma_enabled=is_hma_required(config),
            transport_metadata=agent.get_agent_metadata(),
            state_profile=StateProfile(self.scenario.state_profile) if get_state_group_indices(config) else None,
        )

    def _check_peers(self) -> None:
        """Both descriptors cross the wire codec; the connector compares them before loading metadata (HS-1)."""
        producer = self._descriptor("producer", self.p_config, self.producer)
        consumer = self._descriptor("consumer", self.c_config, self.consumer)
        for field, value in self.scenario.handshake_overrides:
            if field == "mode":
                value = TransferMode(str(value))
            if field == "state_profile" and value is not None:
                value = StateProfile(str(value))
            consumer = attrs.evolve(consumer, **{field: value})  # type: ignore[arg-type]
        wire = encode(consumer)
        overrides = dict(self.scenario.handshake_overrides)
        if "protocol_version" in overrides:
            # A peer of another version also stamps its messages with it (VER-1).
            data = json.loads(wire)
            data["v"] = list(overrides["protocol_version"])  # type: ignore[call-overload]
            wire = json.dumps(data, sort_keys=True).encode()
        received_by_producer = decode(wire)
        received_by_consumer = decode(encode(producer))
        if not isinstance(received_by_producer, EngineDescriptor) or not isinstance(
            received_by_consumer, EngineDescriptor
        ):
            raise MalformedMessageError("a handshake descriptor decoded as another message")
        self.connector.check_peer(received_by_consumer, received_by_producer)

    def _handshake(self) -> None:
        self.producer_name = self.consumer.add_remote_agent(self.producer.get_agent_metadata())
        self.consumer_name = self.producer.add_remote_agent(self.consumer.get_agent_metadata())


class _Play(_Stage):
    """Plays one scenario on the stage: its requests, wave by wave, and its fault timing; then the oracle judges.

    Only scenario data, fault timing and the oracle live here; a request's
    steps are kvspec's engine roles', its lifecycle the sessions', carried
    out by the same driver core as the exchange endpoints.
    """

    def __init__(self, scenario: Scenario, backend: Backend, connector: Connector) -> None:
        super().__init__(scenario, backend, connector)
        self.oracle = _Oracle(self)
        self.tables = {}
        self.producers: dict[str, LiveRequest[ProducerSession]] = {}
        self.consumers: dict[str, LiveRequest[ConsumerSession]] = {}
        self.received: dict[str, int] = {}
        self.polls: dict[str, int] = {}
        self.completed_early: list[tuple[str, ExpectedLoad, list[PageMismatch]]] = []
        self.problems: list[str] = []
        # What bounds a wave (_loop): the sessions' clock, with a fifth of wall time as a floor.
        self.stop_clock: Callable[[], float] = self.clock

    def _start(self, spec: Request, now: float) -> None:
        scenario = self.scenario
        # The whole table vLLM holds for T + R tokens, pruned with T (WIN-1), or the one the case names.
        p_ids = self.p_engine.allocate_table(
            spec.request_id,
            num_tokens=spec.num_tokens,
            recomputed_tokens=spec.recomputed_tokens,
            claim=spec.producer_block_ids,
            whole=True,
        )
        # Keyed by true position, so a shifted pairing shows (ALIGN-1); past a state group's scratch slots (STATE-2).
        ends = self.p_engine.get_page_ends(p_ids, num_tokens=spec.listed_tokens, declared=spec.producer_block_ends)
        _fill_producer_pages(
            self.producer_pool, p_ids, num_tokens=spec.listed_tokens, salt=spec.request_id, block_ends=ends
        )
        self.producer_expected = self.producer_pool.snapshot()
        c_ids = self.c_engine.allocate_suffix(
            spec.request_id,
            num_tokens=spec.num_tokens,
            prefix_hit_tokens=spec.prefix_hit_tokens,
            recomputed_tokens=spec.recomputed_tokens,
            claim=spec.consumer_block_ids,
        )
        self.tables[spec.request_id] = _Played(spec=spec, started=now)
        producer = self.p_engine.hold(
            spec.request_id,
            advertised=self.p_engine.clip(p_ids),
            num_tokens=spec.num_tokens,
            mode=self.mode,
            now=now,
            lease_duration=scenario.lease_of(spec),
            # Above the consumer's drain timeout, as the lease rule asks (SM-1).
            release_grace=1.5 * scenario.drain,
            drain_timeout=scenario.drain,
            peer=self.consumer_name,
            # Protocol 1.1: set only when the request sets them, so they travel through the params dict.
            producer_block_ends=spec.producer_block_ends,
            recomputed_tokens=spec.recomputed_tokens,
            state_tokens=self.p_engine.get_state_tokens(
                spec.num_tokens, given=spec.state_tokens, send=spec.send_state_tokens
            ),
        )
        self.producers[spec.request_id] = producer
        # The parameters reach the consumer as vLLM's dict, through the router.
        params = TransferParams.from_kv_transfer_params(producer.session.params.to_kv_transfer_params())
        # The consumer engine plays the rest: session, STATE-1, WIN-1 and ALIGN-1, PLAN-1, then start.
        # The consumer's transfer timeout is the request's own where it has one (a load among faults, FAIL-1).
        self.c_engine.transfer_timeout = scenario.deadline_of(spec)
        self.consumers[spec.request_id] = self.c_engine.begin(
            params,
            prefix_hit_tokens=spec.prefix_hit_tokens,
            peer=self.producer_name,
            peer_config=self.p_config,
            suffix=lambda: c_ids,
            consumer_block_ends=spec.consumer_block_ends,  # a WRITE offer carries them (ALIGN-1)
            now=now,
        )

    # -- the role hooks

    def _on_producer_message(self, request_id: str, peer: str, message: Message) -> None:
        if isinstance(message, Release):
            self.received[request_id] = self.received.get(request_id, 0) + 1

    def _consumer_ended(self, request: LiveRequest[ConsumerSession]) -> None:
        tables = self.tables[request.request_id]
        tables.ended = self.clock()
        if request.session.state is ConsumerState.LOADED:
            expected = self.oracle.expected(request.request_id, loaded=True)
            found = check_loaded_pages(self.consumer_pool, expected)
            if found:
                # Judged at the end: a page right by then landed late (DONE-1); one still wrong is a data error.
                self.completed_early.append((request.request_id, expected, found))

    # -- the run

    def run(self) -> ScenarioResult:
        started = time.monotonic()
        try:
            for config in (self.p_config, self.c_config):
                self.connector.check_admission(config, self.mode)
        except KVSpecError as exc:
            return ScenarioResult(
                outcomes={},
                mismatches=(),
                early_completions=(),
                problems=(),
                injected=(),
                seconds=time.monotonic() - started,
                refused=exc,
            )
        with self._pool("producer", self.p_config) as producer_pool, allocate_pool(self.c_config) as consumer_pool:
            self.producer_pool, self.consumer_pool = producer_pool, consumer_pool
            _fill_background(producer_pool, seed="producer")
            fill_background(consumer_pool, seed="consumer")
            self.producer_expected = producer_pool.snapshot()
            consumer_before = consumer_pool.snapshot()
            self.producer = self._agent("producer")
            self.consumer = self._agent("consumer")
            self._drivers()
            refused: KVSpecError | None = None
            try:
                try:
                    self._connect(producer_pool, consumer_pool)
                except (
                    IncompatiblePeerError,
                    CacheAccountingError,
                    UnsupportedVersionError,
                    MalformedMessageError,
                ) as exc:
                    refused = exc
                else:
                    self._loop()
                early, mismatches = self.oracle.judge_pools(consumer_before)
            finally:
                for agent in (self.consumer, self.producer):
                    try:
                        agent.close()
                    except KVSpecError as exc:
                        self.problems.append(f"closing {agent.name}: {exc}")
        return self.oracle.result(refused=refused, mismatches=mismatches, early=early, started=started)

    def _settled(self) -> bool:
        """Every request ended on both sides, with every block back (or held by a loaded request)."""
        return not self.c_driver.requests and not self.p_driver.requests

    def _loop(self) -> None:
        waves = sorted({r.wave for r in self.scenario.requests})
        scenario = self.scenario
        longest = max((scenario.lease_of(r) + scenario.deadline_of(r) for r in scenario.requests), default=0.0)
        # On the sessions' clock: a busy machine that slowed the polls down has not used the requests' time up.
        # Wall time counts too, a fifth of it, so a backend whose every call hangs a long while still ends.
        wall, virtual = time.monotonic(), self.clock()
        self.stop_clock = lambda: max(self.clock(), virtual + (time.monotonic() - wall) / 5)
        hard_stop = virtual + longest + 10.0
        for index, wave in enumerate(waves):
            if index:
                self._handshake()  # again: a disconnect in the last wave must not strand the next one
            now = self.clock()
            specs = [spec for spec in self.scenario.requests if spec.wave == wave]
            # Requests with explicit block ids claim theirs before fresh ones are handed out.
            specs.sort(key=lambda s: s.producer_block_ids is None and s.consumer_block_ids is None)
            for spec in specs:
                self._start(spec, now)
            # The next wave starts once blocks are back, so it reuses what the last one freed.
            self._drive(hard_stop)
            if not self._settled():
                stuck = sorted({*self.c_driver.requests, *self.p_driver.requests})
                self.problems.append(f"requests {stuck} did not end within the deadlines (FAIL-1)")
                return
        # Keep polling a little so that late writes land and are seen.
        settle = time.monotonic() + 0.01
        if self.completed_early:
            # Give data that trailed a completion time to land, so it is judged late, not wrong (DONE-1).
            settle += min(0.2, self.scenario.deadline)
        cancelled = [t for t in (self.c_driver.cancelled_at, self.p_driver.cancelled_at) if t is not None]
        if cancelled and self.scenario.watch_late_writes:
            # A cancelled transfer that outlives the drain bound must be seen landing (SM-2).
            settle = max(settle, max(cancelled) + 4 * self.scenario.drain)
        # A copy landing again after DONE is seen only if the pools are read after it (DONE-1).
        settle = max(settle, time.monotonic() + self.scenario.settle)
        poll_until(self._poll_once, done=lambda: time.monotonic() >= settle, min_polls=20, spin=20, pause=_settle_pause)

    def _drive(self, hard_stop: float) -> None:
        # After ten quick polls, a short sleep: cross-process backends progress in their own processes.
        poll_until(self._poll_once, done=self._settled, until=hard_stop, spin=10, clock=self.stop_clock)

    def _poll_once(self) -> None:
        self.clock.tick()
        self._inject_timed_faults()
        self.c_driver.poll()
        self.p_driver.poll()

    def _inject_timed_faults(self) -> None:
        """The scenario's own fault timing: a consumer abort, or the initiator forgetting its peer (SM-2, FAIL-1)."""
        initiator, peer = (
            (self.c_driver, self.producer_name)
            if self.mode is TransferMode.READ
            else (self.p_driver, self.consumer_name)
        )
        for request_id, tables in self.tables.items():
            spec = tables.spec
            consumer = self.consumers[request_id]
            session = consumer.session
            if spec.abort_after_polls is not None and session.state is ConsumerState.LOADING:
                polls = self.polls[request_id] = self.polls.get(request_id, 0) + 1
                if polls > spec.abort_after_polls:
                    self.c_driver.execute(consumer, session.abort(now=self.clock()))
            posted = initiator.requests.get(request_id)
            if spec.disconnect_after_polls is not None and posted is not None and posted.handle is not None:
                key = "disconnect:" + request_id
                polls = self.polls[key] = self.polls.get(key, 0) + 1
                if polls == spec.disconnect_after_polls + 1:
                    initiator.transport.remove_remote_agent(peer)  # the backend's own peer loss
            if spec.kill_peer_after_polls is not None and posted is not None and posted.handle is not None:
                key = "kill:" + request_id
                polls = self.polls[key] = self.polls.get(key, 0) + 1
                if polls == spec.kill_peer_after_polls + 1:
                    self._kill_peer()

    def _kill_peer(self) -> None:
        """Kill the producer's agent on the agent server, under any fault injector (FAIL-1)."""
        agent: object = self.producer
        while isinstance(agent, (FaultInjector, PacedTransport)):
            agent = agent.inner
        if not isinstance(agent, RemoteAgent):
            raise _ScenarioError("kill_peer_after_polls needs the producer on an agent server (kvspec conform --peer)")
        agent.kill()


def _settle_pause() -> None:
    time.sleep(0.001)


def _fill_background(pool: PagePool, *, seed: str) -> None:
    if isinstance(pool, RemotePool):
        pool.fill_background(seed=seed)  # the shadow here and the pool on the agent server
    else:
        fill_background(pool, seed=seed)


def _fill_producer_pages(
    pool: PagePool, block_ids: BlockIds, *, num_tokens: int, salt: str, block_ends: tuple[int, ...] | None
) -> None:
    if isinstance(pool, RemotePool):
        pool.fill_producer_pages(block_ids, num_tokens=num_tokens, salt=salt, block_ends=block_ends)
    else:
        fill_producer_pages(pool, block_ids, num_tokens=num_tokens, salt=salt, block_ends=block_ends)


def _resolve_backend(backend: Backend | str) -> tuple[Backend, bool]:
    if isinstance(backend, str):
        from kvspec.transport import load_backend

        return load_backend(backend), True
    return backend, False


def run_scenario(
    scenario: Scenario,
    *,
    backend: Backend | str = "loopback",
    connector: Connector | None = None,
) -> ScenarioResult:
    """Play ``scenario`` on ``backend`` (a Backend or a name for :func:`kvspec.transport.load_backend`).

    The suite owns both pools; the result holds the oracle's findings. Agents
    are named ``"producer"`` and ``"consumer"`` and closed at the end.
    """
    resolved, owned = _resolve_backend(backend)
    try:
        return _Play(scenario, resolved, connector or ReferenceConnector()).run()
    finally:
        if owned:
            resolved.close()
