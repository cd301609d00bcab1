"""The lifecycle of one request, per role: SM-1, SM-2, DONE-1, FAIL-1, REL-1.

What must live here
-------------------

This module is the lifecycle's definition; everything else only carries it out.
It holds, for each role (the producer P, SM-1; the consumer C, SM-2):

- its states, the events that can happen to it, and the actions a transition
  asks its driver for (:class:`ProducerState`, :class:`ConsumerEvent`, :class:`Action`...);
- ONE transition table per role (:data:`PRODUCER_TRANSITIONS`,
  :data:`CONSUMER_TRANSITIONS`), rows naming the modes they apply to, with an
  explicit *ignored* row for every event the role expects and drops (a late or
  duplicate message, a local call once the end is under way, everything in a
  terminal state, which is sticky);
- ONE deadline table per role (:data:`PRODUCER_DEADLINES`,
  :data:`CONSUMER_DEADLINES`), so that no non-terminal state waits for ever
  (FAIL-1), and the rule that picks the next one (:func:`get_next_deadline`);
- every guard that changes an outcome: which event may enter ``LOADED``
  (DONE-1), what a full prefix hit is, which blocks are freed, which reason
  and which blocks a failure names (FAIL-1), what the one release says (REL-1).

A state machine written anywhere else (a session, a driver, an engine, the
suite) imports its tables and guards from here, as h11's ``_state.py`` is the
one place h11's connection states are written. The sessions
(:class:`kvspec.ProducerSession`, :class:`kvspec.ConsumerSession`) hold a
request's state, build its messages and do the bookkeeping; they make no
decision of their own. The state diagrams of the spec pages are drawn from
these tables at build time.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Generic, Literal, TypeVar

import attrs

from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import (
    BlockAlignmentError,
    ConfigError,
    GroupCountError,
    IncompatiblePeerError,
    KVSpecError,
    TransportError,
    WindowCoverageError,
)
from kvspec.core._models import NULL_BLOCK_ID, BlockIds

__all__ = [
    "CONSUMER_DEADLINES",
    "CONSUMER_TRANSITIONS",
    "DEFAULT_DRAIN_TIMEOUT",
    "DEFAULT_RELEASE_GRACE",
    "LOADED_BY",
    "PRODUCER_DEADLINES",
    "PRODUCER_TRANSITIONS",
    "Action",
    "Anchor",
    "ConsumerEvent",
    "ConsumerState",
    "Deadline",
    "FailureInfo",
    "ProducerEvent",
    "ProducerState",
    "ReleaseOutcome",
    "Transition",
    "check_loaded_rows",
    "get_failed_consumer_block_ids",
    "get_failure_reason",
    "get_freed_block_ids",
    "get_next_deadline",
    "get_producer_failure_reason",
    "get_release_outcome",
    "is_prefix_hit",
]

DEFAULT_DRAIN_TIMEOUT = 5.0
"""Seconds a cancelled transfer may keep moving bytes; backends MUST stop within it (FAIL-1, the drain rule)."""

DEFAULT_RELEASE_GRACE = 10.0
"""Seconds past the lease a producer still waits for a release; above the consumer's drain timeout (FAIL-1)."""


# --------------------------------------------------------------------------- states, events, actions


class ProducerState(str, enum.Enum):
    """Where one producer request stands (SM-1). Blocks are pinned in every non-terminal state."""

    HELD = "held"  # pinned; READ: C may read; WRITE: waiting for C's offer
    WRITING = "writing"  # P's write is posted (WRITE)
    WRITTEN = "written"  # the write ended; Completion or Failure sent; waiting for the release
    ABORTING = "aborting"  # P gave up and sent Abort; C may still be reading
    CANCELLING = "cancelling"  # the write was cancelled (abort); draining
    EXPIRING = "expiring"  # the write was cancelled (lease); draining
    RELEASED = "released"  # terminal: C released; blocks freed
    EXPIRED = "expired"  # terminal: the lease ran out; blocks freed
    ABORTED = "aborted"  # terminal: aborted by either side; blocks freed

    @property
    def is_terminal(self) -> bool:
        """Blocks are freed on entering a terminal state, which is sticky (SM-1)."""
        return self in _PRODUCER_TERMINAL


_PRODUCER_TERMINAL_ORDER = (ProducerState.RELEASED, ProducerState.EXPIRED, ProducerState.ABORTED)
_PRODUCER_TERMINAL = frozenset(_PRODUCER_TERMINAL_ORDER)


class ProducerEvent(str, enum.Enum):
    """What can happen to a producer request (SM-1): a consumer message, a local call, or a deadline."""

    RELEASE = "release"
    OFFER = "offer"
    PEER_ABORT = "peer_abort"
    ABORT = "abort"
    TRANSFER_DONE = "transfer_done"
    TRANSFER_FAILED = "transfer_failed"
    LEASE_EXPIRED = "lease_expired"
    DRAIN_TIMEOUT = "drain_timeout"


class ConsumerState(str, enum.Enum):
    """Where one consumer request stands (SM-2)."""

    ALLOCATED = "allocated"  # blocks allocated, nothing in flight
    LOADING = "loading"  # READ: C's read is posted; WRITE: C's offer is out and P may write
    FAILING = "failing"  # failed while a transfer could still move bytes; draining (FAIL-1)
    ABORTING = "aborting"  # C gave up while a transfer could still move bytes; draining
    LOADED = "loaded"  # terminal: every paired byte is readable (DONE-1); C keeps its blocks
    FAILED = "failed"  # terminal: failed; FailureInfo says why and which blocks may be bad; blocks handed back
    ABORTED = "aborted"  # terminal: aborted by C; blocks handed back

    @property
    def is_terminal(self) -> bool:
        """A terminal state is entered once, sends the one release (REL-1), and is sticky."""
        return self in _CONSUMER_TERMINAL


_CONSUMER_TERMINAL_ORDER = (ConsumerState.LOADED, ConsumerState.FAILED, ConsumerState.ABORTED)
_CONSUMER_TERMINAL = frozenset(_CONSUMER_TERMINAL_ORDER)


class ConsumerEvent(str, enum.Enum):
    """What can happen to a consumer request (SM-2): a producer message, a local call, or a deadline."""

    START = "start"
    PREFIX_HIT = "prefix_hit"
    TRANSFER_DONE = "transfer_done"
    TRANSFER_FAILED = "transfer_failed"
    COMPLETION = "completion"
    FAILURE = "failure"
    PEER_ABORT = "peer_abort"
    ABORT = "abort"
    FAIL = "fail"
    TIMEOUT = "timeout"
    DRAIN_TIMEOUT = "drain_timeout"


class Action(str, enum.Enum):
    """What a transition asks the driver to do, in table order (SM-1, SM-2)."""

    POST = "post"
    CANCEL = "cancel"
    SEND_OFFER = "send_offer"
    SEND_ABORT = "send_abort"
    SEND_FAILURE = "send_failure"
    SEND_RELEASE = "send_release"
    FREE = "free"


_S = TypeVar("_S", ProducerState, ConsumerState)
_E = TypeVar("_E", ProducerEvent, ConsumerEvent)

_BOTH = frozenset({TransferMode.READ, TransferMode.WRITE})
_READ = frozenset({TransferMode.READ})
_WRITE = frozenset({TransferMode.WRITE})


@attrs.frozen(kw_only=True)
class Transition(Generic[_S, _E]):
    """One row of a role's transition table: in ``modes``, ``source`` --``event``--> ``target`` (SM-1, SM-2).

    An ``ignored`` row names an event the role expects and drops in that state
    (a late or duplicate message, a local call after the end): it changes
    nothing and asks for nothing. An event with no row at all is a driver bug
    and raises :class:`kvspec.LocalProtocolError`.
    """

    source: _S
    event: _E
    target: _S
    actions: tuple[Action, ...] = ()
    modes: frozenset[TransferMode] = _BOTH
    ignored: bool = False


def _rows(
    source: _S, modes: frozenset[TransferMode], *rows: tuple[_E | tuple[_E, ...], _S, tuple[Action, ...]]
) -> list[Transition[_S, _E]]:
    out: list[Transition[_S, _E]] = []
    for events, target, actions in rows:
        for event in events if isinstance(events, tuple) else (events,):
            out.append(Transition(source=source, event=event, target=target, actions=actions, modes=modes))
    return out


def _ignore(states: Iterable[_S], modes: frozenset[TransferMode], *events: _E) -> list[Transition[_S, _E]]:
    return [
        Transition(source=state, event=event, target=state, modes=modes, ignored=True)
        for state in states
        for event in events
    ]


P, PE, A = ProducerState, ProducerEvent, Action

# SM-1. READ: C reads P's HELD blocks and releases them; P frees on the release or at
# lease + grace, by when C's read has been cancelled and drained (SM-1, the lease rule).
# WRITE: C offers blocks, P writes and attaches the Completion; any P -> C message after
# the offer is sent only once P's write no longer moves bytes (SM-2, the drain rule).
PRODUCER_TRANSITIONS: tuple[Transition[ProducerState, ProducerEvent], ...] = tuple(
    _rows(
        P.HELD,
        _BOTH,
        (PE.RELEASE, P.RELEASED, (A.FREE,)),
        (PE.ABORT, P.ABORTING, (A.SEND_ABORT,)),
        (PE.LEASE_EXPIRED, P.EXPIRED, (A.FREE, A.SEND_FAILURE)),
    )
    + _rows(
        P.HELD,
        _WRITE,
        (PE.OFFER, P.WRITING, (A.POST,)),
        (PE.PEER_ABORT, P.ABORTED, (A.FREE, A.SEND_ABORT)),
    )
    + _rows(
        P.WRITING,
        _WRITE,
        (PE.TRANSFER_DONE, P.WRITTEN, ()),
        (PE.TRANSFER_FAILED, P.WRITTEN, (A.SEND_FAILURE,)),
        ((PE.RELEASE, PE.PEER_ABORT, PE.ABORT), P.CANCELLING, (A.CANCEL,)),
        (PE.LEASE_EXPIRED, P.EXPIRING, (A.CANCEL,)),
    )
    + _rows(
        P.WRITTEN,
        _WRITE,
        (PE.RELEASE, P.RELEASED, (A.FREE,)),
        (PE.ABORT, P.ABORTED, (A.FREE,)),
        (PE.LEASE_EXPIRED, P.EXPIRED, (A.FREE,)),
    )
    + _rows(
        P.ABORTING,
        _BOTH,
        ((PE.RELEASE, PE.LEASE_EXPIRED), P.ABORTED, (A.FREE,)),
    )
    + _rows(
        P.CANCELLING,
        _WRITE,
        ((PE.TRANSFER_DONE, PE.TRANSFER_FAILED, PE.DRAIN_TIMEOUT), P.ABORTED, (A.FREE, A.SEND_ABORT)),
    )
    + _rows(
        P.EXPIRING,
        _WRITE,
        ((PE.TRANSFER_DONE, PE.TRANSFER_FAILED, PE.DRAIN_TIMEOUT), P.EXPIRED, (A.FREE, A.SEND_FAILURE)),
    )
    # Ignored: late and duplicate consumer messages, a local abort once the end is under way,
    # a second report of a write already reported. Terminal states are sticky (SM-1, REL-1).
    + _ignore((P.HELD,), _READ, PE.PEER_ABORT)
    + _ignore((P.WRITING,), _WRITE, PE.OFFER)
    + _ignore((P.WRITTEN,), _WRITE, PE.OFFER, PE.PEER_ABORT, PE.TRANSFER_DONE, PE.TRANSFER_FAILED)
    + _ignore((P.ABORTING,), _READ, PE.PEER_ABORT, PE.ABORT)
    + _ignore((P.ABORTING,), _WRITE, PE.OFFER, PE.PEER_ABORT, PE.ABORT)
    + _ignore((P.CANCELLING, P.EXPIRING), _WRITE, PE.RELEASE, PE.OFFER, PE.PEER_ABORT, PE.ABORT)
    + _ignore(_PRODUCER_TERMINAL_ORDER, _READ, PE.RELEASE, PE.PEER_ABORT, PE.ABORT)
    + _ignore(
        _PRODUCER_TERMINAL_ORDER,
        _WRITE,
        PE.RELEASE,
        PE.OFFER,
        PE.PEER_ABORT,
        PE.ABORT,
        PE.TRANSFER_DONE,
        PE.TRANSFER_FAILED,
    )
)
"""The producer's transition table (SM-1), ignored events included."""

C, CE = ConsumerState, ConsumerEvent
_END = (A.FREE, A.SEND_RELEASE)

# SM-2. C's blocks are reusable (FREE) only once no transfer can touch them: READ: its own
# read ended or was cancelled and drained; WRITE: P confirmed (Completion, Failure, Abort)
# or the lease plus the drain bound passed (SM-2, the drain rule). Every terminal entry sends the one
# release (REL-1).
CONSUMER_TRANSITIONS: tuple[Transition[ConsumerState, ConsumerEvent], ...] = tuple(
    _rows(
        C.ALLOCATED,
        _BOTH,
        (CE.PREFIX_HIT, C.LOADED, (A.SEND_RELEASE,)),
        (CE.ABORT, C.ABORTED, _END),
        ((CE.FAIL, CE.TIMEOUT, CE.FAILURE, CE.PEER_ABORT), C.FAILED, _END),
    )
    + _rows(C.ALLOCATED, _READ, (CE.START, C.LOADING, (A.POST,)))
    + _rows(C.ALLOCATED, _WRITE, (CE.START, C.LOADING, (A.SEND_OFFER,)))
    + _rows(
        C.LOADING,
        _READ,
        (CE.TRANSFER_DONE, C.LOADED, (A.SEND_RELEASE,)),
        (CE.TRANSFER_FAILED, C.FAILED, _END),
        ((CE.FAILURE, CE.PEER_ABORT, CE.TIMEOUT, CE.FAIL), C.FAILING, (A.CANCEL,)),
        (CE.ABORT, C.ABORTING, (A.CANCEL,)),
    )
    + _rows(
        C.LOADING,
        _WRITE,
        (CE.COMPLETION, C.LOADED, (A.SEND_RELEASE,)),
        ((CE.FAILURE, CE.PEER_ABORT), C.FAILED, _END),
        ((CE.TIMEOUT, CE.FAIL), C.FAILING, (A.SEND_ABORT,)),
        (CE.ABORT, C.ABORTING, (A.SEND_ABORT,)),
    )
    + _rows(C.FAILING, _READ, ((CE.TRANSFER_DONE, CE.TRANSFER_FAILED), C.FAILED, _END))
    + _rows(C.FAILING, _WRITE, ((CE.COMPLETION, CE.FAILURE, CE.PEER_ABORT), C.FAILED, _END))
    + _rows(C.FAILING, _BOTH, (CE.DRAIN_TIMEOUT, C.FAILED, _END))
    + _rows(C.ABORTING, _READ, ((CE.TRANSFER_DONE, CE.TRANSFER_FAILED), C.ABORTED, _END))
    + _rows(C.ABORTING, _WRITE, ((CE.COMPLETION, CE.FAILURE, CE.PEER_ABORT), C.ABORTED, _END))
    + _rows(C.ABORTING, _BOTH, (CE.DRAIN_TIMEOUT, C.ABORTED, _END))
    # Ignored: late and duplicate producer messages, local calls once the end is under way,
    # a second report of a read already reported. Terminal states are sticky (SM-2, REL-1).
    + _ignore((C.ALLOCATED,), _WRITE, CE.COMPLETION)
    + _ignore((C.FAILING, C.ABORTING), _READ, CE.FAILURE, CE.PEER_ABORT, CE.ABORT, CE.FAIL)
    + _ignore((C.FAILING, C.ABORTING), _WRITE, CE.ABORT, CE.FAIL)
    + _ignore(
        _CONSUMER_TERMINAL_ORDER,
        _READ,
        CE.START,
        CE.PREFIX_HIT,
        CE.TRANSFER_DONE,
        CE.TRANSFER_FAILED,
        CE.FAILURE,
        CE.PEER_ABORT,
        CE.ABORT,
        CE.FAIL,
    )
    + _ignore(
        _CONSUMER_TERMINAL_ORDER,
        _WRITE,
        CE.START,
        CE.PREFIX_HIT,
        CE.COMPLETION,
        CE.FAILURE,
        CE.PEER_ABORT,
        CE.ABORT,
        CE.FAIL,
    )
)
"""The consumer's transition table (SM-2), ignored events included."""


Anchor = Literal["lease", "entered", "started"]
"""What a deadline counts from: the lease deadline, entering the state, or C's start (FAIL-1)."""


@attrs.frozen(kw_only=True)
class Deadline(Generic[_S, _E]):
    """In ``state`` (in ``modes``), ``event`` fires at ``anchor`` plus (or, ``minus``, less) a setting (FAIL-1).

    ``anchor``: the lease deadline of the transfer parameters, the time the
    state was entered, or the time the consumer started; ``setting`` names
    the session's duration (``release_grace``, ``drain_timeout``,
    ``start_margin``, ``transfer_timeout``; a setting that is ``None`` turns
    the row off). The earliest row of a state wins, the first on a tie.
    """

    state: _S
    event: _E
    anchor: Anchor
    setting: str | None = None
    minus: bool = False
    reason: FailureReason | None = None
    modes: frozenset[TransferMode] = _BOTH


PRODUCER_DEADLINES: tuple[Deadline[ProducerState, ProducerEvent], ...] = (
    # SM-1, the lease rule: in READ, C's read may still be cancelling at the lease; P waits the grace.
    Deadline(state=P.HELD, event=PE.LEASE_EXPIRED, anchor="lease", setting="release_grace", modes=_READ),
    # WRITE: P never posts, and cancels its write, at the lease (SM-2, the drain rule).
    Deadline(state=P.HELD, event=PE.LEASE_EXPIRED, anchor="lease", modes=_WRITE),
    Deadline(state=P.WRITING, event=PE.LEASE_EXPIRED, anchor="lease", modes=_WRITE),
    Deadline(state=P.WRITTEN, event=PE.LEASE_EXPIRED, anchor="lease", setting="release_grace", modes=_WRITE),
    Deadline(state=P.ABORTING, event=PE.LEASE_EXPIRED, anchor="lease", setting="release_grace"),
    Deadline(state=P.CANCELLING, event=PE.DRAIN_TIMEOUT, anchor="entered", setting="drain_timeout", modes=_WRITE),
    Deadline(state=P.EXPIRING, event=PE.DRAIN_TIMEOUT, anchor="entered", setting="drain_timeout", modes=_WRITE),
)
"""When each non-terminal producer state gives up waiting (SM-1, FAIL-1)."""

_LEASE = FailureReason.LEASE_EXPIRED

CONSUMER_DEADLINES: tuple[Deadline[ConsumerState, ConsumerEvent], ...] = (
    # SM-1, the lease rule: never start a transfer that could outlive P's pin.
    Deadline(state=C.ALLOCATED, event=CE.TIMEOUT, anchor="lease", setting="start_margin", minus=True, reason=_LEASE),
    Deadline(state=C.LOADING, event=CE.TIMEOUT, anchor="lease", reason=_LEASE),
    Deadline(
        state=C.LOADING, event=CE.TIMEOUT, anchor="started", setting="transfer_timeout", reason=FailureReason.TIMEOUT
    ),
    # READ: C's own cancelled read stops within the drain bound.
    Deadline(state=C.FAILING, event=CE.DRAIN_TIMEOUT, anchor="entered", setting="drain_timeout", modes=_READ),
    Deadline(state=C.ABORTING, event=CE.DRAIN_TIMEOUT, anchor="entered", setting="drain_timeout", modes=_READ),
    # WRITE, SM-2 the drain rule: P cancels its write by the lease deadline and it stops within the drain bound.
    Deadline(state=C.FAILING, event=CE.DRAIN_TIMEOUT, anchor="lease", setting="drain_timeout", modes=_WRITE),
    Deadline(state=C.ABORTING, event=CE.DRAIN_TIMEOUT, anchor="lease", setting="drain_timeout", modes=_WRITE),
)
"""When each non-terminal consumer state gives up waiting (SM-2, FAIL-1)."""

del P, PE, C, CE, A, _LEASE

# --------------------------------------------------------------------------- guards


def get_next_deadline(
    rows: Sequence[Deadline[_S, _E]], settings: object, anchors: Mapping[str, float]
) -> tuple[float, Deadline[_S, _E]] | None:
    """The deadline due first among one state's ``rows``, and when; ``None`` when every row is off (FAIL-1).

    A row's time is its anchor (``anchors``: ``lease``, ``entered``,
    ``started``) plus, or with ``minus`` less, the duration its ``setting``
    names on ``settings`` (a session); a setting that is ``None`` turns the
    row off. The earliest row wins, the first on a tie.
    """
    best: tuple[float, Deadline[_S, _E]] | None = None
    for row in rows:
        value = 0.0 if row.setting is None else getattr(settings, row.setting)
        if value is None:
            continue
        at = anchors[row.anchor] + (-value if row.minus else value)
        if best is None or at < best[0]:
            best = (at, row)
    return best


def get_freed_block_ids(block_ids: BlockIds) -> BlockIds:
    """The blocks a terminal state frees: the request's own, the null block left out (SM-1, SM-2, NULL-1).

    The null block belongs to no request and is never freed.
    """
    return BlockIds([[b for b in group if b != NULL_BLOCK_ID] for group in block_ids])


def is_prefix_hit(consumer_block_ids: BlockIds) -> bool:
    """True when C holds no block to load (zero groups, or only null ids): a full prefix hit (SM-2).

    ``start`` then fires ``prefix_hit`` instead of ``start``: nothing moves
    and the request goes straight to ``LOADED``.
    """
    return all(b == NULL_BLOCK_ID for group in consumer_block_ids for b in group)


LOADED_BY: Mapping[TransferMode, ConsumerEvent] = {
    TransferMode.READ: ConsumerEvent.TRANSFER_DONE,
    TransferMode.WRITE: ConsumerEvent.COMPLETION,
}
"""The one event that takes a started consumer request to ``LOADED``, per mode (DONE-1).

READ: C's own read reported DONE; WRITE: P's Completion, which travels as the
write's notification and so arrives after the data.
"""


def check_loaded_rows(table: Iterable[Transition[ConsumerState, ConsumerEvent]]) -> None:
    """Raise :class:`ConfigError` for a row that enters ``LOADED`` on anything but DONE (DONE-1).

    Only ``LOADING`` on its mode's :data:`LOADED_BY` event, or ``ALLOCATED``
    on a full prefix hit, may enter ``LOADED``; a DONE that comes once C gave
    up (``FAILING``, ``ABORTING``) does not revive the request.
    """
    for row in table:
        if row.ignored or row.target is not ConsumerState.LOADED:
            continue
        for mode in sorted(row.modes, key=lambda m: m.value):
            allowed = {
                (ConsumerState.LOADING, LOADED_BY[mode]),
                (ConsumerState.ALLOCATED, ConsumerEvent.PREFIX_HIT),
            }
            if (row.source, row.event) not in allowed:
                raise ConfigError(
                    f"consumer table: {row.source.name} --{row.event.value}--> LOADED in {mode.value} mode; "
                    f"expected only LOADING --{LOADED_BY[mode].value}--> LOADED or a prefix hit (DONE-1)"
                )


@attrs.frozen(kw_only=True)
class FailureInfo:
    """Why a consumer request failed and which of its blocks may hold bad bytes (FAIL-1)."""

    reason: FailureReason
    failed_consumer_block_ids: BlockIds
    detail: str = ""


def get_failed_consumer_block_ids(named: BlockIds | None, consumer_block_ids: BlockIds) -> BlockIds:
    """The consumer blocks a failure names: all of C's blocks unless P's ``Failure`` names some (FAIL-1).

    ``named`` is what the failure's source said (``None``, or zero groups:
    it named none, so every block may be bad).
    """
    return consumer_block_ids if named is None or len(named) == 0 else named


def get_producer_failure_reason(state: ProducerState, reason: FailureReason | None) -> FailureReason:
    """The reason P's ``Failure`` carries: ``lease_expired`` on expiry or with no reason, else its write's (FAIL-1)."""
    if state is ProducerState.EXPIRED or reason is None:
        return FailureReason.LEASE_EXPIRED
    return reason


def get_failure_reason(error: KVSpecError, default: FailureReason = FailureReason.PROTOCOL) -> FailureReason:
    """The reason a request fails with when a check or the transport raises ``error`` (FAIL-1).

    A window-coverage or alignment check names its own reason, a transport
    error carries one, an incompatible peer is ``incompatible_peer``
    (HS-1); anything else is ``default`` (FAIL-1).
    """
    if isinstance(error, WindowCoverageError):
        return FailureReason.WINDOW_COVERAGE
    if isinstance(error, (BlockAlignmentError, GroupCountError)):
        return FailureReason.BLOCK_ALIGNMENT
    if isinstance(error, TransportError):
        return error.reason
    if isinstance(error, IncompatiblePeerError):
        return FailureReason.INCOMPATIBLE_PEER
    return default


class ReleaseOutcome(str, enum.Enum):
    """How the consumer's request ended; carried by its one ``Release`` (REL-1)."""

    LOADED = "loaded"
    PREFIX_HIT = "prefix_hit"
    FAILED = "failed"
    ABORTED = "aborted"


def get_release_outcome(state: ConsumerState, event: ConsumerEvent) -> ReleaseOutcome:
    """What the one release says, sent on entering terminal ``state`` by ``event`` (REL-1).

    A full prefix hit says ``prefix_hit``; otherwise the terminal state names it (REL-1).
    """
    if event is ConsumerEvent.PREFIX_HIT:
        return ReleaseOutcome.PREFIX_HIT
    outcomes = {
        ConsumerState.LOADED: ReleaseOutcome.LOADED,
        ConsumerState.FAILED: ReleaseOutcome.FAILED,
        ConsumerState.ABORTED: ReleaseOutcome.ABORTED,
    }
    if state not in outcomes:
        raise ConfigError(f"release: expected a terminal consumer state, got {state.value}")
    return outcomes[state]
