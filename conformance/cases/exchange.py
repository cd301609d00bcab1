"""Cases that run kvspec's own exchange endpoints (sessions, allocators, deadlines) over the backend under test."""

from __future__ import annotations

import time

import attrs

from kvspec import ConsumerState, FailureReason, TransferMode, TransferParams
from kvspec.exchange import ConsumerEndpoint, ProducerEndpoint, connect, poll_until
from kvspec.testing import (
    ExpectedLoad,
    PageMismatch,
    allocate_pool,
    check_loaded_pages,
    check_pools,
    fill_background,
    fill_producer_pages,
    format_mismatches,
)
from kvspec.transport import Backend, FaultInjector, FaultPlan, Transport

from .._cases import case
from .._clock import PollClock
from .._context import CaseContext
from .._scenario import LOAD_DEADLINE, LOAD_LEASE
from ..configs import full, make_config, sw

__all__ = ["run_endpoints"]

CONFIG = make_config(full(4), sw(8, 4), num_blocks=160)

_R = FailureReason
# What the injected faults (failed and partial posts, dropped, delayed, duplicated notifications) and an abort
# allow the consumer to report (FAIL-1, "Which reason"): a timeout only in WRITE mode, where C hears of a
# failure from P's message alone and that message may be dropped; and in READ mode a read still PENDING at C's
# short deadline (a slow backend, a busy machine) ends there too, as under the scenarios' random faults
# (decision 80 in decisions-testing.md). Without faults every request but the aborted one must load, under a load's
# generous deadline.
_ACCEPTED: dict[TransferMode, frozenset[FailureReason]] = {
    TransferMode.READ: frozenset({_R.POST_FAILED, _R.PARTIAL_TRANSFER, _R.ABORTED, _R.TIMEOUT, _R.LEASE_EXPIRED}),
    TransferMode.WRITE: frozenset({_R.POST_FAILED, _R.PARTIAL_TRANSFER, _R.ABORTED, _R.TIMEOUT, _R.LEASE_EXPIRED}),
}


@attrs.frozen(kw_only=True)
class _Req:
    request_id: str
    num_tokens: int
    prefix_hit_tokens: int = 0
    abort_after_polls: int | None = None


def _pause() -> None:
    time.sleep(0.0002)


def _requests() -> list[_Req]:
    found = [_Req(request_id=f"r{i}", num_tokens=6 + 5 * i, prefix_hit_tokens=4 * (i % 3)) for i in range(8)]
    found.append(_Req(request_id="full-hit", num_tokens=16, prefix_hit_tokens=16))
    found.append(_Req(request_id="aborted", num_tokens=23, abort_after_polls=0))
    return found


def run_endpoints(
    backend: Backend | str = "loopback",
    *,
    mode: str = "read",
    plan: FaultPlan | None = None,
    time_scale: float = 1.0,
) -> list[str]:
    """Run ten requests interleaved on kvspec's endpoints over ``backend``; return the problems found.

    Checks pools (the oracle), completion-time visibility (DONE-1), typed
    failures (FAIL-1), terminal producer states (SM-1), one release per
    request (REL-1) and both free-block counts. A failing case prints a call
    of this function as its reproducer.
    """
    if isinstance(backend, str):
        from kvspec.transport import load_backend

        loaded = load_backend(backend)
        try:
            return run_endpoints(loaded, mode=mode, plan=plan, time_scale=time_scale)
        finally:
            loaded.close()
    return _run(backend, TransferMode(mode), _requests(), plan, time_scale)


def _run(backend: Backend, mode: TransferMode, requests: list[_Req], plan: FaultPlan | None, scale: float) -> list[str]:
    problems: list[str] = []
    # Short deadlines make a lost message cheap under faults; without faults every request must load (FAIL-1).
    deadline, lease = (0.15, 0.25) if plan is not None else (LOAD_DEADLINE, LOAD_LEASE)
    clock = PollClock()  # a starved process's lost time does not count against a deadline
    with allocate_pool(CONFIG) as p_pool, allocate_pool(CONFIG) as c_pool:
        fill_background(p_pool, seed="producer")
        fill_background(c_pool, seed="consumer")
        agents: list[Transport] = [backend.create_agent("producer"), backend.create_agent("consumer")]
        if plan is not None:
            agents = [FaultInjector(agent, plan) for agent in agents]
        try:
            producer = ProducerEndpoint(
                engine_id="producer",
                config=CONFIG,
                transport=agents[0],
                regions=p_pool.regions,
                mode=mode,
                lease_duration=lease * scale,
                release_grace=0.15 * scale,
                drain_timeout=0.1 * scale,
                clock=clock,
            )
            consumer = ConsumerEndpoint(
                engine_id="consumer",
                config=CONFIG,
                transport=agents[1],
                regions=c_pool.regions,
                mode=mode,
                transfer_timeout=deadline * scale,
                drain_timeout=0.1 * scale,
                clock=clock,
            )
            connect(producer, consumer)
            baseline = (producer.allocator.num_free, consumer.allocator.num_free)
            params = {}
            for r in requests:
                params[r.request_id] = producer.prefill(r.request_id, num_tokens=r.num_tokens)
                fill_producer_pages(
                    p_pool, producer.block_table(r.request_id), num_tokens=r.num_tokens, salt=r.request_id
                )
            p_before, c_before = p_pool.snapshot(), c_pool.snapshot()
            for r in requests:
                routed = TransferParams.from_kv_transfer_params(params[r.request_id].to_kv_transfer_params())
                consumer.begin(routed, prefix_hit_tokens=r.prefix_hit_tokens)
            loads: dict[str, ExpectedLoad] = {}
            completed_early: list[tuple[str, ExpectedLoad, list[PageMismatch]]] = []
            polls = 0
            by_id = {r.request_id: r for r in requests}

            def settled() -> bool:
                return all(producer.result(rid) is not None and consumer.result(rid) is not None for rid in by_id)

            def poll() -> None:
                nonlocal polls
                polls += 1
                clock.tick()
                for r in requests:
                    if r.abort_after_polls is not None and polls == r.abort_after_polls + 1:
                        consumer.abort(r.request_id)
                consumer.poll()
                producer.poll()
                for rid, r in by_id.items():
                    result = consumer.result(rid)
                    if result is None or rid in loads:
                        continue
                    load = ExpectedLoad(
                        producer_block_ids=result.producer_block_ids,
                        consumer_block_ids=result.consumer_block_ids,
                        num_tokens=r.num_tokens,
                        salt=rid,
                        loaded=result.state is ConsumerState.LOADED,
                    )
                    loads[rid] = load
                    if load.loaded:
                        early = check_loaded_pages(c_pool, load)
                        if early:
                            completed_early.append((rid, load, early))
                    elif result.failure is None and result.state is ConsumerState.FAILED:
                        problems.append(f"{rid}: FAILED without a typed reason (FAIL-1)")
                    elif result.failure is not None and result.failure.reason not in _ACCEPTED[mode]:
                        wanted = sorted(r.value for r in _ACCEPTED[mode])
                        problems.append(
                            f"{rid}: FAILED {result.failure.reason.value}, expected one of {wanted} (FAIL-1)"
                        )

            if not poll_until(poll, done=settled, until=clock() + 10.0 * scale, pause=_pause, clock=clock):
                stuck = [rid for rid in by_id if producer.result(rid) is None or consumer.result(rid) is None]
                problems.append(f"requests {stuck} did not end within the deadlines (FAIL-1)")
            for rid, load, at_completion in completed_early:
                still_wrong = {(m.layer, m.block) for m in check_loaded_pages(c_pool, load)}
                late = [m for m in at_completion if (m.layer, m.block) not in still_wrong]
                if late:
                    problems.append(f"{rid}: LOADED before {len(late)} pages had landed (DONE-1): {late[0]}")
            mismatches = check_pools(
                producer=p_pool,
                consumer=c_pool,
                producer_before=p_before,
                consumer_before=c_before,
                loads=list(loads.values()),
            )
            if mismatches:
                problems.append("pages differ from the oracle:\n" + format_mismatches(mismatches))
            for rid in by_id:
                p_result = producer.result(rid)
                if p_result is not None and not p_result.state.is_terminal:
                    problems.append(f"{rid}: producer ended in {p_result.state.value} (SM-1)")
                c_result = consumer.result(rid)
                if c_result is not None and c_result.release is None:
                    problems.append(f"{rid}: the consumer never released the producer (REL-1)")
                unfaulted = plan is None and rid != "aborted" and c_result is not None
                if unfaulted and c_result is not None and c_result.state is not ConsumerState.LOADED:
                    problems.append(f"{rid}: expected LOADED without faults, got {c_result.state.value}")
                consumer.finish(rid)
            free = (producer.allocator.num_free, consumer.allocator.num_free)
            if free != baseline:
                problems.append(f"free blocks (producer, consumer) {free}, expected {baseline}: leaked (SM-1, SM-2)")
            if plan is None:
                # Without injected faults the driver records nothing: every fault is a problem.
                for endpoint in (producer, consumer):
                    problems += [f"{endpoint.engine_id}: {fault}" for fault in endpoint.errors]
        finally:
            for agent in agents:
                agent.close()
    return problems


def _check(ctx: CaseContext, mode: TransferMode, plan: FaultPlan | None, rule: str) -> None:
    ctx.last_reproducer = (
        "from kvspec.transport.faults import FaultPlan\n"
        "from kvspec_conformance.cases.exchange import run_endpoints\n\n"
        f"print(run_endpoints({ctx.backend_spec!r}, mode={mode.value!r}, plan={plan!r}, "
        f"time_scale={ctx.time_scale!r}))\n"
    )
    ctx.expect_error_logs()  # the requests include an abort; under a plan, injected faults too
    problems = _run(ctx.backend, mode, _requests(), plan, ctx.time_scale)
    if problems:
        faults = f", faults {plan!r}" if plan else ""
        raise ctx.fail(f"{rule} ({mode.value}, kvspec's exchange endpoints{faults}):\n" + "\n".join(problems))


def _modes(ctx: CaseContext) -> list[TransferMode]:
    return sorted(ctx.capabilities.modes, key=lambda m: m.value)


@case("REL-1", "exchange-endpoints-interleaved", requires=["local_pools", "notifications"])
def _endpoints(ctx: CaseContext) -> None:
    """kvspec's own endpoints, ten requests interleaved (prefix hits, full hit, abort): one release each, no leak."""
    for mode in _modes(ctx):
        _check(ctx, mode, None, "REL-1")


@case("FAIL-1", "exchange-endpoints-under-faults", requires=["local_pools", "notifications"])
def _endpoints_faults(ctx: CaseContext) -> None:
    """kvspec's own endpoints under random injected faults: every request ends in bounded time, nothing leaks."""
    for seed, mode in enumerate(_modes(ctx)):
        plan = FaultPlan(
            seed=seed,
            drop_notifications=0.1,
            delay_notifications=0.2,
            duplicate_notifications=0.2,
            fail_post=0.1,
            partial_transfer=0.1,
        )
        _check(ctx, mode, plan, "FAIL-1")
