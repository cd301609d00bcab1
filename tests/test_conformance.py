"""Tests of the suite itself: registry and catalogue, selection, skips, reports, reproducers, BackendSuite."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import attrs
import pytest
from kvspec_conformance import (
    BackendSuite,
    CaseResult,
    Outcome,
    ReferenceConnector,
    Report,
    all_cases,
    case_test_name,
    catalogue,
    run_suite,
    select_cases,
)
from kvspec_conformance._cases import case, missing_capabilities

from kvspec import BlockIds, KVCacheConfig, TransferMode
from kvspec.core._rules import RULES, Level, get_rule
from kvspec.transport import Capabilities
from kvspec.transport.loopback import LoopbackBackend


def test_every_rule_has_a_case_and_every_case_a_known_rule() -> None:
    table = catalogue()
    assert list(table) == [rule.id for rule in RULES]
    # A rule without a case must name the tests that check it meanwhile (the offload rules, OFF-*).
    waiting = [rule for rule in RULES if not table[rule.id]]
    assert all(rule.checked_by for rule in waiting), [rule.id for rule in waiting if not rule.checked_by]
    root = Path(__file__).resolve().parent.parent
    assert all((root / str(rule.checked_by)).is_file() for rule in waiting)
    for c in all_cases():
        assert c.id.startswith(c.rule + "/")
        assert c.title
        assert get_rule(c.rule).id == c.rule


def test_case_ids_are_unique_and_registration_rejects_bad_ones() -> None:
    ids = [c.id for c in all_cases()]
    assert len(ids) == len(set(ids))
    with pytest.raises(KeyError, match=r"unknown rule 'NOPE-1'; known: HMA-1"):
        case("NOPE-1", "x")
    with pytest.raises(ValueError, match="slug"):
        case("CLIP-1", "Bad Slug")
    with pytest.raises(ValueError, match="capabilities"):
        case("CLIP-1", "x", requires=["teleport"])


def test_select_by_rule_prefix_and_level() -> None:
    clip = select_cases(rules=["CLIP-1"])
    assert clip
    assert {c.rule for c in clip} == {"CLIP-1"}
    one = select_cases(rules=["WIN-1/window-start-on-block-boundary"])
    assert [c.id for c in one] == ["WIN-1/window-start-on-block-boundary"]
    assert all(c.level is Level.MUST for c in select_cases(levels=["must"]))
    with pytest.raises(ValueError, match="matches no rule"):
        select_cases(rules=["XYZ-9"])


def test_missing_capability_is_a_skip_with_reason_never_a_pass() -> None:
    class ReadOnly(LoopbackBackend):
        @property
        def capabilities(self) -> Capabilities:
            return attrs.evolve(super().capabilities, modes=frozenset({TransferMode.READ}), notifications=False)

    backend = ReadOnly()
    report = run_suite(backend, rules=["DONE-1", "FAIL-1/failed-post", "ALIGN-1/write-partial-prefix-hit"])
    backend.close()
    by_id = {r.case_id: r for r in report.results}
    write = by_id["DONE-1/write-notification-after-data"]
    assert write.outcome is Outcome.SKIPPED
    assert "write" in write.message
    assert by_id["FAIL-1/failed-post"].outcome is Outcome.SKIPPED
    assert "notifications" in by_id["FAIL-1/failed-post"].message
    assert by_id["DONE-1/read-done-means-visible"].outcome is Outcome.PASSED
    needs_write = next(c for c in all_cases() if c.id == "ALIGN-1/write-partial-prefix-hit")
    assert missing_capabilities(needs_write, backend.capabilities) == ["write"]


def _report(*outcomes: tuple[str, Level, Outcome]) -> Report:
    return Report(
        backend="x",
        results=tuple(
            CaseResult(
                case_id=f"{rule}/c{i}",
                rule=rule,
                level=level,
                title="t",
                outcome=outcome,
                seconds=0.1,
                message="boom\nline two" if outcome is Outcome.FAILED else "",
                reproducer="print(1)\n" if outcome is Outcome.FAILED else None,
            )
            for i, (rule, level, outcome) in enumerate(outcomes)
        ),
        seconds=1.0,
        max_examples=3,
        kvspec_version="0",
    )


def test_exit_status_fails_only_on_must() -> None:
    assert _report(("CLIP-1", Level.MUST, Outcome.PASSED)).exit_status == 0
    assert _report(("CLIP-1", Level.SHOULD, Outcome.FAILED)).exit_status == 0
    assert _report(("CLIP-1", Level.MUST, Outcome.FAILED)).exit_status == 1
    assert _report(("CLIP-1", Level.MUST, Outcome.ERROR)).exit_status == 1


def test_json_and_junit_reports(tmp_path: Path) -> None:
    report = _report(
        ("CLIP-1", Level.MUST, Outcome.PASSED),
        ("WIN-1", Level.MUST, Outcome.FAILED),
        ("SM-1", Level.MUST, Outcome.SKIPPED),
    )
    report.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["passed"] is False
    assert data["rules"]["WIN-1"]["status"] == "FAIL"
    assert data["rules"]["SM-1"]["status"] == "SKIP"
    assert data["cases"][1]["reproducer"] == "print(1)\n"
    report.write_junit(tmp_path / "r.xml")
    root = ET.parse(tmp_path / "r.xml").getroot()
    assert root.get("tests") == "3"
    assert root.get("failures") == "1"
    assert root.get("skipped") == "1"
    failure = root.find(".//testsuite[@name='WIN-1']/testcase/failure")
    assert failure is not None
    assert "Reproducer" in (failure.text or "")
    text = report.render()
    assert "WIN-1    FAIL" in text
    assert "Reproducer (paste into python)" in text


def test_reproducer_replays_the_failure() -> None:
    from mutants import NoClipping

    report = run_suite("loopback", rules=["CLIP-1/sw-tail-keeps-last-n"], connector=NoClipping())
    (result,) = report.results
    assert result.outcome is Outcome.FAILED
    assert result.reproducer is not None
    assert "from mutants import NoClipping as ConnectorUnderTest" in result.reproducer
    # The pasted script replays the scenario; with the mutant connector it shows the same stray pages.
    namespace: dict[str, object] = {}
    exec(compile(result.reproducer, "<reproducer>", "exec"), namespace)
    replayed = namespace["result"]
    assert not replayed.ok  # type: ignore[attr-defined]
    assert any(m.kind.value == "stray_write" for m in replayed.mismatches)  # type: ignore[attr-defined]


class TestLoopbackThroughBackendSuite(BackendSuite):
    """The pytest way in, as a connector author would write it (a few rules, to stay quick)."""

    backend_factory = staticmethod(LoopbackBackend)
    rules = ("CLIP-1", "HS-1", "REL-1")
    max_examples = 3


def test_backend_suite_has_one_test_method_per_selected_case() -> None:
    selected = {c.id for c in select_cases(rules=TestLoopbackThroughBackendSuite.rules)}
    assert selected
    for c in all_cases():
        method = getattr(TestLoopbackThroughBackendSuite, case_test_name(c.id))
        assert (method is not None) == (c.id in selected), c.id
    assert case_test_name("CLIP-1/sw-tail-keeps-last-n") == "test_clip_1_sw_tail_keeps_last_n"


def test_backend_suite_rejects_an_unknown_xfail_case() -> None:
    with pytest.raises(ValueError, match=r"xfail_cases: unknown case ids \['CLIP-1/no-such-case'\]"):

        class _Broken(BackendSuite):
            backend_factory = staticmethod(LoopbackBackend)
            xfail_cases: ClassVar[Mapping[str, str]] = {"CLIP-1/no-such-case": "typo"}


PER_CASE_SAMPLE = """
from kvspec import BlockIds, KVCacheConfig
from kvspec.transport.loopback import LoopbackBackend
from kvspec_conformance import BackendSuite, CaseContext, ReferenceConnector


class NoClipping(ReferenceConnector):
    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        return block_ids


class TestKnownFailure(BackendSuite):
    backend_factory = staticmethod(LoopbackBackend)
    connector_factory = staticmethod(NoClipping)
    rules = ["CLIP-1/sw-tail-keeps-last-n", "CLIP-1/shorter-than-budget-kept-whole", "HS-1/compatible-pair-accepted"]
    xfail_cases = {"CLIP-1/sw-tail-keeps-last-n": "this connector does not clip yet"}

    def test_hs_1_compatible_pair_accepted(self, kvspec_context: CaseContext) -> None:
        raise AssertionError("the overriding method ran")


class TestStaleXfail(BackendSuite):
    backend_factory = staticmethod(LoopbackBackend)
    rules = ["CLIP-1/sw-tail-keeps-last-n"]
    xfail_cases = {"CLIP-1/sw-tail-keeps-last-n": "fixed since"}
"""


def test_backend_suite_marks_one_case_xfail_or_overrides_it(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(PER_CASE_SAMPLE, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rxXf", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    out = done.stdout
    assert "XFAIL test_sample.py::TestKnownFailure::test_clip_1_sw_tail_keeps_last_n" in out, out
    assert "this connector does not clip yet" in out, out
    # The case that clipping does not change still passes; the override replaced its case.
    assert "FAILED test_sample.py::TestKnownFailure::test_hs_1_compatible_pair_accepted" in out, out
    assert "the overriding method ran" in out, out
    # strict: a known failure that passes again fails the run, so the stale entry is noticed.
    assert "FAILED test_sample.py::TestStaleXfail::test_clip_1_sw_tail_keeps_last_n" in out, out
    assert "2 failed, 1 passed, 1 xfailed" in out, out


class _ClipsOneShort(ReferenceConnector):
    """Keeps one block too few of every window list: one cause that fails many cases across many rules."""

    def clip_block_ids(self, config: KVCacheConfig, block_ids: BlockIds) -> BlockIds:
        from kvspec import get_blocks_per_sw

        clipped = super().clip_block_ids(config, block_ids)
        budgets = get_blocks_per_sw(config)
        pairs = zip(clipped, budgets, strict=True)
        return BlockIds([list(ids[1:]) if budget and len(ids) >= budget else list(ids) for ids, budget in pairs])


def test_report_leads_with_the_first_failing_rule_of_the_shared_cause_and_folds_the_rest() -> None:
    report = run_suite("loopback", rules=["HMA-1", "SW-1", "CLIP-1", "WIN-1"], connector=_ClipsOneShort())
    failures = [r for r in report.results if r.is_failure]
    rules = {r.rule for r in failures}
    assert {"HMA-1", "SW-1"} <= rules, report.counts()
    assert len(failures) > len(rules), report.counts()
    text = report.render()
    start = text.index("Start here: ")
    # The one cause of every failure here: the window lists are a block short of SW-1's budget. HMA-1 comes first in
    # the spec's order, but its cases fail only because their exchanges run through the short lists: the lead names
    # SW-1, the earliest failing rule that WIN-1's error builds on.
    lead = text[start : text.index("\n" + "=" * 78, start)]
    assert "first failing rule SW-1 (Blocks a sliding window needs)" in lead, lead
    assert "with WindowCoverageError" in lead, lead
    assert "Fix SW-1 first" in lead, lead
    assert "HMA-1" in lead, lead
    assert start < text.index("=" * 78), "the lead comes before the first full failure"
    # One full failure a rule; the others one line each, and all of them with --verbose.
    assert text.count("=" * 78) == len(rules)
    assert f"{len(failures) - len(rules)} more failures" in text
    assert report.render(verbose=True).count("=" * 78) == len(failures)


def test_report_lead_never_names_a_rule_downstream_of_the_error() -> None:
    """A handshake refusal fails SW-1's exchange too: SW-1 comes first in the spec's order, yet HS-1 is the root."""

    def lead(cause: str) -> str:
        results = tuple(
            CaseResult(
                case_id=case_id,
                rule=case_id.partition("/")[0],
                level=Level.MUST,
                title="t",
                outcome=Outcome.FAILED,
                seconds=0.1,
                message=f"{case_id.partition('/')[0]}: r: expected LOADED, got FAILED ({cause})",
            )
            for case_id in ("SW-1/a", "SW-1/b", "HS-1/c", "DONE-1/d")
        )
        text = Report(backend="x", results=results, seconds=1.0, max_examples=3, kvspec_version="0").render()
        return text[text.index("Start here: ") : text.index("=" * 78)]

    refused = lead("refused: HandshakeError, field kv_cache_groups[0].block_size: expected 16, got 8 (HS-1)")
    assert "first failing rule HS-1 (Handshake compatibility), 1 case(s), with HandshakeError." in refused, refused
    assert "Fix HS-1 first: 3 more failure(s) in SW-1, DONE-1 end in the same error; they run" in refused, refused
    # A cause that names no rule (a transport's digest mismatch) claims no dependency: the first failing rule leads.
    corrupt = lead("reason integrity, error None, block digests differ from the sender's")
    assert "first failing rule SW-1 (Blocks a sliding window needs), 2 case(s), with reason integrity." in corrupt
    assert "2 more failure(s) in HS-1, DONE-1 end in the same error: fix it first." in corrupt, corrupt
