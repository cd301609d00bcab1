"""What INT-1 costs: a whole request with the integrity check on, as a ratio to the same request without it.

Run: ``.venv/bin/python benchmarks/bench_integrity.py [--reps N] [--backend loopback]``. For each
(mode, request size) it runs the same request over two endpoint pairs in this process, one with
integrity off and one with it on, alternately, and prints the median time of each and their ratio;
then the raw digest rate (BLAKE2b-128 over pages, one core) next to a plain copy of the same bytes.
Asserts nothing about time (timing lives in benchmarks, never in tests).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvspec import BlockIds, KVCacheConfig, PageDigester, TransferMode
from kvspec.exchange import ConsumerEndpoint, ProducerEndpoint, connect, run_request
from kvspec.presets import get_preset
from kvspec.protocol._summary import blocks_needed_for
from kvspec.testing import PagePool, allocate_pool, fill_background
from kvspec.transport import load_backend

__all__: list[str] = []

MIB = 1 << 20
MODEL = "gemma-3-27b"  # 62 layers: 52 sliding-window (1024) and 10 full attention


def _config(num_tokens: int) -> KVCacheConfig:
    # One layer a group (7 groups), heads shrunk 4x so two pairs of pools fit a shared machine: 32 KiB pages.
    shape = dict(layout="blocks_first", max_layers_per_group=1, head_size_divisor=4)
    probe = get_preset(MODEL).build_config(num_blocks=2, **shape)  # type: ignore[arg-type]
    return get_preset(MODEL).build_config(
        num_blocks=blocks_needed_for(probe, num_tokens=num_tokens) + 8,
        **shape,  # type: ignore[arg-type]
    )


def _pair(
    backend_name: str, mode: TransferMode, integrity: bool, config: KVCacheConfig
) -> tuple[ProducerEndpoint, ConsumerEndpoint, PagePool, PagePool, Callable[[], None]]:
    backend = load_backend(backend_name)
    p_pool, c_pool = allocate_pool(config), allocate_pool(config)
    fill_background(p_pool, seed="p")
    fill_background(c_pool, seed="c")
    producer = ProducerEndpoint(
        engine_id="P",
        config=config,
        transport=backend.create_agent("producer"),
        regions=p_pool.regions,
        mode=mode,
        integrity=integrity,
    )
    consumer = ConsumerEndpoint(
        engine_id="C",
        config=config,
        transport=backend.create_agent("consumer"),
        regions=c_pool.regions,
        mode=mode,
        integrity=integrity,
    )
    connect(producer, consumer)

    def close() -> None:
        backend.close()
        p_pool.close()
        c_pool.close()

    return producer, consumer, p_pool, c_pool, close


def bench_requests(backend_name: str, reps: int) -> None:
    print(f"INT-1 on a whole request ({MODEL}, backend {backend_name}; median of {reps}, alternating)")
    print(f"{'mode':<6} {'tokens':>7} {'MiB moved':>10} {'off ms':>9} {'on ms':>9} {'on / off':>9}")
    for mode in (TransferMode.READ, TransferMode.WRITE):
        for tokens in (1024, 4096):
            config = _config(tokens)
            pairs = {flag: _pair(backend_name, mode, flag, config) for flag in (False, True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            moved = 0
            try:
                for rep in range(reps + 1):
                    for flag in (False, True):
                        producer, consumer, *_ = pairs[flag]
                        start = time.perf_counter()
                        result = run_request(
                            producer, consumer, request_id=f"r{rep}", num_tokens=tokens, idle=lambda: None
                        )
                        elapsed = time.perf_counter() - start
                        if result.consumer.failure is not None:
                            raise SystemExit(f"request failed: {result.consumer.failure}")
                        moved = result.consumer.num_bytes
                        if rep:  # the first round warms pages and caches
                            times[flag].append(elapsed)
            finally:
                for *_, close in pairs.values():
                    close()
            off, on = statistics.median(times[False]), statistics.median(times[True])
            print(
                f"{mode.value:<6} {tokens:>7} {moved / MIB:>10.1f} {off * 1e3:>9.1f} {on * 1e3:>9.1f} {on / off:>9.2f}"
            )


def bench_digest(reps: int) -> None:
    config = _config(4096)
    with allocate_pool(config, shared=False) as pool:
        fill_background(pool, seed="d")
        digester = PageDigester(config, [r.buffer for r in pool.regions])
        per_group = (config.num_blocks - 1) // config.num_groups
        ids = BlockIds([list(range(1 + g * per_group, 1 + (g + 1) * per_group)) for g in range(config.num_groups)])
        nbytes = sum(
            len(group) * len(g.layer_names) * g.kv_cache_spec.page_size_bytes
            for group, g in zip(ids, config.kv_cache_groups, strict=True)
        )
        source = bytes(nbytes)
        target = bytearray(nbytes)
        digest_s, copy_s = [], []
        for _ in range(reps):
            start = time.perf_counter()
            digester.digests(ids)
            digest_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            target[:] = source
            copy_s.append(time.perf_counter() - start)
        d, c = statistics.median(digest_s), statistics.median(copy_s)
        print(
            f"\nBLAKE2b-128 block digests over {nbytes / MIB:.0f} MiB ({config.num_groups} groups, {per_group} blocks)"
        )
        rates = f"digest {nbytes / d / 1e9:.2f} GB/s, plain copy {nbytes / c / 1e9:.2f} GB/s"
        print(f"{rates}, digest / copy time {d / c:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="loopback")
    args = parser.parse_args()
    bench_requests(args.backend, args.reps)
    bench_digest(args.reps)


if __name__ == "__main__":
    main()
