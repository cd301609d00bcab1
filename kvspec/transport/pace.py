"""A sound pacing wrapper around any Transport or Backend: slower, reordered, never wrong (DONE-1, REL-1, SM-2).

A real backend over a network completes a transfer many polls after it was
posted, and several transfers in any order. :class:`PacedBackend` makes any
correct backend behave so, without making it incorrect:

- ``check`` reports ``DONE`` only once the inner transfer is DONE **and** this
  agent was called a number of times since the post **and** some wall time
  passed; ``FAILED`` passes through at once. Each transfer draws its own
  numbers (``jitter``), so transfers posted together complete in any order.
- A post's notification is held back by the initiator and sent, through the
  inner agent, only when the wrapper reports the transfer DONE (or when the
  agent is next called after that): it still follows its data (DONE-1). A
  released (cancelled) PENDING transfer sends none, as a cancel may.
- Notifications received are held for a few calls and some wall time, then
  delivered in the order they arrived: late, never lost, never reordered
  within one peer (REL-1).
- ``release`` releases the inner handle at once, so the inner backend's
  cancel semantics hold unchanged (SM-2); capabilities pass through.
- With ``pieces`` above 1 a transfer moves in that many pieces, one after
  the other, the next posted when a check finds the last DONE: bytes land a
  piece per poll, as NIXL without a progress thread moves them. The first
  piece holds the first and the last byte of every descriptor, so the inner
  agent still checks every descriptor at the post and refuses a bad one whole
  (PLAN-1); a release cancels the piece in flight and posts no more.

The pace is seeded: the same :class:`Pace` replays the same delays.
``kvspec conform BACKEND --pace slow|jitter|pieces`` runs the suite so.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from kvspec.core._enums import TransferMode
from kvspec.core._errors import ConfigError, TransportError
from kvspec.transport._base import (
    Backend,
    Capabilities,
    Descriptor,
    MemoryRegion,
    Notification,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
)

__all__ = ["PACES", "Pace", "PacedBackend", "PacedTransport", "paced"]

PACES = ("slow", "jitter", "pieces")

_PENDING = TransferStatus(state=TransferState.PENDING)


def _pieces(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
        raise ConfigError(f"Pace.{attribute.name}: expected an int in [1, 4096], got {value!r}")


def _span(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    ok = isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
    if not ok or not 0 <= value[0] <= value[1]:  # type: ignore[index]
        raise ConfigError(f"Pace.{attribute.name}: expected (low, high) with 0 <= low <= high, got {value!r}")


@attrs.frozen(kw_only=True)
class Pace:
    """How slow the wrapper makes a backend; every span is ``(low, high)``, drawn uniformly per event.

    ``done_polls`` and ``done_seconds``: checks of the transfer (or calls
    into its agent while it has a notification to send) and wall time, from
    the post, before DONE may be reported.
    ``notify_polls`` and ``notify_seconds``: calls into the receiving agent
    and wall time a received notification is held. ``pieces``: how many
    pieces a transfer moves in, one after the other (1: the inner agent's
    own way). ``seed`` makes the draws reproducible; the suite's report
    names it.
    """

    name: str = "custom"
    seed: int = 0
    done_polls: tuple[int, int] = attrs.field(default=(8, 8), validator=_span)
    done_seconds: tuple[float, float] = attrs.field(default=(0.002, 0.002), validator=_span)
    notify_polls: tuple[int, int] = attrs.field(default=(3, 3), validator=_span)
    notify_seconds: tuple[float, float] = attrs.field(default=(0.001, 0.001), validator=_span)
    pieces: int = attrs.field(default=1, validator=_pieces)

    @classmethod
    def named(cls, name: str, *, seed: int = 0) -> Pace:
        """``slow``: every transfer takes 8 checks and 2 ms, every notification 3 calls and 1 ms.

        ``jitter``: 0 to 16 checks and 0 to 3 ms a transfer, 0 to 6 calls and 0
        to 2 ms a notification, so completions come in any order.

        ``pieces``: every transfer moves in 32 pieces, the next one posted when
        a check finds the last one done (NIXL without a progress thread), and
        every notification is held for one call.
        """
        if name == "slow":
            return cls(name=name, seed=seed)
        if name == "jitter":
            return cls(
                name=name,
                seed=seed,
                done_polls=(0, 16),
                done_seconds=(0.0, 0.003),
                notify_polls=(0, 6),
                notify_seconds=(0.0, 0.002),
            )
        if name == "pieces":
            return cls(
                name=name,
                seed=seed,
                done_polls=(0, 0),
                done_seconds=(0.0, 0.0),
                notify_polls=(1, 1),
                notify_seconds=(0.0, 0.0),
                pieces=32,
            )
        raise ConfigError(f"pace: expected one of {', '.join(PACES)}, got {name!r}")

    def describe(self) -> str:
        """``slow (seed 0)``: for report headers and reproducers."""
        return f"{self.name} (seed {self.seed})"


@attrs.define(eq=False)
class _Paced:
    """What the wrapper remembers about one posted transfer."""

    handle: TransferHandle
    peer: str
    notification: bytes | None
    polls_left: int
    due_time: float
    final: TransferStatus | None = None
    # Pieces mode: the mode, the inner handle of the piece in flight and the pieces still to post.
    mode: TransferMode = TransferMode.READ
    current: TransferHandle | None = None
    rest: deque[list[Descriptor]] = attrs.field(factory=deque)


@attrs.define(eq=False)
class _Held:
    notification: Notification
    due_tick: int
    due_time: float


class PacedTransport:
    """Wraps one agent: DONE and notifications later than the inner agent gives them, never earlier."""

    def __init__(self, inner: Transport, pace: Pace) -> None:
        if not isinstance(pace, Pace):
            raise ConfigError(f"PacedTransport.pace: expected a Pace, got {pace!r}")
        self._inner = inner
        self._pace = pace
        self._rng = random.Random(f"{pace.seed}:{inner.name}")
        self._tick = 0
        self._posted: dict[int, _Paced] = {}
        self._held: deque[_Held] = deque()

    @property
    def inner(self) -> Transport:
        """The wrapped agent."""
        return self._inner

    @property
    def pace(self) -> Pace:
        """The pace this agent follows."""
        return self._pace

    def _draw(self, span: tuple[float, float]) -> float:
        low, high = span
        return low if low == high else self._rng.uniform(low, high)

    # -- Transport

    @property
    def name(self) -> str:
        """The wrapped agent's name."""
        return self._inner.name

    @property
    def capabilities(self) -> Capabilities:
        """The wrapped agent's capabilities: pacing removes none and adds none."""
        return self._inner.capabilities

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register through the inner agent."""
        self._inner.register_memory(regions)

    def get_agent_metadata(self) -> bytes:
        """The inner agent's metadata."""
        return self._inner.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        """Add a peer through the inner agent."""
        return self._inner.add_remote_agent(metadata)

    def remove_remote_agent(self, peer: str) -> None:
        """Forget a peer through the inner agent."""
        self._inner.remove_remote_agent(peer)

    def post(
        self,
        mode: TransferMode,
        descriptors: Sequence[Descriptor],
        *,
        peer: str,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Post through the inner agent (which validates everything); the notification waits for DONE.

        In pieces mode the inner agent gets the first piece now (every
        descriptor's first and last byte, so it refuses a bad one whole), the
        others one by one as checks find the last done.
        """
        first, *rest = _split(descriptors, self._pace.pieces)
        handle = self._inner.post(mode, first, peer=peer)
        polls = round(self._draw((float(self._pace.done_polls[0]), float(self._pace.done_polls[1]))))
        self._posted[id(handle)] = _Paced(
            handle=handle,
            peer=peer,
            notification=None if notification is None else bytes(notification),
            polls_left=polls,
            due_time=time.monotonic() + self._draw(self._pace.done_seconds),
            mode=mode,
            current=handle,
            rest=deque(rest),
        )
        return handle

    def _advance(self, state: _Paced) -> TransferStatus:
        """Check the inner transfer; DONE only when it is due, and then send its notification."""
        if state.final is not None:
            return state.final
        state.polls_left -= 1
        status = self._inner.check(state.current or state.handle)
        if status.state is TransferState.FAILED:
            state.final = status
            return status
        if status.state is TransferState.PENDING:
            return status
        if state.rest:
            return self._next_piece(state)
        if state.polls_left > 0 or time.monotonic() < state.due_time:
            return _PENDING
        state.final = status
        if state.notification is not None:
            note, state.notification = state.notification, None
            # Every byte is readable at the peer (inner DONE): the notification follows its data (DONE-1).
            # A peer gone by now would have lost it with any backend.
            with contextlib.suppress(TransportError):
                self._inner.send_notification(state.peer, note)
        return status

    def _next_piece(self, state: _Paced) -> TransferStatus:
        """The piece in flight is DONE: free its handle and post the next; PENDING, or FAILED if refused."""
        done, state.current = state.current, None
        if done is not None and done is not state.handle:
            self._inner.release(done)  # the caller's handle (the first piece's) is released by the caller
        try:
            state.current = self._inner.post(state.mode, state.rest.popleft(), peer=state.peer)
        except TransportError as exc:
            # The first piece checked every descriptor: only the link can refuse a later one (FAIL-1).
            state.rest.clear()
            state.final = TransferStatus(state=TransferState.FAILED, reason=exc.reason, detail=str(exc))
            return state.final
        return _PENDING

    def _progress(self) -> None:
        """A call that is not ``check``: transfers with a notification to send progress, as in a backend.

        Without it a caller that never checks (it waits for the peer's answer)
        would wait for a notification forever.
        """
        self._tick += 1
        for state in list(self._posted.values()):
            if state.final is None and state.notification is not None:
                # An error of the inner check belongs to the caller's own check of that handle, not to this call.
                with contextlib.suppress(TransportError):
                    self._advance(state)

    def check(self, handle: TransferHandle) -> TransferStatus:
        """PENDING until the inner transfer is DONE and the pace's calls and time have passed; FAILED at once."""
        state = self._posted.get(id(handle))
        if state is None:
            return self._inner.check(handle)  # unknown or released: the inner agent raises
        return self._advance(state)

    def release(self, handle: TransferHandle) -> None:
        """Release the inner handle at once (a PENDING one is cancelled, with its notification).

        In pieces mode the piece in flight is cancelled and no later one is posted.
        """
        state = self._posted.pop(id(handle), None)
        if state is not None and state.current is not None and state.current is not handle:
            state.rest.clear()
            self._inner.release(state.current)
        self._inner.release(handle)

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send through the inner agent, in order after every earlier send."""
        self._progress()
        self._inner.send_notification(peer, message)

    def get_notifications(self) -> Sequence[Notification]:
        """What arrived, each held for the pace's calls and time, delivered in arrival order."""
        self._progress()
        now = time.monotonic()
        for note in self._inner.get_notifications():
            polls = round(self._draw((float(self._pace.notify_polls[0]), float(self._pace.notify_polls[1]))))
            self._held.append(
                _Held(
                    notification=note, due_tick=self._tick + polls, due_time=now + self._draw(self._pace.notify_seconds)
                )
            )
        out: list[Notification] = []
        while self._held and self._held[0].due_tick <= self._tick and self._held[0].due_time <= now:
            out.append(self._held.popleft().notification)
        return out

    def close(self) -> None:
        """Close the inner agent; what is held is dropped with it."""
        self._posted.clear()
        self._held.clear()
        self._inner.close()


def _split(descriptors: Sequence[Descriptor], pieces: int) -> list[list[Descriptor]]:
    """``descriptors`` cut into up to ``pieces`` lists that together move the same bytes, each byte once.

    The first list holds every descriptor's first and last byte (a descriptor
    of fewer than three bytes, or an invalid one, whole), so a post of it
    checks every region and both ends of every range; the others split the
    bytes in between into runs of about equal size, in order.
    """
    if pieces <= 1:
        return [list(descriptors)]
    first: list[Descriptor] = []
    middle: list[Descriptor] = []
    for d in descriptors:
        if d.nbytes < 3:
            first.append(d)
            continue
        last = d.nbytes - 1
        first.append(attrs.evolve(d, nbytes=1))
        first.append(
            attrs.evolve(d, local_offset=d.local_offset + last, remote_offset=d.remote_offset + last, nbytes=1)
        )
        middle.append(
            attrs.evolve(d, local_offset=d.local_offset + 1, remote_offset=d.remote_offset + 1, nbytes=last - 1)
        )
    size = -(-sum(d.nbytes for d in middle) // (pieces - 1))  # ceil: at most pieces - 1 runs
    runs: list[list[Descriptor]] = []
    run: list[Descriptor] = []
    room = size
    for d in middle:
        while d.nbytes > 0:
            take = min(d.nbytes, room)
            run.append(attrs.evolve(d, nbytes=take))
            d = attrs.evolve(
                d, local_offset=d.local_offset + take, remote_offset=d.remote_offset + take, nbytes=d.nbytes - take
            )
            room -= take
            if room == 0:
                runs.append(run)
                run, room = [], size
    if run:
        runs.append(run)
    return [first, *runs]


class PacedBackend:
    """Wraps any :class:`Backend`; every agent it creates is a :class:`PacedTransport` of one :class:`Pace`."""

    def __init__(self, inner: Backend, pace: Pace | str) -> None:
        self._inner = inner
        self._pace = Pace.named(pace) if isinstance(pace, str) else pace
        if not isinstance(self._pace, Pace):
            raise ConfigError(f"PacedBackend.pace: expected a Pace or one of {', '.join(PACES)}, got {pace!r}")

    @property
    def inner(self) -> Backend:
        """The wrapped backend."""
        return self._inner

    @property
    def pace(self) -> Pace:
        """The pace every agent follows."""
        return self._pace

    @property
    def name(self) -> str:
        """The inner backend's name: pacing does not change what is tested."""
        return self._inner.name

    @property
    def capabilities(self) -> Capabilities:
        """The inner backend's capabilities."""
        return self._inner.capabilities

    def create_agent(self, name: str) -> PacedTransport:
        """Create an inner agent and pace it."""
        return PacedTransport(self._inner.create_agent(name), self._pace)

    def close(self) -> None:
        """Close the inner backend."""
        self._inner.close()


def paced(backend: Backend | str, pace: Pace | str, *, seed: int = 0, **options: object) -> PacedBackend:
    """``backend`` (a Backend, or a name for :func:`kvspec.transport.load_backend` with ``options``) paced.

    ``pace`` is a :class:`Pace` or ``"slow"``, ``"jitter"`` or ``"pieces"`` with ``seed``.
    """
    from kvspec.transport._registry import load_backend

    inner = load_backend(backend, **options) if isinstance(backend, str) else backend
    return PacedBackend(inner, Pace.named(pace, seed=seed) if isinstance(pace, str) else pace)
