"""--expect-fail: a declared failure is reported as expected, and turns into a failure once the case passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvspec_conformance import run_suite
from kvspec_conformance._report import CaseResult, Outcome
from kvspec_conformance._runner import apply_expected_failures, parse_expected_failures

from kvspec.rules import Level

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
CASE = "CLIP-1/sw-tail-keeps-last-n"


def _result(outcome: Outcome, case_id: str = CASE) -> CaseResult:
    return CaseResult(
        case_id=case_id, rule="CLIP-1", level=Level.MUST, title="t", outcome=outcome, seconds=0.0, message="boom"
    )


def test_parse_reads_lines_comments_and_refuses_unknown_ids() -> None:
    parsed = parse_expected_failures(
        ["# a comment", "", f"{CASE} = vLLM clips differently", "A/b=x=y"], known=[CASE, "A/b"]
    )
    assert parsed == {CASE: "vLLM clips differently", "A/b": "x=y"}
    with pytest.raises(ValueError, match="no case 'NOPE/x'"):
        parse_expected_failures(["NOPE/x=reason"])
    with pytest.raises(ValueError, match="expected CASE_ID=REASON"):
        parse_expected_failures([CASE])
    with pytest.raises(ValueError, match="expected CASE_ID=REASON"):
        parse_expected_failures([f"{CASE}=   "])


@given(st.sampled_from(list(Outcome)), st.booleans())
def test_apply_maps_every_outcome(outcome: Outcome, declared: bool) -> None:
    expected = {CASE: "known"} if declared else {}
    after = apply_expected_failures(_result(outcome), expected)
    if not declared:
        assert after == _result(outcome)
    elif outcome is Outcome.FAILED:
        assert after.outcome is Outcome.EXPECTED_FAILURE
        assert after.message.startswith("expected: known")
        assert not after.is_failure
    elif outcome is Outcome.PASSED:
        assert after.outcome is Outcome.FAILED
        assert "was expected to fail (known) but passed" in after.message
    else:
        assert after.outcome is outcome  # an error is never expected; a skip proves nothing


def test_suite_reports_expected_failure_and_catches_a_fixed_case() -> None:
    from mutants import NoClipping

    broken = run_suite("loopback", rules=[CASE], connector=NoClipping(), expected_failures={CASE: "never clips"})
    (result,) = broken.results
    assert result.outcome is Outcome.EXPECTED_FAILURE
    assert broken.passed
    assert "expected failures:" in broken.render()
    assert broken.to_dict()["rules"]["CLIP-1"]["status"] == "XFAIL"  # type: ignore[index]
    fixed = run_suite("loopback", rules=[CASE], expected_failures={CASE: "never clips"})
    (result,) = fixed.results
    assert result.outcome is Outcome.FAILED
    assert not fixed.passed


def test_cli_flags_and_file(tmp_path: Path) -> None:
    listed = tmp_path / "expected.txt"
    listed.write_text(f"# known deviations\n{CASE}=never clips\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
    base = [sys.executable, "-m", "kvspec", "conform", "loopback", "--connector", "mutants:NoClipping"]
    base += ["--rule", CASE, "-q", "--json", str(tmp_path / "r.json")]
    for extra in (["--expect-fail", f"{CASE}=never clips"], ["--expect-fail-file", str(listed)]):
        run = subprocess.run([*base, *extra], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "1 expected failures" in run.stdout
        data = json.loads((tmp_path / "r.json").read_text())
        assert data["cases"][0]["outcome"] == "expected failure"
    bad = subprocess.run([*base, "--expect-fail", "NOPE/x=y"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert bad.returncode == 2
    assert "no case 'NOPE/x'" in bad.stderr
