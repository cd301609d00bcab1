"""Benchmark: the kvspec Mooncake backend vs the raw Transfer Engine, in the same worker processes, paired runs.

Usage::

    .venv/bin/python benchmarks/bench_mooncake.py                  # 16 KiB, 64 KiB, 2 MiB pages, READ and WRITE
    .venv/bin/python benchmarks/bench_mooncake.py --quick          # a smaller pool, fewer pairs
    .venv/bin/python benchmarks/bench_mooncake.py --sizes 64k --modes read --json out.json

Workload (docs/backends/mooncake.md, Measured): a pool of ``--pool-mib`` MiB per
side split into pages of B bytes; one request moves K = min(1000, N/2) pages
(N pages per pool) from random producer pages to random consumer pages.

Methods, both between the same two worker processes (one Transfer Engine each, TCP):

* ``kvspec``: :class:`kvspec.transport.mooncake.MooncakeAgent` ``post`` +
  ``check`` until DONE + ``release``, timed in this process (a pipe round trip
  per call, the waiter thread, ``get_batch_transfer_status``).
* ``raw``: inside the initiator's worker, on its engine: the same merged
  address lists, built before timing, moved with ``batch_transfer_sync_read``
  or ``_write`` (what a direct caller of the engine writes).

Each pair runs kvspec and raw back to back, in alternating order, so noise
from other processes hits both alike; the ratio is ``raw time / kvspec time``
per pair (kvspec's throughput as a fraction of raw), and the median of the
pairs is reported (goal >= 0.9). Every method's first request is checked byte
for byte. No assertion is made on timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from kvspec import TransferMode
from kvspec.transport import DescriptorList, MemoryRegion, TransferState, _mooncake_worker
from kvspec.transport.mooncake import MooncakeBackend


def raw_op(
    worker: _mooncake_worker.Worker, mode: str, block: int, local: list[int], remote: list[int], peer: str
) -> float:
    """Seconds for one raw synchronous batch of the given pages (region 0 on both sides), in the worker."""
    session, remote_base = worker.peers[peer][3], int(worker.peers[peer][1][0])
    local_base = int(worker.region_base[0])
    local_addresses = [local_base + i * block for i in local]
    remote_addresses = [remote_base + i * block for i in remote]
    lengths = [block] * len(local)
    move = worker.engine.batch_transfer_sync_read if mode == "READ" else worker.engine.batch_transfer_sync_write
    start = time.perf_counter()
    code = move(session, local_addresses, remote_addresses, lengths)
    elapsed = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"raw batch_transfer_sync_{mode.lower()} returned {code}")
    return elapsed


if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    # Worker mode: serve one Mooncake agent, plus the raw timing request above.
    _mooncake_worker.main(sys.argv[2:], extra_ops={"raw": raw_op})
    sys.exit(0)

KIB, MIB = 1024, 1024 * 1024
SIZES = {"16k": 16 * KIB, "64k": 64 * KIB, "2m": 2 * MIB}


class Bench:
    """Two shared-memory pools and a producer and a consumer agent in worker processes."""

    def __init__(self, pool_mib: int) -> None:
        import numpy as np

        pool = pool_mib * MIB
        self.shms = [shared_memory.SharedMemory(create=True, size=pool) for _ in range(2)]
        self.producer_buf, self.consumer_buf = (shm.buf for shm in self.shms)
        np.frombuffer(self.producer_buf, dtype=np.uint64)[:] = np.arange(pool // 8, dtype=np.uint64)  # type: ignore[arg-type]
        self.backend = MooncakeBackend(worker_command=[sys.executable, str(Path(__file__).resolve()), "--worker"])
        self.producer, self.consumer = self.backend.create_agent("producer"), self.backend.create_agent("consumer")
        self.producer.register_memory([MemoryRegion(buffer=self.producer_buf, shm_name=self.shms[0].name)])  # type: ignore[arg-type]
        self.consumer.register_memory([MemoryRegion(buffer=self.consumer_buf, shm_name=self.shms[1].name)])  # type: ignore[arg-type]
        self.consumer.add_remote_agent(self.producer.get_agent_metadata())
        self.producer.add_remote_agent(self.consumer.get_agent_metadata())

    def close(self) -> None:
        self.backend.close()
        del self.producer_buf, self.consumer_buf
        for shm in self.shms:
            shm.close()
            shm.unlink()

    def kvspec(self, mode: TransferMode, block: int, local: list[int], remote: list[int]) -> float:
        agent, peer = (self.consumer, "producer") if mode is TransferMode.READ else (self.producer, "consumer")
        descriptors = DescriptorList.from_columns(  # packed, as TransferPlan.to_descriptors hands them over
            local_region=[0] * len(local),
            local_offset=[i * block for i in local],
            remote_region=[0] * len(remote),
            remote_offset=[i * block for i in remote],
            nbytes=[block] * len(local),
        )
        start = time.perf_counter()
        handle = agent.post(mode, descriptors, peer=peer)
        while (status := agent.check(handle)).state is TransferState.PENDING:
            pass
        agent.release(handle)
        elapsed = time.perf_counter() - start
        if status.state is not TransferState.DONE:
            raise SystemExit(f"kvspec transfer ended {status}")
        return elapsed

    def raw(self, mode: TransferMode, block: int, local: list[int], remote: list[int]) -> float:
        agent, peer = (self.consumer, "producer") if mode is TransferMode.READ else (self.producer, "consumer")
        elapsed = agent._call("raw", mode.name, block, local, remote, peer, timeout=600.0)
        assert isinstance(elapsed, float)
        return elapsed

    def verify(self, block: int, p_ids: list[int], c_ids: list[int], method: str) -> None:
        for p, c in zip(p_ids, c_ids, strict=True):
            if self.consumer_buf[c * block : (c + 1) * block] != self.producer_buf[p * block : (p + 1) * block]:  # type: ignore[index]
                raise SystemExit(f"{method}: consumer page {c} does not hold producer page {p}")
        for c in c_ids:
            self.consumer_buf[c * block : (c + 1) * block] = bytes(block)  # type: ignore[index]

    def measure(self, mode: TransferMode, block: int, pairs: int, rng: random.Random) -> dict[str, Any]:
        pages = self.shms[0].size // block
        count = min(1000, pages // 2)
        p_ids, c_ids = rng.sample(range(pages), count), rng.sample(range(pages), count)
        local, remote = (c_ids, p_ids) if mode is TransferMode.READ else (p_ids, c_ids)
        for method in (self.kvspec, self.raw):  # warm up (connections, first touch) and check the bytes
            method(mode, block, local, remote)
            self.verify(block, p_ids, c_ids, method.__name__)
        ratios, kv_times, raw_times = [], [], []
        for index in range(pairs):
            order = (self.kvspec, self.raw) if index % 2 == 0 else (self.raw, self.kvspec)
            timed = {method.__name__: method(mode, block, local, remote) for method in order}
            kv_times.append(timed["kvspec"])
            raw_times.append(timed["raw"])
            ratios.append(timed["raw"] / timed["kvspec"])
        nbytes = count * block
        return {
            "mode": mode.value,
            "page": block,
            "pages": count,
            "kvspec_gbps": nbytes / statistics.median(kv_times) / 1e9,
            "raw_gbps": nbytes / statistics.median(raw_times) / 1e9,
            "kvspec_ms": statistics.median(kv_times) * 1e3,
            "raw_ms": statistics.median(raw_times) * 1e3,
            "ratio": statistics.median(ratios),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16k,64k,2m", help="page sizes among 16k, 64k, 2m (default all)")
    parser.add_argument("--modes", default="read,write", help="read, write or both (default both)")
    parser.add_argument("--pool-mib", type=int, default=256, help="MiB per pool (default 256)")
    parser.add_argument("--pairs", type=int, default=15, help="paired runs per size and mode (default 15)")
    parser.add_argument("--quick", action="store_true", help="a 64 MiB pool and 5 pairs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.pool_mib, args.pairs = 64, 5
    bench = Bench(args.pool_mib)
    rng = random.Random(27)
    results = []
    try:
        print(f"{'mode':5} {'page':>6} {'pages':>5} {'kvspec GB/s':>11} {'raw GB/s':>9} {'extra ms':>8} {'ratio':>6}")
        for mode in (TransferMode(m.strip().lower()) for m in args.modes.split(",")):
            for size in args.sizes.split(","):
                row = bench.measure(mode, SIZES[size.strip().lower()], args.pairs, rng)
                results.append(row)
                print(
                    f"{row['mode']:5} {size:>6} {row['pages']:>5} {row['kvspec_gbps']:>11.2f} {row['raw_gbps']:>9.2f} "
                    f"{row['kvspec_ms'] - row['raw_ms']:>8.2f} {row['ratio']:>6.2f}",
                    flush=True,
                )
    finally:
        bench.close()
    if args.json is not None:
        meta = {"python": platform.python_version(), "machine": platform.machine(), "pairs": args.pairs}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
