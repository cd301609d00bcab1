"""The suite's default time scale: 1 in-process, 2 for agents in other processes, 4 on another host (68, 97)."""

from __future__ import annotations

import time

import attrs
import pytest
from kvspec_conformance import Case, CaseContext, ReferenceConnector, default_time_scale, run_suite
from kvspec_conformance.configs import full, make_config, sw

from kvspec import KVCacheConfig, TransferRequest
from kvspec.protocol._plan import BlockPairsLike
from kvspec.rules import Level
from kvspec.transport import Capabilities, TransferHandle, TransferStatus
from kvspec.transport.loopback import LoopbackAgent, LoopbackBackend

_CONFIG = make_config(full(4), sw(8, 4), num_blocks=32)


class _CrossProcessLoopback(LoopbackBackend):
    """Loopback that declares its agents live in other processes."""

    @property
    def capabilities(self) -> Capabilities:
        return attrs.evolve(super().capabilities, cross_process=True)


def test_in_process_backend_runs_at_scale_one() -> None:
    assert default_time_scale(LoopbackBackend()) == 1.0


def test_cross_process_backend_runs_at_scale_two() -> None:
    assert default_time_scale(_CrossProcessLoopback()) == 2.0


def test_a_backend_on_another_host_runs_at_scale_four() -> None:
    class _Remote(_CrossProcessLoopback):
        @property
        def capabilities(self) -> Capabilities:
            return attrs.evolve(super().capabilities, remote_pools=True)

    assert default_time_scale(_Remote()) == 4.0


@pytest.mark.parametrize(
    ("cross_process", "given", "expected"), [(False, None, 1.0), (True, None, 2.0), (True, 0.5, 0.5)]
)
def test_run_suite_runs_cases_at_the_resolved_scale(cross_process: bool, given: float | None, expected: float) -> None:
    backend = _CrossProcessLoopback() if cross_process else LoopbackBackend()
    seen: list[float] = []

    def body(ctx: CaseContext) -> None:
        seen.append(ctx.time_scale)

    probe = Case(
        id="SM-1/probe", rule="SM-1", level=Level.MUST, title="records the scale", requires=frozenset(), func=body
    )
    report = run_suite(backend, cases=[probe], time_scale=given)
    assert report.passed
    assert seen == [expected]


# --------------------------------------------------------------------------- every timing follows the scale


def test_fault_delays_in_seconds_follow_the_scale() -> None:
    from kvspec_conformance import Request, Scenario

    from kvspec.transport.faults import FaultPlan

    plan = FaultPlan(delay_notifications=1.0, delay_polls=7, delay_seconds=0.25)
    scenario = Scenario(
        config=_CONFIG,
        requests=[Request(request_id="a", num_tokens=9), Request(request_id="b", num_tokens=9, deadline=0.5, lease=1)],
        faults=plan,
        deadline=0.1,
    )
    scaled = scenario.scaled(6)
    assert scaled.faults == attrs.evolve(plan, delay_seconds=1.5)  # seconds scale; polls are a count, not a time
    assert (scaled.deadline, scaled.lease, scaled.drain) == pytest.approx((0.6, scenario.lease * 6, scenario.drain * 6))
    assert scaled.requests[0] == scenario.requests[0]
    assert (scaled.requests[1].deadline, scaled.requests[1].lease) == pytest.approx((3.0, 6.0))


def test_a_delayed_notification_waits_its_polls_and_its_seconds() -> None:
    from kvspec.transport.faults import FaultInjector, FaultPlan

    backend = LoopbackBackend()
    sender = backend.create_agent("p")
    receiver = FaultInjector(
        backend.create_agent("c"), FaultPlan(delay_notifications=1.0, delay_polls=1, delay_seconds=0.2)
    )
    sender.add_remote_agent(receiver.get_agent_metadata())
    sender.send_notification("c", b"late")
    started = time.monotonic()
    got: list[bytes] = []
    polls = 0
    while not got:
        got += [n.message for n in receiver.get_notifications()]
        polls += 1
    assert got == [b"late"]
    assert time.monotonic() - started >= 0.2
    assert polls > 2
    backend.close()


@pytest.mark.parametrize("scale", [6.0])
def test_sm2_sticky_case_passes_at_a_large_time_scale(scale: float) -> None:
    """Its delay was 400 polls, not scaled: at --time-scale 6 the late completion came within the deadline."""
    report = run_suite("loopback", rules=["SM-2/failed-request-never-loaded"], time_scale=scale)
    assert [r.outcome.value for r in report.results] == ["passed"], report.results[0].message


# --------------------------------------------------------------------------- the sessions' clock (_clock.py)


def test_the_poll_clock_counts_a_starved_gap_as_one_step() -> None:
    from kvspec_conformance._clock import PollClock

    clock = PollClock(step=0.002)
    start = clock()
    time.sleep(0.05)  # the process was descheduled, or one call took long
    assert clock() - start == pytest.approx(0.002, abs=1e-4)
    clock.tick()
    for _ in range(20):
        time.sleep(0.001)
        clock.tick()
    assert 0.02 <= clock() - start <= 0.05  # steady polls count as wall time


class _StallingLoopback(LoopbackBackend):
    """A correct loopback whose checks take 40 ms each: a starved process's polls."""

    def create_agent(self, name: str) -> LoopbackAgent:
        agent = super().create_agent(name)
        check = agent.check

        def slow_check(handle: TransferHandle) -> TransferStatus:
            time.sleep(0.04)
            return check(handle)

        agent.check = slow_check  # type: ignore[method-assign]
        return agent


def test_a_correct_backend_is_not_failed_for_the_time_its_polls_took() -> None:
    """16 pieces, a check of 40 ms each: 0.65 s of wall time, past a 0.3 s deadline, though every check progressed."""
    from kvspec_conformance import Request, Scenario, run_scenario

    from kvspec.transport import Pace, PacedBackend

    pace = Pace(done_polls=(0, 0), done_seconds=(0.0, 0.0), notify_polls=(0, 0), notify_seconds=(0.0, 0.0), pieces=16)
    scenario = Scenario(config=_CONFIG, requests=[Request(request_id="a", num_tokens=9)], deadline=0.3, lease=0.6)
    result = run_scenario(scenario, backend=PacedBackend(_StallingLoopback(), pace))
    assert result.outcome("a").loaded, result.summary()


class _SlowFirstPairing(ReferenceConnector):
    """Kvspec's reference connector whose first pairing takes 0.6 s, as an engine's lazy imports do."""

    def __init__(self) -> None:
        self.cold = True
        self.warmed = False

    def warm_up(self) -> None:
        self.warmed = True

    def pair_block_ids(self, config: KVCacheConfig, request: TransferRequest) -> BlockPairsLike:
        if self.cold:
            self.cold = False
            time.sleep(0.6)
        return super().pair_block_ids(config, request)


def test_an_engine_adapter_is_warmed_before_the_first_case_and_a_slow_call_costs_no_deadline() -> None:
    connector = _SlowFirstPairing()
    seen: list[bool] = []

    def body(ctx: CaseContext) -> None:
        seen.append(connector.warmed)

    probe = Case(id="SM-1/probe", rule="SM-1", level=Level.MUST, title="warm?", requires=frozenset(), func=body)
    assert run_suite(LoopbackBackend(), cases=[probe], connector=connector).passed
    assert seen == [True]
    from kvspec_conformance import Request, Scenario, run_scenario

    # The first pairing (0.6 s) runs after the request started and its lease ran: it must not count.
    scenario = Scenario(config=_CONFIG, requests=[Request(request_id="a", num_tokens=9)], deadline=0.4, lease=0.4)
    result = run_scenario(scenario, backend=LoopbackBackend(), connector=connector)
    assert result.outcome("a").loaded, result.summary()
