"""Helpers the cross-process backend tests share: descriptors, pairing over shared memory, bounded waits."""

from __future__ import annotations

import os
import time
from multiprocessing import shared_memory
from typing import Protocol

import pytest

from kvspec.transport import Descriptor, MemoryRegion, TransferHandle, TransferState, TransferStatus, Transport

__all__ = [
    "DEFAULT_PAR_CASES",
    "LOOPBACK",
    "connect",
    "default_run_rules",
    "desc",
    "listening_ports",
    "regions",
    "tcp_sockets",
    "wait",
]


DEFAULT_PAR_CASES = ("PAR-3/mamba2-n-groups-1", "PAR-6/mla-unread-ranks-notify")
"""The PAR cases a cross-process backend runs by default: three ranks each, sub-blocks split and replicated across
processes (#55208's pair) and a notification to a rank nobody read (MLA, P > D); the rest with --run-slow."""


def default_run_rules() -> tuple[str, ...] | None:
    """What a cross-process backend's TestConformance runs by default: every case but the PAR cases, and of those
    :data:`DEFAULT_PAR_CASES`; every case with --run-slow (KVSPEC_RUN_SLOW).

    Each agent of such a backend is a process of its own: a case with twelve ranks starts about ten more (a minute
    or more of CPU here), and the 32 PAR cases take 3 to 5 minutes on NIXL and Mooncake.
    """
    if os.environ.get("KVSPEC_RUN_SLOW"):
        return None
    from kvspec_conformance import all_cases
    from kvspec_conformance.cases.parallel import SCENARIOS

    assert all(SCENARIOS[case_id].num_ranks <= 3 for case_id in DEFAULT_PAR_CASES)
    return tuple(c.id for c in all_cases() if not c.id.startswith("PAR-") or c.id in DEFAULT_PAR_CASES)


# 127.0.0.1 as /proc/net/tcp writes a local address (little-endian hex).
LOOPBACK = "0100007F"


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


def tcp_sockets(pid: int, *, listening: bool = False) -> list[str]:
    """Local addresses of the TCP sockets process ``pid`` holds, or of those it listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes and (not listening or fields[3] == "0A"):  # 0A: TCP_LISTEN
                    found.append(fields[1])
    return found


def listening_ports(pid: int) -> list[int]:
    """The ports process ``pid`` listens on over TCP (from /proc)."""
    return sorted({int(address.rsplit(":", 1)[1], 16) for address in tcp_sockets(pid, listening=True)})
