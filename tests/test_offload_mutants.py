"""Each offload mutant fails the rule it breaks in the suite's offload cases; the reference passes them all."""

from __future__ import annotations

import pytest
from kvspec_conformance import Report, run_suite
from mutants import SCORE, MutantBackend
from offload_mutants import OFFLOAD_BACKEND_MUTANTS, OFFLOAD_CONNECTOR_MUTANTS, OffloadMutant

from kvspec.transport.loopback import LoopbackBackend

OFFLOAD_RULES = ["OFF-1", "OFF-3", "OFF-4", "OFF-5", "OFF-6", "OFF-7", "OFF-9"]


def _failures(report: Report) -> str:
    return "\n".join(f"{r.case_id}: {r.outcome.value}: {r.message[:300]}" for r in report.results)


@pytest.mark.parametrize("mutant", OFFLOAD_CONNECTOR_MUTANTS, ids=lambda m: m.__name__)
def test_offload_connector_mutant_fails_its_rule(mutant: type[OffloadMutant]) -> None:
    report = run_suite(LoopbackBackend(), rules=[mutant.breaks, *mutant.caught_by], connector=mutant(), max_examples=5)
    failed = {r.case_id for r in report.results if r.outcome.value == "failed"}
    SCORE[mutant.__name__] = mutant.breaks in report.failed_rules() and set(mutant.caught_by) <= failed
    assert mutant.breaks in report.failed_rules(), _failures(report)
    assert set(mutant.caught_by) <= failed, f"expected {mutant.caught_by} to fail:\n{_failures(report)}"
    # A failure (the oracle or a rule check), never an error of the suite, and it replays with the mutant.
    assert not [r for r in report.results if r.outcome.value == "error"], _failures(report)
    assert all(r.reproducer and "ConnectorUnderTest()" in r.reproducer for r in report.results if r.is_failure), (
        _failures(report)
    )


@pytest.mark.parametrize("mutant", OFFLOAD_BACKEND_MUTANTS, ids=lambda m: m.__name__)
def test_offload_backend_mutant_fails_its_rule(mutant: type[MutantBackend]) -> None:
    backend = mutant()
    try:
        report = run_suite(backend, rules=[mutant.breaks, *mutant.caught_by], max_examples=5)
    finally:
        backend.close()
    failed = {r.case_id for r in report.results if r.outcome.value == "failed"}
    SCORE[mutant.__name__] = mutant.breaks in report.failed_rules() and set(mutant.caught_by) <= failed
    assert mutant.breaks in report.failed_rules(), _failures(report)
    assert set(mutant.caught_by) <= failed, _failures(report)


def test_reference_passes_every_offload_case() -> None:
    report = run_suite("loopback", rules=OFFLOAD_RULES, max_examples=5)
    assert report.passed, _failures(report)
    assert len(report.results) >= 15
    assert not [r for r in report.results if r.outcome.value == "skipped"], _failures(report)


def test_a_reference_subclass_that_changes_nothing_passes() -> None:
    # The mutants' base class is the reference itself, so every failure above is the one overridden hook.
    report = run_suite(LoopbackBackend(), rules=OFFLOAD_RULES, connector=OffloadMutant(), max_examples=3)
    assert report.passed, _failures(report)


def test_a_failure_replays_from_its_reproducer(capsys: pytest.CaptureFixture[str]) -> None:
    from offload_mutants import NegativeResidue

    report = run_suite(LoopbackBackend(), rules=["OFF-7"], connector=NegativeResidue(), max_examples=3)
    failure = next(r for r in report.results if r.is_failure)
    assert failure.reproducer is not None
    exec(compile(failure.reproducer, "<reproducer>", "exec"), {"__name__": "__reproducer__"})
    printed = capsys.readouterr().out
    assert "problems:" in printed
    assert "found the page of stream 's'" in printed
