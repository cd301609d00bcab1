"""The driver core (kvspec.drivers._driver): actions done in table order, transfers polled first, typed faults."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvspec import (
    BlockIds,
    ConsumerSession,
    ConsumerState,
    FailureReason,
    MalformedMessageError,
    ProducerSession,
    ProducerState,
    TransferMode,
    TransportError,
)
from kvspec.core._errors import BlockAlignmentError, LocalProtocolError, WindowCoverageError
from kvspec.drivers._driver import CONSUMER, PRODUCER, Driver, DriverFault, LiveRequest, Operation, Role, S, reason_of
from kvspec.transport import Transport
from kvspec.transport.loopback import LoopbackBackend


@pytest.fixture
def agents() -> Iterator[tuple[Transport, Transport, str, str]]:
    backend = LoopbackBackend()
    producer, consumer = backend.create_agent("producer"), backend.create_agent("consumer")
    to_consumer = producer.add_remote_agent(consumer.get_agent_metadata())
    to_producer = consumer.add_remote_agent(producer.get_agent_metadata())
    yield producer, consumer, to_producer, to_consumer
    backend.close()


def _sessions(mode: TransferMode, now: float) -> tuple[ProducerSession, ConsumerSession]:
    producer = ProducerSession.create(
        request_id="r1",
        producer_engine_id="P",
        producer_block_ids=[[1, 2]],
        num_tokens=8,
        mode=mode,
        now=now,
        lease_duration=5.0,
    )
    consumer = ConsumerSession(params=producer.params, consumer_engine_id="C", consumer_block_ids=[[3, 4]])
    return producer, consumer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _driver(role: Role[S], transport: Transport, clock: _Clock, freed: list[BlockIds], ended: list[str]) -> Driver[S]:
    return Driver(
        role=role,
        transport=transport,
        clock=clock,
        on_free=lambda request, ids: freed.append(ids),
        on_end=lambda request: ended.append(request.request_id),
    )


def test_undecodable_notification_and_lost_offer_are_typed_faults(
    agents: tuple[Transport, Transport, str, str],
) -> None:
    producer_agent, consumer_agent, to_producer, to_consumer = agents
    clock = _Clock()
    freed: list[BlockIds] = []
    ended: list[str] = []
    consumer = _driver(CONSUMER, consumer_agent, clock, freed, ended)
    producer_agent.send_notification(to_consumer, b"not a kvspec message")
    consumer.poll()
    (fault,) = consumer.faults
    assert fault.operation is Operation.DECODE
    assert isinstance(fault.error, MalformedMessageError)
    assert fault.peer == "producer"
    # The consumer's WRITE offer cannot reach a forgotten peer: the request ends FAILED, typed (FAIL-1).
    _, session = _sessions(TransferMode.WRITE, clock.now)
    consumer_agent.remove_remote_agent(to_producer)
    request = consumer.add(LiveRequest(session=session, peer=to_producer))
    consumer.execute(request, session.start(now=clock.now))
    sent = consumer.faults[1]
    assert sent.operation is Operation.SEND
    assert isinstance(sent.error, TransportError)
    assert "send ('producer'): TransportError" in str(sent)
    # The offer may have left before the peer was lost: C waits out lease + drain before reusing blocks (SM-2).
    assert session.state is ConsumerState.FAILING
    assert session.failure is not None
    assert session.failure.reason is FailureReason.PEER_DISCONNECTED
    assert not freed
    clock.now = session.params.lease_deadline + session.drain_timeout
    consumer.tick()
    assert session.state is ConsumerState.FAILED  # type: ignore[comparison-overlap]  # mypy narrowed it above
    assert freed == [BlockIds([[3, 4]])]
    assert ended == ["r1"]


def test_a_driver_never_drives_one_request_twice(agents: tuple[Transport, Transport, str, str]) -> None:
    _, consumer_agent, to_producer, _ = agents
    driver = _driver(CONSUMER, consumer_agent, _Clock(), [], [])
    _, session = _sessions(TransferMode.READ, 100.0)
    driver.add(LiveRequest(session=session, peer=to_producer))
    with pytest.raises(LocalProtocolError, match="already being driven"):
        driver.add(LiveRequest(session=session, peer=to_producer))


def test_producer_expiry_without_a_known_peer_is_a_route_fault(agents: tuple[Transport, Transport, str, str]) -> None:
    producer_agent, _, _, _ = agents
    clock = _Clock()
    freed: list[BlockIds] = []
    driver = _driver(PRODUCER, producer_agent, clock, freed, [])
    session, _ = _sessions(TransferMode.WRITE, clock.now)
    driver.add(LiveRequest(session=session))
    clock.now += 10.0
    driver.tick()  # HELD -> EXPIRED: free, then a Failure to a consumer nobody named
    assert session.state is ProducerState.EXPIRED
    assert freed == [BlockIds([[1, 2]])]
    assert [f.operation for f in driver.faults] == [Operation.ROUTE]
    assert not driver.requests


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (WindowCoverageError("window"), FailureReason.WINDOW_COVERAGE),
        (BlockAlignmentError("align"), FailureReason.BLOCK_ALIGNMENT),
        (TransportError("gone", reason="peer_disconnected"), FailureReason.PEER_DISCONNECTED),
        (LocalProtocolError("bug"), FailureReason.PROTOCOL),
    ],
)
def test_reason_of_maps_each_error_to_a_typed_reason(error: Exception, reason: FailureReason) -> None:
    assert reason_of(error) is reason  # type: ignore[arg-type]


def test_a_fault_is_a_record_not_a_string() -> None:
    fault = DriverFault(operation=Operation.POST, error=TransportError("refused"), request_id="r", peer="p")
    assert fault.operation is Operation.POST
    assert str(fault) == "request 'r': post ('p'): TransportError: refused"
