"""Tests of the loopback backend: asynchronous, faithful completion and notifications (DONE-1, PLAN-1)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvspec import ConfigError, PlanError, TransferMode, TransportError
from kvspec.core._models import FailureReason
from kvspec.transport import (
    Backend,
    Descriptor,
    MemoryRegion,
    TransferState,
    Transport,
    load_backend,
)
from kvspec.transport.loopback import LoopbackAgent, LoopbackBackend

PAGE = 64


@pytest.fixture
def backend() -> Iterator[LoopbackBackend]:
    b = LoopbackBackend(chunk_bytes=2 * PAGE)
    yield b
    b.close()


def pair(backend: LoopbackBackend) -> tuple[LoopbackAgent, LoopbackAgent, list[bytearray], list[bytearray]]:
    producer, consumer = backend.create_agent("producer"), backend.create_agent("consumer")
    p_mem = [bytearray(bytes(range(256)) * 4), bytearray(b"\x11" * 512)]
    c_mem = [bytearray(1024), bytearray(512)]
    producer.register_memory([MemoryRegion(buffer=memoryview(m)) for m in p_mem])
    consumer.register_memory([MemoryRegion(buffer=memoryview(m)) for m in c_mem])
    assert consumer.add_remote_agent(producer.get_agent_metadata()) == "producer"
    assert producer.add_remote_agent(consumer.get_agent_metadata()) == "consumer"
    return producer, consumer, p_mem, c_mem


def desc(local_region: int, local_offset: int, remote_region: int, remote_offset: int, nbytes: int) -> Descriptor:
    return Descriptor(
        local_region=local_region,
        local_offset=local_offset,
        remote_region=remote_region,
        remote_offset=remote_offset,
        nbytes=nbytes,
    )


def test_is_a_backend_and_transport(backend: LoopbackBackend) -> None:
    assert isinstance(backend, Backend)
    assert isinstance(backend.create_agent("a"), Transport)
    assert isinstance(load_backend("loopback"), LoopbackBackend)
    assert backend.capabilities.observable_in_flight


def test_read_is_pending_then_data_visible_then_done(backend: LoopbackBackend) -> None:
    producer, consumer, p_mem, c_mem = pair(backend)
    descriptors = [desc(0, i * PAGE, 0, (7 - i) * PAGE, PAGE) for i in range(6)]
    handle = consumer.post(TransferMode.READ, descriptors, peer="producer", notification=b"release")
    # Nothing moves at post time; the transfer is observable in flight.
    assert c_mem[0] == bytearray(1024)
    seen_pending_with_data = False
    for _ in range(10):
        status = consumer.check(handle)
        landed = all(c_mem[0][i * PAGE : (i + 1) * PAGE] == p_mem[0][(7 - i) * PAGE : (8 - i) * PAGE] for i in range(6))
        if status.state is TransferState.DONE:
            # DONE-1: every byte is readable when DONE is reported.
            assert landed
            break
        assert status.state is TransferState.PENDING
        if landed:
            seen_pending_with_data = True
        # Notifications ride behind the data: none before DONE.
        assert producer.inbox == type(producer.inbox)()
    else:
        pytest.fail("transfer never completed")
    assert seen_pending_with_data
    notes = producer.get_notifications()
    assert [(n.peer, n.message) for n in notes] == [("consumer", b"release")]
    assert c_mem[0][6 * PAGE :] == bytearray(1024 - 6 * PAGE)
    consumer.release(handle)


def test_write_notification_arrives_after_data_when_target_polls(backend: LoopbackBackend) -> None:
    producer, consumer, p_mem, c_mem = pair(backend)
    descriptors = [desc(1, 0, 1, 256, 128), desc(0, 512, 0, 0, 256)]
    producer.post(TransferMode.WRITE, descriptors, peer="consumer", notification=b"done")
    # The passive consumer progresses the transfer by polling its notifications.
    for _ in range(10):
        notes = consumer.get_notifications()
        if notes:
            assert notes[0].message == b"done"
            assert c_mem[1][256:384] == p_mem[1][0:128]
            assert c_mem[0][0:256] == p_mem[0][512:768]
            break
    else:
        pytest.fail("notification never arrived")


def test_notifications_keep_order(backend: LoopbackBackend) -> None:
    producer, consumer, _, _ = pair(backend)
    for i in range(5):
        consumer.send_notification("producer", b"m%d" % i)
    assert [n.message for n in producer.get_notifications()] == [b"m%d" % i for i in range(5)]
    assert producer.get_notifications() == []


@pytest.mark.parametrize(
    "bad",
    [
        desc(2, 0, 0, 0, 8),  # local region not registered
        desc(0, 0, 5, 0, 8),  # remote region not registered
        desc(0, 1020, 0, 0, 8),  # local end past the region
        desc(0, 0, 1, 510, 8),  # remote end past the region
        desc(0, -8, 0, 0, 8),
        desc(0, 0, 0, 0, 0),
    ],
)
def test_descriptor_outside_registered_memory_is_refused_before_anything_moves(
    backend: LoopbackBackend, bad: Descriptor
) -> None:
    _, consumer, _, c_mem = pair(backend)
    good = desc(0, 0, 0, 0, 64)
    with pytest.raises(PlanError, match="descriptor 1"):
        consumer.post(TransferMode.READ, [good, bad], peer="producer")
    consumer.get_notifications()
    assert c_mem[0] == bytearray(1024)
    assert consumer.num_pending == 0


def test_unknown_peer_and_closed_agent(backend: LoopbackBackend) -> None:
    producer, consumer, _, _ = pair(backend)
    with pytest.raises(TransportError, match=r"unknown or disconnected peer 'nobody'") as info:
        consumer.post(TransferMode.READ, [desc(0, 0, 0, 0, 8)], peer="nobody")
    assert info.value.reason == FailureReason.PEER_DISCONNECTED.value
    handle = consumer.post(TransferMode.READ, [desc(0, 0, 0, 0, 8)], peer="producer")
    producer.close()
    status = consumer.check(handle)
    assert status.state is TransferState.FAILED
    assert status.reason is FailureReason.PEER_DISCONNECTED
    with pytest.raises(TransportError, match=r"unknown or disconnected peer 'producer'"):
        consumer.send_notification("producer", b"x")
    with pytest.raises(TransportError, match=r"agent 'producer' is closed"):
        producer.get_notifications()


def test_remove_remote_agent_fails_in_flight_and_refuses_new_posts(backend: LoopbackBackend) -> None:
    _, consumer, _, _ = pair(backend)
    handle = consumer.post(TransferMode.READ, [desc(0, 0, 0, 0, 8)], peer="producer")
    consumer.remove_remote_agent("producer")
    assert consumer.check(handle).reason is FailureReason.PEER_DISCONNECTED
    with pytest.raises(TransportError, match=r"unknown or disconnected peer 'producer'"):
        consumer.post(TransferMode.READ, [desc(0, 0, 0, 0, 8)], peer="producer")


def test_release_pending_cancels(backend: LoopbackBackend) -> None:
    producer, consumer, _, c_mem = pair(backend)
    handle = consumer.post(TransferMode.READ, [desc(0, 0, 0, 0, 64)], peer="producer", notification=b"n")
    consumer.release(handle)
    for _ in range(3):
        assert producer.get_notifications() == []
    assert c_mem[0] == bytearray(1024)
    with pytest.raises(TransportError, match=r"unknown or released handle 1"):
        consumer.check(handle)


def test_metadata_from_another_backend_is_refused(backend: LoopbackBackend) -> None:
    other = LoopbackBackend()
    stranger = other.create_agent("producer")
    consumer = backend.create_agent("consumer")
    with pytest.raises(TransportError, match=r"peer 'producer' is not reachable from this backend"):
        consumer.add_remote_agent(stranger.get_agent_metadata())
    with pytest.raises(TransportError, match=r"unreadable peer metadata"):
        consumer.add_remote_agent(b"not json")
    other.close()


def test_duplicate_agent_names_and_bad_options(backend: LoopbackBackend) -> None:
    backend.create_agent("x")
    with pytest.raises(TransportError, match=r"an agent named 'x' already exists"):
        backend.create_agent("x")
    with pytest.raises(ConfigError, match=r"LoopbackBackend\.chunk_bytes: expected a positive int, got 0"):
        LoopbackBackend(chunk_bytes=0)


def test_empty_transfer_completes(backend: LoopbackBackend) -> None:
    producer, consumer, _, _ = pair(backend)
    handle = producer.post(TransferMode.WRITE, [], peer="consumer", notification=b"empty")
    states = [producer.check(handle).state for _ in range(2)]
    assert states[-1] is TransferState.DONE
    assert [n.message for n in consumer.get_notifications()] == [b"empty"]
