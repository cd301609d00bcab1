"""Stateful property tests of each role alone, against an arbitrary (even misbehaving) peer and a late driver.

The peer sends any message at any time: right or wrong request id, wrong
direction, wrong mode, duplicates, conflicting offers. The driver reports
transfers late or never and lets the clock jump past several deadlines.
Several requests run at once on one clock. Each session must still keep its
own promises:

- the producer frees exactly once, only in a terminal state, never while its
  own write is in flight, never posts at or after the lease deadline, and sends
  nothing to the consumer while its write is in flight (SM-1, the drain rule);
- the consumer sends exactly one release, never hands back blocks while its own
  read is in flight, never starts past its start deadline, and in WRITE mode
  hands back offered blocks only after a producer message or at
  ``lease + drain`` (SM-2, REL-1, the drain rule);
- every call either succeeds or raises exactly the protocol error the spec
  names for it, leaving the session unchanged.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvspec import (
    Abort,
    BlockIds,
    BlockOffer,
    Completion,
    ConsumerSession,
    ConsumerState,
    Failure,
    FailureReason,
    LocalProtocolError,
    Output,
    ProducerSession,
    Release,
    ReleaseOutcome,
    RemoteProtocolError,
    TransferMode,
)

LEASE, GRACE, DRAIN, MARGIN = 10.0, 3.0, 2.0, 1.0
P_IDS = BlockIds([[1, 2, 3], [0, 4]])
C_IDS = BlockIds([[11, 12], [13]])
pick = st.integers(0, 15)
times = st.sampled_from([0.1, 0.3, 0.5, 1.0, 2.0, 3.0, 7.0])
rarely = st.integers(0, 5).map(lambda n: n == 0)


@attrs.define
class Sim:
    """A transfer as the backend sees it: in flight until it ends or its cancel drains."""

    pending: bool = True
    cancelled_at: float | None = None
    reported: bool = False
    ok: bool = True

    def settle(self, now: float) -> None:
        if self.pending and self.cancelled_at is not None and now >= self.cancelled_at + DRAIN:
            self.pending, self.ok = False, False


_REFUSALS = (
    r"already started|has no posted transfer to report on|is only sent in WRITE mode"
    r"|reached (producer|consumer) request|Completion from engine|does not accept|a second, different BlockOffer"
)


def _expect(error: type[Exception] | None, call: Any) -> Output | None:
    if error is None:
        out: Output = call()
        return out
    # Every refusal the machines provoke says which rule of the table it broke (SM-1, SM-2).
    with pytest.raises(error, match=_REFUSALS):
        call()
    return None


def _run_clock_out(session: ProducerSession | ConsumerSession, sim: Sim | None, apply: Any, now: float) -> float:
    # A deadline reached late may start another (a cancel's drain), never a third.
    for _ in range(3):
        deadline = session.next_deadline
        if deadline is None:
            break
        now = max(now, deadline)
        if sim is not None:
            sim.settle(now)
        apply(session.tick(now=now), now)
    return now


# --------------------------------------------------------------------------- producer


@attrs.define(eq=False)
class ProducerRequest:
    p: ProducerSession
    write: Sim | None = None
    frees: int = 0

    def apply(self, out: Output | None, now: float) -> None:
        if out is None:
            return
        writing = self.write is not None and self.write.pending
        assert not (out.send and writing), "P told C something while its write still moves bytes"
        if out.post:
            assert self.write is None, "at most one write per request"
            assert now < self.p.params.lease_deadline, "a write posted at or after the lease deadline"
            assert self.p.mode is TransferMode.WRITE
            self.write = Sim()
        if out.cancel:
            assert self.write is not None
            if self.write.cancelled_at is None:
                self.write.cancelled_at = now
        if out.free is not None:
            assert not writing, "P freed blocks under its own write (SM-1)"
            assert self.p.is_terminal
            assert out.free == BlockIds([[1, 2, 3], [4]])
            self.frees += 1


class ProducerAlone(RuleBasedStateMachine):
    """Producer sessions against an arbitrary consumer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.requests: list[ProducerRequest] = []

    def _pick(self, index: int) -> ProducerRequest:
        return self.requests[index % len(self.requests)]

    @precondition(lambda self: sum(not r.p.is_terminal for r in self.requests) < 3)
    @rule(mode=st.sampled_from(TransferMode))
    def new_request(self, mode: TransferMode) -> None:
        session = ProducerSession.create(
            request_id=f"r{len(self.requests)}",
            producer_engine_id="P",
            producer_block_ids=P_IDS,
            num_tokens=40,
            mode=mode,
            now=self.now,
            lease_duration=LEASE,
            release_grace=GRACE,
            drain_timeout=DRAIN,
        )
        self.requests.append(ProducerRequest(p=session))

    @precondition(lambda self: self.requests)
    @rule(
        index=pick,
        kind=st.sampled_from(["release", "offer", "offer", "offer", "other_offer", "abort", "completion"]),
        other_request=rarely,
    )
    def peer_sends(self, index: int, kind: str, other_request: bool) -> None:
        request = self._pick(index)
        p = request.p
        request_id = "elsewhere" if other_request else p.params.request_id
        message: Any = {
            "release": Release(request_id=request_id, consumer_engine_id="C", outcome=ReleaseOutcome.LOADED),
            "offer": BlockOffer(request_id=request_id, consumer_engine_id="C", consumer_block_ids=C_IDS),
            "other_offer": BlockOffer(request_id=request_id, consumer_engine_id="C", consumer_block_ids=[[9], [8]]),
            "abort": Abort(request_id=request_id, engine_id="C"),
            "completion": Completion(request_id=request_id, producer_engine_id="P"),
        }[kind]
        offer = kind in ("offer", "other_offer")
        conflicting = p.offer is not None and p.offer != message
        error: type[Exception] | None = None
        if other_request or kind == "completion" or (offer and (p.mode is TransferMode.READ or conflicting)):
            error = RemoteProtocolError
        state = p.state
        out = _expect(error, lambda: p.receive(message, now=self.now))
        if error is not None:
            assert p.state is state, "a protocol error must leave the session unchanged"
        request.apply(out, self.now)

    @precondition(lambda self: self.requests)
    @rule(index=pick, kind=st.sampled_from(["write_ok", "write_ok", "write_fails", "report", "report", "abort"]))
    def local_event(self, index: int, kind: str) -> None:
        """The write ends, the driver reports it, or the engine aborts (weighted: aborts end requests early)."""
        request = self._pick(index)
        write = request.write
        if kind == "abort":
            request.apply(request.p.abort(now=self.now), self.now)
        elif kind == "report":
            if write is None:
                # Nothing was posted: reporting is the driver's bug.
                request.apply(_expect(LocalProtocolError, lambda: request.p.transfer_done(now=self.now)), self.now)
            elif not write.pending and not write.reported:
                write.reported = True
                if write.ok:
                    request.apply(request.p.transfer_done(now=self.now), self.now)
                else:
                    request.apply(request.p.transfer_failed(FailureReason.TRANSFER_ERROR, now=self.now), self.now)
        elif write is not None and write.pending:
            write.pending, write.ok = False, kind == "write_ok"

    @rule(dt=times)
    def time_jumps(self, dt: float) -> None:
        # A late driver: the clock may jump past several deadlines at once.
        self.now += dt
        for request in self.requests:
            if request.write is not None:
                request.write.settle(self.now)
            request.apply(request.p.tick(now=self.now), self.now)

    @invariant()
    def frees_at_most_once(self) -> None:
        for request in self.requests:
            assert request.frees == (1 if request.p.is_terminal else 0)

    def teardown(self) -> None:
        for request in self.requests:
            _run_clock_out(request.p, request.write, request.apply, self.now)
            assert request.p.is_terminal, request.p
            assert request.frees == 1


# --------------------------------------------------------------------------- consumer


@attrs.define(eq=False)
class ConsumerRequest:
    c: ConsumerSession
    read: Sim | None = None
    offered: bool = False
    confirmed: bool = False
    releases: int = 0
    frees: int = 0

    @property
    def lease(self) -> float:
        return self.c.params.lease_deadline

    def apply(self, out: Output | None, now: float) -> None:
        if out is None:
            return
        reading = self.read is not None and self.read.pending
        for message in out.send:
            if isinstance(message, Release):
                self.releases += 1
            if isinstance(message, BlockOffer):
                assert now < self.lease - MARGIN, "an offer past the start deadline"
                self.offered = True
        if out.post:
            assert self.read is None, "at most one read per request"
            assert self.c.mode is TransferMode.READ
            assert now < self.lease - MARGIN, "a read posted past the start deadline"
            self.read = Sim()
        if out.cancel:
            assert self.read is not None
            if self.read.cancelled_at is None:
                self.read.cancelled_at = now
        if out.free is not None:
            assert not reading, "C handed back blocks under its own read (SM-2)"
            if self.c.mode is TransferMode.WRITE and self.offered:
                assert self.confirmed or now >= self.lease + DRAIN, "C handed back offered blocks unconfirmed"
            assert self.c.state in (ConsumerState.FAILED, ConsumerState.ABORTED)
            self.frees += 1


class ConsumerAlone(RuleBasedStateMachine):
    """Consumer sessions against an arbitrary producer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.requests: list[ConsumerRequest] = []

    def _pick(self, index: int) -> ConsumerRequest:
        return self.requests[index % len(self.requests)]

    @precondition(lambda self: sum(not r.c.is_terminal for r in self.requests) < 3)
    @rule(mode=st.sampled_from(TransferMode), prefix_hit=rarely)
    def new_request(self, mode: TransferMode, prefix_hit: bool) -> None:
        params = ProducerSession.create(
            request_id=f"r{len(self.requests)}",
            producer_engine_id="P",
            producer_block_ids=P_IDS,
            num_tokens=40,
            mode=mode,
            now=self.now,
            lease_duration=LEASE,
        ).params
        session = ConsumerSession(
            params=params,
            consumer_engine_id="C",
            consumer_block_ids=BlockIds([]) if prefix_hit else C_IDS,
            start_margin=MARGIN,
            drain_timeout=DRAIN,
        )
        self.requests.append(ConsumerRequest(c=session))

    @precondition(lambda self: self.requests)
    @rule(index=pick)
    def start(self, index: int) -> None:
        request = self._pick(index)
        c = request.c
        busy = c.state in (ConsumerState.LOADING, ConsumerState.FAILING, ConsumerState.ABORTING)
        out = _expect(LocalProtocolError if busy else None, lambda: c.start(now=self.now))
        request.apply(out, self.now)

    @precondition(lambda self: self.requests)
    @rule(
        index=pick,
        kind=st.sampled_from(["completion", "completion", "failure", "abort", "release", "stranger"]),
        other_request=rarely,
    )
    def peer_sends(self, index: int, kind: str, other_request: bool) -> None:
        request = self._pick(index)
        c = request.c
        request_id = "elsewhere" if other_request else c.params.request_id
        message: Any = {
            "completion": Completion(request_id=request_id, producer_engine_id="P"),
            "failure": Failure(request_id=request_id, producer_engine_id="P", reason=FailureReason.TIMEOUT),
            "abort": Abort(request_id=request_id, engine_id="P"),
            "release": Release(request_id=request_id, consumer_engine_id="C", outcome=ReleaseOutcome.LOADED),
            "stranger": Completion(request_id=request_id, producer_engine_id="Q"),
        }[kind]
        error: type[Exception] | None = None
        read_completion = kind == "completion" and c.mode is TransferMode.READ
        if other_request or kind in ("release", "stranger") or read_completion:
            error = RemoteProtocolError
        state = c.state
        out = _expect(error, lambda: c.receive(message, now=self.now))
        if error is not None:
            assert c.state is state, "a protocol error must leave the session unchanged"
        elif request.offered:
            request.confirmed = True
        request.apply(out, self.now)

    @precondition(lambda self: self.requests)
    @rule(index=pick, kind=st.sampled_from(["read_ok", "read_ok", "read_fails", "report", "report", "abort", "fail"]))
    def local_event(self, index: int, kind: str) -> None:
        """The read ends, the driver reports it, or the engine gives up (weighted: those end requests early)."""
        request = self._pick(index)
        c, read = request.c, request.read
        if kind == "abort":
            request.apply(c.abort(now=self.now), self.now)
        elif kind == "fail":
            request.apply(c.fail(FailureReason.WINDOW_COVERAGE, now=self.now), self.now)
        elif kind == "report":
            if read is None:
                request.apply(_expect(LocalProtocolError, lambda: c.transfer_done(now=self.now)), self.now)
            elif not read.pending and not read.reported:
                read.reported = True
                if read.ok:
                    request.apply(c.transfer_done(now=self.now), self.now)
                else:
                    request.apply(c.transfer_failed(FailureReason.TRANSFER_ERROR, now=self.now), self.now)
        elif read is not None and read.pending:
            read.pending, read.ok = False, kind == "read_ok"

    @rule(dt=times)
    def time_jumps(self, dt: float) -> None:
        self.now += dt
        for request in self.requests:
            if request.read is not None:
                request.read.settle(self.now)
            request.apply(request.c.tick(now=self.now), self.now)

    @invariant()
    def one_release_iff_terminal(self) -> None:
        for request in self.requests:
            assert request.releases == (1 if request.c.is_terminal else 0)
            assert request.frees <= 1

    def teardown(self) -> None:
        for request in self.requests:
            _run_clock_out(request.c, request.read, request.apply, self.now)
            assert request.c.is_terminal, request.c
            assert request.releases == 1, "exactly one release per consumer request (REL-1)"


_BUDGET = settings(settings.default, max_examples=3 * settings().max_examples // 2)
TestProducerAlone = ProducerAlone.TestCase
TestProducerAlone.settings = _BUDGET
TestConsumerAlone = ConsumerAlone.TestCase
TestConsumerAlone.settings = _BUDGET


# --------------------------------------------------------------------------- the machines can fail


def _mutant_frees_on_abort_mid_write(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvspec.protocol._session as s

    row = s.Transition(
        source=s.ProducerState.WRITING,
        event=s.ProducerEvent.ABORT,
        target=s.ProducerState.ABORTED,
        actions=(s.Action.FREE, s.Action.SEND_ABORT),
        modes=frozenset({TransferMode.WRITE}),
    )
    monkeypatch.setitem(s._PRODUCER_INDEX, (TransferMode.WRITE, row.source, row.event), row)


def _mutant_frees_on_abort_mid_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvspec.protocol._session as s

    row = s.Transition(
        source=s.ConsumerState.LOADING,
        event=s.ConsumerEvent.ABORT,
        target=s.ConsumerState.ABORTED,
        actions=(s.Action.FREE, s.Action.SEND_RELEASE),
        modes=frozenset({TransferMode.READ}),
    )
    monkeypatch.setitem(s._CONSUMER_INDEX, (TransferMode.READ, row.source, row.event), row)


def _mutant_short_quarantine(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvspec.protocol._session as s

    due = s.ConsumerSession._due

    def short(self: ConsumerSession) -> Any:
        found = due(self)
        if found is not None and found[1] is s.ConsumerEvent.DRAIN_TIMEOUT:
            return self._entered_at + self.drain_timeout, found[1], found[2]
        return found

    monkeypatch.setattr(s.ConsumerSession, "_due", short)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mutant", "machine"),
    [
        (_mutant_frees_on_abort_mid_write, ProducerAlone),
        (_mutant_frees_on_abort_mid_read, ConsumerAlone),
        (_mutant_short_quarantine, ConsumerAlone),
    ],
)
def test_the_machines_catch_broken_sessions(mutant: Any, machine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    mutant(monkeypatch)
    # Whichever invariant fires first, the failure is the machine's: its reproducer names the machine.
    with pytest.raises(AssertionError, match=rf"state = {machine.__name__}\(\)"):
        run_state_machine_as_test(machine, settings=settings(max_examples=300, deadline=None, print_blob=False))
