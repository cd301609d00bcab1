"""Run inside a network namespace by tests/test_off_loopback.py: one READ and one WRITE between two agents.

``python tests/netns_pair.py BACKEND OPTIONS_JSON`` builds the backend with
those options, pairs a producer and a consumer agent over shared memory,
moves bytes both ways, checks them, and prints one JSON object: the local
addresses of every TCP socket each agent's process holds while paired (as
/proc/net/tcp writes them), and whether the bytes arrived.
"""

from __future__ import annotations

import json
import random
import sys
from multiprocessing import shared_memory

from transport_helpers import connect, desc, tcp_sockets, wait

from kvspec import TransferMode
from kvspec.transport import TransferState, load_backend

SIZE = 1 << 16
PAGE = 4096


def _buf(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # pragma: no cover - only after close()
        raise RuntimeError(f"shared memory {shm.name} is closed")
    return buf


class _Pools:
    def __init__(self) -> None:
        self.producer = [shared_memory.SharedMemory(create=True, size=SIZE) for _ in range(2)]
        self.consumer = [shared_memory.SharedMemory(create=True, size=SIZE) for _ in range(2)]

    def close(self) -> None:
        for shm in (*self.producer, *self.consumer):
            shm.close()
            shm.unlink()


def main(backend_name: str, options: dict[str, object]) -> dict[str, object]:
    backend = load_backend(backend_name, **options)
    pools = _Pools()
    try:
        producer, consumer = backend.create_agent("producer"), backend.create_agent("consumer")
        connect(producer, consumer, pools)
        rng = random.Random(7)
        p0, p1, c0, c1 = (_buf(shm) for shm in (*pools.producer, *pools.consumer))
        p0[:PAGE] = rng.randbytes(PAGE)
        p1[PAGE : 2 * PAGE] = rng.randbytes(PAGE)
        read = consumer.post(TransferMode.READ, [desc(0, 0, 0, 0, PAGE)], peer=producer.name)
        write = producer.post(TransferMode.WRITE, [desc(1, PAGE, 1, 3 * PAGE, PAGE)], peer=consumer.name)
        states = [wait(consumer, read).state, wait(producer, write).state]
        consumer.release(read)
        producer.release(write)
        intact = bytes(c0[:PAGE]) == bytes(p0[:PAGE]) and bytes(c1[3 * PAGE : 4 * PAGE]) == bytes(p1[PAGE : 2 * PAGE])
        del p0, p1, c0, c1  # no view may outlive the pools' close
        sockets = {agent.name: tcp_sockets(agent.pid) for agent in (producer, consumer)}  # type: ignore[attr-defined]
        return {"done": all(s is TransferState.DONE for s in states), "intact": intact, "sockets": sockets}
    finally:
        backend.close()
        pools.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))))
