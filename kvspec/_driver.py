"""The driver core: carries out what the sessions ask for over one Transport, a clock and the connector seam.

Theory of operation
-------------------

A :class:`Driver` serves one engine's side of many requests: one sans-IO
session each (:class:`ProducerSession` or :class:`ConsumerSession`, SM-1,
SM-2), the transfer handle it posted, and the peer agent it talks to. It is
the only code that turns session actions into I/O, and session inputs out of
I/O; the exchange endpoints (:mod:`kvspec._exchange`) and the conformance
suite's scenarios are thin roles over it, so the request lifecycle is written
once.

- :meth:`Driver.execute` carries out an :class:`Output`'s actions in table
  order: :class:`Send` (codec bytes as a notification), :class:`Post` (the
  role's plan as descriptors; a WRITE carries the Completion, DONE-1),
  :class:`Cancel` (release the handle; drained at once only on a backend with
  ``immediate_cancel``, else when the session's drain timeout fires, SM-2) and
  :class:`Free` (handed to the role, never while a transfer is in flight).
- :meth:`Driver.poll` feeds the sessions what happened: transfer status
  first (so a transfer that already ended is never cancelled by the message
  that follows it), then decoded notifications, then deadlines (FAIL-1).

What goes wrong is recorded as typed :class:`DriverFault` records, never as
strings: a lost control message ends in a deadline, never a hang (FAIL-1).

Integrity (INT-1) is the driver's, so every backend has it: a driver given a
:class:`kvspec.PageDigester` over its own pool puts the digests of the blocks
it wrote on a WRITE's Completion, and, as a consumer, checks the blocks it
received before its session may report LOADED: after a READ is DONE against
the digests of the transfer parameters, on a WRITE's Completion against the
Completion's. A difference ends the request FAILED(integrity); so does a
sender that sent no digests. The producer's READ digests are the role's to
put in the transfer parameters (:meth:`Driver.digests`), since the parameters
leave before any transfer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

import attrs

from kvspec._codec import decode, encode
from kvspec._enums import FailureReason, TransferMode
from kvspec._errors import (
    BlockAlignmentError,
    GroupCountError,
    IncompatiblePeerError,
    KVSpecError,
    LocalProtocolError,
    ProtocolError,
    TransportError,
    WindowCoverageError,
)
from kvspec._integrity import BlockDigests, BlockPairsLike, PageDigester
from kvspec._messages import BlockOffer, Completion, Message
from kvspec._models import BlockIds
from kvspec._plan import TransferPlan
from kvspec._session import (
    Cancel,
    ConsumerSession,
    ConsumerState,
    Free,
    Output,
    Post,
    ProducerSession,
    Send,
)
from kvspec.transport._base import TransferHandle, TransferState, Transport

__all__ = ["Driver", "DriverFault", "LiveRequest", "Operation", "reason_of"]

Clock = Callable[[], float]
Session = ProducerSession | ConsumerSession


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


def reason_of(error: KVSpecError, default: FailureReason = FailureReason.PROTOCOL) -> FailureReason:
    """The typed failure reason of a check or transport error (FAIL-1)."""
    if isinstance(error, WindowCoverageError):
        return FailureReason.WINDOW_COVERAGE
    if isinstance(error, (BlockAlignmentError, GroupCountError)):
        return FailureReason.BLOCK_ALIGNMENT
    if isinstance(error, TransportError):
        return error.reason
    if isinstance(error, IncompatiblePeerError):
        return FailureReason.INCOMPATIBLE_PEER
    return default


@attrs.define(eq=False)
class LiveRequest:
    """One request on this side: its session, the peer agent, the plan and the transfer in flight.

    ``plan`` is the consumer's READ plan, made before it starts (PLAN-1); a
    producer's WRITE is planned when the offer arrives. ``pairs`` are the
    block pairs that plan moves (the role sets them with the plan); a driver
    with integrity on digests and checks them (INT-1). ``posted`` turns true
    once the transport accepted a post for this request.
    """

    session: Session
    peer: str | None = None
    plan: TransferPlan | None = None
    pairs: BlockPairsLike | None = None
    handle: TransferHandle | None = None
    posted: bool = False
    freed: bool = False

    @property
    def request_id(self) -> str:
        """The producer's request id, carried by every message of the exchange."""
        return self.session.params.request_id


class PlanWrite(Protocol):
    def __call__(self, request: LiveRequest, offer: BlockOffer) -> TransferPlan: ...


class Driver:
    """Carries out sessions' actions over ``transport``; the role supplies planning and block bookkeeping.

    ``plan_write`` plans a producer's WRITE for the consumer's offer (through
    the connector seam); ``on_free`` returns freed block ids to the role's
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
        transport: Transport,
        clock: Clock,
        on_free: Callable[[LiveRequest, BlockIds], None],
        on_end: Callable[[LiveRequest], None],
        plan_write: PlanWrite | None = None,
        on_message: Callable[[str, str, Message], None] | None = None,
        fallback_peer: Callable[[], str | None] | None = None,
        integrity: PageDigester | None = None,
    ) -> None:
        self.transport = transport
        self.integrity = integrity
        self.clock = clock
        self.on_free = on_free
        self.on_end = on_end
        self.plan_write = plan_write
        self.on_message = on_message
        self.fallback_peer = fallback_peer
        self.requests: dict[str, LiveRequest] = {}
        self.faults: list[DriverFault] = []
        self.cancelled_at: float | None = None

    # -- requests

    def add(self, request: LiveRequest) -> LiveRequest:
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

    def execute(self, request: LiveRequest, out: Output) -> None:
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
                if isinstance(message, Completion) and self.integrity is not None:
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

    def _send(self, request: LiveRequest, message: Message) -> None:
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
            session = request.session
            if isinstance(message, BlockOffer) and isinstance(session, ConsumerSession):
                self.execute(
                    request, session.fail(FailureReason.PEER_DISCONNECTED, now=self.clock(), detail="offer not sent")
                )

    def _post(self, request: LiveRequest, action: Post) -> None:
        session = request.session
        try:
            if isinstance(session, ProducerSession):
                mode = TransferMode.WRITE
                if session.offer is None or self.plan_write is None:
                    raise LocalProtocolError("a write is posted only for an offer, by a driver that plans writes")
                try:
                    request.plan = self.plan_write(request, session.offer)
                except KVSpecError as exc:
                    self.fault(Operation.PLAN, exc, request.request_id)
                    out = session.transfer_failed(reason_of(exc), now=self.clock(), detail=str(exc))
                    self.execute(request, out)
                    return
            else:
                mode = TransferMode.READ
            plan = request.plan
            if plan is None:
                raise LocalProtocolError("a read is posted only for a planned request")
            if request.peer is None:
                raise TransportError("no peer to post to", reason=FailureReason.PEER_DISCONNECTED.value)
            completion = action.notification
            if completion is not None and self.integrity is not None and isinstance(session, ProducerSession):
                # INT-1: the Completion carries the digest of every block the write moves.
                completion = attrs.evolve(completion, consumer_block_digests=self._written_digests(request))
            if plan.num_descriptors == 0:
                # Every needed block is already there: nothing to move. A WRITE's Completion goes on its own.
                if completion is not None:
                    self._send(request, completion)
                self.execute(request, session.transfer_done(now=self.clock()))
                return
            if (
                self.integrity is not None
                and isinstance(session, ConsumerSession)
                and session.params.producer_block_digests is None
            ):
                # INT-1: nothing to check the read against; fail before any byte moves.
                detail = "the producer sent no block digests (INT-1 is off on its side)"
                self.execute(request, session.transfer_failed(FailureReason.INTEGRITY, now=self.clock(), detail=detail))
                return
            notification = None if completion is None else encode(completion)
            request.handle = self.transport.post(
                mode, plan.to_descriptors(mode), peer=request.peer, notification=notification
            )
            request.posted = True
        except KVSpecError as exc:
            self.fault(Operation.POST, exc, request.request_id, request.peer)
            out = session.transfer_failed(reason_of(exc, FailureReason.POST_FAILED), now=self.clock(), detail=str(exc))
            self.execute(request, out)

    def _cancel(self, request: LiveRequest) -> None:
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

    def _free(self, request: LiveRequest, block_ids: BlockIds) -> None:
        if request.handle is not None:
            raise LocalProtocolError(f"request {request.request_id!r}: free while a transfer is in flight (SM-2)")
        if not request.freed:
            request.freed = True
            self.on_free(request, block_ids)

    # -- transport

    def _check(self, request: LiveRequest) -> None:
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
            bad = self._check_read(request)
            if bad is not None:
                self.execute(
                    request,
                    session.transfer_failed(FailureReason.INTEGRITY, now=self.clock(), detail=_corrupt_text(bad)),
                )
                return
            self.execute(request, session.transfer_done(now=self.clock()))
        else:
            reason = status.reason or FailureReason.TRANSFER_ERROR
            self.execute(request, session.transfer_failed(reason, now=self.clock(), detail=status.detail))

    # -- integrity (INT-1)

    def _written_digests(self, request: LiveRequest) -> BlockDigests:
        """WRITE on the producer: per entry of the offer, the digest of the block written into it."""
        session = request.session
        if self.integrity is None or not isinstance(session, ProducerSession) or session.offer is None:
            raise LocalProtocolError("digests of a write are taken by a producer with integrity on, for an offer")
        if request.pairs is None:
            raise LocalProtocolError(f"request {request.request_id!r}: integrity needs the pairs of the write")
        return self.integrity.written_digests(request.pairs, session.offer.consumer_block_ids)

    def _check_read(self, request: LiveRequest) -> BlockIds | None:
        """READ on the consumer: the blocks that differ from the producer's digests, or None when all agree."""
        session = request.session
        if self.integrity is None or not isinstance(session, ConsumerSession):
            return None
        if session.state is not ConsumerState.LOADING:
            return None  # cancelled: this DONE ends the request FAILED or ABORTED anyway
        digests = session.params.producer_block_digests
        if request.pairs is None or digests is None:
            return session.consumer_block_ids
        bad = self.integrity.check_read(request.pairs, session.params.producer_block_ids, digests)
        return bad if any(len(group) for group in bad) else None

    def _receive_completion(self, request: LiveRequest, message: Completion) -> Output:
        """WRITE on the consumer: LOADED only if every written block matches the Completion's digest."""
        session = request.session
        now = self.clock()
        if not isinstance(session, ConsumerSession) or self.integrity is None:
            return session.receive(message, now=now)  # a producer refuses a Completion itself
        if session.state is not ConsumerState.LOADING:
            return session.receive(message, now=now)  # only LOADING turns a Completion into LOADED
        if message.consumer_block_digests is None:
            detail = "the producer sent no block digests (INT-1 is off on its side)"
            return session.reject_completion(
                message, now=now, failed_consumer_block_ids=session.consumer_block_ids, detail=detail
            )
        bad = self.integrity.check_written(session.consumer_block_ids, message.consumer_block_digests)
        if any(len(group) for group in bad):
            return session.reject_completion(message, now=now, failed_consumer_block_ids=bad, detail=_corrupt_text(bad))
        return session.receive(message, now=now)

    def _drop_handle(self, request: LiveRequest) -> None:
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
