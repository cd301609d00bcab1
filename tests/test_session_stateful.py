"""Stateful property tests: a producer and a consumer session over a lossy network and a simulated transport.

Hypothesis interleaves messages (delivered in any order, duplicated or
dropped), transfer completions and failures, hung transfers, aborts on both
sides, local failures and the clock. A small simulated backend keeps the
backend's side of the contract: a transfer moves bytes until it is DONE,
FAILED or, once cancelled, at most ``DRAIN`` seconds later (DRAIN-1). Drivers
are punctual: the clock never jumps past a session's next deadline without
ticking it (what ``next_deadline`` is for).

Checked after every step and at the end:

- P frees its blocks exactly once, in a terminal state, and never while a
  transfer that touches them is in flight (SM-1);
- C's blocks are handed back only when no transfer can write into them
  (SM-2, DRAIN-1);
- every C request ends in exactly one terminal state and sends exactly one
  release (REL-1); both sides terminate once the clock has run (FAIL-1).
"""

from __future__ import annotations

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvspec import (
    BlockIds,
    Completion,
    ConsumerSession,
    FailureReason,
    Output,
    ProducerSession,
    Release,
    TransferMode,
    decode,
    encode,
)

LEASE, GRACE, DRAIN = 10.0, 3.0, 2.0
P_IDS = BlockIds([[1, 2, 3], [0, 4]])
C_IDS = BlockIds([[11, 12], [13]])


@attrs.define
class SimTransfer:
    """One posted transfer as the backend sees it."""

    owner: str  # "p" (WRITE) or "c" (READ)
    state: str = "pending"  # pending -> done | failed | stopped
    cancelled_at: float | None = None
    reported: bool = False
    notification: Completion | None = None

    @property
    def in_flight(self) -> bool:
        return self.state == "pending"


class Exchange(RuleBasedStateMachine):
    """One request between a producer and a consumer session."""

    @initialize(
        mode=st.sampled_from(TransferMode),
        prefix_hit=st.integers(0, 4).map(lambda n: n == 0),
        start_margin=st.sampled_from([0.0, 1.0]),
        transfer_timeout=st.sampled_from([None, 1.5, 4.0]),
        start_now=st.integers(0, 3).map(lambda n: n > 0),
    )
    def setup(
        self,
        mode: TransferMode,
        prefix_hit: bool,
        start_margin: float,
        transfer_timeout: float | None,
        start_now: bool,
    ) -> None:
        self.now = 0.0
        self.mode = mode
        self.p = ProducerSession.create(
            request_id="r1",
            producer_engine_id="P",
            producer_block_ids=P_IDS,
            num_tokens=40,
            mode=mode,
            now=0.0,
            lease_duration=LEASE,
            release_grace=GRACE,
            drain_timeout=DRAIN,
        )
        params = decode(encode(self.p.params))
        assert params == self.p.params
        self.c = ConsumerSession(
            params=self.p.params,
            consumer_engine_id="C",
            consumer_block_ids=BlockIds([]) if prefix_hit else C_IDS,
            start_margin=start_margin,
            transfer_timeout=transfer_timeout,
            drain_timeout=DRAIN,
        )
        self.to_p: list[bytes] = []
        self.to_c: list[bytes] = []
        self.transfer: SimTransfer | None = None
        self.started = False
        self.p_frees: list[BlockIds] = []
        self.c_frees: list[BlockIds] = []
        self.releases: list[Release] = []
        self.c_terminal_entries = 0
        self.p_terminal_entries = 0
        self.broken = False
        if start_now:
            # Most runs start at once, so that transfers are in flight when the chaos begins.
            self.start_consumer()

    # ----------------------------------------------------------------- applying outputs

    def _apply(self, role: str, out: Output) -> None:
        # Mark the run broken until the output is checked, so teardown does not mask the first failure.
        self.broken = True
        for step in out.steps:
            if step.target.is_terminal:
                if role == "c":
                    self.c_terminal_entries += 1
                else:
                    self.p_terminal_entries += 1
        for message in out.send:
            data = encode(message)
            if role == "p":
                self.to_c.append(data)
            else:
                if isinstance(message, Release):
                    self.releases.append(message)
                self.to_p.append(data)
        if out.post:
            assert self.transfer is None, "a request posts at most one transfer"
            owner_is_p = self.mode is TransferMode.WRITE
            assert (role == "p") == owner_is_p
            self.transfer = SimTransfer(owner=role, notification=out.notification)
            if owner_is_p:
                assert out.notification == self.p.completion
        if out.cancel:
            assert self.transfer is not None
            assert self.transfer.owner == role
            if self.transfer.cancelled_at is None:
                self.transfer.cancelled_at = self.now
        if out.free is not None:
            # SM-1 / SM-2: nothing may still be moving bytes into or out of blocks handed back.
            assert self.transfer is None or not self.transfer.in_flight, f"{role} freed blocks mid-transfer"
            if role == "p":
                assert self.p.is_terminal
                assert out.free == BlockIds([[1, 2, 3], [4]])
                self.p_frees.append(out.free)
            else:
                assert self.c.state.name in ("FAILED", "ABORTED")
                self.c_frees.append(out.free)
        self.broken = False

    def _finish_transfer(self, state: str) -> None:
        assert self.transfer is not None
        self.transfer.state = state
        if state == "done" and self.transfer.notification is not None:
            # The backend delivers the post's notification only after the data (DONE-1).
            self.to_c.append(encode(self.transfer.notification))

    def _stop_overdue(self) -> None:
        t = self.transfer
        if t is not None and t.in_flight and t.cancelled_at is not None and t.cancelled_at + DRAIN <= self.now:
            t.state = "stopped"  # the backend's drain bound (DRAIN-1)

    def _deadlines(self) -> list[float]:
        found = [d for d in (self.p.next_deadline, self.c.next_deadline) if d is not None]
        t = self.transfer
        if t is not None and t.in_flight and t.cancelled_at is not None:
            found.append(t.cancelled_at + DRAIN)
        return found

    def _tick_all(self) -> None:
        self._stop_overdue()
        self._apply("p", self.p.tick(now=self.now))
        self._apply("c", self.c.tick(now=self.now))
        self._stop_overdue()

    # ----------------------------------------------------------------- rules

    @precondition(lambda self: not self.started)
    @rule()
    def start_consumer(self) -> None:
        self.started = True
        self._apply("c", self.c.start(now=self.now))

    @precondition(lambda self: self.to_p or self.to_c)
    @rule(to_producer=st.booleans(), index=st.integers(0, 10), keep=st.integers(0, 3).map(lambda n: n == 0))
    def deliver(self, to_producer: bool, index: int, keep: bool) -> None:
        """Deliver one message in any order; ``keep`` leaves a copy behind to be delivered again."""
        role = "p" if (to_producer and self.to_p) or not self.to_c else "c"
        queue = self.to_p if role == "p" else self.to_c
        data = queue[index % len(queue)] if keep else queue.pop(index % len(queue))
        session = self.p if role == "p" else self.c
        self._apply(role, session.receive(decode(data), now=self.now))

    @precondition(lambda self: self.to_p or self.to_c)
    @rule(index=st.integers(0, 10), to_producer=st.booleans())
    def drop_message(self, index: int, to_producer: bool) -> None:
        queue = self.to_p if (to_producer and self.to_p) or not self.to_c else self.to_c
        queue.pop(index % len(queue))

    @precondition(lambda self: self.transfer is not None and self.transfer.in_flight)
    @rule(ok=st.integers(0, 3).map(lambda n: n > 0), report=st.integers(0, 3).map(lambda n: n > 0))
    def transfer_ends(self, ok: bool, report: bool) -> None:
        self._finish_transfer("done" if ok else "failed")
        if report:
            self.driver_reports_transfer()

    @precondition(lambda self: self.transfer is not None and not self.transfer.in_flight and not self.transfer.reported)
    @rule()
    def driver_reports_transfer(self) -> None:
        """The driver polls the transport and reports the transfer's end (possibly late, or never)."""
        assert self.transfer is not None
        self.transfer.reported = True
        session = self.p if self.transfer.owner == "p" else self.c
        if self.transfer.state == "done":
            out = session.transfer_done(now=self.now)
        else:
            out = session.transfer_failed(FailureReason.TRANSFER_ERROR, now=self.now)
        self._apply(self.transfer.owner, out)

    @rule(what=st.sampled_from(["producer_aborts", "consumer_aborts", "consumer_fails_locally"]))
    def something_gives_up(self, what: str) -> None:
        # One rule for all three, so giving up is no likelier than any other step.
        if what == "producer_aborts":
            self._apply("p", self.p.abort(now=self.now, detail="client gone"))
        elif what == "consumer_aborts":
            self._apply("c", self.c.abort(now=self.now))
        else:
            self._apply("c", self.c.fail(FailureReason.WINDOW_COVERAGE, now=self.now))

    @rule(dt=st.sampled_from([0.1, 0.3, 0.5, 1.0, 2.0, 4.0]))
    def time_passes(self, dt: float) -> None:
        target = self.now + dt
        # A punctual driver: tick at every deadline on the way.
        for _ in range(100):
            due = [d for d in self._deadlines() if d <= target]
            if not due:
                break
            self.now = max(self.now, min(due))
            self._tick_all()
        else:
            raise AssertionError("deadlines do not advance")
        self.now = target
        self._tick_all()

    # ----------------------------------------------------------------- invariants

    @invariant()
    def at_most_once(self) -> None:
        assert len(self.p_frees) <= 1
        assert len(self.c_frees) <= 1
        assert len(self.releases) <= 1
        assert self.c_terminal_entries <= 1
        assert self.p_terminal_entries <= 1

    @invariant()
    def consumer_release_matches_its_state(self) -> None:
        assert (len(self.releases) == 1) == self.c.is_terminal
        if self.releases:
            assert self.c.release == self.releases[0]

    @invariant()
    def no_transfer_outlives_its_drain_bound(self) -> None:
        t = self.transfer
        if t is not None and t.in_flight and t.cancelled_at is not None:
            assert self.now < t.cancelled_at + DRAIN

    def teardown(self) -> None:
        if not hasattr(self, "p") or self.broken:
            return
        # Let the clock run and the network deliver until both sides are terminal (FAIL-1: bounded).
        for _ in range(50):
            while self.to_p or self.to_c:
                if self.to_p:
                    self._apply("p", self.p.receive(decode(self.to_p.pop(0)), now=self.now))
                if self.to_c:
                    self._apply("c", self.c.receive(decode(self.to_c.pop(0)), now=self.now))
            if self.p.is_terminal and self.c.is_terminal:
                break
            deadlines = self._deadlines()
            assert deadlines, f"stuck: {self.p!r} {self.c!r} with no deadline"
            self.now = max(self.now, min(deadlines))
            self._tick_all()
        assert self.p.is_terminal, self.p
        assert self.c.is_terminal, self.c
        assert self.p.next_deadline is None
        assert self.c.next_deadline is None
        assert len(self.p_frees) == 1, "P frees its blocks exactly once"
        assert len(self.releases) == 1, "every consumer request sends exactly one release (REL-1)"
        assert self.c_terminal_entries == 1
        expected_c_frees = 1 if self.c.state.name in ("FAILED", "ABORTED") else 0
        assert len(self.c_frees) == expected_c_frees
        if self.c.state.name == "FAILED":
            assert self.c.failure is not None


# The interesting interleavings need a few hundred runs; four times the profile's budget stays within seconds.
TestExchange = Exchange.TestCase
TestExchange.settings = settings(settings.default, max_examples=4 * settings.default.max_examples)
