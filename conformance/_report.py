"""Conformance results and their renderings: the terminal table by rule, JSON, and JUnit XML."""

from __future__ import annotations

import enum
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO
from xml.etree import ElementTree as ET

import attrs

from kvspec import PROTOCOL_VERSION
from kvspec.rules import RULES, Level

__all__ = ["CaseResult", "Outcome", "Report", "connector_tested"]


class Outcome(str, enum.Enum):
    """How one case ended. ``ERROR`` is a crash of the suite or backend outside any assertion.

    ``EXPECTED_FAILURE`` is a case that failed as the user declared it would
    (``--expect-fail CASE_ID=REASON``); it fails no run. A declared case that
    passes is turned into ``FAILED``, so a fixed deviation is noticed.
    """

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    ERROR = "error"
    EXPECTED_FAILURE = "expected failure"


@attrs.frozen(kw_only=True)
class CaseResult:
    """One case's outcome, with its message and, on failure, a pasteable reproducer."""

    case_id: str
    rule: str
    level: Level
    title: str
    outcome: Outcome
    seconds: float
    message: str = ""
    reproducer: str | None = None

    @property
    def is_failure(self) -> bool:
        """Failed or errored."""
        return self.outcome in (Outcome.FAILED, Outcome.ERROR)

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready data."""
        return {
            "id": self.case_id,
            "rule": self.rule,
            "level": self.level.value,
            "title": self.title,
            "outcome": self.outcome.value,
            "seconds": round(self.seconds, 4),
            "message": self.message,
            "reproducer": self.reproducer,
        }


@attrs.frozen(kw_only=True)
class Report:
    """Every case result of one run against one backend."""

    backend: str
    results: tuple[CaseResult, ...]
    seconds: float
    max_examples: int
    kvspec_version: str
    tested: tuple[tuple[str, str], ...] = ()
    """What else was under test, as (field, value): the connector's import path, the installed vLLM."""
    pace: str | None = None  # "slow (seed 3)" under --pace: the seed replays the run
    log_errors: tuple[str, ...] = ()
    """Error lines the backend logged that no case expected (``"during CASE: SOURCE: TEXT"``): each fails the run."""
    expected_log_errors: int = 0  # error lines logged while a case injected a fault or lost a peer, or allowed

    @property
    def passed(self) -> bool:
        """True unless some MUST case failed or errored, or the backend logged an error no case expected."""
        return not self.log_errors and not any(r.is_failure and r.level is Level.MUST for r in self.results)

    @property
    def exit_status(self) -> int:
        """0 when :attr:`passed`, 1 otherwise."""
        return 0 if self.passed else 1

    def counts(self) -> dict[str, int]:
        """Number of results per outcome."""
        found = {outcome.value: 0 for outcome in Outcome}
        for result in self.results:
            found[result.outcome.value] += 1
        return found

    def by_rule(self) -> dict[str, list[CaseResult]]:
        """Results grouped by rule in the order of docs/spec/index.md; rules with no selected case are left out."""
        table: dict[str, list[CaseResult]] = {rule.id: [] for rule in RULES}
        for result in self.results:
            table.setdefault(result.rule, []).append(result)
        return {rule: results for rule, results in table.items() if results}

    def failed_rules(self) -> list[str]:
        """Rules with at least one failed or errored case."""
        return [rule for rule, results in self.by_rule().items() if any(r.is_failure for r in results)]

    # -- renderings

    def to_dict(self) -> dict[str, object]:
        """The JSON document: summary, per-rule status, and every case."""
        rules = {}
        for rule, results in self.by_rule().items():
            rules[rule] = {
                "status": _rule_status(results),
                **{outcome.value: sum(r.outcome is outcome for r in results) for outcome in Outcome},
            }
        return {
            "backend": self.backend,
            "kvspec_version": self.kvspec_version,
            **self.tested_fields(),
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "max_examples": self.max_examples,
            "pace": self.pace,
            "log_errors": list(self.log_errors),
            "expected_log_errors": self.expected_log_errors,
            "counts": self.counts(),
            "rules": rules,
            "cases": [r.to_dict() for r in self.results],
        }

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def to_junit(self) -> str:
        """JUnit XML: one testsuite per rule, one testcase per case."""
        root = ET.Element(
            "testsuites",
            name=f"kvspec conformance ({self.backend})",
            tests=str(len(self.results)),
            failures=str(sum(r.outcome is Outcome.FAILED for r in self.results)),
            errors=str(sum(r.outcome is Outcome.ERROR for r in self.results)),
            skipped=str(sum(r.outcome in (Outcome.SKIPPED, Outcome.EXPECTED_FAILURE) for r in self.results)),
            time=f"{self.seconds:.3f}",
        )
        properties = ET.SubElement(root, "properties")
        described = {"backend": self.backend, "kvspec_version": self.kvspec_version, **self.tested_fields()}
        for name, value in described.items():
            ET.SubElement(properties, "property", name=name, value=value)
        for rule, results in self.by_rule().items():
            suite = ET.SubElement(
                root,
                "testsuite",
                name=rule,
                tests=str(len(results)),
                failures=str(sum(r.outcome is Outcome.FAILED for r in results)),
                errors=str(sum(r.outcome is Outcome.ERROR for r in results)),
                skipped=str(sum(r.outcome in (Outcome.SKIPPED, Outcome.EXPECTED_FAILURE) for r in results)),
                time=f"{sum(r.seconds for r in results):.3f}",
            )
            for result in results:
                testcase = ET.SubElement(
                    suite,
                    "testcase",
                    classname=f"kvspec_conformance.{rule}",
                    name=f"{result.case_id} [{result.level.value}]",
                    time=f"{result.seconds:.3f}",
                )
                if result.outcome in (Outcome.SKIPPED, Outcome.EXPECTED_FAILURE):
                    ET.SubElement(testcase, "skipped", message=result.message)
                elif result.is_failure:
                    tag = "failure" if result.outcome is Outcome.FAILED else "error"
                    element = ET.SubElement(testcase, tag, message=result.message.splitlines()[0][:500])
                    element.text = result.message + (
                        f"\n\nReproducer:\n{result.reproducer}" if result.reproducer else ""
                    )
        if self.log_errors:
            suite = ET.SubElement(root, "testsuite", name="backend-logs", tests="1", failures="1", errors="0")
            testcase = ET.SubElement(suite, "testcase", classname="kvspec_conformance.logs", name="no unexpected error")
            failure = ET.SubElement(testcase, "failure", message=self.log_errors[0][:500])
            failure.text = "\n".join(self.log_errors)
        ET.indent(root)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

    def write_junit(self, path: str | Path) -> None:
        """Write :meth:`to_junit`."""
        Path(path).write_text(self.to_junit(), encoding="utf-8")

    def render(self, *, verbose: bool = False) -> str:
        """The terminal report: a table by rule, then every failure with its reproducer."""
        paced = f", pace {self.pace}" if self.pace else ""
        lines = [f"kvspec conformance: backend {self.backend!r}, kvspec {self.kvspec_version}{paced}"]
        lines += [*self._tested_lines(), ""]
        header = f"{'rule':<8} {'status':<7} {'pass':>4} {'fail':>4} {'skip':>4} {'xfail':>5}  notes"
        lines += [header, "-" * len(header)]
        for rule, results in self.by_rule().items():
            notes = sorted({r.message for r in results if r.outcome is Outcome.SKIPPED})
            failed = [r.case_id.partition("/")[2] for r in results if r.is_failure]
            note = ("failed: " + ", ".join(failed)) if failed else ("; ".join(notes) if notes else "")
            lines.append(
                f"{rule:<8} {_rule_status(results):<7} "
                f"{sum(r.outcome is Outcome.PASSED for r in results):>4} "
                f"{sum(r.is_failure for r in results):>4} "
                f"{sum(r.outcome is Outcome.SKIPPED for r in results):>4} "
                f"{sum(r.outcome is Outcome.EXPECTED_FAILURE for r in results):>5}  {_clip(note, 70)}"
            )
        if verbose:
            lines += ["", "cases:"]
            lines += [f"  {r.outcome.value:<7} {r.level.value:<6} {r.case_id} ({r.seconds:.2f}s)" for r in self.results]
        failures = [r for r in self.results if r.is_failure]
        lines += _start_here(self.by_rule())
        # One failure a rule in full (the first); the rest of that rule's failures by id and first line, since
        # one cause (a window list one block short) fails dozens of cases with the same story. --verbose: all.
        shown: set[str] = set()
        folded: list[CaseResult] = []
        for result in failures:
            if result.rule in shown and not verbose:
                folded.append(result)
                continue
            shown.add(result.rule)
            lines += ["", "=" * 78, f"{result.outcome.value.upper()} {result.case_id} [{result.level.value}]"]
            lines.append(f"  {result.title}")
            lines += ["", result.message.rstrip()]
            if result.reproducer:
                lines += ["", "Reproducer (paste into python):", "", result.reproducer.rstrip()]
        if folded:
            lines += ["", f"{len(folded)} more failures of the rules above (--verbose prints each in full):"]
            lines += [f"  {r.case_id}: {_clip(_first_line(r.message), 90)}" for r in folded]
        if self.log_errors:
            lines += ["", "=" * 78, "FAILED: the backend logged errors no case expected (a correct backend logs none):"]
            lines += [f"  {_clip(line, 200)}" for line in self.log_errors[:20]]
            if len(self.log_errors) > 20:
                lines.append(f"  ... and {len(self.log_errors) - 20} more")
            lines.append("  (allow a known one with --allow-log REGEX; KVSPEC_BACKEND_LOGS=1 shows every worker line)")
        counts = self.counts()
        failed_case = any(r.is_failure and r.level is Level.MUST for r in self.results)
        verdict = (
            "PASSED"
            if self.passed
            else "FAILED (a MUST case failed)"
            if failed_case
            else "FAILED (the backend logged an unexpected error)"
        )
        expected = [r for r in self.results if r.outcome is Outcome.EXPECTED_FAILURE]
        if expected:
            lines += ["", "expected failures:"]
            lines += [f"  {r.case_id}: {_clip(r.message.splitlines()[0], 90)}" for r in expected]
        lines += [
            "",
            f"{verdict}: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
            f"{counts['skipped']} skipped, {counts['expected failure']} expected failures in {self.seconds:.1f}s",
        ]
        return "\n".join(lines) + "\n"

    def tested_fields(self) -> dict[str, str]:
        """What was tested besides the backend: the protocol version, then :attr:`tested` (connector, vLLM)."""
        return {"protocol_version": ".".join(map(str, PROTOCOL_VERSION)), **dict(self.tested)}

    def _tested_lines(self) -> list[str]:
        return ["  " + ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in self.tested_fields().items())]

    def print(self, stream: TextIO | None = None, *, verbose: bool = False) -> None:
        """Write :meth:`render` to ``stream`` (stdout by default)."""
        (stream or sys.stdout).write(self.render(verbose=verbose))


# What each rule's check takes as its input, from the rules before it (docs/spec/index.md): a defect in one of these
# fails the checks downstream of it with the downstream rule's error. WIN-1's WindowCoverageError, for one, is raised
# when the block lists that SW-1's budget, CLIP-1's clip, ALIGN-1's pairing and NULL-1's pruning produced miss a
# block the window needs; the handshake (HS-1, VER-1) and admission (ADM-1) refuse on their own inputs alone.
_BUILDS_ON: dict[str, tuple[str, ...]] = {
    "CLIP-1": ("SW-1",),
    "ALIGN-1": ("SW-1", "CLIP-1"),
    "NULL-1": ("SW-1", "CLIP-1", "ALIGN-1"),
    "WIN-1": ("SW-1", "CLIP-1", "ALIGN-1", "NULL-1", "TOK-1"),
    "PLAN-1": ("SW-1", "CLIP-1", "ALIGN-1", "NULL-1"),
}


def _start_here(by_rule: dict[str, list[CaseResult]]) -> list[str]:
    """The report's lead when cases failed: the first failing rule of the cause most failures share.

    One defect (a window list kept one block short) fails dozens of cases across many rules: every case that runs
    an exchange ends in the same error, whatever its rule. Failures are grouped by that error (else by their first
    line); the cause most of them share is the one to fix first. Its root is the rule that error belongs to (a rule
    id in parentheses in the message) or one that rule builds on (:data:`_BUILDS_ON`), the earliest of them in the
    spec's order that fails with it; other rules' cases fail with it only because they run through it.
    """
    failures = [r for results in by_rule.values() for r in results if r.is_failure]
    if not failures:
        return []
    causes: dict[str, list[CaseResult]] = {}
    for result in failures:
        causes.setdefault(_cause(result.message), []).append(result)
    cause, shared = max(causes.items(), key=lambda item: len(item[1]))  # ties: the first seen, by dict order
    rules = list(dict.fromkeys(r.rule for r in shared))
    root, upstream = _root_rule(rules, shared)
    in_root = [r for r in shared if r.rule == root]
    title = next((rule.title for rule in RULES if rule.id == root), "")
    lines = [
        "",
        f"Start here: first failing rule {root} ({title}), {len(in_root)} case(s), with {cause}.",
        f"  {in_root[0].case_id}: {_clip(_first_line(in_root[0].message), 100)}",
    ]
    later = [rule for rule in rules if rule != root]
    if later:
        named = ", ".join(later[:10]) + (", ..." if len(later) > 10 else "")
        more = f"{len(shared) - len(in_root)} more failure(s) in {named} end in the same error"
        # The dependency is claimed only where the error's rule builds on the root; else the root is the first seen.
        lines.append(f"  Fix {root} first: {more}; they run through it." if upstream else f"  {more}: fix it first.")
    if len(causes) > 1:
        lines.append(
            f"  {len(failures) - len(shared)} failure(s) with {len(causes) - 1} other cause(s) below: "
            "rerun after this fix first."
        )
    return lines


def _root_rule(rules: list[str], shared: list[CaseResult]) -> tuple[str, bool]:
    """Of the rules failing with one cause (in the spec's order), the one the cause comes from (:func:`_start_here`).

    The rule the error names, or one it builds on, the earliest that fails (and True); else the first failing
    rule (and False: nothing says the others depend on it).
    """
    known = {rule.id for rule in RULES}
    named = [m for m in re.findall(r"\(([A-Z]+-\d+)\)", _first_line(shared[0].message)) if m in known]
    if named:
        upstream = {*_BUILDS_ON.get(named[-1], ()), named[-1]}
        for rule in rules:
            if rule in upstream:
                return rule, True
    return rules[0], False


def _cause(message: str) -> str:
    """A failure's cause for grouping: the kvspec error it names, else the reason or the first line it starts with."""
    error = re.search(r"\b([A-Z][A-Za-z]*Error)\b", message)
    reason = re.search(r"\breason ([a-z_]+)", message)
    if error is not None:
        return error.group(1) + (f" (reason {reason.group(1)})" if reason else "")
    first = re.search(r"\breason ([a-z_]+)", _first_line(message))
    if first is not None:  # a request failed without a kvspec error (a digest mismatch, a lost peer)
        return f"reason {first.group(1)}"
    return re.sub(r"\d+", "N", _first_line(message).partition(": ")[2] or _first_line(message)).rstrip(":")


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0] if stripped else "(no message)"


def _rule_status(results: Sequence[CaseResult]) -> str:
    if any(r.is_failure for r in results):
        return "FAIL"
    if all(r.outcome is Outcome.SKIPPED for r in results):
        return "SKIP"
    if any(r.outcome is Outcome.EXPECTED_FAILURE for r in results):
        return "XFAIL"
    return "PASS"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def connector_tested(connector: object) -> tuple[tuple[str, str], ...]:
    """What a report names as tested besides the backend, as (field, value): nothing for kvspec's reference.

    A connector with a ``kvspec_tested()`` method (the vLLM and SGLang
    adapters) names itself and its engine's release; any other is named by
    its class, ``MODULE:CLASS``.
    """
    from kvspec.connector import ReferenceConnector

    tested = getattr(connector, "kvspec_tested", None)
    if callable(tested):
        return tuple((str(field), str(value)) for field, value in tested())
    kind = type(connector)
    return () if kind is ReferenceConnector else (("connector", f"{kind.__module__}:{kind.__qualname__}"),)
