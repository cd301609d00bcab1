"""The suite's default time scale: 1 in-process, 2 for agents in other processes, 4 on another host (68, 97)."""

from __future__ import annotations

import attrs
import pytest
from kvspec_conformance import Case, CaseContext, default_time_scale, run_suite

from kvspec.rules import Level
from kvspec.transport import Capabilities
from kvspec.transport.loopback import LoopbackBackend


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
