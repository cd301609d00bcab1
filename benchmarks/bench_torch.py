"""Benchmark the torch backend against raw torch.distributed send/recv of the same bytes between the same processes.

Run: ``.venv/bin/python benchmarks/bench_torch.py [--sizes 64K,2M] [--blocks 1000] [--reps 5]``

Workload (docs/backends/torch.md, Measured): one pool of ``--pool`` bytes per side, cut
into pages of B bytes; one request moves K = min(--blocks, pool/B/2) pages
from random producer ids to different random consumer ids (``rand``). For
2 MiB pages and a 512 MiB pool that is 128 pages (256 MiB); pass
``--pool 4G --blocks 1000`` for the full 1,000 (two 4 GiB shared blocks).

Compared, between the very same two worker processes and process group:

- ``backend READ`` / ``backend WRITE``: ``post`` to ``DONE`` seen by this
  process (validation, coalescing, pipe round trips included).
- ``raw isend``: one ``send``/``recv`` per page straight into pool views, all
  posted, then waited.
- ``raw gather``: copy the pages into one buffer, one send, scatter.
- ``raw contig``: one send of K·B contiguous bytes (no page semantics; the
  transport's ceiling).

Prints GB/s (1e9 bytes/s, medians) and the ratio of the backend to the best
raw non-contiguous pattern (target 0.8), plus start-up times. No assertions.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from kvspec import TransferMode
from kvspec.transport import Descriptor, MemoryRegion, TransferState
from kvspec.transport.torch_dist import TorchAgent, TorchDistributedBackend

__all__ = ["main"]

_RAW_TAG = 1 << 29


def raw_transfer(
    worker: Any, peer: str, role: str, method: str, spans: Sequence[tuple[int, int]], reps: int
) -> list[float]:
    """Runs inside a worker: move ``spans`` (offset, nbytes) of region 0 with a raw pattern; returns seconds per rep."""
    import torch

    group, peer_rank = worker.process_group(peer)
    pool = worker.region(0)
    views = [pool.narrow(0, off, n) for off, n in spans]
    total = sum(n for _, n in spans)
    staging = torch.empty(total, dtype=torch.uint8)
    staging.fill_(0)  # touch the pages before timing
    times: list[float] = []
    for _ in range(reps):
        group.barrier().wait()
        started = time.perf_counter()
        if method == "isend":
            op = group.send if role == "send" else group.recv
            works = [op([view], peer_rank, _RAW_TAG) for view in views]
            for work in works:
                work.wait()
        elif method == "gather":
            if role == "send":
                torch.cat(views, out=staging)
                group.send([staging], peer_rank, _RAW_TAG).wait()
            else:
                group.recv([staging], peer_rank, _RAW_TAG).wait()
                offset = 0
                for view in views:
                    view.copy_(staging.narrow(0, offset, view.numel()))
                    offset += view.numel()
        elif method == "contig":
            contiguous = pool.narrow(0, 0, total)
            op = group.send if role == "send" else group.recv
            op([contiguous], peer_rank, _RAW_TAG).wait()
        times.append(time.perf_counter() - started)
    return times


def _raw(
    producer: TorchAgent, consumer: TorchAgent, method: str, pids: list[int], cids: list[int], size: int, reps: int
) -> float:
    """Median seconds of a raw pattern, timed on the receiver."""
    results: dict[str, list[float]] = {}

    def run(agent: TorchAgent, peer: str, role: str, ids: list[int]) -> None:
        spans = [(i * size, size) for i in ids]
        results[role] = agent.call_in_worker(raw_transfer, peer, role, method, spans, reps, timeout_s=600)

    sender = threading.Thread(target=run, args=(producer, consumer.name, "send", pids))
    sender.start()
    run(consumer, producer.name, "recv", cids)
    sender.join()
    return statistics.median(results["recv"])


def _backend(initiator: TorchAgent, peer: str, mode: TransferMode, descriptors: list[Descriptor], reps: int) -> float:
    times: list[float] = []
    for _ in range(reps):
        started = time.perf_counter()
        handle = initiator.post(mode, descriptors, peer=peer)
        status = initiator.check(handle)
        while status.state is TransferState.PENDING:
            status = initiator.check(handle)
        times.append(time.perf_counter() - started)
        initiator.release(handle)
        if status.state is not TransferState.DONE:
            raise RuntimeError(f"{mode.value} failed: {status}")
    return statistics.median(times)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _pool(nbytes: int) -> Any:
    """A one-region shared pool of ``nbytes`` (kvspec.testing's pool needs a KV config; a raw block is simpler)."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    assert shm.buf is not None
    return shm


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,2M", help="page sizes, comma separated (default 64K,2M)")
    parser.add_argument("--blocks", type=int, default=1000, help="pages per request, at most half the pool")
    parser.add_argument("--pool", default="512M", help="bytes per pool (default 512M)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", default="1M", help="backend staging message size")
    parser.add_argument("--ring", type=int, default=8, help="backend staging buffers per transfer")
    parser.add_argument("--check-wait", type=float, default=0.001, help="backend check_wait_s")
    parser.add_argument("--stage-below", default="32K", help="backend stage_below (0: never stage)")
    args = parser.parse_args(argv)
    pool_bytes = _size(args.pool)
    rng = random.Random(args.seed)

    started = time.perf_counter()
    backend = TorchDistributedBackend(
        timeout_s=120.0,
        chunk_bytes=_size(args.chunk),
        ring=args.ring,
        check_wait_s=args.check_wait,
        stage_below=_size(args.stage_below),
    )
    producer, consumer = backend.create_agent("producer"), backend.create_agent("consumer")
    shms = [_pool(pool_bytes), _pool(pool_bytes)]
    try:
        piece = 4 << 20
        for offset in range(0, pool_bytes, piece):  # random bytes so that a misplaced page shows
            end = min(offset + piece, pool_bytes)
            shms[0].buf[offset:end] = rng.randbytes(end - offset)
        for agent, shm in zip((producer, consumer), shms, strict=True):
            agent.register_memory([MemoryRegion(buffer=shm.buf[:pool_bytes], shm_name=shm.name)])
        ready = time.perf_counter() - started
        paired = time.perf_counter()
        consumer.add_remote_agent(producer.get_agent_metadata())
        producer.add_remote_agent(consumer.get_agent_metadata())
        paired = time.perf_counter() - paired
        when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        print(f"# torch backend benchmark, {when}, torch {producer.torch_version}, load {os.getloadavg()[0]:.1f}")
        print(f"# pids: producer {producer.pid}, consumer {consumer.pid}")
        print(
            f"start-up: backend with two workers spawned and ready {ready:.2f} s; pairing (control connections "
            f"and the gloo process group) {paired * 1e3:.1f} ms"
        )
        print()
        print(
            "| page | K | payload MB | backend READ | backend WRITE | raw isend | raw gather | raw contig "
            "| READ/best | WRITE/best |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for text in args.sizes.split(","):
            size = _size(text)
            count = min(args.blocks, pool_bytes // size // 2)
            pids = rng.sample(range(pool_bytes // size), count)
            cids = rng.sample(range(pool_bytes // size), count)
            payload = count * size
            read = [
                Descriptor(local_region=0, local_offset=c * size, remote_region=0, remote_offset=p * size, nbytes=size)
                for p, c in zip(pids, cids, strict=True)
            ]
            write = [
                Descriptor(local_region=0, local_offset=p * size, remote_region=0, remote_offset=c * size, nbytes=size)
                for p, c in zip(pids, cids, strict=True)
            ]
            # Warm-up, and a byte check of both directions (the WRITE lands back where the READ put it).
            _backend(consumer, producer.name, TransferMode.READ, read, 1)
            shms[1].buf[:pool_bytes] = bytes(pool_bytes)
            _backend(producer, consumer.name, TransferMode.WRITE, write, 1)
            ok = all(
                shms[1].buf[c * size : (c + 1) * size] == shms[0].buf[p * size : (p + 1) * size]
                for p, c in zip(pids, cids, strict=True)
            )
            if not ok:
                raise RuntimeError("the backend moved wrong bytes")
            # Interleave the methods rep by rep: the load on a shared machine drifts more than they differ.
            times: dict[str, list[float]] = {k: [] for k in ("READ", "WRITE", "isend", "gather", "contig")}
            for _ in range(args.reps):
                times["READ"].append(_backend(consumer, producer.name, TransferMode.READ, read, 1))
                times["WRITE"].append(_backend(producer, consumer.name, TransferMode.WRITE, write, 1))
                for method in ("isend", "gather", "contig"):
                    times[method].append(_raw(producer, consumer, method, pids, cids, size, 1))
            gbps = {k: payload / statistics.median(v) / 1e9 for k, v in times.items()}
            best = max(gbps["isend"], gbps["gather"])
            print(
                f"| {text} | {count} | {payload / 1e6:.0f} | {gbps['READ']:.2f} | {gbps['WRITE']:.2f} | "
                f"{gbps['isend']:.2f} | {gbps['gather']:.2f} | {gbps['contig']:.2f} | "
                f"{gbps['READ'] / best:.2f} | {gbps['WRITE'] / best:.2f} |",
                flush=True,
            )
    finally:
        backend.close()
        for shm in shms:
            shm.close()
            shm.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
