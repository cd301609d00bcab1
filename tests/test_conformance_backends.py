"""The suite against the cross-process backends: pools in shared memory, read directly by the oracle."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import pytest
from kvspec_conformance import Report, run_suite

# Both backends bind 127.0.0.1 only.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

BACKENDS = [
    pytest.param("torch", "torch", "torch", marks=pytest.mark.torch, id="torch"),
    pytest.param("nixl", "nixl_cu12", "nixl", marks=pytest.mark.nixl, id="nixl"),
]
# STATE-2/state-window-and-full: in the shared padded layout the transport moves a state page's tensor bytes
# only, ranges shorter than a page, beside window and full-attention pages (STATE-2, PLAN-1).
SMOKE = [
    "CLIP-1/sw-tail-keeps-last-n",
    "DONE-1",
    "FAIL-1/failed-post",
    "HS-1/compatible-pair-accepted",
    "STATE-2/state-window-and-full",
]


def _failures(report: Report) -> str:
    return "\n\n".join(f"{r.case_id}: {r.message}\n{r.reproducer}" for r in report.results if r.is_failure)


# By name through run_suite, as `kvspec conform torch` does. Behind --run-slow (decision 148 in decisions-testing.md):
# every SMOKE case
# runs in the default run on the same backends, tests/test_torch_backend.py and tests/test_nixl_backend.py
# TestConformance (every case); this copy would start two more workers with torch (~10 s of CPU) and NIXL.
@pytest.mark.slow
@pytest.mark.parametrize(("backend", "module", "extra"), BACKENDS)
def test_smoke(backend: str, module: str, extra: str, require_module: Callable[..., ModuleType]) -> None:
    require_module(module, extra)
    report = run_suite(backend, rules=SMOKE, max_examples=2, time_scale=3.0)
    assert report.passed, _failures(report)
    assert any(r.outcome.value == "passed" for r in report.results)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "module", "extra"), BACKENDS)
def test_every_must_case(backend: str, module: str, extra: str, require_module: Callable[..., ModuleType]) -> None:
    require_module(module, extra)
    report = run_suite(backend, levels=["MUST"], max_examples=5, time_scale=3.0)
    assert report.passed, _failures(report)


# Each cross-process backend once under a pace (loopback runs under both, tests/test_conformance_pace.py): the cases
# where how soon a transfer completes, and in which order, decides what the suite sees. A failure is a suite defect.
PACED = [
    pytest.param("torch", "torch", "torch", "jitter", marks=pytest.mark.torch, id="torch-jitter"),
    pytest.param("nixl", "nixl_cu12", "nixl", "slow", marks=pytest.mark.nixl, id="nixl-slow"),
]
PACED_RULES = [
    "DONE-1/completion-implies-visibility",
    "DONE-1/transport-many-in-flight",
    "DONE-1/transport-notification-after-data",
    "REL-1",
    "OFF-3",
]


@pytest.mark.parametrize(("backend", "module", "extra", "pace"), PACED)
def test_paced(backend: str, module: str, extra: str, pace: str, require_module: Callable[..., ModuleType]) -> None:
    require_module(module, extra)
    report = run_suite(backend, rules=PACED_RULES, max_examples=2, time_scale=3.0, pace=pace, pace_seed=0)
    assert report.pace == f"{pace} (seed 0)"
    assert report.passed, _failures(report)
    assert not [r for r in report.results if r.is_failure], _failures(report)
