"""Each mutant breaks one rule; the suite must fail it on that rule (and the reference loopback on none)."""

from __future__ import annotations

import pytest
from kvspec_conformance import ReferenceConnector, Report, run_suite, select_cases
from mutants import (
    BACKEND_MUTANTS,
    CACHE_MUTANTS,
    CONNECTOR_MUTANTS,
    DRIVER_MUTANTS,
    ENDPOINT_MUTANTS,
    FAULT_BACKEND_MUTANTS,
    FAULT_DRIVER_MUTANTS,
    PARALLEL_MUTANTS,
    SCORE,
    STATE_ENDPOINT_MUTANTS,
    CorruptsAfterCopy,
    DriverMutant,
    EndpointMutant,
    MutantBackend,
    ParallelMutant,
)

from kvspec.transport.loopback import LoopbackBackend


def _failures(report: Report) -> str:
    return "\n".join(f"{r.case_id}: {r.outcome.value}: {r.message[:200]}" for r in report.results)


def _rejected(report: Report, rule: str, caught_by: tuple[str, ...]) -> bool:
    """The mutant fails its rule, and every case named to catch it fails (not errors): what the score counts."""
    failed = {r.case_id for r in report.results if r.outcome.value == "failed"}
    return rule in report.failed_rules() and set(caught_by) <= failed


@pytest.mark.parametrize("mutant", BACKEND_MUTANTS, ids=lambda m: m.__name__)
def test_backend_mutant_fails_its_rule(mutant: type[MutantBackend]) -> None:
    backend = mutant()
    # Where the mutant names the cases that catch it, and they are its rule's, those cases alone: a backend that
    # never notifies waits out every deadline of every case of the rule (23 s for REL-1's four).
    own = bool(mutant.caught_by) and all(case.startswith(f"{mutant.breaks}/") for case in mutant.caught_by)
    try:
        rules = list(mutant.caught_by) if own else [mutant.breaks, *mutant.caught_by]
        report = run_suite(backend, rules=rules, max_examples=5)
    finally:
        backend.close()
    SCORE[mutant.__name__] = _rejected(report, mutant.breaks, mutant.caught_by)
    assert mutant.breaks in report.failed_rules(), _failures(report)
    assert SCORE[mutant.__name__], f"expected {mutant.caught_by} to fail:\n{_failures(report)}"
    assert not report.passed


@pytest.mark.parametrize("mutant", CONNECTOR_MUTANTS, ids=lambda m: m.__name__)
def test_connector_mutant_fails_its_rule(mutant: type[ReferenceConnector]) -> None:
    rule: str = mutant.breaks  # type: ignore[attr-defined]
    caught_by: tuple[str, ...] = getattr(mutant, "caught_by", ())
    # The cases named to catch it may belong to other rules (a state not moved fails STATE-1 and STATE-4 too).
    report = run_suite(LoopbackBackend(), rules=[rule, *caught_by], connector=mutant(), max_examples=5)
    SCORE[mutant.__name__] = _rejected(report, rule, caught_by)
    assert rule in report.failed_rules(), _failures(report)
    assert SCORE[mutant.__name__], f"expected {caught_by} to fail:\n{_failures(report)}"
    failed = [r for r in report.results if r.is_failure and r.rule == rule]
    # Every failure names what went wrong and carries a reproducer that replays the scenario, or the
    # whole case (a case that calls the connector directly), with the connector under test.
    assert all(r.reproducer and "ConnectorUnderTest()" in r.reproducer for r in failed)
    # Wrong bytes are a data error, not an early completion: DONE-1 is not blamed for them.
    assert not any("before the data was visible" in r.message for r in failed)


@pytest.mark.parametrize("mutant", DRIVER_MUTANTS, ids=lambda m: m.__name__)
def test_driver_mutant_fails_integrity(mutant: type[DriverMutant], monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver whose INT-1 check is broken fails the integrity cases, run with the suite's --integrity."""
    mutant.patch(monkeypatch)
    report = run_suite(LoopbackBackend(), rules=[mutant.breaks], integrity=True, max_examples=5)
    SCORE[mutant.__name__] = _rejected(report, mutant.breaks, mutant.caught_by)
    assert mutant.breaks in report.failed_rules(), _failures(report)
    assert SCORE[mutant.__name__], f"expected {mutant.caught_by} to fail:\n{_failures(report)}"


@pytest.mark.parametrize("mutant", FAULT_DRIVER_MUTANTS, ids=lambda m: m.__name__)
def test_fault_driver_mutant_fails_its_fault_case(mutant: type[DriverMutant], monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver that misreads a flipped status, or counts a slow post done by time, fails the case it names."""
    mutant.patch(monkeypatch)
    report = run_suite(LoopbackBackend(), rules=list(mutant.caught_by), max_examples=5)
    SCORE[mutant.__name__] = _rejected(report, mutant.breaks, mutant.caught_by)
    assert SCORE[mutant.__name__], f"expected {mutant.caught_by} to fail:\n{_failures(report)}"


@pytest.mark.parametrize("mutant", FAULT_BACKEND_MUTANTS, ids=lambda m: m.__name__)
def test_fault_backend_mutant_fails_its_fault_case(mutant: type[MutantBackend]) -> None:
    """A backend that moves memory an agent never registered fails the registration-failure case."""
    backend = mutant()
    try:
        report = run_suite(backend, rules=list(mutant.caught_by), max_examples=5)
    finally:
        backend.close()
    SCORE[mutant.__name__] = _rejected(report, mutant.breaks, mutant.caught_by)
    assert SCORE[mutant.__name__], f"expected {mutant.caught_by} to fail:\n{_failures(report)}"


@pytest.mark.parametrize("mutant", ENDPOINT_MUTANTS, ids=lambda m: m.__name__)
def test_endpoint_mutant_fails_the_stale_reference_case(
    mutant: type[EndpointMutant], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Endpoints that serve or accept a consumed transfer reference fail SM-1/stale-transfer-reference (#52234)."""
    mutant.patch(monkeypatch)
    report = run_suite(LoopbackBackend(), rules=list(mutant.caught_by), max_examples=5)
    SCORE[mutant.__name__] = _rejected(report, mutant.breaks, mutant.caught_by)
    assert SCORE[mutant.__name__], f"expected {mutant.caught_by} to fail:\n{_failures(report)}"


@pytest.mark.parametrize("mutant", STATE_ENDPOINT_MUTANTS, ids=lambda m: m.__name__)
def test_state_endpoint_mutant_fails_the_case_it_names(
    mutant: type[EndpointMutant], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Endpoints that place the state at the wrong t, or move it after advertising its slot, fail STATE-1/STATE-3."""
    mutant.patch(monkeypatch)
    report = run_suite(LoopbackBackend(), rules=list(mutant.caught_by), max_examples=5)
    SCORE[mutant.__name__] = _rejected(report, mutant.breaks, mutant.caught_by)
    assert SCORE[mutant.__name__], f"expected {mutant.caught_by} to fail:\n{_failures(report)}"


def test_every_state_case_is_proven_by_a_mutant() -> None:
    """Each STATE-* case is named by a mutant that must fail it (issue 25: at least 12 such cases)."""
    cases = {c.id for c in select_cases(rules=["STATE-1", "STATE-2", "STATE-3", "STATE-4", "STATE-5"])}
    mutants = [*CONNECTOR_MUTANTS, *STATE_ENDPOINT_MUTANTS]
    named = {case_id for m in mutants for case_id in getattr(m, "caught_by", ())}
    assert len(cases) >= 12
    assert sorted(cases - named) == []


@pytest.mark.parametrize("mutant", PARALLEL_MUTANTS, ids=lambda m: m.__name__)
def test_parallel_mutant_fails_its_cases(mutant: type[ParallelMutant], monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong rank mapping (planner, count, pairing) fails every PAR case named for it, as a failure with a reason."""
    mutant.patch(monkeypatch)
    report = run_suite(LoopbackBackend(), rules=list(mutant.caught_by))
    SCORE[mutant.__name__] = _rejected(report, mutant.breaks, mutant.caught_by)
    assert SCORE[mutant.__name__], f"expected {mutant.caught_by} to fail:\n{_failures(report)}"
    assert all(r.reproducer for r in report.results if r.is_failure)


def test_every_parallel_case_is_proven_by_a_mutant_and_passes_unmutated() -> None:
    """Each PAR-* case is named by a mutant that must fail it (issue 33: 20 or more); loopback passes them all."""
    cases = {c.id for c in select_cases(rules=["PAR-" + str(i) for i in range(1, 10)])}
    # PAR-9 is the handshake's: its mutants are connectors (EqualTpOnly, IgnoresPageLayouts).
    handshake = (m for m in CONNECTOR_MUTANTS if getattr(m, "breaks", "") == "PAR-9")
    named = {case_id for m in PARALLEL_MUTANTS for case_id in m.caught_by}
    named |= {case_id for m in handshake for case_id in getattr(m, "caught_by", ())}
    assert len(cases) >= 20
    assert sorted(cases - named) == []
    report = run_suite("loopback", rules=sorted(cases))
    assert report.passed, _failures(report)


@pytest.mark.parametrize("mutant", CACHE_MUTANTS, ids=lambda m: m.__name__)
def test_cache_mutant_fails_its_case(mutant: type[ReferenceConnector]) -> None:
    """A connector that loses a cache (a draft group, an indexer, an unknown kind, a chunk) fails its CACHE-1 case."""
    caught_by: tuple[str, ...] = mutant.caught_by  # type: ignore[attr-defined]
    report = run_suite(LoopbackBackend(), rules=list(caught_by), connector=mutant())
    SCORE[mutant.__name__] = _rejected(report, "CACHE-1", caught_by)
    assert SCORE[mutant.__name__], f"expected {caught_by} to fail:\n{_failures(report)}"
    assert all(r.reproducer for r in report.results if r.is_failure)


def test_every_cache_case_is_proven_by_a_mutant_and_passes_unmutated() -> None:
    """Each CACHE-1 case is named by a mutant that must fail it, #54926's and an unknown kind's among them."""
    cases = {c.id for c in select_cases(rules=["CACHE-1"])}
    named = {case_id for m in CACHE_MUTANTS for case_id in m.caught_by}  # type: ignore[attr-defined]
    assert {"CACHE-1/draft-groups-omitted", "CACHE-1/unknown-kind-refused"} <= cases
    assert sorted(cases - named) == []
    report = run_suite("loopback", rules=["CACHE-1"])
    assert report.passed, _failures(report)


def test_reference_driver_passes_integrity_by_default_and_skips_it_when_off() -> None:
    """The unpatched driver passes INT-1 with no flag; with --no-integrity both cases skip, saying how to run them."""
    on = run_suite("loopback", rules=["INT-1"])
    assert on.passed, _failures(on)
    assert [r.outcome.value for r in on.results] == ["passed", "passed"]
    off = run_suite("loopback", rules=["INT-1"], integrity=False)
    assert [r.outcome.value for r in off.results] == ["skipped", "skipped"]
    assert all("kvspec conform --no-integrity" in r.message for r in off.results), _failures(off)


def test_a_page_corrupted_after_a_correct_copy_fails_the_default_integrity_check() -> None:
    """INT-1 runs without a flag and fails a backend that damages a page after a correct copy; off, it skips."""
    backend = CorruptsAfterCopy()
    try:
        on = run_suite(backend, rules=["INT-1"], max_examples=5)
        off = run_suite(backend, rules=["INT-1"], max_examples=5, integrity=False)
    finally:
        backend.close()
    assert "INT-1" in on.failed_rules(), _failures(on)
    assert any("digests of blocks" in r.message for r in on.results if r.is_failure), _failures(on)
    assert [r.outcome.value for r in off.results] == ["skipped", "skipped"]


@pytest.mark.parametrize("mutant", [*BACKEND_MUTANTS], ids=lambda m: m.__name__)
def test_backend_mutants_pass_unrelated_pure_rules(mutant: type[MutantBackend]) -> None:
    # The handshake refuses before any agent moves a byte, so no transport mutant can break it.
    backend = mutant()
    try:
        report = run_suite(backend, rules=["HS-1/mismatch-table", "ADM-1"], max_examples=1)
    finally:
        backend.close()
    assert report.passed, _failures(report)


# The control (the unmutated reference connector on loopback passes every rule these mutants break) is the whole
# loopback suite: tests/test_conformance_cli.py::test_loopback_passes_every_case_within_budget.
