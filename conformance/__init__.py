"""kvspec's conformance suite: run it against any Transport backend (installed as kvspec_conformance).

Two ways in: ``kvspec conform [BACKEND]`` on the command line, or subclass
:class:`BackendSuite` in your own pytest suite. :func:`catalogue` lists every
rule with its cases; :func:`run_scenario` replays one scenario (what a failure
prints as its reproducer), :func:`run_offload_scenario` one offload scenario.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._cases import CAPABILITIES, Case, CaseFailure, CaseSkip, all_cases, case, catalogue, select_cases
from ._connector import (
    Connector,
    OffloadConnector,
    ReferenceConnector,
    ReferenceOffloadConnector,
    as_offload_connector,
)
from ._context import DEFAULT_MAX_EXAMPLES, CaseContext, default_time_scale
from ._offload_scenario import OffloadRequest, OffloadResult, OffloadScenario, run_offload_scenario
from ._report import CaseResult, Outcome, Report
from ._runner import run_case, run_suite
from ._scenario import PresetConfig, Request, RequestOutcome, Scenario, ScenarioResult, run_scenario

if TYPE_CHECKING:
    from .pytest_plugin import BackendSuite, case_test_name

__all__ = [
    "CAPABILITIES",
    "DEFAULT_MAX_EXAMPLES",
    "BackendSuite",
    "Case",
    "CaseContext",
    "CaseFailure",
    "CaseResult",
    "CaseSkip",
    "Connector",
    "OffloadConnector",
    "OffloadRequest",
    "OffloadResult",
    "OffloadScenario",
    "Outcome",
    "PresetConfig",
    "ReferenceConnector",
    "ReferenceOffloadConnector",
    "Report",
    "Request",
    "RequestOutcome",
    "Scenario",
    "ScenarioResult",
    "all_cases",
    "as_offload_connector",
    "case",
    "case_test_name",
    "catalogue",
    "default_time_scale",
    "run_case",
    "run_offload_scenario",
    "run_scenario",
    "run_suite",
    "select_cases",
]


def __getattr__(name: str) -> object:
    # BackendSuite needs pytest; import it only when asked for.
    if name in ("BackendSuite", "case_test_name"):
        from . import pytest_plugin

        return getattr(pytest_plugin, name)
    raise AttributeError(f"module 'kvspec_conformance' has no attribute {name!r}")
