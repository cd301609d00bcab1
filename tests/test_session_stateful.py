"""Stateful property tests: producer and consumer sessions over a lossy network and a simulated transport.

Hypothesis runs several requests at once on one clock and interleaves, for
any of them: messages delivered in any order, duplicated or dropped; transfer
completions, failures and hangs; aborts on both sides; local failures; and
the clock. A small simulated backend keeps the backend's side of the
contract: a transfer moves bytes until it is DONE, FAILED or, once cancelled,
at most ``DRAIN`` seconds later (the drain rule). Drivers are punctual: the
clock never jumps past a session's next deadline without ticking it (what
``next_deadline`` is for); the adversarial tests cover late drivers.

Checked after every step and at the end:

- P frees its blocks exactly once, in a terminal state, and never while a
  transfer that touches them is in flight (SM-1);
- C's blocks are handed back only when no transfer can write into them (SM-2);
- every C request ends in exactly one terminal state and sends exactly one
  release (REL-1); every request on both sides terminates once the clock has
  run (FAIL-1).
"""

from __future__ import annotations

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvspec import (
    BlockIds,
    Completion,
    ConsumerSession,
    ConsumerState,
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
P_FREED = BlockIds([[1, 2, 3], [4]])
C_IDS = BlockIds([[11, 12], [13]])
pick = st.integers(0, 15)


@attrs.define
class SimTransfer:
    """One posted transfer as the backend sees it."""

    owner: str  # "p" (WRITE) or "c" (READ)
    notification: Completion | None
    state: str = "pending"  # pending -> done | failed | stopped
    cancelled_at: float | None = None
    reported: bool = False

    @property
    def in_flight(self) -> bool:
        return self.state == "pending"


def _unreported(pair: Pair) -> bool:
    return pair.transfer is not None and not pair.transfer.in_flight and not pair.transfer.reported


@attrs.define(eq=False)
class Pair:
    """One request: its two sessions, the two message queues and its transfer."""

    p: ProducerSession
    c: ConsumerSession
    to_p: list[bytes] = attrs.field(factory=list)
    to_c: list[bytes] = attrs.field(factory=list)
    transfer: SimTransfer | None = None
    started: bool = False
    p_frees: list[BlockIds] = attrs.field(factory=list)
    c_frees: list[BlockIds] = attrs.field(factory=list)
    releases: list[Release] = attrs.field(factory=list)
    c_terminal_entries: int = 0
    p_terminal_entries: int = 0

    @property
    def mode(self) -> TransferMode:
        return self.p.mode

    @property
    def done(self) -> bool:
        return self.p.is_terminal and self.c.is_terminal and not self.to_p and not self.to_c

    def apply(self, role: str, out: Output, now: float) -> None:
        for step in out.steps:
            if step.target.is_terminal:
                if role == "c":
                    self.c_terminal_entries += 1
                else:
                    self.p_terminal_entries += 1
        for message in out.send:
            if role == "p":
                self.to_c.append(encode(message))
            else:
                if isinstance(message, Release):
                    self.releases.append(message)
                self.to_p.append(encode(message))
        if out.post:
            assert self.transfer is None, "a request posts at most one transfer"
            assert (role == "p") == (self.mode is TransferMode.WRITE)
            self.transfer = SimTransfer(owner=role, notification=out.notification)
        if out.cancel:
            assert self.transfer is not None
            assert self.transfer.owner == role
            if self.transfer.cancelled_at is None:
                self.transfer.cancelled_at = now
        if out.free is not None:
            # SM-1 / SM-2: nothing may still move bytes into or out of blocks handed back.
            assert self.transfer is None or not self.transfer.in_flight, f"{role} freed blocks mid-transfer"
            if role == "p":
                assert self.p.is_terminal
                assert out.free == P_FREED
                self.p_frees.append(out.free)
            else:
                assert self.c.state in (ConsumerState.FAILED, ConsumerState.ABORTED)
                self.c_frees.append(out.free)

    def finish_transfer(self, state: str) -> None:
        assert self.transfer is not None
        self.transfer.state = state
        if state == "done" and self.transfer.notification is not None:
            # The backend delivers the post's notification only after the data (DONE-1).
            self.to_c.append(encode(self.transfer.notification))

    def report_transfer(self, now: float) -> None:
        t = self.transfer
        if t is None or t.in_flight or t.reported:
            return
        t.reported = True
        session = self.p if t.owner == "p" else self.c
        if t.state == "done":
            out = session.transfer_done(now=now)
        else:
            out = session.transfer_failed(FailureReason.TRANSFER_ERROR, now=now)
        self.apply(t.owner, out, now)

    def stop_overdue(self, now: float) -> None:
        t = self.transfer
        if t is not None and t.in_flight and t.cancelled_at is not None and t.cancelled_at + DRAIN <= now:
            t.state = "stopped"  # the backend's drain bound

    def deadlines(self) -> list[float]:
        found = [d for d in (self.p.next_deadline, self.c.next_deadline) if d is not None]
        t = self.transfer
        if t is not None and t.in_flight and t.cancelled_at is not None:
            found.append(t.cancelled_at + DRAIN)
        return found

    def tick(self, now: float) -> None:
        self.stop_overdue(now)
        self.apply("p", self.p.tick(now=now), now)
        self.apply("c", self.c.tick(now=now), now)
        self.stop_overdue(now)

    def check(self) -> None:
        assert len(self.p_frees) <= 1
        assert len(self.c_frees) <= 1
        assert len(self.releases) <= 1
        assert self.c_terminal_entries <= 1
        assert self.p_terminal_entries <= 1
        assert (len(self.releases) == 1) == self.c.is_terminal
        if self.releases:
            assert self.c.release == self.releases[0]

    def check_finished(self) -> None:
        assert self.p.is_terminal, self.p
        assert self.c.is_terminal, self.c
        assert self.p.next_deadline is None
        assert self.c.next_deadline is None
        assert len(self.p_frees) == 1, "P frees its blocks exactly once"
        assert len(self.releases) == 1, "every consumer request sends exactly one release (REL-1)"
        assert self.c_terminal_entries == 1
        assert len(self.c_frees) == (1 if self.c.state in (ConsumerState.FAILED, ConsumerState.ABORTED) else 0)
        if self.c.state is ConsumerState.FAILED:
            assert self.c.failure is not None


class Exchange(RuleBasedStateMachine):
    """Several requests between a producer and a consumer, on one clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pairs: list[Pair] = []
        self.broken = False

    def _live(self) -> list[Pair]:
        return [pair for pair in self.pairs if not pair.done]

    def _pick(self, index: int) -> Pair:
        live = self._live()
        return live[index % len(live)]

    def _guarded(self, pair: Pair, role: str, out: Output) -> None:
        # Teardown must not mask the first failure with one of its own.
        self.broken = True
        pair.apply(role, out, self.now)
        self.broken = False

    # ----------------------------------------------------------------- rules

    @precondition(lambda self: len(self._live()) < 4)
    @rule(
        mode=st.sampled_from(TransferMode),
        prefix_hit=st.integers(0, 4).map(lambda n: n == 0),
        start_margin=st.sampled_from([0.0, 1.0]),
        transfer_timeout=st.sampled_from([None, 1.5, 4.0]),
        start_now=st.integers(0, 3).map(lambda n: n > 0),
    )
    def new_request(
        self,
        mode: TransferMode,
        prefix_hit: bool,
        start_margin: float,
        transfer_timeout: float | None,
        start_now: bool,
    ) -> None:
        producer = ProducerSession.create(
            request_id=f"r{len(self.pairs)}",
            producer_engine_id="P",
            producer_block_ids=P_IDS,
            num_tokens=40,
            mode=mode,
            now=self.now,
            lease_duration=LEASE,
            release_grace=GRACE,
            drain_timeout=DRAIN,
        )
        params = decode(encode(producer.params))  # through the router, as bytes
        assert params == producer.params
        consumer = ConsumerSession(
            params=params,
            consumer_engine_id="C",
            consumer_block_ids=BlockIds([]) if prefix_hit else C_IDS,
            start_margin=start_margin,
            transfer_timeout=transfer_timeout,
            drain_timeout=DRAIN,
        )
        pair = Pair(p=producer, c=consumer)
        self.pairs.append(pair)
        if start_now:
            self._start(pair)

    def _start(self, pair: Pair) -> None:
        pair.started = True
        self._guarded(pair, "c", pair.c.start(now=self.now))

    @precondition(lambda self: any(not pair.started for pair in self._live()))
    @rule(index=pick)
    def start_consumer(self, index: int) -> None:
        waiting = [pair for pair in self._live() if not pair.started]
        self._start(waiting[index % len(waiting)])

    @precondition(lambda self: any(pair.to_p or pair.to_c for pair in self.pairs))
    @rule(index=pick, to_producer=st.booleans(), which=pick, keep=st.integers(0, 3).map(lambda n: n == 0))
    def deliver(self, index: int, to_producer: bool, which: int, keep: bool) -> None:
        """Deliver one message in any order; ``keep`` leaves a copy behind to be delivered again."""
        pending = [pair for pair in self.pairs if pair.to_p or pair.to_c]
        pair = pending[index % len(pending)]
        role = "p" if (to_producer and pair.to_p) or not pair.to_c else "c"
        queue = pair.to_p if role == "p" else pair.to_c
        data = queue[which % len(queue)] if keep else queue.pop(which % len(queue))
        session = pair.p if role == "p" else pair.c
        self._guarded(pair, role, session.receive(decode(data), now=self.now))

    @precondition(lambda self: any(pair.to_p or pair.to_c for pair in self.pairs))
    @rule(index=pick, to_producer=st.booleans(), which=pick)
    def drop_message(self, index: int, to_producer: bool, which: int) -> None:
        pending = [pair for pair in self.pairs if pair.to_p or pair.to_c]
        pair = pending[index % len(pending)]
        queue = pair.to_p if (to_producer and pair.to_p) or not pair.to_c else pair.to_c
        queue.pop(which % len(queue))

    @precondition(lambda self: any(p.transfer is not None and p.transfer.in_flight for p in self.pairs))
    @rule(index=pick, ok=st.integers(0, 3).map(lambda n: n > 0), report=st.integers(0, 3).map(lambda n: n > 0))
    def transfer_ends(self, index: int, ok: bool, report: bool) -> None:
        flying = [pair for pair in self.pairs if pair.transfer is not None and pair.transfer.in_flight]
        pair = flying[index % len(flying)]
        pair.finish_transfer("done" if ok else "failed")
        if report:
            self.broken = True
            pair.report_transfer(self.now)
            self.broken = False

    @precondition(lambda self: any(_unreported(pair) for pair in self.pairs))
    @rule(index=pick)
    def driver_reports_transfer(self, index: int) -> None:
        """The driver polls the transport and reports a transfer's end (possibly late, or never)."""
        ended = [
            p for p in self.pairs if p.transfer is not None and not p.transfer.in_flight and not p.transfer.reported
        ]
        self.broken = True
        ended[index % len(ended)].report_transfer(self.now)
        self.broken = False

    @precondition(lambda self: self._live())
    @rule(index=pick, what=st.sampled_from(["producer_aborts", "consumer_aborts", "consumer_fails_locally"]))
    def something_gives_up(self, index: int, what: str) -> None:
        pair = self._pick(index)
        if what == "producer_aborts":
            self._guarded(pair, "p", pair.p.abort(now=self.now, detail="client gone"))
        elif what == "consumer_aborts":
            self._guarded(pair, "c", pair.c.abort(now=self.now))
        else:
            self._guarded(pair, "c", pair.c.fail(FailureReason.WINDOW_COVERAGE, now=self.now))

    @rule(dt=st.sampled_from([0.1, 0.3, 0.5, 1.0, 2.0, 4.0]))
    def time_passes(self, dt: float) -> None:
        target = self.now + dt
        # A punctual driver: tick at every deadline on the way.
        for _ in range(1000):
            due = [d for pair in self.pairs for d in pair.deadlines() if d <= target]
            if not due:
                break
            self._tick_all(max(self.now, min(due)))
        else:  # pragma: no cover - a session whose deadline never advances
            raise AssertionError("deadlines do not advance")
        self._tick_all(target)

    def _tick_all(self, now: float) -> None:
        self.now = now
        self.broken = True
        for pair in self.pairs:
            pair.tick(now)
        self.broken = False

    # ----------------------------------------------------------------- invariants

    @invariant()
    def each_request_keeps_its_promises(self) -> None:
        for pair in self.pairs:
            pair.check()
            t = pair.transfer
            if t is not None and t.in_flight and t.cancelled_at is not None:
                assert self.now < t.cancelled_at + DRAIN

    def teardown(self) -> None:
        if self.broken:
            return
        # Let the clock run and the network deliver until every request is finished (FAIL-1: bounded).
        for _ in range(200):
            for pair in self.pairs:
                while pair.to_p or pair.to_c:
                    if pair.to_p:
                        pair.apply("p", pair.p.receive(decode(pair.to_p.pop(0)), now=self.now), self.now)
                    if pair.to_c:
                        pair.apply("c", pair.c.receive(decode(pair.to_c.pop(0)), now=self.now), self.now)
            if all(pair.done for pair in self.pairs):
                break
            deadlines = [d for pair in self.pairs for d in pair.deadlines()]
            assert deadlines, f"stuck with no deadline: {[(pair.p, pair.c) for pair in self._live()]}"
            self.now = max(self.now, min(deadlines))
            for pair in self.pairs:
                pair.tick(self.now)
        for pair in self.pairs:
            pair.check_finished()


# Interleavings of several requests need a few hundred runs; twice the profile's budget stays within seconds.
TestExchange = Exchange.TestCase
TestExchange.settings = settings(settings.default, max_examples=2 * settings().max_examples)
