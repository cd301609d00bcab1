"""Scenarios: two agents over suite-owned shared-memory pools, requests driven to the end, then the oracle.

Theory of operation. A :class:`Scenario` is plain data whose ``repr`` is valid
Python, so a failing case prints it as a reproducer. :func:`run_scenario`
plays it on a backend:

1. Both pools are allocated in shared memory and filled with keyed noise;
   each request's producer blocks get pages keyed by (request, group, layer,
   logical position) (:mod:`kvspec.testing`).
2. Each side keeps a free-block list (most recently freed first, so that a
   block freed too early is reused at once and a late write into it is seen).
3. The producer clips and advertises its blocks; the consumer clips its
   uncached suffix; the connector under test pairs and plans; the initiator
   posts (READ: the consumer; WRITE: the producer, with the completion as the
   post's notification). Control messages travel as transport notifications.
4. The loop polls both agents until every request is terminal on both sides
   (consumer LOADED or FAILED, producer RELEASED, EXPIRED or ABORTED), with a
   hard bound; then it keeps polling a little while so that late writes land.
5. The moment a consumer sees completion, the request's pages are checked
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
    NULL_BLOCK_ID,
    Abort,
    BlockIds,
    BlockOffer,
    BlockPairsLike,
    Completion,
    EngineDescriptor,
    Failure,
    FailureReason,
    IncompatiblePeerError,
    KVCacheConfig,
    KVSpecError,
    MalformedMessageError,
    Message,
    PlanError,
    Release,
    ReleaseOutcome,
    TransferMode,
    TransportError,
    UnsupportedVersionError,
    decode,
    encode,
    get_blocks_per_sw,
    get_consumer_block_counts,
    get_exchange_clipped_blocks,
    get_logical_block_count,
    get_num_skipped_tokens,
    is_hma_required,
)
from kvspec.presets import get_preset
from kvspec.testing import (
    ExpectedLoad,
    PageMismatch,
    PagePool,
    allocate_pool,
    check_loaded_pages,
    check_pools,
    fill_background,
    fill_producer_pages,
    format_mismatches,
)
from kvspec.transport import Backend, FaultInjector, FaultPlan, InjectedFault, TransferHandle, TransferState, Transport

from ._connector import Connector, ReferenceConnector

__all__ = [
    "PresetConfig",
    "Request",
    "RequestOutcome",
    "Scenario",
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
    makes the initiator forget its peer then (a native peer loss).
    """

    request_id: str
    num_tokens: int
    prefix_hit_tokens: int = 0
    producer_block_ids: BlockIds | None = attrs.field(default=None, converter=_optional_ids)
    consumer_block_ids: BlockIds | None = attrs.field(default=None, converter=_optional_ids)
    wave: int = 0
    abort_after_polls: int | None = None
    disconnect_after_polls: int | None = None


@attrs.frozen(kw_only=True)
class Scenario:
    """A whole exchange: configs, mode, requests, injected faults and deadlines (seconds).

    ``drain`` is the drain bound: a transfer released while PENDING may move
    bytes for that long, so its blocks are reused only after it (SM-2).
    ``handshake_overrides`` replaces fields of the consumer's handshake
    descriptor, e.g. ``(("mode", "write"),)`` or ``(("protocol_version", (2, 0)),)``.
    """

    config: ConfigSource
    requests: tuple[Request, ...] = attrs.field(converter=_to_requests)
    mode: str = attrs.field(default="read", validator=_one_of("read", "write"))
    consumer_config: ConfigSource | None = None
    faults: FaultPlan | None = None
    fault_side: str = attrs.field(default="both", validator=_one_of("producer", "consumer", "both"))
    deadline: float = 1.0
    lease: float = 2.0
    drain: float = 0.1
    handshake_overrides: tuple[tuple[str, object], ...] = attrs.field(default=(), converter=_to_overrides)

    def to_python(self, backend: str = "loopback", connector: str | None = None) -> str:
        """A script that replays this scenario on ``backend`` and prints what the oracle found.

        ``connector`` is ``"module:Class"`` of a connector under test built without arguments.
        """
        imports = ""
        call = f"run_scenario(scenario, backend={backend!r})"
        if connector is not None:
            module, _, name = connector.partition(":")
            imports = f"from {module} import {name} as ConnectorUnderTest\n"
            call = f"run_scenario(scenario, backend={backend!r}, connector=ConnectorUnderTest())"
        return (
            "from kvspec import *\n"
            "from kvspec.transport.faults import FaultPlan\n"
            "from kvspec_conformance import PresetConfig, Request, Scenario, run_scenario\n"
            f"{imports}\n"
            f"scenario = {self!r}\n"
            f"result = {call}\n"
            "print(result.summary())\n"
        )


@attrs.frozen(kw_only=True)
class RequestOutcome:
    """How one request ended on both sides, as the scenario driver observed it."""

    request_id: str
    consumer_state: str  # "loaded" or "failed"
    producer_state: str  # "released", "expired", "aborted" or "held"
    reason: FailureReason | None = None
    error: str | None = None  # the kvspec error type raised before any byte moved
    detail: str = ""
    posted: bool = False
    releases_sent: int = 0
    releases_received: int = 0
    seconds: float = 0.0


@attrs.frozen(kw_only=True)
class ScenarioResult:
    """What the oracle and the driver found. ``ok`` means no page, timing or leak problem."""

    outcomes: dict[str, RequestOutcome]
    mismatches: tuple[PageMismatch, ...]
    early_completions: tuple[str, ...]
    problems: tuple[str, ...]
    injected: tuple[InjectedFault, ...]
    seconds: float
    refused: str | None = None  # "ErrorType: message" when admission or the handshake refused the pair
    lost_messages: tuple[str, ...] = ()  # control messages the transport refused to send (after a disconnect)

    @property
    def ok(self) -> bool:
        """No mismatch, no early completion, no leak or hang."""
        return not (self.mismatches or self.early_completions or self.problems)

    def outcome(self, request_id: str) -> RequestOutcome:
        """The outcome of one request."""
        return self.outcomes[request_id]

    def summary(self) -> str:
        """Human-readable findings."""
        lines = [f"{len(self.outcomes)} requests in {self.seconds:.3f}s"]
        if self.refused:
            lines.append(f"refused before setup: {self.refused}")
        for o in self.outcomes.values():
            why = f" reason={o.reason.value}" if o.reason else ""
            err = f" error={o.error}" if o.error else ""
            lines.append(
                f"  {o.request_id}: consumer {o.consumer_state}, producer {o.producer_state}{why}{err}, "
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


# --------------------------------------------------------------------------- the driver


class _Allocator:
    """Free block ids of one side; most recently freed are reused first."""

    def __init__(self, num_blocks: int) -> None:
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() gives 1 first
        self.baseline = len(self.free)

    def claim(self, block_id: int) -> None:
        if block_id != NULL_BLOCK_ID and block_id in self.free:
            self.free.remove(block_id)

    def allocate(self) -> int:
        if not self.free:
            raise _ScenarioError("the scenario ran out of free blocks; give the config more num_blocks")
        return self.free.pop()

    def release(self, ids: Iterable[int]) -> None:
        for block_id in ids:
            if block_id != NULL_BLOCK_ID and block_id not in self.free:
                self.free.append(block_id)


class _ScenarioError(Exception):
    """The scenario itself is inconsistent (not a backend failure)."""


def _encode(kind: str, request_id: str, **extra: Any) -> bytes:
    """Control messages are real protocol messages in kvspec's wire codec (VER-1)."""
    message: Message
    if kind == "offer":
        message = BlockOffer(
            request_id=request_id, consumer_engine_id="consumer", consumer_block_ids=extra["consumer_block_ids"]
        )
    elif kind == "complete":
        message = Completion(request_id=request_id, producer_engine_id="producer")
    elif kind == "failed":
        message = Failure(
            request_id=request_id,
            producer_engine_id="producer",
            reason=FailureReason(extra["reason"]),
            failed_consumer_block_ids=BlockIds([]) if extra.get("moved_nothing") else extra["consumer_block_ids"],
            detail=str(extra.get("detail", "")),
        )
    elif kind == "release":
        message = Release(request_id=request_id, consumer_engine_id="consumer", outcome=extra["outcome"])
    else:  # "drained": P confirms no write of its touches C's blocks any more
        message = Abort(request_id=request_id, engine_id="producer", detail="drained")
    return encode(message)


def _decode(data: bytes) -> tuple[str, str, dict[str, object]]:
    message = decode(data)
    if isinstance(message, BlockOffer):
        return "offer", message.request_id, {"consumer_block_ids": message.consumer_block_ids}
    if isinstance(message, Completion):
        return "complete", message.request_id, {}
    if isinstance(message, Failure):
        moved_nothing = len(message.failed_consumer_block_ids) == 0
        extra: dict[str, object] = {
            "reason": message.reason.value,
            "detail": message.detail,
            "moved_nothing": moved_nothing,
        }
        return "failed", message.request_id, extra
    if isinstance(message, Release):
        abort = message.outcome in (ReleaseOutcome.FAILED, ReleaseOutcome.ABORTED)
        return "release", message.request_id, {"abort": abort}
    if isinstance(message, Abort):
        return "drained", message.request_id, {}
    raise MalformedMessageError(f"unexpected {type(message).__name__} among the control messages")


@attrs.define(eq=False)
class _State:
    """Driver bookkeeping of one request, on both sides."""

    spec: Request
    producer_ids: BlockIds  # P's table, before clipping
    producer_advertised: BlockIds  # after clipping (CLIP-1)
    consumer_ids: BlockIds  # C's uncached suffix, before clipping
    consumer_offered: BlockIds  # after clipping
    started: float
    c_state: str = "allocated"  # allocated, loading, loaded, failed
    p_state: str = "held"  # held, released, expired, aborted
    reason: FailureReason | None = None
    error: str | None = None
    detail: str = ""
    moved_nothing: bool = False  # failed before any post: no consumer byte may change
    posted: bool = False
    c_handle: TransferHandle | None = None  # READ
    p_handle: TransferHandle | None = None  # WRITE
    polls: int = 0
    p_polls: int = 0
    c_deadline: float = 0.0
    p_deadline: float = 0.0
    c_blocks_held: bool = True
    c_quarantine_until: float | None = None
    c_drain_until: float | None = None  # C cancelled its read: blocks wait for the drain bound
    p_drain_until: float | None = None  # P cancelled its write: blocks (and its confirmation) wait for it
    p_blocks_held: bool = True
    p_confirm_drain: bool = False
    releases_sent: int = 0
    releases_received: int = 0
    finished_at: float = 0.0
    offered_to_producer: BlockIds = attrs.field(factory=lambda: BlockIds([]))

    @property
    def c_terminal(self) -> bool:
        return self.c_state in ("loaded", "failed")

    @property
    def p_terminal(self) -> bool:
        return self.p_state in ("released", "expired", "aborted") and self.p_handle is None

    @property
    def settled(self) -> bool:
        """Both sides ended and every block is back (or held by a loaded request)."""
        c_done = self.c_terminal and (self.c_state == "loaded" or not self.c_blocks_held)
        return c_done and self.p_terminal and not self.p_blocks_held


def _reason(value: str | None, default: FailureReason) -> FailureReason:
    try:
        return FailureReason(value) if value else default
    except ValueError:
        return default


class _Driver:
    def __init__(self, scenario: Scenario, backend: Backend, connector: Connector) -> None:
        self.scenario = scenario
        self.backend = backend
        self.connector = connector
        self.mode = TransferMode(scenario.mode)
        self.p_config = _build(scenario.config)
        self.c_config = _build(scenario.consumer_config) if scenario.consumer_config is not None else self.p_config
        self.states: dict[str, _State] = {}
        self.loads: list[ExpectedLoad] = []
        self.early: list[str] = []
        self.completed_early: list[tuple[str, ExpectedLoad, list[PageMismatch]]] = []
        self.problems: list[str] = []
        self.injectors: list[FaultInjector] = []

    # -- setup

    def _agent(self, role: str) -> Transport:
        agent: Transport = self.backend.create_agent(role)
        plan = self.scenario.faults
        if plan is not None and self.scenario.fault_side in (role, "both"):
            injector = FaultInjector(agent, plan)
            self.injectors.append(injector)
            return injector
        return agent

    def _producer_table(self, spec: Request) -> BlockIds:
        if spec.producer_block_ids is not None:
            for ids in spec.producer_block_ids:
                for block_id in ids:
                    self.p_alloc.claim(block_id)
            return spec.producer_block_ids
        groups: list[list[int]] = []
        for group in self.p_config.kv_cache_groups:
            total = get_logical_block_count(group.kv_cache_spec, num_tokens=spec.num_tokens)
            # P has computed every token; vLLM nulls the blocks its window skipped
            # (docs/spec/alignment-and-coverage.md, WIN-1).
            skipped = min(
                get_num_skipped_tokens(group.kv_cache_spec, num_computed_tokens=spec.num_tokens)
                // group.kv_cache_spec.block_size,
                total,
            )
            groups.append([NULL_BLOCK_ID] * skipped + [self.p_alloc.allocate() for _ in range(total - skipped)])
        return BlockIds(groups)

    def _consumer_suffix(self, spec: Request) -> BlockIds:
        if spec.consumer_block_ids is not None:
            for ids in spec.consumer_block_ids:
                for block_id in ids:
                    self.c_alloc.claim(block_id)
            return spec.consumer_block_ids
        if spec.prefix_hit_tokens == spec.num_tokens:
            return BlockIds([])  # full prefix hit: zero groups (CLIP-1)
        counts = get_consumer_block_counts(
            self.c_config, num_tokens=spec.num_tokens, prefix_hit_tokens=spec.prefix_hit_tokens
        )
        return BlockIds([[self.c_alloc.allocate() for _ in range(n)] for n in counts])

    def _start(self, spec: Request, now: float) -> None:
        p_ids = self._producer_table(spec)
        fill_producer_pages(self.producer_pool, p_ids, num_tokens=spec.num_tokens, salt=spec.request_id)
        self.producer_expected = self.producer_pool.snapshot()
        c_ids = self._consumer_suffix(spec)
        state = _State(
            spec=spec,
            producer_ids=p_ids,
            producer_advertised=self.connector.clip_block_ids(self.p_config, p_ids),
            consumer_ids=c_ids,
            consumer_offered=self.connector.clip_block_ids(self.c_config, c_ids),
            started=now,
            c_deadline=now + self.scenario.deadline,
            p_deadline=now + self.scenario.lease,
        )
        self.states[spec.request_id] = state
        if self.mode is TransferMode.READ:
            self._consumer_read(state, now)
        else:
            self._consumer_offer(state)

    # -- consumer side

    def _expected(self, state: _State, loaded: bool) -> ExpectedLoad:
        # The oracle's expectation comes from the reference, never from the connector under test.
        consumer = BlockIds([]) if state.moved_nothing else state.consumer_ids
        return ExpectedLoad(
            producer_block_ids=get_exchange_clipped_blocks(state.producer_ids, get_blocks_per_sw(self.p_config)),
            consumer_block_ids=get_exchange_clipped_blocks(consumer, get_blocks_per_sw(self.c_config)),
            num_tokens=state.spec.num_tokens,
            salt=state.spec.request_id,
            loaded=loaded,
        )

    def _pairs(self, state: _State) -> BlockPairsLike:
        pairs: BlockPairsLike = self.connector.pair_block_ids(
            self.p_config,
            num_tokens=state.spec.num_tokens,
            prefix_hit_tokens=state.spec.prefix_hit_tokens,
            producer_block_ids=state.producer_advertised,
            consumer_block_ids=state.consumer_offered,
        )
        return pairs

    def _consumer_read(self, state: _State, now: float) -> None:
        try:
            pairs = self._pairs(state)
            plan = self.connector.plan(producer_config=self.p_config, consumer_config=self.c_config, pairs=pairs)
        except KVSpecError as exc:
            self._fail_before_post(state, exc, now)
            return
        if plan.num_descriptors == 0:
            self._loaded(state, now)
            return
        try:
            state.c_handle = self.consumer.post(
                TransferMode.READ, plan.to_descriptors(TransferMode.READ), peer=self.producer_name
            )
        except (TransportError, PlanError) as exc:
            state.moved_nothing = True
            self._consumer_failed(
                state, _reason(getattr(exc, "reason", None), FailureReason.POST_FAILED), str(exc), now
            )
            state.error = type(exc).__name__
            return
        state.posted = True
        state.c_state = "loading"

    def _fail_before_post(self, state: _State, exc: KVSpecError, now: float) -> None:
        name = type(exc).__name__
        reason = {
            "WindowCoverageError": FailureReason.WINDOW_COVERAGE,
            "BlockAlignmentError": FailureReason.BLOCK_ALIGNMENT,
            "GroupCountError": FailureReason.BLOCK_ALIGNMENT,
        }.get(name, FailureReason.PROTOCOL)
        state.moved_nothing = True
        state.error = name
        self._consumer_failed(state, reason, str(exc), now)

    def _consumer_offer(self, state: _State) -> None:
        state.c_state = "loading"
        self._send(
            self.consumer,
            self.producer_name,
            _encode("offer", state.spec.request_id, consumer_block_ids=state.consumer_offered.to_lists()),
        )

    def _loaded(self, state: _State, now: float) -> None:
        expected = self._expected(state, loaded=True)
        found = check_loaded_pages(self.consumer_pool, expected)
        if found:
            # Judged at the end: a page right by then landed late (DONE-1); one still wrong is a data error.
            self.completed_early.append((state.spec.request_id, expected, found))
        state.c_state = "loaded"
        state.finished_at = now
        self.loads.append(expected)
        self._send_release(state)

    def _consumer_failed(self, state: _State, reason: FailureReason, detail: str, now: float) -> None:
        if state.c_terminal:
            return
        state.c_state = "failed"
        state.reason = reason
        state.detail = detail
        state.finished_at = now
        self.loads.append(self._expected(state, loaded=False))
        self._send_release(state)
        if state.c_drain_until is not None:
            state.c_quarantine_until = state.c_drain_until  # our cancelled read may still land (SM-2)
        elif self.mode is TransferMode.READ or state.moved_nothing:
            self._free_consumer(state)  # our read ended (DONE or FAILED) or was never posted
        else:
            # A WRITE into our blocks may still be in flight: keep them until P says it drained, or its lease ends.
            state.c_quarantine_until = state.started + self.scenario.lease + self.scenario.deadline

    def _cancel_read(self, state: _State, now: float) -> None:
        assert state.c_handle is not None
        self.consumer.release(state.c_handle)
        state.c_handle = None
        state.c_drain_until = now + self.scenario.drain
        self.cancelled_at.append(now)

    def _free_consumer(self, state: _State) -> None:
        if state.c_blocks_held:
            state.c_blocks_held = False
            state.c_quarantine_until = None
            self.c_alloc.release(b for ids in state.consumer_ids for b in ids)

    def _send_release(self, state: _State) -> None:
        state.releases_sent += 1
        if state.c_state == "loaded":
            outcome = ReleaseOutcome.PREFIX_HIT if len(state.consumer_offered) == 0 else ReleaseOutcome.LOADED
        else:
            outcome = ReleaseOutcome.ABORTED if state.reason is FailureReason.ABORTED else ReleaseOutcome.FAILED
        self._send(self.consumer, self.producer_name, _encode("release", state.spec.request_id, outcome=outcome))

    def _send(self, agent: Transport, peer: str, message: bytes) -> None:
        try:
            agent.send_notification(peer, message)
        except TransportError as exc:
            # A lost control message must end in a deadline, never a hang (FAIL-1).
            self.lost_sends.append(f"{agent.name} -> {peer}: {exc}")

    def _poll_consumer(self, now: float) -> None:
        for note in self.consumer.get_notifications():
            try:
                kind, request_id, extra = _decode(note.message)
            except KVSpecError as exc:
                self.problems.append(f"consumer got an undecodable notification ({exc}) (VER-1)")
                continue
            state = self.states.get(request_id)
            if state is None:
                continue
            if kind == "complete" and state.c_state == "loading":
                self._loaded(state, now)
            elif kind == "failed" and state.c_state == "loading":
                state.moved_nothing = bool(extra.get("moved_nothing"))
                self._consumer_failed(
                    state,
                    _reason(str(extra.get("reason")), FailureReason.TRANSFER_ERROR),
                    str(extra.get("detail")),
                    now,
                )
                if not state.moved_nothing:
                    self._free_consumer(state)  # P reports failure only after its transfer drained
            elif kind == "drained":
                self._free_consumer(state)
        for state in self.states.values():
            if state.c_state == "loading" and state.c_handle is not None:
                state.polls += 1
                spec = state.spec
                if spec.disconnect_after_polls is not None and state.polls == spec.disconnect_after_polls + 1:
                    self.consumer.remove_remote_agent(self.producer_name)  # the backend's own peer loss
                if spec.abort_after_polls is not None and state.polls > spec.abort_after_polls:
                    # Abort while LOADING: release cancels; the blocks wait for the drain bound (SM-2).
                    self._cancel_read(state, now)
                    self._consumer_failed(state, FailureReason.ABORTED, "aborted by the consumer", now)
                    continue
                status = self.consumer.check(state.c_handle)
                if status.state is TransferState.DONE:
                    self.consumer.release(state.c_handle)
                    state.c_handle = None
                    self._loaded(state, now)
                elif status.state is TransferState.FAILED:
                    self.consumer.release(state.c_handle)
                    state.c_handle = None
                    self._consumer_failed(state, status.reason or FailureReason.TRANSFER_ERROR, status.detail, now)
            elif state.c_state == "loading" and self.mode is TransferMode.WRITE:
                state.polls += 1
                if state.spec.abort_after_polls is not None and state.polls > state.spec.abort_after_polls:
                    self._consumer_failed(state, FailureReason.ABORTED, "aborted by the consumer", now)
            if state.c_state == "loading" and now > state.c_deadline:
                if state.c_handle is not None:
                    self._cancel_read(state, now)
                self._consumer_failed(state, FailureReason.TIMEOUT, "no completion before the deadline", now)
            if state.c_quarantine_until is not None and now > state.c_quarantine_until:
                self._free_consumer(state)

    # -- producer side

    def _poll_producer(self, now: float) -> None:
        for note in self.producer.get_notifications():
            try:
                kind, request_id, extra = _decode(note.message)
            except KVSpecError as exc:
                self.problems.append(f"producer got an undecodable notification ({exc}) (VER-1)")
                continue
            state = self.states.get(request_id)
            if state is None:
                continue
            if kind == "release":
                state.releases_received += 1
                if state.p_state != "held":
                    continue  # terminal states are sticky; repeats are no-ops (SM-1, REL-1)
                aborting = state.p_handle is not None
                self._cancel_write(state, now)
                state.p_state = "aborted" if aborting and extra.get("abort") else "released"
                state.p_confirm_drain = bool(extra.get("abort")) and self.mode is TransferMode.WRITE
                self._free_producer_when_drained(state, now)
            elif kind == "offer" and state.p_state == "held" and not state.posted:
                self._producer_write(state, BlockIds(extra["consumer_block_ids"]), now)
        for state in self.states.values():
            if state.p_handle is not None:
                state.p_polls += 1
                if (
                    state.spec.disconnect_after_polls is not None
                    and state.p_polls == state.spec.disconnect_after_polls + 1
                ):
                    self.producer.remove_remote_agent(self.consumer_name)  # the backend's own peer loss
                status = self.producer.check(state.p_handle)
                if status.state is TransferState.DONE:
                    self.producer.release(state.p_handle)
                    state.p_handle = None
                elif status.state is TransferState.FAILED:
                    self.producer.release(state.p_handle)
                    state.p_handle = None
                    reason = status.reason or FailureReason.TRANSFER_ERROR
                    self._send(
                        self.producer,
                        self.consumer_name,
                        _encode(
                            "failed",
                            state.spec.request_id,
                            reason=reason.value,
                            detail=status.detail,
                            consumer_block_ids=state.offered_to_producer,
                        ),
                    )
            if state.p_state == "held" and now > state.p_deadline:
                self._cancel_write(state, now)  # never free blocks with a transfer in flight (SM-1)
                state.p_state = "expired"
            self._free_producer_when_drained(state, now)

    def _cancel_write(self, state: _State, now: float) -> None:
        if state.p_handle is not None:
            self.producer.release(state.p_handle)
            state.p_handle = None
            state.p_drain_until = now + self.scenario.drain
            self.cancelled_at.append(now)

    def _free_producer_when_drained(self, state: _State, now: float) -> None:
        if state.p_state == "held" or not state.p_blocks_held:
            return
        if state.p_drain_until is not None and now <= state.p_drain_until:
            return  # a cancelled write may still move bytes (SM-1)
        state.p_blocks_held = False
        self.p_alloc.release(b for ids in state.producer_ids for b in ids)
        if state.p_confirm_drain:
            # Sent only once P's write no longer moves bytes: C may reuse its blocks (SM-2).
            self._send(self.producer, self.consumer_name, _encode("drained", state.spec.request_id))

    def _producer_write(self, state: _State, offered: BlockIds, now: float) -> None:
        request_id = state.spec.request_id
        state.offered_to_producer = offered
        try:
            pairs = self.connector.pair_block_ids(
                self.p_config,
                num_tokens=state.spec.num_tokens,
                prefix_hit_tokens=state.spec.prefix_hit_tokens,
                producer_block_ids=state.producer_advertised,
                consumer_block_ids=offered,
            )
            plan = self.connector.plan(producer_config=self.p_config, consumer_config=self.c_config, pairs=pairs)
        except KVSpecError as exc:
            state.error = type(exc).__name__
            reason = {
                "WindowCoverageError": FailureReason.WINDOW_COVERAGE,
                "BlockAlignmentError": FailureReason.BLOCK_ALIGNMENT,
                "GroupCountError": FailureReason.BLOCK_ALIGNMENT,
            }.get(state.error, FailureReason.PROTOCOL)
            message = _encode("failed", request_id, reason=reason.value, detail=str(exc), moved_nothing=True)
            self._send(self.producer, self.consumer_name, message)
            return
        state.posted = True
        if plan.num_descriptors == 0:
            self._send(self.producer, self.consumer_name, _encode("complete", request_id))
            return
        try:
            state.p_handle = self.producer.post(
                TransferMode.WRITE,
                plan.to_descriptors(TransferMode.WRITE),
                peer=self.consumer_name,
                notification=_encode("complete", request_id),
            )
        except (TransportError, PlanError) as exc:
            state.error = type(exc).__name__
            reason = _reason(getattr(exc, "reason", None), FailureReason.POST_FAILED)
            message = _encode("failed", request_id, reason=reason.value, detail=str(exc), moved_nothing=True)
            self._send(self.producer, self.consumer_name, message)

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
                refused=f"{type(exc).__name__}: {exc}",
            )
        self.lost_sends: list[str] = []
        self.cancelled_at: list[float] = []
        self.p_alloc = _Allocator(self.p_config.num_blocks)
        self.c_alloc = _Allocator(self.c_config.num_blocks)
        with allocate_pool(self.p_config) as producer_pool, allocate_pool(self.c_config) as consumer_pool:
            self.producer_pool, self.consumer_pool = producer_pool, consumer_pool
            fill_background(producer_pool, seed="producer")
            fill_background(consumer_pool, seed="consumer")
            self.producer_expected = producer_pool.snapshot()
            consumer_before = consumer_pool.snapshot()
            self.producer = self._agent("producer")
            self.consumer = self._agent("consumer")
            refused: str | None = None
            try:
                try:
                    self._connect(producer_pool, consumer_pool)
                except (IncompatiblePeerError, UnsupportedVersionError, MalformedMessageError) as exc:
                    refused = f"{type(exc).__name__}: {exc}"
                else:
                    self._loop(started)
                self._judge_early_completions()
                mismatches = check_pools(
                    producer=producer_pool,
                    consumer=consumer_pool,
                    producer_before=self.producer_expected,
                    consumer_before=consumer_before,
                    loads=self.loads,
                )
            finally:
                for agent in (self.consumer, self.producer):
                    try:
                        agent.close()
                    except KVSpecError as exc:
                        self.problems.append(f"closing {agent.name}: {exc}")
        for state in self.states.values():
            self._free_consumer(state)  # the engine finishes every request
        if len(self.c_alloc.free) != self.c_alloc.baseline:
            self.problems.append(f"consumer free blocks {len(self.c_alloc.free)}, baseline {self.c_alloc.baseline}")
        if len(self.p_alloc.free) != self.p_alloc.baseline:
            self.problems.append(
                f"producer free blocks {len(self.p_alloc.free)}, baseline {self.p_alloc.baseline} (leaked, SM-1)"
            )
        outcomes = {
            rid: RequestOutcome(
                request_id=rid,
                consumer_state=s.c_state,
                producer_state=s.p_state,
                reason=s.reason,
                error=s.error,
                detail=s.detail,
                posted=s.posted,
                releases_sent=s.releases_sent,
                releases_received=s.releases_received,
                seconds=max(0.0, s.finished_at - s.started),
            )
            for rid, s in self.states.items()
        }
        injected = tuple(f for injector in self.injectors for f in injector.injected)
        return ScenarioResult(
            refused=refused,
            outcomes=outcomes,
            mismatches=tuple(mismatches),
            early_completions=tuple(self.early),
            problems=tuple(self.problems),
            injected=injected,
            lost_messages=tuple(self.lost_sends),
            seconds=time.monotonic() - started,
        )

    def _judge_early_completions(self) -> None:
        for request_id, load, at_completion in self.completed_early:
            still_wrong = {(m.layer, m.block) for m in check_loaded_pages(self.consumer_pool, load)}
            late = [m for m in at_completion if (m.layer, m.block) not in still_wrong]
            if late:
                self.early.append(
                    f"{request_id}: reported complete while {len(late)} paired pages had not landed yet, "
                    f"e.g. group {late[0].group}, layer {late[0].layer!r}, block {late[0].block}"
                )

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
        )

    def _check_peers(self) -> None:
        """Both descriptors cross the wire codec; the connector compares them before loading metadata (HS-1)."""
        producer = self._descriptor("producer", self.p_config, self.producer)
        consumer = self._descriptor("consumer", self.c_config, self.consumer)
        for field, value in self.scenario.handshake_overrides:
            if field == "mode":
                value = TransferMode(str(value))
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
        assert isinstance(received_by_producer, EngineDescriptor)
        assert isinstance(received_by_consumer, EngineDescriptor)
        self.connector.check_peer(received_by_consumer, received_by_producer)

    def _handshake(self) -> None:
        self.producer_name = self.consumer.add_remote_agent(self.producer.get_agent_metadata())
        self.consumer_name = self.producer.add_remote_agent(self.consumer.get_agent_metadata())

    def _loop(self, started: float) -> None:
        waves = sorted({r.wave for r in self.scenario.requests})
        hard_stop = started + self.scenario.lease + self.scenario.deadline + 10.0
        for index, wave in enumerate(waves):
            if index:
                self._handshake()  # again: a disconnect in the last wave must not strand the next one
            now = time.monotonic()
            specs = [spec for spec in self.scenario.requests if spec.wave == wave]
            # Requests with explicit block ids claim theirs before fresh ones are handed out.
            specs.sort(key=lambda s: s.producer_block_ids is None and s.consumer_block_ids is None)
            for spec in specs:
                self._start(spec, now)
            # The next wave starts once blocks are back, so it reuses what the last one freed.
            self._drive(hard_stop, until=lambda: all(s.settled for s in self.states.values()))
            if time.monotonic() > hard_stop:
                stuck = [rid for rid, s in self.states.items() if not s.settled]
                self.problems.append(f"requests {stuck} did not end within the deadlines (FAIL-1)")
                return
        # Let quarantined blocks come back, then keep polling a little so that late writes land and are seen.
        self._drive(hard_stop, until=lambda: all(s.c_quarantine_until is None for s in self.states.values()))
        held = [rid for rid, s in self.states.items() if s.c_quarantine_until is not None]
        if held:
            self.problems.append(f"consumer blocks of {held} never came back (SM-2)")
        settle = time.monotonic() + 0.01
        if self.completed_early:
            # Give data that trailed a completion time to land, so it is judged late, not wrong (DONE-1).
            settle += min(0.2, self.scenario.deadline)
        if self.cancelled_at:
            # A cancelled transfer that outlives the drain bound must be seen landing (SM-2).
            settle = max(settle, max(self.cancelled_at) + 4 * self.scenario.drain)
        polls = 0
        while polls < 20 or time.monotonic() < settle:
            self._poll_once(time.monotonic())
            polls += 1
            if polls > 20:
                time.sleep(0.001)

    def _drive(self, hard_stop: float, *, until: Callable[[], bool]) -> None:
        idle = 0
        while not until():
            now = time.monotonic()
            if now > hard_stop:
                return
            self._poll_once(now)
            idle += 1
            if idle > 10:
                time.sleep(0.0005)  # cross-process backends progress in their own processes

    def _poll_once(self, now: float) -> None:
        self._poll_consumer(now)
        self._poll_producer(now)


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
        return _Driver(scenario, resolved, connector or ReferenceConnector()).run()
    finally:
        if owned:
            resolved.close()
