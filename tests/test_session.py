"""Per-role sessions (SM-1, SM-2, REL-1, FAIL-1; lease and drain rules): every path, and the tables' shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvspec import (
    Abort,
    BlockIds,
    BlockOffer,
    Completion,
    ConfigError,
    ConsumerSession,
    ConsumerState,
    Failure,
    FailureReason,
    LocalProtocolError,
    ProducerSession,
    ProducerState,
    Release,
    ReleaseOutcome,
    RemoteProtocolError,
    TransferMode,
    decode,
    encode,
)
from kvspec.protocol._session import (
    CONSUMER_DEADLINES,
    CONSUMER_TRANSITIONS,
    PRODUCER_DEADLINES,
    PRODUCER_TRANSITIONS,
    Action,
    ConsumerEvent,
    Free,
    Output,
    Post,
    ProducerEvent,
    Send,
    Transition,
    to_markdown,
    to_mermaid,
)

READ, WRITE = TransferMode.READ, TransferMode.WRITE
LEASE, GRACE, DRAIN = 10.0, 3.0, 2.0
P_IDS = [[1, 2, 3], [0, 4]]
C_IDS = [[11, 12], [13]]


def _pair(
    mode: TransferMode, consumer_ids: object = C_IDS, **consumer: object
) -> tuple[ProducerSession, ConsumerSession]:
    producer = ProducerSession.create(
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
    session = ConsumerSession(
        params=producer.params,
        consumer_engine_id="C",
        consumer_block_ids=consumer_ids,  # type: ignore[arg-type]
        drain_timeout=DRAIN,
        **consumer,  # type: ignore[arg-type]
    )
    return producer, session


def _wire(out: Output) -> list[object]:
    # Every message crosses the codec, as a driver would send it.
    return [decode(encode(m)) for m in out.send]


def _one(out: Output, kind: type) -> object:
    sent = _wire(out)
    assert len(sent) == 1, sent
    assert isinstance(sent[0], kind), sent
    return sent[0]


PRODUCER_FREED = BlockIds([[1, 2, 3], [4]])  # the null block is never freed (NULL-1)
CONSUMER_FREED = BlockIds(C_IDS)


# --------------------------------------------------------------------------- happy paths


def test_read_happy_path() -> None:
    producer, consumer = _pair(READ)
    out = consumer.start(now=1.0)
    assert out.post
    assert not out.send
    assert consumer.state is ConsumerState.LOADING
    out = consumer.transfer_done(now=2.0)
    release = _one(out, Release)
    assert out.free is None  # a LOADED consumer keeps its blocks: they now hold the KV
    assert consumer.state is ConsumerState.LOADED  # type: ignore[comparison-overlap]
    assert consumer.release == release
    out = producer.receive(release, now=2.5)
    assert out.free == PRODUCER_FREED
    assert producer.state is ProducerState.RELEASED


def test_write_happy_path() -> None:
    producer, consumer = _pair(WRITE)
    offer = _one(consumer.start(now=1.0), BlockOffer)
    assert offer == BlockOffer(request_id="r1", consumer_engine_id="C", consumer_block_ids=C_IDS)
    out = producer.receive(offer, now=1.5)
    assert out.post
    assert out.notification == Completion(request_id="r1", producer_engine_id="P")
    assert producer.offer == offer
    assert producer.transfer_done(now=2.0).free is None  # P still waits for the release (SM-1)
    out = consumer.receive(decode(encode(out.notification)), now=2.1)
    release = _one(out, Release)
    assert consumer.state is ConsumerState.LOADED
    out = producer.receive(release, now=2.2)  # type: ignore[arg-type]
    assert out.free == PRODUCER_FREED
    assert producer.state is ProducerState.RELEASED


@pytest.mark.parametrize("mode", [READ, WRITE])
@pytest.mark.parametrize("ids", [[], [[], []], [[0], [0, 0]]])
def test_full_prefix_hit_only_releases(mode: TransferMode, ids: object) -> None:
    producer, consumer = _pair(mode, consumer_ids=ids)
    assert consumer.is_prefix_hit
    out = consumer.start(now=1.0)
    assert not out.post
    release = _one(out, Release)
    assert release == Release(request_id="r1", consumer_engine_id="C", outcome=ReleaseOutcome.PREFIX_HIT)
    assert consumer.state is ConsumerState.LOADED
    assert producer.receive(release, now=1.1).free == PRODUCER_FREED


# --------------------------------------------------------------------------- leases and deadlines (SM-1)


def test_read_producer_frees_only_after_lease_plus_grace() -> None:
    producer, _ = _pair(READ)
    assert producer.next_deadline == LEASE + GRACE
    assert producer.tick(now=LEASE).ignored  # C may still be cancelling its read
    out = producer.tick(now=LEASE + GRACE)
    assert out.free == PRODUCER_FREED
    assert producer.state is ProducerState.EXPIRED
    failure = _one(out, Failure)
    assert failure.reason is FailureReason.LEASE_EXPIRED  # type: ignore[attr-defined]
    assert producer.next_deadline is None


def test_read_consumer_does_not_start_past_the_start_margin() -> None:
    _, consumer = _pair(READ, start_margin=1.0)
    out = consumer.start(now=LEASE - 0.5)
    assert not out.post
    assert consumer.state is ConsumerState.FAILED
    assert consumer.failure is not None
    assert consumer.failure.reason is FailureReason.LEASE_EXPIRED
    assert out.free == CONSUMER_FREED
    assert _one(out, Release).outcome is ReleaseOutcome.FAILED  # type: ignore[attr-defined]


def test_read_consumer_cancels_at_the_lease_and_releases_after_the_drain() -> None:
    producer, consumer = _pair(READ)
    consumer.start(now=1.0)
    out = consumer.tick(now=LEASE)
    assert out.cancel
    assert out.free is None
    assert not out.send
    assert consumer.state is ConsumerState.FAILING
    # The read is still draining: a DONE now does not make it LOADED.
    out = consumer.transfer_done(now=LEASE + 0.5)
    assert consumer.state is ConsumerState.FAILED  # type: ignore[comparison-overlap]
    assert out.free == CONSUMER_FREED
    release = _one(out, Release)
    assert producer.receive(release, now=LEASE + 0.6).free == PRODUCER_FREED
    assert producer.state is ProducerState.RELEASED


def test_read_consumer_drain_timeout_bounds_a_hung_cancel() -> None:
    _, consumer = _pair(READ, transfer_timeout=2.0)
    consumer.start(now=1.0)
    assert consumer.next_deadline == 3.0
    assert consumer.tick(now=3.0).cancel
    assert consumer.failure is not None
    assert consumer.failure.reason is FailureReason.TIMEOUT
    assert consumer.tick(now=3.0 + DRAIN - 0.01).ignored
    out = consumer.tick(now=3.0 + DRAIN)
    assert out.free == CONSUMER_FREED
    assert consumer.state is ConsumerState.FAILED


def test_write_producer_cancels_a_write_at_the_lease_and_frees_after_the_drain() -> None:
    producer, consumer = _pair(WRITE)
    offer = _one(consumer.start(now=1.0), BlockOffer)
    producer.receive(offer, now=2.0)  # type: ignore[arg-type]
    out = producer.tick(now=LEASE)
    assert out.cancel
    assert out.free is None
    assert producer.state is ProducerState.EXPIRING
    out = producer.tick(now=LEASE + DRAIN)
    assert out.free == PRODUCER_FREED
    failure = _one(out, Failure)
    assert failure.failed_consumer_block_ids == CONSUMER_FREED  # type: ignore[attr-defined]
    # The consumer timed out at the lease too, asked P to stop, and takes P's Failure as the drain confirmation.
    out = consumer.tick(now=LEASE)
    _one(out, Abort)
    assert consumer.state is ConsumerState.FAILING
    out = consumer.receive(failure, now=LEASE + DRAIN)  # type: ignore[arg-type]
    assert consumer.state is ConsumerState.FAILED  # type: ignore[comparison-overlap]
    assert out.free == CONSUMER_FREED


def test_write_producer_never_posts_after_the_lease() -> None:
    producer, consumer = _pair(WRITE)
    offer = consumer.offer
    out = producer.receive(offer, now=LEASE)
    assert not out.post
    assert producer.state is ProducerState.EXPIRED
    assert out.free == PRODUCER_FREED


# --------------------------------------------------------------------------- aborts and drains (SM-2)


def test_write_consumer_abort_waits_for_the_producer_drain_confirmation() -> None:
    producer, consumer = _pair(WRITE)
    producer.receive(_one(consumer.start(now=1.0), BlockOffer), now=1.1)  # type: ignore[arg-type]
    out = consumer.abort(now=2.0)
    abort = _one(out, Abort)
    assert out.free is None  # P's write may still land in these blocks
    assert consumer.state is ConsumerState.ABORTING
    out = producer.receive(abort, now=2.1)  # type: ignore[arg-type]
    assert out.cancel
    assert out.free is None
    assert producer.state is ProducerState.CANCELLING
    out = producer.transfer_failed(FailureReason.ABORTED, now=2.5)  # the cancelled write drained
    assert out.free == PRODUCER_FREED
    confirmation = _one(out, Abort)
    out = consumer.receive(confirmation, now=2.6)  # type: ignore[arg-type]
    assert out.free == CONSUMER_FREED
    assert consumer.state is ConsumerState.ABORTED  # type: ignore[comparison-overlap]
    assert _one(out, Release).outcome is ReleaseOutcome.ABORTED
    assert producer.receive(consumer.release, now=2.7).ignored


def test_write_consumer_quarantine_without_confirmation_lasts_until_lease_plus_drain() -> None:
    _, consumer = _pair(WRITE)
    consumer.start(now=1.0)
    consumer.abort(now=2.0)
    assert consumer.next_deadline == LEASE + DRAIN
    assert consumer.tick(now=LEASE + DRAIN - 0.01).ignored
    out = consumer.tick(now=LEASE + DRAIN)
    assert out.free == CONSUMER_FREED
    assert consumer.state is ConsumerState.ABORTED


def test_read_consumer_abort_cancels_its_read_and_waits_for_it() -> None:
    _, consumer = _pair(READ)
    consumer.start(now=1.0)
    out = consumer.abort(now=2.0)
    assert out.cancel
    assert not out.send
    assert out.free is None
    out = consumer.transfer_failed(FailureReason.ABORTED, now=2.2)
    assert out.free == CONSUMER_FREED
    assert _one(out, Release).outcome is ReleaseOutcome.ABORTED  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", [READ, WRITE])
def test_producer_abort_keeps_blocks_until_the_release(mode: TransferMode) -> None:
    producer, consumer = _pair(mode)
    out = producer.abort(now=1.0, detail="client gone")
    abort = _one(out, Abort)
    assert out.free is None
    assert producer.state is ProducerState.ABORTING
    out = consumer.receive(abort, now=1.1)  # type: ignore[arg-type]
    assert consumer.state is ConsumerState.FAILED
    assert consumer.failure is not None
    assert consumer.failure.reason is FailureReason.ABORTED
    assert consumer.failure.detail == "client gone"
    assert out.free == CONSUMER_FREED
    out = producer.receive(_one(out, Release), now=1.2)  # type: ignore[arg-type]
    assert out.free == PRODUCER_FREED
    assert producer.state is ProducerState.ABORTED  # type: ignore[comparison-overlap]


def test_read_producer_abort_without_a_release_frees_after_lease_plus_grace() -> None:
    producer, _ = _pair(READ)
    producer.abort(now=1.0)
    assert producer.next_deadline == LEASE + GRACE
    assert producer.tick(now=LEASE + GRACE).free == PRODUCER_FREED


def test_write_failure_reports_the_offered_blocks() -> None:
    producer, consumer = _pair(WRITE)
    producer.receive(_one(consumer.start(now=1.0), BlockOffer), now=1.1)  # type: ignore[arg-type]
    out = producer.transfer_failed(FailureReason.POST_FAILED, now=1.2, detail="bad descriptor")
    failure = _one(out, Failure)
    assert out.free is None
    out = consumer.receive(failure, now=1.3)  # type: ignore[arg-type]
    assert consumer.failure is not None
    assert consumer.failure.reason is FailureReason.POST_FAILED
    assert consumer.failure.failed_consumer_block_ids == CONSUMER_FREED
    assert consumer.failure.detail == "bad descriptor"
    assert out.free == CONSUMER_FREED


def test_consumer_local_failure_before_start() -> None:
    _, consumer = _pair(READ)
    out = consumer.fail(FailureReason.WINDOW_COVERAGE, now=0.5, detail="block 3 is null")
    assert consumer.state is ConsumerState.FAILED
    assert out.free == CONSUMER_FREED
    assert _one(out, Release).outcome is ReleaseOutcome.FAILED  # type: ignore[attr-defined]
    assert consumer.start(now=0.6).ignored  # a terminal state is sticky


# --------------------------------------------------------------------------- duplicates, late signals, errors


def test_duplicate_and_late_messages_are_ignored() -> None:
    producer, consumer = _pair(WRITE)
    offer = consumer.offer
    consumer.start(now=1.0)
    producer.receive(offer, now=1.1)
    assert producer.receive(offer, now=1.2).ignored  # duplicate offer
    producer.transfer_done(now=1.3)
    assert producer.transfer_done(now=1.4).ignored  # duplicate report
    release = _one(consumer.receive(producer.completion, now=1.5), Release)
    assert consumer.receive(producer.completion, now=1.6).ignored
    assert producer.receive(release, now=1.7).free == PRODUCER_FREED  # type: ignore[arg-type]
    assert producer.receive(release, now=1.8).ignored  # type: ignore[arg-type]  # REL-1: repeats are no-ops
    assert producer.abort(now=1.9).ignored
    assert producer.tick(now=100.0).ignored
    assert consumer.abort(now=100.0).ignored


def test_remote_protocol_errors_leave_the_session_unchanged() -> None:
    producer, consumer = _pair(READ)
    other = BlockOffer(request_id="r1", consumer_engine_id="C", consumer_block_ids=C_IDS)
    with pytest.raises(RemoteProtocolError, match="WRITE"):
        producer.receive(other, now=1.0)  # no offers in READ mode
    with pytest.raises(RemoteProtocolError, match="r2"):
        producer.receive(Release(request_id="r2", consumer_engine_id="C", outcome=ReleaseOutcome.LOADED), now=1.0)
    with pytest.raises(RemoteProtocolError, match=r"a producer does not accept Completion from a consumer"):
        producer.receive(Completion(request_id="r1", producer_engine_id="P"), now=1.0)  # wrong direction
    with pytest.raises(RemoteProtocolError, match="WRITE"):
        consumer.receive(Completion(request_id="r1", producer_engine_id="P"), now=1.0)
    with pytest.raises(RemoteProtocolError, match="Q"):
        consumer.receive(Completion(request_id="r1", producer_engine_id="Q"), now=1.0)
    with pytest.raises(RemoteProtocolError, match=r"a consumer does not accept BlockOffer from a producer"):
        consumer.receive(other, now=1.0)
    assert producer.state is ProducerState.HELD
    assert consumer.state is ConsumerState.ALLOCATED
    # Deadlines still run, so the blocks are still freed (FAIL-1).
    assert producer.tick(now=LEASE + GRACE).free == PRODUCER_FREED


def test_a_conflicting_second_offer_is_a_remote_error() -> None:
    producer, consumer = _pair(WRITE)
    producer.receive(consumer.offer, now=1.0)
    with pytest.raises(RemoteProtocolError, match="different"):
        producer.receive(BlockOffer(request_id="r1", consumer_engine_id="C", consumer_block_ids=[[9], [8]]), now=1.1)


def test_local_protocol_errors() -> None:
    producer, consumer = _pair(READ)
    with pytest.raises(LocalProtocolError, match=r"consumer request 'r1' has no posted transfer to report on"):
        consumer.transfer_done(now=1.0)  # nothing posted yet
    with pytest.raises(LocalProtocolError, match=r"producer request 'r1' has no posted transfer to report on"):
        producer.transfer_done(now=1.0)  # P never transfers in READ mode
    consumer.start(now=1.0)
    with pytest.raises(LocalProtocolError, match="already started"):
        consumer.start(now=1.1)
    with pytest.raises(LocalProtocolError, match=r"transfer_failed: expected a FailureReason, got 'timeout'"):
        consumer.transfer_failed("timeout", now=1.2)  # type: ignore[arg-type]
    assert consumer.state is ConsumerState.LOADING


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"release_grace": -1.0}, "release_grace"),
        ({"drain_timeout": float("nan")}, "drain_timeout"),
        ({"lease_duration": float("inf")}, "lease_duration"),
    ],
)
def test_bad_producer_settings(kwargs: dict[str, float], name: str) -> None:
    settings: dict[str, float] = {"lease_duration": LEASE} | kwargs
    with pytest.raises(ConfigError, match=name):
        ProducerSession.create(
            request_id="r",
            producer_engine_id="P",
            producer_block_ids=P_IDS,
            num_tokens=1,
            mode=READ,
            now=0.0,
            **settings,  # type: ignore[arg-type]
        )


def test_bad_consumer_settings() -> None:
    producer, _ = _pair(READ)
    with pytest.raises(ConfigError, match="consumer_engine_id"):
        ConsumerSession(params=producer.params, consumer_engine_id="", consumer_block_ids=C_IDS)
    with pytest.raises(ConfigError, match="transfer_timeout"):
        ConsumerSession(params=producer.params, consumer_engine_id="C", consumer_block_ids=C_IDS, transfer_timeout=-1)
    with pytest.raises(ConfigError, match="params"):
        ConsumerSession(params={}, consumer_engine_id="C", consumer_block_ids=C_IDS)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the tables


def _taken(table: Sequence[Transition[Any, Any]]) -> list[Transition[Any, Any]]:
    return [row for row in table if not row.ignored]


def test_ignored_rows_change_nothing_and_ask_for_nothing() -> None:
    rows: tuple[Transition[Any, Any], ...] = (*PRODUCER_TRANSITIONS, *CONSUMER_TRANSITIONS)
    for row in rows:
        if row.ignored:
            assert row.target is row.source, row
            assert not row.actions, row
    # Terminal states are sticky: they have ignored rows only.
    assert all(row.ignored for row in rows if row.source.is_terminal)


def test_producer_frees_exactly_on_entering_a_terminal_state() -> None:
    for row in _taken(PRODUCER_TRANSITIONS):
        assert (Action.FREE in row.actions) == row.target.is_terminal, row
        assert not row.source.is_terminal, row  # terminal states are sticky


def test_consumer_releases_exactly_on_entering_a_terminal_state() -> None:
    for row in _taken(CONSUMER_TRANSITIONS):
        assert (Action.SEND_RELEASE in row.actions) == row.target.is_terminal, row
        # Blocks become reusable only in FAILED/ABORTED; a LOADED request keeps them.
        assert (Action.FREE in row.actions) == (row.target in (ConsumerState.FAILED, ConsumerState.ABORTED)), row
        assert not row.source.is_terminal, row


def test_every_non_terminal_state_has_a_deadline_in_every_mode() -> None:
    # FAIL-1: no state waits forever; each one leaves on a time event in each mode it can be reached in,
    # and that event has a row of the deadline table next to the transition table, and back.
    for table, deadlines, events in (
        (PRODUCER_TRANSITIONS, PRODUCER_DEADLINES, {ProducerEvent.LEASE_EXPIRED, ProducerEvent.DRAIN_TIMEOUT}),
        (CONSUMER_TRANSITIONS, CONSUMER_DEADLINES, {ConsumerEvent.TIMEOUT, ConsumerEvent.DRAIN_TIMEOUT}),
    ):
        for mode in (READ, WRITE):
            rows = [r for r in _taken(table) if mode in r.modes]
            reachable = {rows[0].source} | {r.target for r in rows}
            for state in reachable:
                if state.is_terminal:
                    continue
                timed = {r.event for r in rows if r.source is state and r.event in events}
                due = {d.event for d in deadlines if d.state is state and mode in d.modes}
                assert timed, f"{mode.value}: {state} has no deadline"
                assert due == timed, f"{mode.value}: {state}: deadline table {due}, transitions {timed}"


def test_an_event_without_a_row_is_a_local_protocol_error() -> None:
    producer, consumer = _pair(WRITE)
    consumer.start(now=1.0)
    with pytest.raises(LocalProtocolError, match="event 'prefix_hit' has no row in state loading"):
        consumer._fire(ConsumerEvent.PREFIX_HIT, 1.1)
    with pytest.raises(LocalProtocolError, match="event 'drain_timeout' has no row in state held"):
        producer._fire(ProducerEvent.DRAIN_TIMEOUT, 1.1)
    assert consumer.state is ConsumerState.LOADING
    assert producer.state is ProducerState.HELD


def test_output_actions_come_in_table_order() -> None:
    producer, consumer = _pair(WRITE)
    assert producer.abort(now=1.0).actions == (Send(message=Abort(request_id="r1", engine_id="P")),)
    release = Release(request_id="r1", consumer_engine_id="C", outcome=ReleaseOutcome.FAILED)
    assert producer.receive(release, now=1.1).actions == (Free(block_ids=PRODUCER_FREED),)
    consumer.start(now=1.0)
    assert consumer.fail(FailureReason.TIMEOUT, now=2.0).actions == (
        Send(message=Abort(request_id="r1", engine_id="C")),
    )
    out = consumer.receive(Abort(request_id="r1", engine_id="P", detail="drained"), now=2.1)
    # FAILING -> FAILED asks for (FREE, SEND_RELEASE), in the table's order (SM-2, REL-1).
    assert [type(a) for a in out.actions] == [Free, Send]
    assert out.free == CONSUMER_FREED
    assert out.send == (consumer.release,)
    offer = BlockOffer(request_id="r1", consumer_engine_id="C", consumer_block_ids=C_IDS)
    assert _pair(WRITE)[0].receive(offer, now=1.0).actions == (
        Post(notification=Completion(request_id="r1", producer_engine_id="P")),
    )
    assert _pair(READ)[1].start(now=1.0).actions == (Post(),)


def test_mermaid_diagrams_cover_every_row() -> None:
    for role, table in (("producer", PRODUCER_TRANSITIONS), ("consumer", CONSUMER_TRANSITIONS)):
        text = to_mermaid(role)  # type: ignore[arg-type]
        assert text.startswith("stateDiagram-v2\n")
        lines = [line for line in text.splitlines() if "-->" in line and "[*]" not in line]
        assert len(lines) == len(_taken(table))
        for mode in (READ, WRITE):
            per_mode = to_mermaid(role, mode)  # type: ignore[arg-type]
            assert sum("-->" in line and "[*]" not in line for line in per_mode.splitlines()) == sum(
                mode in row.modes for row in _taken(table)
            )
        assert to_markdown(role).count("\n") == len(_taken(table)) + 2  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"role: expected 'producer' or 'consumer', got 'router'"):
        to_mermaid("router")  # type: ignore[arg-type]
