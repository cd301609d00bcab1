"""A stale or already-consumed transfer reference moves no byte (SM-1, REL-1; vLLM #52234).

vLLM #52234 answered garbage, or a previous prompt's answer, with HTTP 200
when a consumer presented transfer parameters whose request had already been
consumed and released, after the producer had handed those blocks to another
request. The case runs kvspec's own exchange endpoints over the backend under
test: request ``r1`` is loaded and released, the producer's next request ``r2``
takes the same blocks, then ``r1``'s parameters come back.
"""

from __future__ import annotations

from collections.abc import Callable

from kvspec import ConsumerState, KVSpecError, ProtocolError, TransferMode, TransferParams
from kvspec.exchange import ConsumerEndpoint, ProducerEndpoint, connect, poll_until
from kvspec.testing import PagePool, allocate_pool, fill_background, fill_producer_pages
from kvspec.transport import Backend, Transport

from .._cases import case
from .._clock import PollClock
from .._context import CaseContext
from ..configs import full, make_config, sw

__all__ = ["run_stale_reference"]

CONFIG = make_config(full(4), sw(8, 4), num_blocks=64)
LEASE = 5.0  # r1's lease outlives the whole case: only its release ended it, as in #52234
TIMEOUT = 0.3  # a consumer's transfer timeout; the bound a refused WRITE offer waits out


def _poll(
    endpoints: list[ProducerEndpoint | ConsumerEndpoint], until: float, done: Callable[[], bool], clock: PollClock
) -> None:
    def each() -> None:
        clock.tick()
        for endpoint in endpoints:
            endpoint.poll()

    poll_until(each, done=done, until=until, clock=clock)


def _snapshot(pool: PagePool) -> list[bytes]:
    return [bytes(r.buffer) for r in pool.regions]


def _changed(pool: PagePool, before: list[bytes]) -> list[int]:
    return [i for i, (now, then) in enumerate(zip(_snapshot(pool), before, strict=True)) if now != then]


def run_stale_reference(
    backend: Backend | str = "loopback", *, mode: str = "write", time_scale: float = 1.0
) -> list[str]:
    """Load and release ``r1``, reuse its blocks for ``r2``, present ``r1``'s parameters again; the problems found.

    The consumer that consumed ``r1`` must refuse them with a
    :class:`kvspec.ProtocolError` before anything moves. In WRITE mode a second
    consumer that never saw ``r1`` presents them too: the producer holds no
    ``r1`` any more, so nothing may be written, and that consumer ends FAILED
    with a typed reason. A failing case prints a call of this function.
    """
    if isinstance(backend, str):
        from kvspec.transport import load_backend

        loaded = load_backend(backend)
        try:
            return run_stale_reference(loaded, mode=mode, time_scale=time_scale)
        finally:
            loaded.close()
    return _run(backend, TransferMode(mode), time_scale)


def _run(backend: Backend, mode: TransferMode, scale: float) -> list[str]:
    problems: list[str] = []
    with allocate_pool(CONFIG) as p_pool, allocate_pool(CONFIG) as c_pool, allocate_pool(CONFIG) as b_pool:
        for pool, seed in ((p_pool, "producer"), (c_pool, "consumer"), (b_pool, "consumer-b")):
            fill_background(pool, seed=seed)
        agents: list[Transport] = []
        clock = PollClock()  # r1 must load within TIMEOUT: a starved process's lost time does not count
        try:
            for name in ("producer", "consumer", "consumer-b"):
                agents.append(backend.create_agent(name))
            producer = ProducerEndpoint(
                engine_id="producer",
                config=CONFIG,
                transport=agents[0],
                regions=p_pool.regions,
                mode=mode,
                lease_duration=LEASE * scale,
                clock=clock,
            )
            consumers = [
                ConsumerEndpoint(
                    engine_id=engine_id,
                    config=CONFIG,
                    transport=agent,
                    regions=pool.regions,
                    mode=mode,
                    transfer_timeout=TIMEOUT * scale,
                    drain_timeout=0.1 * scale,
                    clock=clock,
                )
                for engine_id, agent, pool in (("consumer", agents[1], c_pool), ("consumer-b", agents[2], b_pool))
            ]
            consumer, other = consumers
            for each in consumers:
                connect(producer, each)
            everyone: list[ProducerEndpoint | ConsumerEndpoint] = [producer, *consumers]
            r1 = producer.prefill("r1", num_tokens=20)
            fill_producer_pages(p_pool, producer.block_table("r1"), num_tokens=20, salt="r1")
            consumer.begin(TransferParams.from_kv_transfer_params(r1.to_kv_transfer_params()))
            _poll(everyone, clock() + 10.0 * scale, lambda: producer.result("r1") is not None, clock)
            first, served = consumer.result("r1"), producer.result("r1")
            if first is None or first.state is not ConsumerState.LOADED or served is None:
                return [f"setup: r1 did not load and release within {10.0 * scale:.1f} s: {first}, {served}"]
            consumer.finish("r1")  # decode ended: C's blocks go back to its pool
            # P's next request takes the blocks r1 held (low ids first), with its own KV in them.
            r1_blocks = {b for group in r1.producer_block_ids for b in group if b}
            producer.prefill("r2", num_tokens=20)
            fill_producer_pages(p_pool, producer.block_table("r2"), num_tokens=20, salt="r2")
            if not r1_blocks & {b for group in producer.block_table("r2") for b in group}:
                return ["setup: r2 does not reuse any of r1's blocks, so the case proves nothing"]
            stale = TransferParams.from_kv_transfer_params(r1.to_kv_transfer_params())  # the router replays it
            before = _snapshot(c_pool)
            try:
                consumer.begin(stale)
            except ProtocolError:
                pass  # refused by name before anything moved
            else:
                _poll(everyone, clock() + 10.0 * scale, lambda: consumer.active_requests == (), clock)
                again = consumer.result("r1")
                problems.append(
                    "the consumer that consumed r1 accepted r1's transfer parameters again (REL-1: its release "
                    "was sent; SM-1: the producer freed and reused those blocks), instead of raising a "
                    f"ProtocolError: it ended {again.state.value if again else 'still running'}"
                )
            moved = _changed(c_pool, before)
            if moved:
                problems.append(f"the replayed r1 moved bytes into the consumer's regions {moved} (#52234)")
            if mode is TransferMode.WRITE:
                before = _snapshot(b_pool)
                other.begin(stale)  # a consumer that never saw r1: only the producer can refuse it
                _poll(everyone, clock() + 10.0 * scale, lambda: other.result("r1") is not None, clock)
                ended = other.result("r1")
                if ended is None or ended.state is not ConsumerState.FAILED or ended.failure is None:
                    state = "still running" if ended is None else ended.state.value
                    problems.append(
                        f"a second consumer offered its blocks for r1, which the producer had released and whose "
                        f"blocks r2 now holds: expected FAILED within {2 * TIMEOUT * scale:.1f} s (the producer "
                        f"answers Failure), got {state} (SM-1, FAIL-1)"
                    )
                moved = _changed(b_pool, before)
                if moved:
                    problems.append(
                        f"the producer wrote into the second consumer's regions {moved} for r1, a request it had "
                        "released: a released request's blocks were served (SM-1, #52234)"
                    )
            for endpoint in everyone:
                problems += [f"{endpoint.engine_id}: {fault}" for fault in endpoint.errors]
        except KVSpecError as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            for agent in agents:
                agent.close()
    return problems


@case("SM-1", "stale-transfer-reference", requires=["local_pools", "notifications"])
def _stale_reference(ctx: CaseContext) -> None:
    """r1's parameters presented again after r1 was consumed and its blocks reused: refused, no byte moved."""
    for mode in sorted(ctx.capabilities.modes, key=lambda m: m.value):
        ctx.last_reproducer = (
            "from kvspec_conformance.cases.stale import run_stale_reference\n\n"
            f"print(run_stale_reference({ctx.backend_spec!r}, mode={mode.value!r}, time_scale={ctx.time_scale!r}))\n"
        )
        problems = run_stale_reference(ctx.backend, mode=mode.value, time_scale=ctx.time_scale)
        if problems:
            raise ctx.fail(f"SM-1 ({mode.value}, kvspec's exchange endpoints):\n" + "\n".join(problems))
