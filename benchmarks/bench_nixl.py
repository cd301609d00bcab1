"""Benchmark: the kvspec NIXL backend vs raw NIXL on the same descriptors and processes, and vs memcpy.

Usage::

    .venv/bin/python benchmarks/bench_nixl.py                 # 16 KiB, 64 KiB, 2 MiB pages
    .venv/bin/python benchmarks/bench_nixl.py --quick         # a smaller pool, fewer repetitions
    .venv/bin/python benchmarks/bench_nixl.py --tls tcp       # UCX_TLS=tcp instead of the default (CMA)
    .venv/bin/python benchmarks/bench_nixl.py --configs in-process --sizes 16k
    .venv/bin/python benchmarks/bench_nixl.py --netns --sizes 64k,2m --modes read   # two simulated hosts (root)

Workload (docs/backends/nixl.md, Measured): a pool of ``--pool-mib`` MiB per side
split into blocks of B bytes; one request moves K = min(1000, N/2) blocks
(K = 128 at 2 MiB with a 512 MiB pool) from producer ids to different consumer
ids. ``rand``: K random ids on each side, chosen independently; ``runs16``:
the same count laid out as runs of 16 adjacent ids on both sides.

Configurations (``--configs``), each between the same two processes for kvspec and raw NIXL:

* ``workers``: both agents in worker processes, as the conformance suite runs
  them; kvspec calls reach the initiator's agent over a pipe, raw NIXL is
  timed inside that worker.
* ``in-process``: the initiator's agent (the consumer for READ, the producer
  for WRITE) in this process (``NixlBackend(in_process=...)``), as an engine
  runs its own agent, and its peer in a worker; raw NIXL is timed in this
  process on the same agent.

Methods, timed per request (median of ``--reps``):

* ``kvspec``: :class:`kvspec.transport.nixl.NixlAgent` ``post`` + ``check``
  until DONE + ``release``, timed in this process. The descriptors are a
  :class:`kvspec.transport.DescriptorList` built before timing, as
  ``TransferPlan.to_descriptors`` hands them over, like raw NIXL's index
  arrays; "pack ms" is what a plain list of ``Descriptor`` objects would add.
* ``raw-prep``: the same NIXL agent and connection: ``make_prepped_xfer`` on
  lists prepared once over every block of both pools (NIXL merges adjacent
  blocks) + ``transfer`` + polling ``check_xfer_state`` + ``release_xfer_handle``.
* ``raw-init``: the same, with one descriptor per block through
  ``get_xfer_descs`` + ``initialize_xfer`` (no merging), as a naive caller would.
* ``memcpy``: one process copying the same blocks between the two
  shared-memory pools with memoryview slice assignment.

``--netns`` puts the two agents on two simulated hosts: network namespaces
``kvb-p`` and ``kvb-c`` joined by a veth pair (10.79.0.1 and 10.79.0.2, device
``kvb0`` on both sides), each worker started inside its namespace with
``ip netns exec``, UCX on ``tcp`` over ``kvb0`` only (``net_devices``), so no
byte crosses by shared memory or CMA. It implies ``--configs workers --tls tcp``
and needs root; the namespaces are deleted at the end. ``memcpy`` stays the
same-host copy.

The methods are timed in turns, so that noise from other processes on the
machine hits them alike. The ratio printed is ``kvspec / raw-prep`` of the
medians (target >= 0.9), then of the best requests; "extra ms" is what a
request costs kvspec beyond raw NIXL (median difference). Every method's
warm-up request is checked byte for byte. No assertion is made on timings.
The UCX transports in use are read from the agents' UCX logs
(``UCX_PROTO_INFO=y``) and printed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from kvspec import TransferMode
from kvspec.transport import Descriptor, DescriptorList, MemoryRegion, TransferState, _nixl_worker
from kvspec.transport.nixl import NixlAgent, NixlBackend


def raw_op(
    worker: _nixl_worker.Worker,
    style: str,
    mode: str,
    block: int,
    local_ids: list[int],
    remote_ids: list[int],
    peer: str,
    reps: int,
) -> list[float]:
    """Time ``reps`` raw NIXL requests of the given blocks (region 0 on both sides)."""
    np = worker.np
    agent = worker.agent
    _, remote_base, remote_size = worker.peers[peer]
    local_base, local_size = int(worker.region_base[0]), int(worker.region_size[0])
    lidx = np.asarray(local_ids, dtype=np.int64)
    ridx = np.asarray(remote_ids, dtype=np.int64)
    cache: dict[Any, Any] = worker.__dict__.setdefault("bench_prepped", {})
    if style == "prep" and (peer, block) not in cache:

        def every_block(base: int, size: int) -> Any:
            count = size // block
            rows = np.zeros((count, 3), dtype=np.uint64)
            rows[:, 0] = base + np.arange(count, dtype=np.uint64) * block
            rows[:, 1] = block
            return rows

        cache[(peer, block)] = (
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", every_block(local_base, local_size), "DRAM"),
            agent.prep_xfer_dlist(peer, every_block(int(remote_base[0]), int(remote_size[0])), "DRAM"),
        )
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        if style == "prep":
            local_h, remote_h = cache[(peer, block)]
            handle = agent.make_prepped_xfer(mode, local_h, lidx.astype(np.int32), remote_h, ridx.astype(np.int32))
        else:
            zeros = np.zeros(len(lidx), dtype=np.uint64)
            sizes = np.full(len(lidx), block, dtype=np.uint64)
            local = np.column_stack((local_base + lidx * block, sizes, zeros)).astype(np.uint64)
            remote = np.column_stack((int(remote_base[0]) + ridx * block, sizes, zeros)).astype(np.uint64)
            handle = agent.initialize_xfer(
                mode, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer
            )
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        times.append(time.perf_counter() - start)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended {state}")
    return times


if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    # Worker mode: serve one NIXL agent, plus the raw-NIXL timing request above.
    _nixl_worker.main(sys.argv[2:], extra_ops={"raw": raw_op})
    sys.exit(0)


KIB, MIB = 1024, 1024 * 1024
GB = 1e9


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size like 16k or 2m, got {text!r}")
    return int(match.group(1)) * {"": 1, "k": KIB, "m": MIB}[match.group(2).lower()]


def block_ids(pattern: str, count: int, num_blocks: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(producer ids, consumer ids) of one request."""
    if pattern == "rand":
        return rng.sample(range(num_blocks), count), rng.sample(range(num_blocks), count)
    runs = count // 16
    starts = [16 * i for i in range(num_blocks // 16)]
    return (
        [s + j for s in rng.sample(starts, runs) for j in range(16)],
        [s + j for s in rng.sample(starts, runs) for j in range(16)],
    )


class Bench:
    """Two pools, one backend with a producer and a consumer agent, and the timing loops."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        import numpy as np

        self.np = np
        self.args = args
        pool = args.pool_mib * MIB
        self.shms = [shared_memory.SharedMemory(create=True, size=pool) for _ in range(2)]
        self.producer_buf, self.consumer_buf = (shm.buf for shm in self.shms)
        # Every 8-byte word unique, so a misplaced block is always seen.
        np.frombuffer(self.producer_buf, dtype=np.uint64)[:] = np.arange(pool // 8, dtype=np.uint64)  # type: ignore[arg-type]
        env = (
            {}
            if args.no_ucx_log
            else {
                "UCX_LOG_LEVEL": "info",
                "UCX_PROTO_INFO": "y",
                "UCX_LOG_FILE": str(log_dir / "ucx.%p.log"),
            }
        )
        self.env = env
        # (backend, producer, consumer) per configuration and mode; built on first use.
        self.pairs: dict[tuple[str, TransferMode], tuple[NixlBackend, NixlAgent, NixlAgent]] = {}
        self.backends: list[NixlBackend] = []
        self.config = "workers"
        self.netns = bool(args.netns)

    def pair(self, mode: TransferMode) -> tuple[NixlAgent, NixlAgent]:
        """The producer and consumer agents of the current configuration for ``mode``.

        ``workers``: both agents in worker processes, one backend for both
        modes. ``in-process``: the initiator (the consumer for READ, the
        producer for WRITE) in this process, its peer in a worker.
        """
        key = (self.config, mode) if self.config == "in-process" else (self.config, TransferMode.READ)
        if key not in self.pairs and self.netns:
            self.pairs[key] = self._netns_pair()
        if key not in self.pairs:
            local = None if self.config == "workers" else ("consumer" if mode is TransferMode.READ else "producer")
            backend = NixlBackend(
                tls=self.args.tls,
                env=self.env,
                in_process=local,
                worker_command=[sys.executable, str(Path(__file__).resolve()), "--worker"],
            )
            self.backends.append(backend)
            producer, consumer = backend.create_agent("producer"), backend.create_agent("consumer")
            producer.register_memory([MemoryRegion(buffer=self.producer_buf, shm_name=self.shms[0].name)])  # type: ignore[arg-type]
            consumer.register_memory([MemoryRegion(buffer=self.consumer_buf, shm_name=self.shms[1].name)])  # type: ignore[arg-type]
            consumer.add_remote_agent(producer.get_agent_metadata())
            producer.add_remote_agent(consumer.get_agent_metadata())
            self.pairs[key] = (backend, producer, consumer)
        _, producer, consumer = self.pairs[key]
        return producer, consumer

    def _netns_pair(self) -> tuple[NixlBackend, NixlAgent, NixlAgent]:
        """Producer and consumer in workers on two simulated hosts, UCX over tcp on ``kvb0`` (``--netns``)."""
        agents = []
        for role, namespace in (("producer", NETNS[0]), ("consumer", NETNS[1])):
            backend = NixlBackend(
                tls="tcp",
                env={**self.env, "UCX_NET_DEVICES": NETNS_DEVICE},
                worker_command=[
                    "ip",
                    "netns",
                    "exec",
                    namespace,
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                ],
            )
            self.backends.append(backend)
            agents.append(backend.create_agent(role))
        producer, consumer = agents
        producer.register_memory([MemoryRegion(buffer=self.producer_buf, shm_name=self.shms[0].name)])  # type: ignore[arg-type]
        consumer.register_memory([MemoryRegion(buffer=self.consumer_buf, shm_name=self.shms[1].name)])  # type: ignore[arg-type]
        consumer.add_remote_agent(producer.get_agent_metadata())
        producer.add_remote_agent(consumer.get_agent_metadata())
        return self.backends[-1], producer, consumer

    def close_backends(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends.clear()
        self.pairs.clear()

    def close(self) -> None:
        self.close_backends()
        for shm in self.shms:
            shm.close()
            shm.unlink()

    def clear(self, block: int, consumer_ids: list[int]) -> None:
        for c in consumer_ids:
            self.consumer_buf[c * block : (c + 1) * block] = bytes(block)  # type: ignore[index]

    def verify(self, block: int, producer_ids: list[int], consumer_ids: list[int], method: str) -> None:
        for p, c in zip(producer_ids, consumer_ids, strict=True):
            if self.consumer_buf[c * block : (c + 1) * block] != self.producer_buf[p * block : (p + 1) * block]:  # type: ignore[index]
                raise SystemExit(f"{method}: consumer block {c} does not hold producer block {p}")

    def initiator(self, mode: TransferMode) -> tuple[NixlAgent, str]:
        # READ: the consumer pulls; WRITE: the producer pushes (Descriptor local = initiator).
        producer, consumer = self.pair(mode)
        return (consumer, "producer") if mode is TransferMode.READ else (producer, "consumer")

    def run_kvspec(self, mode: TransferMode, block: int, local: list[int], remote: list[int], reps: int) -> list[float]:
        agent, peer = self.initiator(mode)
        # Packed, as TransferPlan.to_descriptors hands them over (a plain list costs pack_ms more).
        descriptors = DescriptorList.from_columns(
            local_region=[0] * len(local),
            local_offset=[i * block for i in local],
            remote_region=[0] * len(remote),
            remote_offset=[i * block for i in remote],
            nbytes=[block] * len(local),
        )
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            handle = agent.post(mode, descriptors, peer=peer)
            while (status := agent.check(handle)).state is TransferState.PENDING:
                pass
            agent.release(handle)
            times.append(time.perf_counter() - start)
            if status.state is not TransferState.DONE:
                raise SystemExit(f"kvspec transfer ended {status}")
        return times

    def run_raw(
        self, style: str, mode: TransferMode, block: int, local: list[int], remote: list[int], reps: int
    ) -> list[float]:
        agent, peer = self.initiator(mode)
        if agent.in_process:
            # The same NIXL agent, prepared lists and connection, in this process.
            return raw_op(agent._worker, style, mode.name, block, local, remote, peer, reps)  # type: ignore[arg-type]
        times = agent._call("raw", style, mode.name, block, local, remote, peer, reps, timeout=600.0)
        assert isinstance(times, list)
        return times

    def run_memcpy(self, block: int, producer_ids: list[int], consumer_ids: list[int], reps: int) -> list[float]:
        pairs = [
            (self.consumer_buf[c * block : (c + 1) * block], self.producer_buf[p * block : (p + 1) * block])  # type: ignore[index]
            for p, c in zip(producer_ids, consumer_ids, strict=True)
        ]
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for destination, source in pairs:
                destination[:] = source
            times.append(time.perf_counter() - start)
        for destination, source in pairs:
            destination.release()
            source.release()
        return times

    def run(
        self, method: str, mode: TransferMode, block: int, p_ids: list[int], c_ids: list[int], n: int
    ) -> list[float]:
        local, remote = (c_ids, p_ids) if mode is TransferMode.READ else (p_ids, c_ids)
        if method == "kvspec":
            return self.run_kvspec(mode, block, local, remote, n)
        if method in ("raw-prep", "raw-init"):
            return self.run_raw(method[4:], mode, block, local, remote, n)
        return self.run_memcpy(block, p_ids, c_ids, n)

    def measure(self, mode: TransferMode, block: int, p_ids: list[int], c_ids: list[int]) -> dict[str, list[float]]:
        """Warm up and check the bytes of every method, then time them in turns (fair under noise); medians."""
        for method in METHODS:
            self.clear(block, c_ids)
            self.run(method, mode, block, p_ids, c_ids, 1)
            self.verify(block, p_ids, c_ids, method)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for _ in range(self.args.reps):
            for method in METHODS:
                times[method] += self.run(method, mode, block, p_ids, c_ids, 1)
        return times


METHODS = ("kvspec", "raw-prep", "raw-init", "memcpy")
NETNS = ("kvb-p", "kvb-c")
NETNS_DEVICE = "kvb0"
NETNS_ADDRESSES = ("10.79.0.1/24", "10.79.0.2/24")


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


def netns_up() -> None:
    """Two namespaces joined by a veth pair, ``kvb0`` on each side, loopback up (``--netns``)."""
    netns_down()
    for namespace in NETNS:
        _ip("netns", "add", namespace)
    _ip("link", "add", "kvbp", "type", "veth", "peer", "name", "kvbc")
    for device, namespace, address in zip(("kvbp", "kvbc"), NETNS, NETNS_ADDRESSES, strict=True):
        _ip("link", "set", device, "netns", namespace)
        _ip("-n", namespace, "link", "set", device, "name", NETNS_DEVICE)
        _ip("-n", namespace, "addr", "add", address, "dev", NETNS_DEVICE)
        _ip("-n", namespace, "link", "set", NETNS_DEVICE, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")


def netns_down() -> None:
    for namespace in NETNS:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def packing_ms(block: int, p_ids: list[int], c_ids: list[int]) -> float:
    """Median ms to pack a plain list of Descriptor objects into a DescriptorList (what post does with one)."""
    plain = [
        Descriptor(local_region=0, local_offset=c * block, remote_region=0, remote_offset=p * block, nbytes=block)
        for p, c in zip(p_ids, c_ids, strict=True)
    ]
    times = []
    for _ in range(21):
        start = time.perf_counter()
        DescriptorList(plain)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# A UCX_PROTO_INFO table of the connection between the agents: "| <agent> intra-node cfg#N |",
# "| <title> |", then rows "| range | description | config |" up to the next table.
TABLE = (
    r"\| \S+ intra-node cfg#\d+ +\|\n.*?\| (remote memory (?:read|write)[^|]*?) +\|\n"
    r"(.*?)(?=\n[^\n]*\+-+\+\n[^\n]*\+-+\+|\Z)"
)


def transports(log_dir: Path) -> list[str]:
    """Summarise the UCX lanes and the get/put protocols of the connection between the two agents."""
    lines: list[str] = []
    for log in sorted(log_dir.glob("ucx.*.log")):
        text = log.read_text(errors="replace")
        for lanes in re.findall(r"UCX\s+INFO\s+(\S+ (?:intra|inter)-node cfg#\d+ .*)", text):
            lines.append(f"lanes: {lanes.strip()}")
        for title, body in re.findall(TABLE, text, flags=re.S):
            rows = re.findall(r"\|\s*([\d.]+(?:\.\.\w+)?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|", body)
            lines.append(f"{title.strip()}: " + "; ".join(f"{r} {d} {c}" for r, d, c in rows))
    return sorted(set(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")], default="16k,64k,2m")
    parser.add_argument("--patterns", type=lambda s: s.split(","), default="rand,runs16")
    parser.add_argument("--modes", type=lambda s: [TransferMode[x.upper()] for x in s.split(",")], default="read,write")
    parser.add_argument(
        "--configs",
        type=lambda s: s.split(","),
        default="workers,in-process",
        help="where the initiating agent runs: in a worker process, or in this process",
    )
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=1000, help="blocks per request (at most half the pool)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tls", choices=["tcp"], default=None, help="UCX_TLS for the workers (default: UCX picks)")
    parser.add_argument("--quick", action="store_true", help="128 MiB pool, 3 repetitions")
    parser.add_argument("--no-ucx-log", action="store_true", help="do not collect UCX protocol logs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--netns", action="store_true", help="the two agents on two simulated hosts (network namespaces; root)"
    )
    args = parser.parse_args()
    if args.netns:
        args.configs, args.tls = ["workers"], "tcp"
        netns_up()
    if args.quick:
        args.pool_mib, args.reps = 128, 3
    log_dir = Path(tempfile.mkdtemp(prefix="kvspec-bench-nixl-"))
    print(f"# kvspec NIXL backend benchmark, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {platform.node()}, {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"# pool {args.pool_mib} MiB per side, median of {args.reps}, UCX_TLS={args.tls or '(default)'}")
    if args.netns:
        print(f"# two simulated hosts: namespaces {NETNS[0]} and {NETNS[1]}, UCX over tcp on {NETNS_DEVICE} only")
    bench = Bench(args, log_dir)
    results: list[dict[str, Any]] = []
    header = f"{'mode':5} {'pattern':7} {'page':>5} {'K':>5} {'config':10}  " + "  ".join(f"{m:>9}" for m in METHODS)
    print(header + "  kvspec/raw-prep (best)  kvspec/memcpy  extra ms  pack ms   (GB/s, medians)")
    try:
        # One configuration at a time, its backends closed after it, so that only its own
        # workers share the machine with the timed requests.
        for config in args.configs:
            bench.config = config
            for block in args.sizes:
                num_blocks = args.pool_mib * MIB // block
                count = min(args.blocks, num_blocks // 2)
                for pattern in args.patterns:
                    # The same ids for every configuration.
                    rng = random.Random(f"{block}-{pattern}")
                    p_ids, c_ids = block_ids(
                        pattern, count - count % 16 if pattern == "runs16" else count, num_blocks, rng
                    )
                    payload = len(p_ids) * block
                    pack_ms = packing_ms(block, p_ids, c_ids)
                    for mode in args.modes:
                        times = bench.measure(mode, block, p_ids, c_ids)
                        gbps = {m: payload / statistics.median(t) / GB for m, t in times.items()}
                        best = {m: payload / min(t) / GB for m, t in times.items()}
                        ratio, vs_memcpy = gbps["kvspec"] / gbps["raw-prep"], gbps["kvspec"] / gbps["memcpy"]
                        best_ratio = best["kvspec"] / best["raw-prep"]
                        # What a request costs kvspec beyond raw NIXL (pipe round trip, checks, bookkeeping).
                        extra_ms = (statistics.median(times["kvspec"]) - statistics.median(times["raw-prep"])) * 1e3
                        page = f"{block // KIB}K" if block < MIB else f"{block // MIB}M"
                        print(
                            f"{mode.name:5} {pattern:7} {page:>5} {len(p_ids):>5} {config:10}  "
                            + "  ".join(f"{gbps[m]:9.2f}" for m in METHODS)
                            + f"  {ratio:15.2f} ({best_ratio:4.2f})  {vs_memcpy:13.2f}"
                            + f"  {extra_ms:8.2f}  {pack_ms:7.2f}",
                            flush=True,
                        )
                        results.append(
                            {
                                "mode": mode.name,
                                "pattern": pattern,
                                "block": block,
                                "blocks": len(p_ids),
                                "config": config,
                                "pack_ms": pack_ms,
                                "seconds": times,
                            }
                        )
            bench.close_backends()
    finally:
        bench.close()
        if args.netns:
            netns_down()
    print("\n# UCX transports (from UCX_PROTO_INFO in the agents' logs)")
    for line in transports(log_dir) or ["(no UCX log collected)"]:
        print(f"#   {line}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, default=str)
        )


if __name__ == "__main__":
    main()
