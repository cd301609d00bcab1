"""The protocol 1.1 cases: the reference passes them, connectors built like vLLM's or kvspec 1.0 fail them.

Also: a connector that refuses a scenario makes cases fail with its refusal, never error.
"""

from __future__ import annotations

import pytest
from kvspec_conformance import (
    Connector,
    Outcome,
    ReferenceConnector,
    Report,
    Request,
    Scenario,
    run_scenario,
    run_suite,
)
from kvspec_conformance._scenario import ScenarioRefused
from kvspec_conformance.cases.positions import RECOMPUTE
from mutants import (
    REFUSAL,
    KeywordFormConnector,
    Kvspec10Connector,
    Protocol10Connector,
    RefusingConnector,
    VllmLikeConnector,
)

from kvspec import UnsupportedHybridError

RECOMPUTED = "WIN-1/recomputed-last-token-lists-for-prompt-length"
WINDOW_OF_N_MINUS_1 = "WIN-1/recomputed-last-token-window-needs-token-n-minus-1"
LOOKAHEAD = "ALIGN-1/list-shifted-by-lookahead-refused-by-its-end"
NEW_CASES = [RECOMPUTED, WINDOW_OF_N_MINUS_1, LOOKAHEAD]


def _run(connector: Connector) -> Report:
    return run_suite("loopback", rules=NEW_CASES, connector=connector, max_examples=2)


def _outcomes(report: Report) -> dict[str, tuple[Outcome, str]]:
    return {r.case_id: (r.outcome, r.message) for r in report.results}


def test_the_reference_passes_the_new_cases() -> None:
    report = _run(ReferenceConnector())
    assert {case: outcome for case, (outcome, _) in _outcomes(report).items()} == dict.fromkeys(
        NEW_CASES, Outcome.PASSED
    )


def test_a_connector_built_like_vllm_fails_the_window_and_lookahead_cases() -> None:
    found = _outcomes(_run(VllmLikeConnector()))
    # vLLM's N-length lists are correct and load; what it gets wrong is the window of token N - 1 ...
    assert found[RECOMPUTED][0] is Outcome.PASSED
    outcome, message = found[WINDOW_OF_N_MINUS_1]
    assert outcome is Outcome.FAILED
    assert "pruned-n13: expected WindowCoverageError before any transfer was posted" in message
    # ... and a list shifted by lookahead slots, which it pairs block by neighbouring block.
    outcome, message = found[LOOKAHEAD]
    assert outcome is Outcome.FAILED
    assert "lookahead: expected BlockAlignmentError before any transfer was posted" in message
    assert "posted=True" in message
    # The oracle keys P's pages by true position, so it sees every page land one block off.
    assert "pages differ from the oracle" in message
    assert "expected the page of group 0, layer 'g0.l0', position 2" in message
    assert "found the page of group 0, layer 'g0.l0', position 3" in message


def test_kvspec_1_0_refused_vllm_lists_and_missed_the_shift() -> None:
    found = _outcomes(_run(Kvspec10Connector()))
    outcome, message = found[RECOMPUTED]
    assert outcome is Outcome.FAILED
    assert "expected LOADED, got FAILED" in message
    assert "BlockAlignmentError" in message
    # 1.0 reasoned about T = N - 1, but refused the N-length lists for their length before it got there.
    outcome, message = found[WINDOW_OF_N_MINUS_1]
    assert outcome is Outcome.FAILED
    assert "expected WindowCoverageError before any transfer was posted, got error BlockAlignmentError" in message
    assert found[LOOKAHEAD][0] is Outcome.FAILED


def test_a_connector_written_for_protocol_1_0_fails_the_new_cases_without_errors() -> None:
    # Deliberately the 1.0 seam, which the 1.1 Connector protocol no longer matches.
    legacy: Connector = Protocol10Connector()  # type: ignore[assignment]
    report = _run(legacy)  # refused before any pairing: it cannot be told the new fields
    for case, (outcome, message) in _outcomes(report).items():
        assert outcome is Outcome.FAILED, case
        assert "takes no" in message
        assert "(protocol 1.1)" in message
    # The cases of 1.0 still run with it: the suite passes the new keywords only where a request uses them.
    with pytest.warns(DeprecationWarning, match="pair_block_ids"):
        assert run_suite(
            "loopback",
            rules=["WIN-1/token-sweep-around-boundaries", "WIN-1/needed-block-null-on-producer-fails"],
            connector=legacy,
        ).passed


def test_a_connector_of_the_keyword_form_still_passes_with_a_deprecation_warning() -> None:
    # pair_block_ids(config, *, num_tokens=..., ...) before the request value: it gets every keyword (0.3.0 drops it).
    legacy: Connector = KeywordFormConnector()  # type: ignore[assignment]
    with pytest.warns(DeprecationWarning, match=r"KeywordFormConnector\.pair_block_ids.*removed in kvspec 0\.3\.0"):
        report = _run(legacy)
    assert {case: outcome for case, (outcome, _) in _outcomes(report).items()} == dict.fromkeys(
        NEW_CASES, Outcome.PASSED
    )


def test_a_refused_scenario_fails_cases_with_the_refusal_text_and_never_errors() -> None:
    rules = ["SM-1", "REL-1", "PLAN-1/every-layout", "WIN-1", "FAIL-1/partial-transfer"]
    report = run_suite("loopback", rules=rules, connector=RefusingConnector(), max_examples=2)
    assert report.results
    assert not [r.case_id for r in report.results if r.outcome is Outcome.ERROR]
    failed = [r for r in report.results if r.outcome is Outcome.FAILED]
    assert failed
    for result in failed:
        assert REFUSAL in result.message, result.case_id


def test_a_refused_result_names_the_refusal_when_a_request_is_asked_for() -> None:
    scenario = Scenario(config=RECOMPUTE, requests=[Request(request_id="r", num_tokens=8)])
    result = run_scenario(scenario, connector=RefusingConnector())
    # The result carries the error object itself, not its text (issue 24): cases test its class.
    assert isinstance(result.refused, UnsupportedHybridError), result.refused
    assert f"refused before setup: UnsupportedHybridError: {result.refused}" in result.summary()
    with pytest.raises(ScenarioRefused, match=r"request 'r' never ran: the scenario was refused: UnsupportedHybrid"):
        result.outcome("r")
    with pytest.raises(KeyError, match="'elsewhere'"):
        run_scenario(scenario).outcome("elsewhere")  # a request that was never in the scenario
