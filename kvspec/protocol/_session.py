"""Sans-IO per-request state machines for the producer (SM-1) and the consumer (SM-2).

Theory of operation
-------------------

One :class:`ProducerSession` and one :class:`ConsumerSession` exist per
request; a driver keeps them in a dict keyed by ``request_id`` (every message
of an exchange carries the producer's request id). A session does no I/O and
reads no clock: the driver feeds it events with the current time ``now`` and
carries out the returned :class:`Output`, whose ``actions`` are typed records
in the order the table row lists them (as h11 returns events):

- :class:`Send`: a message to encode (``kvspec.encode``) and send to the peer;
- :class:`Post`: post the transfer now (C's READ, or P's WRITE carrying
  ``notification``, the Completion, as the post's notification);
- :class:`Cancel`: release (cancel) the in-flight transfer, keep polling it
  and report its end (``transfer_done``/``transfer_failed``);
- :class:`Free`: block ids that no transfer touches any more: the producer
  returns them to its pool; the consumer may reuse (or recompute into) them.

``output.send``, ``.post``, ``.cancel``, ``.free`` and ``.notification`` are
views of ``actions``. kvspec's own driver is :mod:`kvspec.drivers._driver`.

Every deadline is derived from the lease deadline in the transfer parameters
and the session's timeouts, so no state waits forever (FAIL-1). A driver
calls ``tick(now=...)`` at least at ``session.next_deadline``; every other
method also fires the deadlines that are due before it handles its event.

Each role is driven by ONE transition table (:data:`PRODUCER_TRANSITIONS`,
:data:`CONSUMER_TRANSITIONS`); rows name the modes they apply to, and the
docs' state diagrams are generated from them (:func:`to_mermaid`). Every
event a role expects and drops (late or duplicate messages, local calls once
the end is under way; everything in a terminal state, which is sticky) has an
explicit ignored row. An event with no row at all raises
:class:`kvspec.LocalProtocolError`; so does any other event the local driver
should never have produced; a message the peer should never have sent raises
:class:`kvspec.RemoteProtocolError`. Either error leaves the session
unchanged and its deadlines running, so blocks are still freed in bounded
time. The deadlines of each state are tables too (:data:`PRODUCER_DEADLINES`,
:data:`CONSUMER_DEADLINES`), next to the transitions they fire.

A driver, in short (READ mode)::

    # producer engine, when prefill ends
    producer = ProducerSession.create(request_id="r1", producer_engine_id="P",
        producer_block_ids=clipped, num_tokens=n, mode=TransferMode.READ,
        now=time.monotonic(), lease_duration=30.0)
    router.forward(producer.params.to_kv_transfer_params())

    # consumer engine, when the request arrives
    params = TransferParams.from_kv_transfer_params(kv_transfer_params)
    consumer = ConsumerSession(params=params, consumer_engine_id="C",
        consumer_block_ids=suffix)
    out = consumer.start(now=time.monotonic())
    if out.post:
        handle = transport.post(TransferMode.READ, descriptors, peer=...)
    ...  # poll: transport.check(handle) -> consumer.transfer_done(now=...)
    for message in out.send:
        transport.send_notification(peer, kvspec.encode(message))

    # producer engine, on each notification
    out = producer.receive(kvspec.decode(note.message), now=time.monotonic())
    if out.free is not None:
        pool.free(out.free)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import attrs

from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import ConfigError, LocalProtocolError, RemoteProtocolError
from kvspec.core._models import BlockIds
from kvspec.reference._messages import (
    Abort,
    BlockOffer,
    Completion,
    Failure,
    Message,
    Release,
    TransferParams,
    TransportData,
)
from kvspec.spec.lifecycle import (
    CONSUMER_DEADLINES,
    CONSUMER_TRANSITIONS,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_RELEASE_GRACE,
    PRODUCER_DEADLINES,
    PRODUCER_TRANSITIONS,
    Action,
    ConsumerEvent,
    ConsumerState,
    Deadline,
    FailureInfo,
    ProducerEvent,
    ProducerState,
    Transition,
    check_loaded_rows,
    get_failed_consumer_block_ids,
    get_freed_block_ids,
    get_next_deadline,
    get_producer_failure_reason,
    get_release_outcome,
    is_prefix_hit,
)

__all__ = [
    "CONSUMER_DEADLINES",
    "CONSUMER_TRANSITIONS",
    "DEFAULT_DRAIN_TIMEOUT",
    "DEFAULT_RELEASE_GRACE",
    "PRODUCER_DEADLINES",
    "PRODUCER_TRANSITIONS",
    "Action",
    "Cancel",
    "ConsumerEvent",
    "ConsumerSession",
    "ConsumerState",
    "Deadline",
    "Effect",
    "FailureInfo",
    "Free",
    "Output",
    "Post",
    "ProducerEvent",
    "ProducerSession",
    "ProducerState",
    "Send",
    "Step",
    "Transition",
    "to_markdown",
    "to_mermaid",
]

S = TypeVar("S", ProducerState, ConsumerState)
E = TypeVar("E", ProducerEvent, ConsumerEvent)

_BOTH = frozenset({TransferMode.READ, TransferMode.WRITE})


def _index(
    table: Iterable[Transition[S, E]],
) -> dict[tuple[TransferMode, S, E], Transition[S, E]]:
    index: dict[tuple[TransferMode, S, E], Transition[S, E]] = {}
    for row in table:
        for mode in row.modes:
            key = (mode, row.source, row.event)
            if key in index:  # pragma: no cover - guards the tables above
                raise ConfigError(f"transition table: two rows for {key}")
            index[key] = row
    return index


_PRODUCER_INDEX = _index(PRODUCER_TRANSITIONS)
_CONSUMER_INDEX = _index(CONSUMER_TRANSITIONS)
check_loaded_rows(CONSUMER_TRANSITIONS)


def _deadline_index(
    rows: Iterable[Deadline[S, E]],
) -> dict[tuple[TransferMode, S], tuple[Deadline[S, E], ...]]:
    index: dict[tuple[TransferMode, S], list[Deadline[S, E]]] = {}
    for deadline in rows:
        for mode in deadline.modes:
            index.setdefault((mode, deadline.state), []).append(deadline)
    return {key: tuple(found) for key, found in index.items()}


_PRODUCER_DUE = _deadline_index(PRODUCER_DEADLINES)
_CONSUMER_DUE = _deadline_index(CONSUMER_DEADLINES)


def _row(
    index: Mapping[tuple[TransferMode, S, E], Transition[S, E]],
    role: str,
    request_id: str,
    mode: TransferMode,
    state: S,
    event: E,
) -> Transition[S, E]:
    row = index.get((mode, state, event))
    if row is None:
        # No row, not even an ignored one: the local driver produced an event this state cannot have.
        raise LocalProtocolError(
            f"{role} request {request_id!r}: event {event.value!r} has no row in state {state.value} "
            f"({mode.value} mode)"
        )
    return row


# --------------------------------------------------------------------------- outputs


@attrs.frozen(kw_only=True)
class Step:
    """One transition taken, for logs and tests."""

    source: ProducerState | ConsumerState
    event: ProducerEvent | ConsumerEvent
    target: ProducerState | ConsumerState
    now: float


@attrs.frozen(kw_only=True)
class Send:
    """Encode ``message`` (``kvspec.encode``) and send it to the peer as a notification."""

    message: Message


@attrs.frozen(kw_only=True)
class Post:
    """Post the request's transfer now: C's READ, or P's WRITE carrying ``notification`` (DONE-1)."""

    notification: Completion | None = None


@attrs.frozen(kw_only=True)
class Cancel:
    """Release (cancel) the transfer in flight; report its end, or let the drain timeout fire (SM-2)."""


@attrs.frozen(kw_only=True)
class Free:
    """Blocks no transfer touches any more: P returns them to its pool; C may reuse them (SM-1, SM-2)."""

    block_ids: BlockIds


Effect = Send | Post | Cancel | Free
"""One thing a session asks its driver to do; :attr:`Output.actions` lists them in table order."""


@attrs.frozen(kw_only=True)
class Output:
    """What the driver must do after one call, in order; empty when the event was ignored.

    ``actions`` is the ordered tuple of :data:`Effect` records, in the order
    the transition table lists them (h11 style); a driver carries them out one
    by one. ``send``, ``free``, ``post``, ``cancel`` and ``notification`` are
    views of ``actions`` for callers that only ask one question.
    """

    actions: tuple[Effect, ...] = ()
    steps: tuple[Step, ...] = ()

    def __add__(self, other: Output) -> Output:
        if self.free is not None and other.free is not None:  # pragma: no cover - terminal states free once
            raise LocalProtocolError("one call freed blocks twice")
        return Output(actions=self.actions + other.actions, steps=self.steps + other.steps)

    @property
    def ignored(self) -> bool:
        """True when no transition was taken."""
        return not self.steps

    @property
    def send(self) -> tuple[Message, ...]:
        """The messages to send, in order."""
        return tuple(a.message for a in self.actions if isinstance(a, Send))

    @property
    def free(self) -> BlockIds | None:
        """The block ids to free, if this call freed any."""
        return next((a.block_ids for a in self.actions if isinstance(a, Free)), None)

    @property
    def post(self) -> bool:
        """True when the transfer must be posted now."""
        return any(isinstance(a, Post) for a in self.actions)

    @property
    def cancel(self) -> bool:
        """True when the transfer in flight must be cancelled."""
        return any(isinstance(a, Cancel) for a in self.actions)

    @property
    def notification(self) -> Completion | None:
        """The Completion a WRITE carries as its post's notification (DONE-1)."""
        return next((a.notification for a in self.actions if isinstance(a, Post)), None)


_NOTHING = Output()


def _check_duration(name: str, value: float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")


# --------------------------------------------------------------------------- producer


class ProducerSession:
    """The producer's side of one request (SM-1): pins blocks until released, expired or aborted.

    ``release_grace``: seconds past the lease deadline P still holds the
    blocks waiting for the release, in READ mode or once its write is
    final; MUST exceed the consumer's drain timeout (SM-1, the lease rule).
    ``drain_timeout``: seconds a cancelled write may take to stop (SM-2, the drain rule).
    """

    def __init__(
        self,
        *,
        params: TransferParams,
        release_grace: float = DEFAULT_RELEASE_GRACE,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        if not isinstance(params, TransferParams):
            raise ConfigError(f"ProducerSession.params: expected TransferParams, got {params!r}")
        _check_duration("ProducerSession.release_grace", release_grace)
        _check_duration("ProducerSession.drain_timeout", drain_timeout)
        self.params = params
        self.release_grace = float(release_grace)
        self.drain_timeout = float(drain_timeout)
        self._state = ProducerState.HELD
        self._entered_at = -math.inf
        self._offer: BlockOffer | None = None
        self._posted = False

    @classmethod
    def create(
        cls,
        *,
        request_id: str,
        producer_engine_id: str,
        producer_block_ids: BlockIds | Iterable[Iterable[int]],
        num_tokens: int,
        mode: TransferMode,
        now: float,
        lease_duration: float,
        transport_data: TransportData | None = None,
        release_grace: float = DEFAULT_RELEASE_GRACE,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        producer_block_ends: Iterable[int] | None = None,
        recomputed_tokens: int = 0,
        producer_block_digests: Iterable[Iterable[str]] | None = None,
        state_tokens: int | None = None,
    ) -> ProducerSession:
        """Pin clipped blocks for a consumer; ``session.params`` is what the router forwards (SM-1).

        ``producer_block_ends`` (protocol 1.1) is where each list ends, from the
        unclipped table (:func:`kvspec.get_block_ends`); ``recomputed_tokens``
        the tokens after ``num_tokens`` the lists cover but C recomputes (ALIGN-1, WIN-1).
        ``producer_block_digests`` (optional, INT-1) holds the digest of each
        advertised block, taken once its pages hold the prefill's output.
        ``state_tokens`` (protocol 1.2, STATE-1) is how many tokens the state
        groups' state absorbed; ``None`` when the config has no state groups.
        """
        _check_duration("ProducerSession.lease_duration", lease_duration)
        params = TransferParams(
            request_id=request_id,
            producer_engine_id=producer_engine_id,
            producer_block_ids=BlockIds(producer_block_ids),
            num_tokens=num_tokens,
            mode=mode,
            lease_deadline=float(now) + float(lease_duration),
            transport_data={} if transport_data is None else transport_data,
            producer_block_ends=None if producer_block_ends is None else tuple(producer_block_ends),
            recomputed_tokens=recomputed_tokens,
            state_tokens=state_tokens,
            producer_block_digests=None
            if producer_block_digests is None
            else tuple(tuple(group) for group in producer_block_digests),
        )
        return cls(params=params, release_grace=release_grace, drain_timeout=drain_timeout)

    # ----------------------------------------------------------------- views

    @property
    def state(self) -> ProducerState:
        """The current state."""
        return self._state

    @property
    def is_terminal(self) -> bool:
        """True once the blocks have been freed (RELEASED, EXPIRED or ABORTED)."""
        return self._state.is_terminal

    @property
    def mode(self) -> TransferMode:
        """READ or WRITE, from the transfer parameters."""
        return self.params.mode

    @property
    def request_id(self) -> str:
        """The producer's request id, from the transfer parameters."""
        return self.params.request_id

    @property
    def offer(self) -> BlockOffer | None:
        """The consumer's block offer (WRITE mode), once received."""
        return self._offer

    @property
    def completion(self) -> Completion:
        """The message to attach to the write as its notification (WRITE mode; DONE-1)."""
        return Completion(request_id=self.params.request_id, producer_engine_id=self.params.producer_engine_id)

    @property
    def next_deadline(self) -> float | None:
        """When ``tick`` must next be called; ``None`` in a terminal state."""
        due = self._due()
        return None if due is None else due[0]

    # ----------------------------------------------------------------- events

    def receive(self, message: Message, *, now: float) -> Output:
        """Handle a message from the consumer (Release, BlockOffer or Abort)."""
        if getattr(message, "request_id", None) != self.params.request_id:
            raise RemoteProtocolError(
                f"message for request {getattr(message, 'request_id', None)!r} "
                f"reached producer request {self.params.request_id!r}"
            )
        if isinstance(message, Release):
            return self._handle(ProducerEvent.RELEASE, now)
        if isinstance(message, BlockOffer):
            self._check_offer(message)
            out = self._advance(now)
            if self._offer is None and self._state is ProducerState.HELD:
                self._offer = message
            return out + self._fire(ProducerEvent.OFFER, now)
        if isinstance(message, Abort):
            return self._handle(ProducerEvent.PEER_ABORT, now)
        raise RemoteProtocolError(f"a producer does not accept {type(message).__name__} from a consumer")

    def abort(self, *, now: float, detail: str = "") -> Output:
        """The producer's engine gives up on the request (client gone, shutdown)."""
        return self._handle(ProducerEvent.ABORT, now, detail=detail)

    def transfer_done(self, *, now: float) -> Output:
        """The posted write reached DONE (WRITE mode)."""
        self._check_transfer_report()
        return self._handle(ProducerEvent.TRANSFER_DONE, now)

    def transfer_failed(self, reason: FailureReason, *, now: float, detail: str = "") -> Output:
        """The posted write failed or could not be posted (WRITE mode; FAIL-1)."""
        self._check_transfer_report()
        if not isinstance(reason, FailureReason):
            raise LocalProtocolError(f"transfer_failed: expected a FailureReason, got {reason!r}")
        return self._handle(ProducerEvent.TRANSFER_FAILED, now, reason=reason, detail=detail)

    def tick(self, *, now: float) -> Output:
        """Fire every deadline due at ``now`` (FAIL-1)."""
        return self._advance(now)

    # ----------------------------------------------------------------- machinery

    def _check_offer(self, offer: BlockOffer) -> None:
        if self.mode is not TransferMode.WRITE:
            raise RemoteProtocolError("a BlockOffer is only sent in WRITE mode; this request is READ")
        if self._offer is not None and offer != self._offer:
            raise RemoteProtocolError(f"a second, different BlockOffer for request {self.params.request_id!r}")

    def _check_transfer_report(self) -> None:
        if self.mode is not TransferMode.WRITE or not self._posted:
            raise LocalProtocolError(
                f"producer request {self.params.request_id!r} has no posted transfer to report on "
                f"(mode {self.mode.value}, state {self._state.value})"
            )

    def _due(self) -> tuple[float, ProducerEvent] | None:
        rows = _PRODUCER_DUE.get((self.mode, self._state), ())
        due = get_next_deadline(rows, self, {"lease": self.params.lease_deadline, "entered": self._entered_at})
        return None if due is None else (due[0], due[1].event)

    def _advance(self, now: float) -> Output:
        out = _NOTHING
        while (due := self._due()) is not None and now >= due[0]:
            out = out + self._fire(due[1], now)
        return out

    def _handle(
        self, event: ProducerEvent, now: float, *, reason: FailureReason | None = None, detail: str = ""
    ) -> Output:
        return self._advance(now) + self._fire(event, now, reason=reason, detail=detail)

    def _fire(
        self, event: ProducerEvent, now: float, *, reason: FailureReason | None = None, detail: str = ""
    ) -> Output:
        row = _row(_PRODUCER_INDEX, "producer", self.params.request_id, self.mode, self._state, event)
        if row.ignored:
            return _NOTHING
        source, self._state, self._entered_at = self._state, row.target, now
        actions = tuple(self._act(action, reason=reason, detail=detail) for action in row.actions)
        return Output(actions=actions, steps=(Step(source=source, event=event, target=row.target, now=now),))

    def _act(self, action: Action, *, reason: FailureReason | None, detail: str) -> Effect:
        params = self.params
        if action is Action.FREE:
            return Free(block_ids=get_freed_block_ids(params.producer_block_ids))
        if action is Action.POST:
            self._posted = True
            return Post(notification=self.completion)
        if action is Action.CANCEL:
            return Cancel()
        if action is Action.SEND_ABORT:
            return Send(message=Abort(request_id=params.request_id, engine_id=params.producer_engine_id, detail=detail))
        if action is Action.SEND_FAILURE:
            reason = get_producer_failure_reason(self._state, reason)
            failed = self._offer.consumer_block_ids if self._offer is not None else BlockIds([])
            message = Failure(
                request_id=params.request_id,
                producer_engine_id=params.producer_engine_id,
                reason=reason,
                failed_consumer_block_ids=failed,
                detail=detail,
            )
            return Send(message=message)
        raise LocalProtocolError(f"producer cannot perform {action}")  # pragma: no cover - table guard

    def __repr__(self) -> str:
        return f"<ProducerSession {self.params.request_id!r} {self.mode.value} {self._state.value}>"


# --------------------------------------------------------------------------- consumer


class ConsumerSession:
    """The consumer's side of one request (SM-2): loads, then sends exactly one release (REL-1).

    ``consumer_block_ids`` are C's clipped, uncached suffix (CLIP-1); zero
    groups, or only null ids, is a full prefix hit: ``start`` releases at
    once. ``start_margin``: C does not start a transfer later than this many
    seconds before the lease deadline (SM-1, the lease rule). ``transfer_timeout``: an
    optional bound on the transfer, tighter than the lease. ``drain_timeout``
    bounds the wait for a cancelled transfer to stop; it MUST be at least the
    producer's and below the producer's release grace (SM-1, SM-2: the lease and drain rules).
    ``consumer_block_ends`` (protocol 1.1) is where each group's list ends
    (:func:`kvspec.get_block_ends`); the WRITE offer carries it so P can refuse
    a list shifted against its own (ALIGN-1). ``None`` offers none, as 1.0 did.
    """

    def __init__(
        self,
        *,
        params: TransferParams,
        consumer_engine_id: str,
        consumer_block_ids: BlockIds | Iterable[Iterable[int]],
        start_margin: float = 0.0,
        transfer_timeout: float | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        consumer_block_ends: Iterable[int] | None = None,
    ) -> None:
        if not isinstance(params, TransferParams):
            raise ConfigError(f"ConsumerSession.params: expected TransferParams, got {params!r}")
        if not isinstance(consumer_engine_id, str) or not consumer_engine_id:
            found = consumer_engine_id
            raise ConfigError(f"ConsumerSession.consumer_engine_id: expected a non-empty str, got {found!r}")
        _check_duration("ConsumerSession.start_margin", start_margin)
        _check_duration("ConsumerSession.transfer_timeout", transfer_timeout, allow_none=True)
        _check_duration("ConsumerSession.drain_timeout", drain_timeout)
        self.params = params
        self.consumer_engine_id = consumer_engine_id
        self.consumer_block_ids = BlockIds(consumer_block_ids)
        self.consumer_block_ends = None if consumer_block_ends is None else tuple(consumer_block_ends)
        if self.consumer_block_ends is not None:
            _ = self.offer  # the offer's validator checks the ends against the lists now, not at start (ALIGN-1)
        self.start_margin = float(start_margin)
        self.transfer_timeout = None if transfer_timeout is None else float(transfer_timeout)
        self.drain_timeout = float(drain_timeout)
        self._state = ConsumerState.ALLOCATED
        self._entered_at = -math.inf
        self._started_at = -math.inf
        self._posted = False
        self._failure: FailureInfo | None = None
        self._release: Release | None = None

    # ----------------------------------------------------------------- views

    @property
    def state(self) -> ConsumerState:
        """The current state."""
        return self._state

    @property
    def is_terminal(self) -> bool:
        """True once LOADED, FAILED or ABORTED; the release has then been sent (REL-1)."""
        return self._state.is_terminal

    @property
    def mode(self) -> TransferMode:
        """READ or WRITE, from the transfer parameters."""
        return self.params.mode

    @property
    def request_id(self) -> str:
        """The producer's request id, from the transfer parameters."""
        return self.params.request_id

    @property
    def is_prefix_hit(self) -> bool:
        """True when the consumer holds no block to load: a full local prefix hit (CLIP-1)."""
        return is_prefix_hit(self.consumer_block_ids)

    @property
    def failure(self) -> FailureInfo | None:
        """Why the request failed and which consumer blocks may be bad; set once FAILING or FAILED."""
        return self._failure

    @property
    def release(self) -> Release | None:
        """The one release this request sent, once terminal (REL-1)."""
        return self._release

    @property
    def offer(self) -> BlockOffer:
        """The block offer C sends in WRITE mode."""
        return BlockOffer(
            request_id=self.params.request_id,
            consumer_engine_id=self.consumer_engine_id,
            consumer_block_ids=self.consumer_block_ids,
            consumer_block_ends=self.consumer_block_ends,
        )

    @property
    def next_deadline(self) -> float | None:
        """When ``tick`` must next be called; ``None`` in a terminal state."""
        due = self._due()
        return None if due is None else due[0]

    # ----------------------------------------------------------------- events

    def start(self, *, now: float) -> Output:
        """Begin loading: post the READ, send the WRITE offer, or release at once on a full prefix hit."""
        if self._state is not ConsumerState.ALLOCATED and not self._state.is_terminal:
            raise LocalProtocolError(f"consumer request {self.params.request_id!r} already started")
        event = ConsumerEvent.PREFIX_HIT if self.is_prefix_hit else ConsumerEvent.START
        out = self._advance(now)
        if event is ConsumerEvent.START and self._state is ConsumerState.ALLOCATED:
            self._started_at = now
        return out + self._fire(event, now)

    def receive(self, message: Message, *, now: float) -> Output:
        """Handle a message from the producer (Completion, Failure or Abort)."""
        if getattr(message, "request_id", None) != self.params.request_id:
            raise RemoteProtocolError(
                f"message for request {getattr(message, 'request_id', None)!r} "
                f"reached consumer request {self.params.request_id!r}"
            )
        if isinstance(message, (Completion, Failure)) and message.producer_engine_id != self.params.producer_engine_id:
            raise RemoteProtocolError(
                f"{type(message).__name__} from engine {message.producer_engine_id!r}, "
                f"expected {self.params.producer_engine_id!r}"
            )
        if isinstance(message, Completion):
            self._check_completion(message)
            return self._handle(ConsumerEvent.COMPLETION, now)
        if isinstance(message, Failure):
            failed = get_failed_consumer_block_ids(message.failed_consumer_block_ids, self.consumer_block_ids)
            return self._handle(ConsumerEvent.FAILURE, now, reason=message.reason, detail=message.detail, failed=failed)
        if isinstance(message, Abort):
            return self._handle(ConsumerEvent.PEER_ABORT, now, reason=FailureReason.ABORTED, detail=message.detail)
        raise RemoteProtocolError(f"a consumer does not accept {type(message).__name__} from a producer")

    def reject_completion(
        self, message: Completion, *, now: float, failed_consumer_block_ids: BlockIds, detail: str = ""
    ) -> Output:
        """A Completion whose blocks failed the integrity check: end FAILED(integrity), never LOADED (INT-1).

        The Completion still says that P's write is over (it follows the data,
        DONE-1), so the blocks are freed at once, as on a Failure from P.
        ``failed_consumer_block_ids`` names the blocks whose digests differ.
        """
        if not isinstance(message, Completion):
            raise LocalProtocolError(f"reject_completion: expected a Completion, got {type(message).__name__}")
        self._check_completion(message)
        return self._handle(
            ConsumerEvent.FAILURE,
            now,
            reason=FailureReason.INTEGRITY,
            detail=detail,
            failed=failed_consumer_block_ids,
        )

    def abort(self, *, now: float) -> Output:
        """The consumer's engine gives up on the request; its blocks wait for the drain (SM-2)."""
        return self._handle(ConsumerEvent.ABORT, now)

    def fail(self, reason: FailureReason, *, now: float, detail: str = "") -> Output:
        """A local check failed (handshake, window coverage, alignment...): end FAILED (FAIL-1)."""
        if not isinstance(reason, FailureReason):
            raise LocalProtocolError(f"fail: expected a FailureReason, got {reason!r}")
        return self._handle(ConsumerEvent.FAIL, now, reason=reason, detail=detail)

    def transfer_done(self, *, now: float) -> Output:
        """The posted read reached DONE: every paired byte is readable (READ mode; DONE-1)."""
        self._check_transfer_report()
        return self._handle(ConsumerEvent.TRANSFER_DONE, now)

    def transfer_failed(self, reason: FailureReason, *, now: float, detail: str = "") -> Output:
        """The posted read failed or could not be posted (READ mode; FAIL-1)."""
        self._check_transfer_report()
        if not isinstance(reason, FailureReason):
            raise LocalProtocolError(f"transfer_failed: expected a FailureReason, got {reason!r}")
        return self._handle(ConsumerEvent.TRANSFER_FAILED, now, reason=reason, detail=detail)

    def tick(self, *, now: float) -> Output:
        """Fire every deadline due at ``now`` (FAIL-1)."""
        return self._advance(now)

    # ----------------------------------------------------------------- machinery

    def _check_completion(self, message: Completion) -> None:
        if message.request_id != self.params.request_id:
            raise RemoteProtocolError(
                f"Completion for request {message.request_id!r} reached consumer request {self.params.request_id!r}"
            )
        if message.producer_engine_id != self.params.producer_engine_id:
            raise RemoteProtocolError(
                f"Completion from engine {message.producer_engine_id!r}, expected {self.params.producer_engine_id!r}"
            )
        if self.mode is not TransferMode.WRITE:
            raise RemoteProtocolError("a Completion is only sent in WRITE mode; this request is READ")

    def _check_transfer_report(self) -> None:
        if self.mode is not TransferMode.READ or not self._posted:
            raise LocalProtocolError(
                f"consumer request {self.params.request_id!r} has no posted transfer to report on "
                f"(mode {self.mode.value}, state {self._state.value})"
            )

    def _due(self) -> tuple[float, ConsumerEvent, FailureReason | None] | None:
        anchors = {"lease": self.params.lease_deadline, "entered": self._entered_at, "started": self._started_at}
        due = get_next_deadline(_CONSUMER_DUE.get((self.mode, self._state), ()), self, anchors)
        return None if due is None else (due[0], due[1].event, due[1].reason)

    def _advance(self, now: float) -> Output:
        out = _NOTHING
        while (due := self._due()) is not None and now >= due[0]:
            out = out + self._fire(due[1], now, reason=due[2])
        return out

    def _handle(
        self,
        event: ConsumerEvent,
        now: float,
        *,
        reason: FailureReason | None = None,
        detail: str = "",
        failed: BlockIds | None = None,
    ) -> Output:
        return self._advance(now) + self._fire(event, now, reason=reason, detail=detail, failed=failed)

    def _fire(
        self,
        event: ConsumerEvent,
        now: float,
        *,
        reason: FailureReason | None = None,
        detail: str = "",
        failed: BlockIds | None = None,
    ) -> Output:
        row = _row(_CONSUMER_INDEX, "consumer", self.params.request_id, self.mode, self._state, event)
        if row.ignored:
            return _NOTHING
        source, self._state, self._entered_at = self._state, row.target, now
        if row.target in (ConsumerState.FAILING, ConsumerState.FAILED) and self._failure is None:
            self._failure = FailureInfo(
                reason=reason or FailureReason.TRANSFER_ERROR,
                failed_consumer_block_ids=get_failed_consumer_block_ids(failed, self.consumer_block_ids),
                detail=detail,
            )
        actions = tuple(self._act(action, event=event) for action in row.actions)
        return Output(actions=actions, steps=(Step(source=source, event=event, target=row.target, now=now),))

    def _act(self, action: Action, *, event: ConsumerEvent) -> Effect:
        params = self.params
        if action is Action.FREE:
            return Free(block_ids=get_freed_block_ids(self.consumer_block_ids))
        if action is Action.POST:
            self._posted = True
            return Post()
        if action is Action.CANCEL:
            return Cancel()
        if action is Action.SEND_OFFER:
            return Send(message=self.offer)
        if action is Action.SEND_ABORT:
            return Send(message=Abort(request_id=params.request_id, engine_id=self.consumer_engine_id))
        if action is Action.SEND_RELEASE:
            if self._release is not None:  # pragma: no cover - terminal states are entered once
                raise LocalProtocolError("a second release for one consumer request (REL-1)")
            self._release = Release(
                request_id=params.request_id,
                consumer_engine_id=self.consumer_engine_id,
                outcome=get_release_outcome(self._state, event),
            )
            return Send(message=self._release)
        raise LocalProtocolError(f"consumer cannot perform {action}")  # pragma: no cover - table guard

    def __repr__(self) -> str:
        return f"<ConsumerSession {self.params.request_id!r} {self.mode.value} {self._state.value}>"


# --------------------------------------------------------------------------- diagrams

Role = Literal["producer", "consumer"]


def _table(role: Role) -> Sequence[Transition[Any, Any]]:
    if role == "producer":
        return PRODUCER_TRANSITIONS
    if role == "consumer":
        return CONSUMER_TRANSITIONS
    raise ConfigError(f"role: expected 'producer' or 'consumer', got {role!r}")


def _label(row: Transition[Any, Any], mode: TransferMode | None) -> str:
    label: str = row.event.value
    if mode is None and row.modes != _BOTH:
        label = f"[{'/'.join(sorted(m.value for m in row.modes))}] {label}"
    if row.actions:
        label += " / " + ", ".join(a.value for a in row.actions)
    return label


def to_mermaid(role: Role, mode: TransferMode | None = None) -> str:
    """A mermaid ``stateDiagram-v2`` of one role's transition table, for one mode or both (SM-1, SM-2)."""
    table = _table(role)
    rows = [row for row in table if not row.ignored and (mode is None or mode in row.modes)]
    initial = table[0].source
    lines = ["stateDiagram-v2", f"    [*] --> {initial.name}"]
    for row in rows:
        lines.append(f"    {row.source.name} --> {row.target.name}: {_label(row, mode)}")
    terminal = sorted({row.target.name for row in rows if row.target.is_terminal})
    lines.extend(f"    {name} --> [*]" for name in terminal)
    return "\n".join(lines) + "\n"


def to_markdown(role: Role) -> str:
    """The transition table of one role as a markdown table, ignored events left out (SM-1, SM-2)."""
    lines = ["| state | event | modes | next state | actions |", "|---|---|---|---|---|"]
    for row in (r for r in _table(role) if not r.ignored):
        modes = "both" if row.modes == _BOTH else "/".join(sorted(m.value for m in row.modes))
        actions = ", ".join(f"`{a.value}`" for a in row.actions) or "-"
        lines.append(f"| {row.source.name} | `{row.event.value}` | {modes} | {row.target.name} | {actions} |")
    return "\n".join(lines) + "\n"
