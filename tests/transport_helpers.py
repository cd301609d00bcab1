"""Helpers the cross-process backend tests share: descriptors, pairing over shared memory, bounded waits."""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Protocol

import pytest

from kvspec.transport import Descriptor, MemoryRegion, TransferHandle, TransferState, TransferStatus, Transport

__all__ = ["connect", "desc", "regions", "wait"]


class _Pools(Protocol):
    producer: list[shared_memory.SharedMemory]
    consumer: list[shared_memory.SharedMemory]


def desc(local_region: int, local_offset: int, remote_region: int, remote_offset: int, nbytes: int) -> Descriptor:
    """A descriptor from positional fields, for compact test tables."""
    return Descriptor(
        local_region=local_region,
        local_offset=local_offset,
        remote_region=remote_region,
        remote_offset=remote_offset,
        nbytes=nbytes,
    )


def regions(blocks: list[shared_memory.SharedMemory]) -> list[MemoryRegion]:
    """Shared-memory blocks as regions an agent in another process can attach by name."""
    return [MemoryRegion(buffer=shm.buf, shm_name=shm.name) for shm in blocks]  # type: ignore[arg-type]


def connect(producer: Transport, consumer: Transport, pools: _Pools) -> None:
    """Register each side's pool and exchange agent metadata both ways."""
    producer.register_memory(regions(pools.producer))
    consumer.register_memory(regions(pools.consumer))
    assert consumer.add_remote_agent(producer.get_agent_metadata()) == producer.name
    assert producer.add_remote_agent(consumer.get_agent_metadata()) == consumer.name


def wait(agent: Transport, handle: TransferHandle, deadline: float = 20.0) -> TransferStatus:
    """Poll until the transfer leaves PENDING; fail the test past ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        status = agent.check(handle)
        if status.state is not TransferState.PENDING:
            return status
        time.sleep(0.0005)
    pytest.fail(f"transfer {handle.transfer_id} still PENDING after {deadline} s")
