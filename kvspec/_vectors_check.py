"""Run an external implementation over a vector set and report per rule: ``kvspec vectors check``.

The contract (docs: "Implementing kvspec in another language"): the command
reads one vector (a JSON object) on stdin and prints one answer on stdout:
``{"output": ...}``, ``{"error": {"class": "..."}}`` or
``{"unsupported": true}``. With ``--jsonl`` the command is started once and
reads one vector per line, answering one line per vector, in order. An
answer matches when its output equals the vector's (numbers by value), or
when its error class equals the vector's (plus the ``differences`` of an
``IncompatiblePeerError``, and the ``field`` of a ``MalformedMessageError``
when the answer names one). ``unsupported`` is reported as skipped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TextIO

import attrs

from kvspec._errors import ConfigError
from kvspec._vector_cases import DEFAULT_COUNT, DEFAULT_SEED, write_vectors
from kvspec._vectors import Json, answer_schema, answer_vector, same_json, vector_schema

__all__ = [
    "CheckReport",
    "Outcome",
    "add_arguments",
    "check_vectors",
    "load_vectors",
    "render_report",
    "run",
    "validate_json",
]


# --------------------------------------------------------------------------- a small JSON Schema validator


def _type_ok(kind: str, value: Json) -> bool:
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    return bool(checks[kind](value))


def validate_json(
    schema: Mapping[str, Json], value: Json, *, root: Mapping[str, Json] | None = None, path: str = "$"
) -> list[str]:
    """Problems of ``value`` against the JSON Schema subset kvspec's schemas use; empty when valid.

    Supports ``$ref`` (local), ``type``, ``const``, ``enum``, ``properties``,
    ``required``, ``additionalProperties``, ``items``, ``prefixItems``,
    ``minItems``/``maxItems``, ``minimum``, ``minLength``, ``pattern``,
    ``allOf``, ``anyOf``, ``oneOf`` and ``if``/``then``.
    """
    top = schema if root is None else root
    if "$ref" in schema:
        target: Json = top
        for part in str(schema["$ref"]).removeprefix("#/").split("/"):
            target = target[part]
        return validate_json(target, value, root=top, path=path)
    problems: list[str] = []
    kind = schema.get("type")
    if kind is not None and not any(_type_ok(k, value) for k in (kind if isinstance(kind, list) else [kind])):
        return [f"{path}: expected {kind}, got {json.dumps(value)[:60]}"]
    if "const" in schema and not same_json(schema["const"], value):
        problems.append(f"{path}: expected {schema['const']!r}")
    if "enum" in schema and not any(same_json(e, value) for e in schema["enum"]):
        problems.append(f"{path}: expected one of {schema['enum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        problems += [f"{path}: missing {name!r}" for name in schema.get("required", []) if name not in value]
        for name, item in value.items():
            if name in properties:
                problems += validate_json(properties[name], item, root=top, path=f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                problems.append(f"{path}: unexpected {name!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                problems += validate_json(schema["additionalProperties"], item, root=top, path=f"{path}.{name}")
    if isinstance(value, list):
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items")
            if isinstance(sub, dict):
                problems += validate_json(sub, item, root=top, path=f"{path}[{i}]")
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            problems.append(f"{path}: {len(value)} items out of bounds")
    if isinstance(value, str) and (
        len(value) < schema.get("minLength", 0) or ("pattern" in schema and not re.search(schema["pattern"], value))
    ):
        problems.append(f"{path}: {value!r} does not match")
    if _type_ok("number", value) and value < schema.get("minimum", value):
        problems.append(f"{path}: below {schema['minimum']}")
    for sub in schema.get("allOf", []):
        problems += validate_json(sub, value, root=top, path=path)
    if "anyOf" in schema and not any(not validate_json(s, value, root=top, path=path) for s in schema["anyOf"]):
        problems.append(f"{path}: matches no alternative of anyOf")
    if "oneOf" in schema and sum(not validate_json(s, value, root=top, path=path) for s in schema["oneOf"]) != 1:
        problems.append(f"{path}: must match exactly one alternative of oneOf")
    if "if" in schema and not validate_json(schema["if"], value, root=top, path=path):
        problems += validate_json(schema.get("then", {}), value, root=top, path=path)
    return problems


# --------------------------------------------------------------------------- loading


def load_vectors(
    directory: str | Path, *, rule: str | None = None, function: str | None = None
) -> list[tuple[Path, dict[str, Json]]]:
    """Every ``<rule>/<function>/<case>.json`` under ``directory``, validated against the vector schema."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"vectors check: {folder} is not a directory")
    schema = vector_schema()
    found = []
    for path in sorted(folder.glob("*/*/*.json")):
        vector = json.loads(path.read_text(encoding="utf-8"))
        problems = validate_json(schema, vector)
        if problems:
            raise ConfigError(f"vectors check: {path} is not a valid vector: {'; '.join(problems[:3])}")
        if (rule is None or vector["rule"] == rule) and (function is None or vector["function"] == function):
            found.append((path, vector))
    if not found:
        raise ConfigError(f"vectors check: no vector under {folder} matches rule={rule} function={function}")
    return found


# --------------------------------------------------------------------------- comparing


@attrs.frozen(kw_only=True)
class Outcome:
    """One vector's result: ``passed``, ``failed`` or ``skipped``, with what the implementation answered."""

    path: Path
    vector: Mapping[str, Json]
    status: str
    answer: Json = None
    problem: str = ""


def _compare(vector: Mapping[str, Json], answer: Json) -> tuple[str, str]:
    problems = validate_json(answer_schema(), answer)
    if problems:
        return "failed", f"not a valid answer: {'; '.join(problems[:3])}"
    if "unsupported" in answer:
        return "skipped", "unsupported"
    if "output" in vector:
        if "output" not in answer:
            return "failed", f"expected an output, got error {answer['error'].get('class')!r}"
        return ("passed", "") if same_json(vector["output"], answer["output"]) else ("failed", "output differs")
    expected, found = vector["error"], answer.get("error")
    if found is None:
        return "failed", f"expected error {expected['class']!r}, got an output"
    if found["class"] != expected["class"]:
        return "failed", f"expected error {expected['class']!r}, got {found['class']!r}"
    if "differences" in expected and not same_json(expected["differences"], found.get("differences")):
        return "failed", "IncompatiblePeerError differences differ"
    if "field" in found and found["field"] != expected.get("field"):
        return "failed", f"expected field {expected.get('field')!r}, got {found['field']!r}"
    return "passed", ""


class _Runner:
    """Asks the implementation: one process per vector, or one process for all (``jsonl``)."""

    def __init__(self, command: str, *, jsonl: bool, timeout: float) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise ConfigError("vectors check: --command is empty")
        self.jsonl, self.timeout = jsonl, timeout
        self._proc: subprocess.Popen[str] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def ask(self, vector: Mapping[str, Json]) -> tuple[Json, str]:
        text = json.dumps(vector, sort_keys=True)
        try:
            raw = self._ask_jsonl(text) if self.jsonl else self._ask_once(text)
        except (OSError, subprocess.SubprocessError, concurrent.futures.TimeoutError) as exc:
            self.close()
            return None, f"the implementation did not answer: {type(exc).__name__}: {exc}"
        try:
            return json.loads(raw), ""
        except ValueError:
            return None, f"the answer is not JSON: {raw[:200]!r}"

    def _ask_once(self, text: str) -> str:
        done = subprocess.run(self.argv, input=text, capture_output=True, text=True, timeout=self.timeout, check=False)
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"exit status {done.returncode}: {done.stderr.strip()[-300:]}")
        return done.stdout

    def _ask_jsonl(self, text: str) -> str:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        stdin, stdout = self._proc.stdin, self._proc.stdout
        if stdin is None or stdout is None:  # pragma: no cover - both are pipes by construction
            raise subprocess.SubprocessError("the implementation's pipes are closed")
        stdin.write(text + "\n")
        stdin.flush()
        line = self._pool.submit(stdout.readline).result(timeout=self.timeout)
        if not line:
            raise subprocess.SubprocessError(f"the implementation closed its output (exit status {self._proc.poll()})")
        return line

    def close(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
            proc.kill()
            proc.wait()

    def shutdown(self) -> None:
        self.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _generated(outcome: Outcome) -> bool:
    return str(outcome.vector["case"]).startswith("generated_")


@attrs.frozen(kw_only=True)
class CheckReport:
    """Every vector's outcome, in path order."""

    outcomes: tuple[Outcome, ...]

    @property
    def ok(self) -> bool:
        """True when no vector failed (skipped ones do not fail the run)."""
        return all(o.status != "failed" for o in self.outcomes)

    def by_rule(self) -> dict[str, dict[str, int]]:
        """Rule -> counts of passed, failed and skipped vectors."""
        table: dict[str, dict[str, int]] = {}
        for outcome in self.outcomes:
            row = table.setdefault(outcome.vector["rule"], {"passed": 0, "failed": 0, "skipped": 0})
            row[outcome.status] += 1
        return dict(sorted(table.items()))

    def first_failures(self) -> list[tuple[Outcome, int]]:
        """The first failing vector of each (rule, function), hand-picked before generated, and how many failed."""
        firsts: dict[tuple[str, str], list[Any]] = {}
        for outcome in self.outcomes:
            if outcome.status == "failed":
                key = (outcome.vector["rule"], outcome.vector["function"])
                entry = firsts.setdefault(key, [outcome, 0])
                entry[1] += 1
                if _generated(entry[0]) and not _generated(outcome):
                    entry[0] = outcome  # a hand-picked case names the rule's own example
        return [(first, n) for first, n in firsts.values()]

    def to_json(self) -> dict[str, Json]:
        """The machine-readable report of ``--report``."""
        return {
            "ok": self.ok,
            "rules": self.by_rule(),
            "failures": [
                {"vector": str(o.path), "problem": o.problem, "answer": o.answer}
                for o in self.outcomes
                if o.status == "failed"
            ],
        }


def check_vectors(
    directory: str | Path,
    command: str,
    *,
    rule: str | None = None,
    function: str | None = None,
    jsonl: bool = False,
    timeout: float = 30.0,
) -> CheckReport:
    """Ask ``command`` (split like a POSIX shell) every vector under ``directory`` and compare its answers."""
    runner = _Runner(command, jsonl=jsonl, timeout=timeout)
    outcomes = []
    try:
        for path, vector in load_vectors(directory, rule=rule, function=function):
            question = {k: v for k, v in vector.items() if k not in ("output", "error")}
            answer, problem = runner.ask(question)
            status = "failed"
            if not problem:
                status, problem = _compare(vector, answer)
            outcomes.append(Outcome(path=path, vector=vector, status=status, answer=answer, problem=problem))
    finally:
        runner.shutdown()
    return CheckReport(outcomes=tuple(outcomes))


def _short(value: Json, limit: int = 600) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_report(report: CheckReport, *, root: Path | None = None) -> str:
    """The per-rule table, then the first differing vector of each failing (rule, function)."""
    rows = [
        (rule, str(sum(c.values())), str(c["passed"]), str(c["failed"]), str(c["skipped"]))
        for rule, c in report.by_rule().items()
    ]
    totals = [sum(int(r[i]) for r in rows) for i in range(1, 5)]
    header = ("rule", "vectors", "passed", "failed", "skipped")
    body = [header, *rows, ("total", *map(str, totals))]
    widths = [max(len(r[i]) for r in body) for i in range(5)]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        for r in body
    ]
    for outcome, n in report.first_failures():
        path = (
            outcome.path.relative_to(root) if root is not None and outcome.path.is_relative_to(root) else outcome.path
        )
        expected = {k: outcome.vector[k] for k in ("output", "error") if k in outcome.vector}
        lines += [
            "",
            f"FAIL {path} ({n} failing in {outcome.vector['rule']} {outcome.vector['function']}): {outcome.problem}",
            f"  input:    {_short(outcome.vector['input'])}",
            f"  expected: {_short(expected)}",
            f"  got:      {_short(outcome.answer)}",
        ]
    verdict = "OK" if report.ok else "FAILED"
    lines += ["", f"{verdict}: {totals[2]} failed, {totals[3]} skipped, {totals[1]} passed"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``write``, ``check`` and ``answer`` subcommands of ``kvspec vectors``."""
    sub = parser.add_subparsers(dest="vectors_command", required=True, metavar="ACTION")
    write = sub.add_parser(
        "write",
        help="write the vectors as JSON files",
        description="Write DIR/<rule>/<function>/<case>.json per vector, the JSON Schemas and a manifest. The same "
        "kvspec version and seed write the same bytes. A folder a previous write filled is replaced; any other "
        "non-empty folder is refused.",
    )
    write.add_argument("directory", metavar="DIR", help="where to write DIR/<rule>/<function>/<case>.json")
    write.add_argument("--rule", metavar="ID", help="only this rule's vectors, e.g. WIN-1")
    write.add_argument(
        "--count",
        type=int,
        default=DEFAULT_COUNT,
        metavar="N",
        help=f"generated vectors per rule and function (default {DEFAULT_COUNT})",
    )
    write.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        metavar="S",
        help=f"seed of the generated vectors (default {DEFAULT_SEED})",
    )
    check = sub.add_parser(
        "check",
        help="run an implementation over the vectors and compare",
        description="Run PROG once per vector (the vector on stdin, its answer on stdout) and compare; "
        "exit 1 on any difference.",
    )
    check.add_argument("directory", metavar="DIR", help="a directory written by `kvspec vectors write`")
    check.add_argument(
        "--command",
        dest="implementation",
        required=True,
        metavar='"PROG ARGS"',
        help="the implementation, split like a POSIX shell",
    )
    check.add_argument("--rule", metavar="ID", help="only this rule's vectors")
    check.add_argument("--function", metavar="NAME", help="only this function's vectors")
    check.add_argument(
        "--jsonl", action="store_true", help="start PROG once; one vector per line in, one answer per line out"
    )
    check.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="per vector (default 30)")
    check.add_argument("--report", metavar="FILE", help="also write a JSON report here")
    answer = sub.add_parser(
        "answer",
        help="kvspec's own answer to vectors on stdin (the reference implementation of the contract)",
        description="Read one vector on stdin and print kvspec's answer; with --jsonl, one per line until EOF.",
    )
    answer.add_argument("--jsonl", action="store_true", help="one vector per line in, one answer per line out")


def _answer_stream(stdin: IO[str], out: TextIO, *, jsonl: bool) -> int:
    lines: Iterator[str] = iter(stdin.readline, "") if jsonl else iter([stdin.read()])
    for line in lines:
        if line.strip():
            print(json.dumps(answer_vector(json.loads(line)), sort_keys=True), file=out, flush=True)
    return 0


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Carry out ``kvspec vectors ACTION``; returns the exit status."""
    if args.vectors_command == "write":
        written = write_vectors(args.directory, seed=args.seed, count=args.count, rule=args.rule)
        print(f"wrote {len(written)} vectors under {args.directory}", file=out)
        return 0
    if args.vectors_command == "answer":
        return _answer_stream(sys.stdin, out, jsonl=args.jsonl)
    report = check_vectors(
        args.directory,
        args.implementation,
        rule=args.rule,
        function=args.function,
        jsonl=args.jsonl,
        timeout=args.timeout,
    )
    out.write(render_report(report, root=Path(args.directory)))
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return 0 if report.ok else 1
