"""The driver core: carries out what the sessions ask for over one Transport, a clock and the connector seam.

Theory of operation
-------------------

A :class:`Driver` serves one engine's side of many requests: one sans-IO
session each (:class:`ProducerSession` or :class:`ConsumerSession`, SM-1,
SM-2), the transfer handle it posted, and the peer agent it talks to. It is
the only code that turns session actions into I/O, and session inputs out of
I/O; the exchange endpoints (:mod:`kvspec.drivers._exchange`) and the conformance
suite's scenarios are thin roles over it, so the request lifecycle is written
once.

The driver never asks which class a session is. What differs between the two
sides is a :class:`Role` (the role protocol), given once per driver:
:data:`PRODUCER` posts WRITEs it plans when the consumer's offer arrives,
:data:`CONSUMER` posts the READ its engine planned before it started and is
the side whose blocks INT-1 checks.

- :meth:`Driver.execute` carries out an :class:`Output`'s actions in table
  order: :class:`Send` (codec bytes as a notification), :class:`Post` (the
  role's plan as descriptors; a WRITE carries the Completion, DONE-1),
  :class:`Cancel` (release the handle; drained at once only on a backend with
  ``immediate_cancel``, else when the session's drain timeout fires, SM-2) and
  :class:`Free` (handed to the engine, never while a transfer is in flight).
- :meth:`Driver.poll` feeds the sessions what happened: transfer status
  first (so a transfer that already ended is never cancelled by the message
  that follows it), then decoded notifications, then deadlines (FAIL-1).
- :func:`poll_until` is the one loop that polls until requests settle, with
  a bound, for the endpoints, the suite's scenarios and its cases.

What goes wrong is recorded as typed :class:`DriverFault` records, never as
strings: a lost control message ends in a deadline, never a hang (FAIL-1).

Integrity (INT-1) is the driver's, so every backend has it: a driver given a
:class:`kvspec.PageDigester` over its own pool puts the digests of the blocks
it wrote on a WRITE's Completion, and, as a consumer, checks the blocks it
received before its session may report LOADED. What it checks, when, and how
a difference ends the request is the table :data:`INTEGRITY_ROWS`: one row
per outcome, FAILED(integrity) whenever a row finds blocks that differ from
the sender's digests, or no digests at all. The producer's READ digests are
the engine's to put in the transfer parameters (:meth:`Driver.digests`),
since the parameters leave before any transfer.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import attrs

from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import (
    KVSpecError,
    LocalProtocolError,
    ProtocolError,
    TransportError,
)
from kvspec.core._models import BlockIds
from kvspec.protocol._codec import decode, encode
from kvspec.protocol._offload_session import OffloadSession
from kvspec.protocol._plan import TransferPlan
from kvspec.protocol._session import (
    Cancel,
    ConsumerSession,
    ConsumerState,
    Free,
    Output,
    Post,
    ProducerSession,
    Send,
)
from kvspec.reference._integrity import BlockDigests, BlockPairsLike, PageDigester
from kvspec.reference._messages import BlockOffer, Completion, Message, TransferParams
from kvspec.spec.lifecycle import get_failure_reason as reason_of
from kvspec.transport._base import Descriptor, TransferHandle, TransferState, Transport

__all__ = [
    "CONSUMER",
    "INTEGRITY_ROWS",
    "OFFLOAD",
    "PRODUCER",
    "DrivenSession",
    "Driver",
    "DriverFault",
    "Evidence",
    "IntegrityRow",
    "LiveRequest",
    "Moment",
    "Operation",
    "Role",
    "poll_until",
    "reason_of",
]

Clock = Callable[[], float]
Session = ProducerSession | ConsumerSession


class DrivenSession(Protocol):
    """What the driver asks of every session it drives: exchange sessions and offload copies alike."""

    @property
    def request_id(self) -> str: ...

    @property
    def mode(self) -> TransferMode: ...

    @property
    def is_terminal(self) -> bool: ...

    def receive(self, message: Message, *, now: float) -> Output: ...

    def tick(self, *, now: float) -> Output: ...

    def transfer_done(self, *, now: float) -> Output: ...

    def transfer_failed(self, reason: FailureReason, *, now: float, detail: str = "") -> Output: ...


S = TypeVar("S", bound=DrivenSession)


class Operation(str, enum.Enum):
    """Which driver operation a :class:`DriverFault` comes from."""

    CHECK = "check"  # a local check before anything moved (WIN-1, ALIGN-1, PLAN-1, HS-1)
    PLAN = "plan"  # the producer could not plan a write for an offer (PLAN-1)
    POST = "post"  # the transport refused a post
    POLL = "poll"  # the transport's check() raised
    RELEASE = "release"  # the transport's release() raised
    SEND = "send"  # a control message could not be sent
    RECEIVE = "receive"  # the transport's get_notifications() raised
    DECODE = "decode"  # a notification was not a message of this protocol (VER-1)
    PROTOCOL = "protocol"  # a session refused a peer's message (RemoteProtocolError)
    ROUTE = "route"  # no known peer to send a message to


@attrs.frozen(kw_only=True)
class DriverFault:
    """One thing that went wrong while driving, as a typed record: callers test fields, never text (FAIL-1)."""

    operation: Operation
    error: KVSpecError
    request_id: str | None = None
    peer: str | None = None

    def __str__(self) -> str:
        where = f"request {self.request_id!r}: " if self.request_id is not None else ""
        to = f" ({self.peer!r})" if self.peer is not None else ""
        return f"{where}{self.operation.value}{to}: {type(self.error).__name__}: {self.error}"


def _corrupt_text(bad: BlockIds) -> str:
    shown = "; ".join(f"group {g}: {list(ids)[:8]}" for g, ids in enumerate(bad) if len(ids))
    return f"block digests differ from the sender's (INT-1): {shown}"


@attrs.define(eq=False)
class LiveRequest(Generic[S]):
    """One request on this side: its session, the peer agent, the plan and the transfer in flight.

    ``plan`` is the consumer's READ plan, made before it starts (PLAN-1); a
    producer's WRITE is planned when the offer arrives. ``pairs`` are the
    block pairs that plan moves (the role sets them with the plan); a driver
    with integrity on digests and checks them (INT-1). ``posted`` turns true
    once the transport accepted a post for this request.
    """

    session: S
    peer: str | None = None
    plan: TransferPlan | None = None
    pairs: BlockPairsLike | None = None
    handle: TransferHandle | None = None
    posted: bool = False
    freed: bool = False

    @property
    def request_id(self) -> str:
        """The producer's request id, carried by every message of the exchange (an offload copy's own id)."""
        return self.session.request_id


class PlanWrite(Protocol):
    def __call__(self, request: LiveRequest[ProducerSession], offer: BlockOffer) -> TransferPlan: ...


# --------------------------------------------------------------------------- the role protocol


class Role(Protocol[S]):
    """What a driver needs of the side it serves, so that it never branches on session classes (SM-1, SM-2).

    :meth:`descriptors` plans the side's post (PLAN-1) and says what it
    moves, in the session's mode: a consumer READs, a producer WRITEs, an
    offload copy moves its pages. :meth:`lost` is what a control message that
    could not leave does to the request (FAIL-1). The INT-1 members:
    :meth:`evidence` is what a receiver checks (``None`` when this side
    checks nothing now), :meth:`block_ids` the consumer's blocks a sender
    digests, :meth:`reject` ends a receiver FAILED(integrity) on a Completion
    whose blocks differ.
    """

    def descriptors(self, driver: Driver[S], request: LiveRequest[S]) -> Sequence[Descriptor]: ...

    def lost(self, request: LiveRequest[S], message: Message, *, now: float) -> Output: ...

    def evidence(self, request: LiveRequest[S], completion: Completion | None) -> Evidence | None: ...

    def block_ids(self, request: LiveRequest[S]) -> BlockIds: ...

    def reject(
        self, request: LiveRequest[S], message: Completion, bad: BlockIds, *, now: float, detail: str
    ) -> Output: ...


class _ProducerRole:
    """The prefill side: it WRITEs, planned when the offer arrives; it checks nothing it receives (SM-1)."""

    def descriptors(
        self, driver: Driver[ProducerSession], request: LiveRequest[ProducerSession]
    ) -> Sequence[Descriptor]:
        offer = request.session.offer
        if offer is None or driver.plan_write is None:
            raise LocalProtocolError("a write is posted only for an offer, by a driver that plans writes")
        request.plan = driver.plan_write(request, offer)
        return request.plan.to_descriptors(TransferMode.WRITE)

    def lost(self, request: LiveRequest[ProducerSession], message: Message, *, now: float) -> Output:
        return Output()  # a Failure or Abort lost on the way: the consumer's own deadline ends it (FAIL-1)

    def evidence(self, request: LiveRequest[ProducerSession], completion: Completion | None) -> Evidence | None:
        return None  # a producer receives no blocks: a Completion sent to it is its session's to refuse

    def block_ids(self, request: LiveRequest[ProducerSession]) -> BlockIds:
        offer = request.session.offer
        return BlockIds([]) if offer is None else offer.consumer_block_ids

    def reject(
        self, request: LiveRequest[ProducerSession], message: Completion, bad: BlockIds, *, now: float, detail: str
    ) -> Output:
        return request.session.receive(message, now=now)  # pragma: no cover - evidence() is always None


class _ConsumerRole:
    """The decode side: it READs what it planned before it started, and checks every block it receives (SM-2)."""

    def descriptors(
        self, driver: Driver[ConsumerSession], request: LiveRequest[ConsumerSession]
    ) -> Sequence[Descriptor]:
        if request.plan is None:
            raise LocalProtocolError("a read is posted only for a planned request")
        return request.plan.to_descriptors(TransferMode.READ)

    def lost(self, request: LiveRequest[ConsumerSession], message: Message, *, now: float) -> Output:
        if isinstance(message, BlockOffer):
            # The offer may have left before the peer was lost: the session waits out lease + drain (SM-2).
            return request.session.fail(FailureReason.PEER_DISCONNECTED, now=now, detail="offer not sent")
        return Output()

    def evidence(self, request: LiveRequest[ConsumerSession], completion: Completion | None) -> Evidence | None:
        session = request.session
        if session.state is not ConsumerState.LOADING:
            return None  # only a loading consumer checks (cancelled: it ends FAILED or ABORTED anyway)
        params = session.params
        return Evidence(
            pairs=request.pairs,
            params=params,
            block_ids=session.consumer_block_ids,
            sent=params.producer_block_digests if completion is None else completion.consumer_block_digests,
        )

    def block_ids(self, request: LiveRequest[ConsumerSession]) -> BlockIds:
        return request.session.consumer_block_ids

    def reject(
        self, request: LiveRequest[ConsumerSession], message: Completion, bad: BlockIds, *, now: float, detail: str
    ) -> Output:
        return request.session.reject_completion(message, now=now, failed_consumer_block_ids=bad, detail=detail)


class _OffloadRole:
    """An offload engine's copies (OFF-3, OFF-6): it moves the session's pages; no control message, no INT-1."""

    def descriptors(self, driver: Driver[OffloadSession], request: LiveRequest[OffloadSession]) -> Sequence[Descriptor]:
        session = request.session
        if session.gpu_posts:
            return [
                Descriptor(
                    local_region=c.gpu_region,
                    local_offset=c.gpu_offset,
                    remote_region=c.chunk_region,
                    remote_offset=c.chunk_offset,
                    nbytes=c.nbytes,
                )
                for c in session.copies
            ]
        return [
            Descriptor(
                local_region=c.chunk_region,
                local_offset=c.chunk_offset,
                remote_region=c.gpu_region,
                remote_offset=c.gpu_offset,
                nbytes=c.nbytes,
            )
            for c in session.copies
        ]

    def lost(self, request: LiveRequest[OffloadSession], message: Message, *, now: float) -> Output:
        return Output()  # pragma: no cover - a copy sends nothing

    def evidence(self, request: LiveRequest[OffloadSession], completion: Completion | None) -> Evidence | None:
        return None

    def block_ids(self, request: LiveRequest[OffloadSession]) -> BlockIds:
        return BlockIds([])  # pragma: no cover - a copy carries no Completion to digest

    def reject(
        self, request: LiveRequest[OffloadSession], message: Completion, bad: BlockIds, *, now: float, detail: str
    ) -> Output:
        return request.session.receive(message, now=now)  # pragma: no cover - evidence() is always None


PRODUCER: Role[ProducerSession] = _ProducerRole()
"""The role of a driver of producer sessions."""

CONSUMER: Role[ConsumerSession] = _ConsumerRole()
"""The role of a driver of consumer sessions."""

OFFLOAD: Role[OffloadSession] = _OffloadRole()
"""The role of a driver of offload copies, one per agent that posts them."""


# --------------------------------------------------------------------------- INT-1 as table rows


class Moment(str, enum.Enum):
    """When an :class:`IntegrityRow` is looked at."""

    POST = "post"  # the receiver is about to post its READ
    DONE = "done"  # the receiver's READ reached DONE
    COMPLETION = "completion"  # a WRITE's Completion reached the receiver


@attrs.frozen(kw_only=True)
class Evidence:
    """What an integrity check looks at: the pairs moved, the parameters, the receiver's blocks, what was sent."""

    pairs: BlockPairsLike | None
    params: TransferParams
    block_ids: BlockIds
    sent: BlockDigests | None


Verdict = tuple[BlockIds, str] | None
"""The blocks that failed an integrity check and why; ``None`` when every block agrees (INT-1)."""

_NO_DIGESTS = "the producer sent no block digests (INT-1 is off on its side)"


def _digests_sent(digester: PageDigester, evidence: Evidence) -> Verdict:
    return None if evidence.sent is not None else (evidence.block_ids, _NO_DIGESTS)


def _read_agrees(digester: PageDigester, evidence: Evidence) -> Verdict:
    if evidence.pairs is None or evidence.sent is None:
        return evidence.block_ids, _corrupt_text(evidence.block_ids)
    bad = digester.check_read(evidence.pairs, evidence.params.producer_block_ids, evidence.sent)
    return (bad, _corrupt_text(bad)) if any(len(group) for group in bad) else None


def _written_agrees(digester: PageDigester, evidence: Evidence) -> Verdict:
    if evidence.sent is None:
        return evidence.block_ids, _NO_DIGESTS
    bad = digester.check_written(evidence.block_ids, evidence.sent)
    return (bad, _corrupt_text(bad)) if any(len(group) for group in bad) else None


@attrs.frozen(kw_only=True)
class IntegrityRow:
    """One INT-1 outcome: in ``mode``, at ``moment``, a receiving consumer runs ``check``.

    A verdict ends the request FAILED(integrity), never LOADED: at
    ``post`` and ``done`` as a failed transfer (nothing posted, or the read's
    blocks not trusted), at ``completion`` by rejecting the Completion, which
    still says that the producer's write is over (DONE-1).
    """

    mode: TransferMode
    moment: Moment
    check: Callable[[PageDigester, Evidence], Verdict]
    says: str


INTEGRITY_ROWS: tuple[IntegrityRow, ...] = (
    IntegrityRow(
        mode=TransferMode.READ,
        moment=Moment.POST,
        check=_digests_sent,
        says="the parameters carry no digests: FAILED(integrity) before any byte moves",
    ),
    IntegrityRow(
        mode=TransferMode.READ,
        moment=Moment.DONE,
        check=_read_agrees,
        says="a block read differs from the parameters' digest: FAILED(integrity), never LOADED",
    ),
    IntegrityRow(
        mode=TransferMode.WRITE,
        moment=Moment.COMPLETION,
        check=_written_agrees,
        says="the Completion carries no digests, or a block written differs from its digest: FAILED(integrity)",
    ),
)
"""Every INT-1 outcome of the driver, one row each; the sender's digests are stamped, never checked, by it."""


# --------------------------------------------------------------------------- one poll loop


def _short_sleep() -> None:
    time.sleep(0.0005)  # a backend in another process gets the CPU


def poll_until(
    poll: Callable[[], None],
    *,
    done: Callable[[], bool],
    until: float | None = None,
    pause: Callable[[], None] = _short_sleep,
    spin: int = 0,
    min_polls: int = 0,
    clock: Clock = time.monotonic,
) -> bool:
    """Call ``poll`` until ``done()`` holds (after ``min_polls`` polls at least) or ``clock()`` passes ``until``.

    The first ``spin`` polls run back to back, then ``pause`` runs between
    polls while not done. Returns ``done()``. Every loop that waits for
    requests to settle is this one, so none forgets its bound (FAIL-1);
    without ``until`` the sessions' own deadlines bound it.
    """
    polls = 0
    while polls < min_polls or not done():
        if until is not None and clock() > until:
            break
        poll()
        polls += 1
        if polls > spin and (polls < min_polls or not done()):
            pause()
    return done()


# --------------------------------------------------------------------------- the driver


class Driver(Generic[S]):
    """Carries out sessions' actions over ``transport``; the engine supplies planning and block bookkeeping.

    ``role`` is the side it serves (:data:`PRODUCER` or :data:`CONSUMER`).
    ``plan_write`` plans a producer's WRITE for the consumer's offer (through
    the connector seam); ``on_free`` returns freed block ids to the engine's
    pool; ``on_end`` is called once per request when its session is terminal
    and no transfer of it is in flight; ``on_message`` sees every decoded
    control message, for finished requests too; ``fallback_peer`` names the
    agent to tell when a request has no known peer yet. ``cancelled_at`` is
    when the driver last cancelled a transfer in flight (or ``None``).
    ``integrity`` turns INT-1 on: a digester over this side's own pool.
    """

    def __init__(
        self,
        *,
        role: Role[S],
        transport: Transport,
        clock: Clock,
        on_free: Callable[[LiveRequest[S], BlockIds], None],
        on_end: Callable[[LiveRequest[S]], None],
        plan_write: PlanWrite | None = None,
        on_message: Callable[[str, str, Message], None] | None = None,
        fallback_peer: Callable[[], str | None] | None = None,
        integrity: PageDigester | None = None,
    ) -> None:
        self.role: Role[S] = role
        self.transport = transport
        self.integrity = integrity
        self.clock = clock
        self.on_free: Callable[[LiveRequest[S], BlockIds], None] = on_free
        self.on_end: Callable[[LiveRequest[S]], None] = on_end
        self.plan_write = plan_write
        self.on_message = on_message
        self.fallback_peer = fallback_peer
        self.requests: dict[str, LiveRequest[S]] = {}
        self.faults: list[DriverFault] = []
        self.cancelled_at: float | None = None

    # -- requests

    def add(self, request: LiveRequest[S]) -> LiveRequest[S]:
        """Track a new request; its session's first output is then given to :meth:`execute`."""
        if request.request_id in self.requests:
            raise LocalProtocolError(f"request {request.request_id!r} is already being driven")
        self.requests[request.request_id] = request
        return request

    def digests(self, block_ids: BlockIds) -> BlockDigests | None:
        """The digests of this side's blocks when integrity is on, else ``None`` (INT-1)."""
        return None if self.integrity is None else self.integrity.digests(block_ids)

    def fault(self, operation: Operation, error: KVSpecError, request_id: str | None, peer: str | None = None) -> None:
        """Record a typed fault."""
        self.faults.append(DriverFault(operation=operation, error=error, request_id=request_id, peer=peer))

    def execute(self, request: LiveRequest[S], out: Output) -> None:
        """Carry out ``out.actions`` in table order, then end the request if its session is terminal (SM-1, SM-2)."""
        for action in out.actions:
            if isinstance(action, Send):
                self._send(request, action.message)
            elif isinstance(action, Post):
                self._post(request, action)
            elif isinstance(action, Cancel):
                self._cancel(request)
            elif isinstance(action, Free):
                self._free(request, action.block_ids)
        if request.session.is_terminal and request.handle is None and request.request_id in self.requests:
            del self.requests[request.request_id]
            self.on_end(request)

    # -- polling

    def poll(self) -> None:
        """Progress transfers, then handle notifications, then fire deadlines (DONE-1, FAIL-1)."""
        for posted in list(self.requests.values()):
            if posted.handle is not None:
                self._check(posted)
        for peer, message in self._receive():
            request_id = getattr(message, "request_id", "")
            if self.on_message is not None:
                self.on_message(request_id, peer, message)
            request = self.requests.get(request_id)
            if request is None:
                continue  # late or duplicate message for a finished request: ignored (SM-1, SM-2)
            if request.peer is None:
                request.peer = peer  # WRITE: where the producer sends its Completion and failures
            try:
                if isinstance(message, Completion):
                    out = self._receive_completion(request, message)
                else:
                    out = request.session.receive(message, now=self.clock())
            except ProtocolError as exc:
                self.fault(Operation.PROTOCOL, exc, request_id, peer)
                continue
            self.execute(request, out)
        self.tick()

    def tick(self) -> None:
        """Fire every session deadline that is due (FAIL-1)."""
        for request in list(self.requests.values()):
            self.execute(request, request.session.tick(now=self.clock()))

    # -- the actions

    def _send(self, request: LiveRequest[S], message: Message) -> None:
        peer = request.peer
        if peer is None and self.fallback_peer is not None:
            peer = self.fallback_peer()
        if peer is None:
            error = TransportError(
                f"no known peer for {type(message).__name__}", reason=FailureReason.PEER_DISCONNECTED.value
            )
            self.fault(Operation.ROUTE, error, request.request_id)
            return
        try:
            self.transport.send_notification(peer, encode(message))
        except TransportError as exc:
            # A lost control message ends in a deadline, never a hang (FAIL-1).
            self.fault(Operation.SEND, exc, request.request_id, peer)
            self.execute(request, self.role.lost(request, message, now=self.clock()))

    def _post(self, request: LiveRequest[S], action: Post) -> None:
        session = request.session
        try:
            descriptors = self.role.descriptors(self, request)
        except KVSpecError as exc:
            self.fault(Operation.PLAN, exc, request.request_id)
            self.execute(request, session.transfer_failed(reason_of(exc), now=self.clock(), detail=str(exc)))
            return
        mode = session.mode  # a session posts in its own mode: P WRITEs in WRITE mode, C READs in READ mode
        try:
            if request.peer is None:
                raise TransportError("no peer to post to", reason=FailureReason.PEER_DISCONNECTED.value)
            completion = action.notification
            if completion is not None and self.integrity is not None:
                # INT-1: the Completion carries the digest of every block the write moves.
                completion = attrs.evolve(completion, consumer_block_digests=self._written_digests(request))
            if not descriptors:
                # Every needed block is already there: nothing to move. A WRITE's Completion goes on its own.
                if completion is not None:
                    self._send(request, completion)
                self.execute(request, session.transfer_done(now=self.clock()))
                return
            verdict = self._verdict(request, Moment.POST)
            if verdict is not None:
                self.execute(
                    request, session.transfer_failed(FailureReason.INTEGRITY, now=self.clock(), detail=verdict[1])
                )
                return
            notification = None if completion is None else encode(completion)
            request.handle = self.transport.post(mode, descriptors, peer=request.peer, notification=notification)
            request.posted = True
        except KVSpecError as exc:
            self.fault(Operation.POST, exc, request.request_id, request.peer)
            out = session.transfer_failed(reason_of(exc, FailureReason.POST_FAILED), now=self.clock(), detail=str(exc))
            self.execute(request, out)

    def _cancel(self, request: LiveRequest[S]) -> None:
        if request.handle is None:
            return
        # Releasing a pending transfer cancels it. Only a backend that stops at once
        # (Capabilities.immediate_cancel) counts as drained now; any other is drained
        # when the session's drain timeout fires from tick() (SM-2, the drain rule).
        self._drop_handle(request)
        self.cancelled_at = self.clock()
        if self.transport.capabilities.immediate_cancel:
            cancelled = request.session.transfer_failed(FailureReason.ABORTED, now=self.clock(), detail="cancelled")
            self.execute(request, cancelled)

    def _free(self, request: LiveRequest[S], block_ids: BlockIds) -> None:
        if request.handle is not None:
            raise LocalProtocolError(f"request {request.request_id!r}: free while a transfer is in flight (SM-2)")
        if not request.freed:
            request.freed = True
            self.on_free(request, block_ids)

    # -- transport

    def _check(self, request: LiveRequest[S]) -> None:
        """Poll a posted transfer and feed its end to the session (DONE-1, FAIL-1)."""
        if request.handle is None:  # pragma: no cover - poll checks only posted requests
            return
        session = request.session
        try:
            status = self.transport.check(request.handle)
        except TransportError as exc:
            self.fault(Operation.POLL, exc, request.request_id, request.peer)
            self._drop_handle(request)
            self.execute(request, session.transfer_failed(reason_of(exc), now=self.clock(), detail=str(exc)))
            return
        if status.state is TransferState.PENDING:
            return
        self._drop_handle(request)
        if status.state is TransferState.DONE:
            verdict = self._verdict(request, Moment.DONE)
            if verdict is not None:
                self.execute(
                    request, session.transfer_failed(FailureReason.INTEGRITY, now=self.clock(), detail=verdict[1])
                )
                return
            self.execute(request, session.transfer_done(now=self.clock()))
        else:
            reason = status.reason or FailureReason.TRANSFER_ERROR
            self.execute(request, session.transfer_failed(reason, now=self.clock(), detail=status.detail))

    # -- integrity (INT-1)

    def _verdict(self, request: LiveRequest[S], moment: Moment, completion: Completion | None = None) -> Verdict:
        """The row of INTEGRITY_ROWS for this moment, checked, when integrity is on and the role receives blocks."""
        evidence = None if self.integrity is None else self.role.evidence(request, completion)
        if self.integrity is None or evidence is None:
            return None
        for row in INTEGRITY_ROWS:
            if row.mode is evidence.params.mode and row.moment is moment:
                return row.check(self.integrity, evidence)
        return None

    def _written_digests(self, request: LiveRequest[S]) -> BlockDigests:
        """WRITE on the producer: per entry of the offer, the digest of the block written into it."""
        if self.integrity is None:  # pragma: no cover - called only with integrity on
            raise LocalProtocolError("digests of a write are taken by a driver with integrity on")
        if request.pairs is None:
            raise LocalProtocolError(f"request {request.request_id!r}: integrity needs the pairs of the write")
        return self.integrity.written_digests(request.pairs, self.role.block_ids(request))

    def _receive_completion(self, request: LiveRequest[S], message: Completion) -> Output:
        """WRITE on the consumer: LOADED only if every written block matches the Completion's digest."""
        now = self.clock()
        verdict = self._verdict(request, Moment.COMPLETION, message)
        if verdict is None:
            return request.session.receive(message, now=now)  # a producer refuses a Completion itself
        bad, detail = verdict
        return self.role.reject(request, message, bad, now=now, detail=detail)

    def _drop_handle(self, request: LiveRequest[S]) -> None:
        if request.handle is not None:
            handle, request.handle = request.handle, None
            try:
                self.transport.release(handle)
            except TransportError as exc:
                self.fault(Operation.RELEASE, exc, request.request_id, request.peer)

    def _receive(self) -> list[tuple[str, Message]]:
        """Drain and decode notifications; undecodable ones are recorded and dropped (VER-1)."""
        try:
            notes = self.transport.get_notifications()
        except TransportError as exc:
            self.fault(Operation.RECEIVE, exc, None)
            return []
        messages = []
        for note in notes:
            try:
                messages.append((note.peer, decode(note.message)))
            except KVSpecError as exc:
                self.fault(Operation.DECODE, exc, None, note.peer)
        return messages
