"""Offload copies as sessions: one store or load between the GPU pool and the chunk pool (OFF-3, OFF-4, OFF-6).

Theory of operation. An offloading engine copies pages to a slower tier
(a store, OFF-3) and back (a load, OFF-6). Each copy is one
:class:`OffloadSession`, sans-IO like the exchange's sessions, so the same
driver (:class:`kvspec.exchange.Driver`, role :data:`kvspec.exchange.OFFLOAD`)
posts it, polls it and fires its deadline. The session says *what* to copy,
as :class:`ChunkCopy` records (a GPU page and the chunk-pool sub-block it
pairs with, OFF-7), and in which transfer mode the side that posts it moves
bytes; the driver turns them into descriptors of that side.

A copy is posted once (``start``), then lands (DONE) or fails: the backend
failed or refused it, or it outlived ``timeout`` (FAILED, and the transfer
is cancelled). A store that landed is *complete*; the engine's chunk manager
makes a key *present* only once every sub-block of its chunk is complete
(OFF-4), and may *evict* it afterwards; a load reads only present keys.
Those per-key states (:data:`kvspec.spec.offload.KEY_TRANSITIONS`) are the
engine's; the copy's are :data:`kvspec.spec.offload.COPY_TRANSITIONS`, which
this session follows.

Any other event in a terminal state is ignored (a late report of a cancelled
copy); in ``pending`` it is a local protocol error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import ConfigError, LocalProtocolError, RemoteProtocolError
from kvspec.protocol._session import Cancel, Output, Post
from kvspec.reference._messages import Message
from kvspec.spec.offload import COPY_TRANSITIONS, OffloadEvent, OffloadKind, OffloadState

__all__ = ["ChunkCopy", "OffloadKind", "OffloadSession", "OffloadState"]


@attrs.frozen(kw_only=True)
class ChunkCopy:
    """One page moved: ``nbytes`` at a GPU pool address and at a chunk-pool address (OFF-7)."""

    gpu_region: int
    gpu_offset: int
    chunk_region: int
    chunk_offset: int
    nbytes: int


def _copies(value: Iterable[ChunkCopy]) -> tuple[ChunkCopy, ...]:
    return tuple(value)


_NOTHING = Output()
_NEXT = {(state, event): target for state, event, target, _action in COPY_TRANSITIONS}


def _next(state: OffloadState, event: OffloadEvent) -> OffloadState:
    """The state ``event`` takes a copy to, by the copy table (OFF-4)."""
    target = _NEXT.get((state, event))
    if target is None:  # pragma: no cover - the session checks the state before it fires
        raise LocalProtocolError(f"offload copy: no {event.value!r} in state {state.value}")
    return target


class OffloadSession:
    """One store or load of a request (OFF-3, OFF-6), driven like a transfer of the exchange.

    ``mode`` is the transfer mode of the side that posts it: a GPU side posts
    a store as a WRITE and a load as a READ; a chunk-pool side the other way
    round (:attr:`gpu_posts`). ``timeout`` bounds the copy from its post
    (``None``: unbounded); past it the copy is FAILED(timeout) and cancelled.
    """

    def __init__(
        self,
        *,
        request_id: str,
        kind: OffloadKind,
        mode: TransferMode,
        copies: Iterable[ChunkCopy],
        timeout: float | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"OffloadSession.request_id: expected a non-empty str, got {request_id!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0):
            raise ConfigError(f"OffloadSession.timeout: expected a finite number of seconds >= 0, got {timeout!r}")
        self._request_id = request_id
        self.kind = OffloadKind(kind)
        self._mode = TransferMode(mode)
        self.copies = _copies(copies)
        self.timeout = None if timeout is None else float(timeout)
        self._state = OffloadState.PENDING
        self._started_at = -math.inf
        self.reason: FailureReason | None = None
        self.detail = ""

    @property
    def request_id(self) -> str:
        """This copy's id, unique among the copies its driver runs."""
        return self._request_id

    @property
    def mode(self) -> TransferMode:
        """The transfer mode the posting side moves bytes in."""
        return self._mode

    @property
    def state(self) -> OffloadState:
        """The current state."""
        return self._state

    @property
    def is_terminal(self) -> bool:
        """True once the copy landed or failed."""
        return self._state.is_terminal

    @property
    def gpu_posts(self) -> bool:
        """True when the GPU side posts this copy: a store it WRITEs, a load it READs."""
        return (self.kind is OffloadKind.STORE) == (self._mode is TransferMode.WRITE)

    @property
    def next_deadline(self) -> float | None:
        """When ``tick`` must next be called; ``None`` unless copying with a timeout."""
        if self._state is not OffloadState.COPYING or self.timeout is None:
            return None
        return self._started_at + self.timeout

    def start(self, *, now: float) -> Output:
        """Post the copy."""
        if self._state is not OffloadState.PENDING:
            raise LocalProtocolError(f"offload copy {self._request_id!r} already started ({self._state.value})")
        self._state, self._started_at = _next(self._state, OffloadEvent.START), now
        return Output(actions=(Post(),))

    def transfer_done(self, *, now: float) -> Output:
        """The copy landed: every page it names holds its source's bytes (DONE-1)."""
        if self._report():
            self._state = _next(self._state, OffloadEvent.TRANSFER_DONE)
        return _NOTHING

    def transfer_failed(self, reason: FailureReason, *, now: float, detail: str = "") -> Output:
        """The copy failed or could not be posted (FAIL-1)."""
        if not isinstance(reason, FailureReason):
            raise LocalProtocolError(f"transfer_failed: expected a FailureReason, got {reason!r}")
        if self._report():
            self._fail(OffloadEvent.TRANSFER_FAILED, reason, detail)
        return _NOTHING

    def tick(self, *, now: float) -> Output:
        """Fail the copy once it outlived its timeout, and cancel it (FAIL-1)."""
        due = self.next_deadline
        if due is None or now < due:
            return _NOTHING
        self._fail(OffloadEvent.DEADLINE, FailureReason.TIMEOUT, f"did not complete within {self.timeout}s")
        return Output(actions=(Cancel(),))

    def receive(self, message: Message, *, now: float) -> Output:
        """A copy takes no control message: whatever arrives is the peer's protocol error."""
        raise RemoteProtocolError(f"an offload copy takes no {type(message).__name__}")

    def _report(self) -> bool:
        if self._state is OffloadState.PENDING:
            raise LocalProtocolError(f"offload copy {self._request_id!r} has no posted transfer to report on")
        return self._state is OffloadState.COPYING  # a report after the end (a cancelled copy) is ignored

    def _fail(self, event: OffloadEvent, reason: FailureReason, detail: str) -> None:
        self._state, self.reason, self.detail = _next(self._state, event), reason, detail

    def __repr__(self) -> str:
        return f"<OffloadSession {self._request_id!r} {self.kind.value} {self._mode.value} {self._state.value}>"
