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
import contextlib
import json
import math
import os
import re
import selectors
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TextIO

import attrs

from kvspec.core._errors import ConfigError
from kvspec.tools._vector_cases import DEFAULT_COUNT, DEFAULT_SEED, write_vectors
from kvspec.tools._vectors import Json, answer_schema, answer_vector, same_json, vector_schema

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_VECTOR_BYTES",
    "CheckReport",
    "Outcome",
    "add_arguments",
    "check_vectors",
    "load_vectors",
    "read_vector_file",
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


MAX_VECTOR_BYTES = 16 << 20
"""Most bytes one vector file may hold (the committed ones hold at most a few tens of KiB)."""


def read_vector_file(path: Path, limit: int = MAX_VECTOR_BYTES) -> str:
    """The text of a regular file of at most ``limit`` bytes; :class:`ConfigError` naming it otherwise.

    A FIFO, a device (a link to ``/dev/zero``), a socket or a directory is
    refused by its kind without being read: it is opened non-blocking (a FIFO
    with no writer would wait for one) and checked on the opened descriptor,
    so a file swapped in between the two is caught too.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"vectors check: {path}: cannot open it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"vectors check: {path}: expected a regular file, got {_file_kind(info.st_mode)}")
        if info.st_size > limit:
            raise ConfigError(f"vectors check: {path}: expected at most {limit} bytes, got {info.st_size}")
        data = handle.read(limit + 1)  # a file that grows meanwhile is still bounded
    if len(data) > limit:
        raise ConfigError(f"vectors check: {path}: expected at most {limit} bytes, got more")
    return data.decode("utf-8")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), f"file mode {oct(mode)}")


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
        try:
            vector = json.loads(read_vector_file(path))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ConfigError(f"vectors check: {path} is not a JSON vector ({type(exc).__name__})") from None
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


MAX_ANSWER_BYTES = 1 << 20
"""Most bytes one answer may take (a line with ``--jsonl``); more is a failure naming the vector."""

_STDERR_TAIL = 4096  # bytes of the implementation's stderr kept for a failure message; the rest is drained


class _NoAnswer(Exception):
    """The implementation gave no usable answer; ``timed_out`` when a deadline passed."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill and reap ``proc``, closing its pipes; a process that already ended is only reaped."""
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class _Runner:
    """Asks the implementation: one process per vector, or one process for all (``jsonl``).

    Every read and write waits on the pipes with ``selectors`` until a
    deadline (the vector's ``timeout``, never past the run's ``until``), so an
    implementation that stops answering costs one timeout and is killed; an
    answer longer than ``max_bytes`` is a failure, never held in memory.
    """

    def __init__(self, command: str, *, jsonl: bool, timeout: float, until: float, max_bytes: int) -> None:
        try:
            self.argv = shlex.split(command)
        except ValueError as exc:
            raise ConfigError(f"vectors check: --command {command!r} does not split like a shell: {exc}") from None
        if not self.argv:
            raise ConfigError("vectors check: --command is empty")
        self.jsonl, self.timeout, self.until, self.max_bytes = jsonl, timeout, until, max_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""  # bytes the jsonl implementation printed past the last answer's newline

    def ask(self, vector: Mapping[str, Json]) -> tuple[Json, str, bool]:
        """The answer, or ``None`` and a problem; the flag says the problem was a timeout."""
        text = json.dumps(vector, sort_keys=True).encode()
        deadline = min(time.monotonic() + self.timeout, self.until)
        try:
            raw = self._ask_jsonl(text, deadline) if self.jsonl else self._ask_once(text, deadline)
        except _NoAnswer as exc:
            self.close()
            return None, f"the implementation did not answer: {exc}", exc.timed_out
        except OSError as exc:
            self.close()
            return None, f"the implementation did not answer: {type(exc).__name__}: {exc}", False
        try:
            return json.loads(raw), "", False
        except (ValueError, RecursionError):
            return None, f"the answer is not JSON: {raw[:200]!r}", False

    def _start(self, *, stderr: int | None) -> subprocess.Popen[bytes]:
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, bufsize=0)
        except OSError as exc:
            raise ConfigError(f"vectors check: cannot start {self.argv[0]!r}: {exc.strerror or exc}") from None
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                os.set_blocking(stream.fileno(), False)
        return proc

    def _ask_once(self, text: bytes, deadline: float) -> bytes:
        proc = self._proc = self._start(stderr=subprocess.PIPE)
        stdin, stdout, stderr = _pipe(proc.stdin), _pipe(proc.stdout), _pipe(proc.stderr)
        out, err = bytearray(), bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(stdin, selectors.EVENT_WRITE)
            sel.register(stdout, selectors.EVENT_READ)
            sel.register(stderr, selectors.EVENT_READ)
            view = memoryview(text)
            while len(sel.get_map()) > 0:
                for key, _ in _select(sel, deadline):
                    if key.fileobj is stdin:
                        try:
                            view = view[_write(stdin, view) :]
                        except BrokenPipeError:  # it answers without reading its input: allowed
                            view = view[:0]
                        if not view:
                            sel.unregister(stdin)
                            stdin.close()  # end of input: the one vector is written
                        continue
                    chunk = _read(key.fileobj)
                    if chunk is None:
                        continue
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.fileobj is stdout:
                        out += chunk
                        if len(out) > self.max_bytes:
                            raise _NoAnswer(f"the answer exceeds {self.max_bytes} bytes")
                    else:
                        err = (err + chunk)[-_STDERR_TAIL:]
        try:
            status = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise _NoAnswer("it closed its output but did not exit within the timeout", timed_out=True) from None
        if status != 0:
            detail = err.decode("utf-8", "replace").strip()[-300:]
            raise _NoAnswer(f"exit status {status}: {detail}")
        self._proc = None
        return bytes(out)

    def _ask_jsonl(self, text: bytes, deadline: float) -> bytes:
        if self._proc is None or self._proc.poll() is not None:
            self._proc, self._pending = self._start(stderr=None), b""
        proc = self._proc
        stdin, stdout = _pipe(proc.stdin), _pipe(proc.stdout)
        line = bytearray(self._pending)
        with selectors.DefaultSelector() as sel:
            view = memoryview(text + b"\n")
            sel.register(stdin, selectors.EVENT_WRITE)
            while view:
                for _ in _select(sel, deadline):
                    try:
                        view = view[_write(stdin, view) :]
                    except BrokenPipeError:
                        raise _NoAnswer(f"it closed its input (exit status {proc.poll()})") from None
            sel.unregister(stdin)
            sel.register(stdout, selectors.EVENT_READ)
            while b"\n" not in line:
                if len(line) > self.max_bytes:
                    raise _NoAnswer(f"the answer line exceeds {self.max_bytes} bytes")
                for _ in _select(sel, deadline):
                    chunk = _read(stdout)
                    if chunk is None:
                        continue
                    if not chunk:
                        raise _NoAnswer(f"it closed its output (exit status {proc.poll()})")
                    line += chunk
        answer, _, self._pending = bytes(line).partition(b"\n")
        if len(answer) > self.max_bytes:
            raise _NoAnswer(f"the answer line exceeds {self.max_bytes} bytes")
        return answer

    def close(self) -> None:
        """Kill and reap the implementation, if one is running."""
        if self._proc is not None:
            proc, self._proc = self._proc, None
            _kill(proc)


def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
    if stream is None:  # pragma: no cover - every stream is a pipe by construction
        raise _NoAnswer("the implementation's pipes are closed")
    return stream


def _select(sel: selectors.BaseSelector, deadline: float) -> list[tuple[selectors.SelectorKey, int]]:
    """Ready pipes; raises _NoAnswer (a timeout) once ``deadline`` has passed with none ready."""
    left = deadline - time.monotonic()
    ready = sel.select(timeout=left) if left > 0 else []
    if not ready:
        raise _NoAnswer("no answer within the timeout", timed_out=True)
    return ready


def _read(stream: Any) -> bytes | None:
    """Up to 64 KiB from a non-blocking pipe: ``b""`` at its end, ``None`` when nothing is there yet."""
    try:
        return os.read(stream.fileno(), 65536)
    except BlockingIOError:
        return None


def _write(stream: Any, data: memoryview) -> int:
    """Bytes written to a non-blocking pipe (0 when it is full); BrokenPipeError when the reader is gone."""
    try:
        return os.write(stream.fileno(), data[:65536])
    except BlockingIOError:
        return 0


def _generated(outcome: Outcome) -> bool:
    return str(outcome.vector["case"]).startswith("generated_")


@attrs.frozen(kw_only=True)
class CheckReport:
    """Every vector's outcome, in path order; ``stopped`` says why the run ended early ("" when it did not)."""

    outcomes: tuple[Outcome, ...]
    stopped: str = ""

    @property
    def ok(self) -> bool:
        """True when the run finished and no vector failed (skipped ones do not fail the run)."""
        return not self.stopped and all(o.status != "failed" for o in self.outcomes)

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
            "stopped": self.stopped or None,
            "rules": self.by_rule(),
            "failures": [
                {"vector": str(o.path), "problem": o.problem, "answer": o.answer}
                for o in self.outcomes
                if o.status == "failed"
            ],
        }


DEFAULT_TIMEOUT = 30.0
"""Seconds one vector may take (``--timeout``)."""
DEFAULT_TOTAL_TIMEOUT = 1800.0
"""Seconds the whole run may take (``--total-timeout``): 425 vectors at about a second each, four times over."""
DEFAULT_MAX_TIMEOUTS = 3
"""Consecutive timed-out vectors after which the run stops (``--max-timeouts``)."""


def check_vectors(
    directory: str | Path,
    command: str,
    *,
    rule: str | None = None,
    function: str | None = None,
    jsonl: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    total_timeout: float = DEFAULT_TOTAL_TIMEOUT,
    max_timeouts: int = DEFAULT_MAX_TIMEOUTS,
    max_answer_bytes: int = MAX_ANSWER_BYTES,
) -> CheckReport:
    """Ask ``command`` (split like a POSIX shell) every vector under ``directory`` and compare its answers.

    ``timeout`` bounds each vector, ``total_timeout`` the whole run, and the
    run stops after ``max_timeouts`` consecutive timeouts (the report's
    ``stopped`` says which); an answer past ``max_answer_bytes`` fails its
    vector. A timed-out implementation is killed.
    """
    for name, value in (("timeout", timeout), ("total_timeout", total_timeout)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"vectors check: {name} expected a positive number of seconds, got {value!r}")
    if max_timeouts < 1 or max_answer_bytes < 1:
        raise ConfigError("vectors check: max_timeouts and max_answer_bytes expected positive integers")
    runner = _Runner(command, jsonl=jsonl, timeout=timeout, until=math.inf, max_bytes=max_answer_bytes)
    vectors = load_vectors(directory, rule=rule, function=function)
    until = runner.until = time.monotonic() + total_timeout
    outcomes: list[Outcome] = []
    stopped, in_a_row = "", 0
    try:
        for path, vector in vectors:
            if time.monotonic() >= until:
                stopped = f"the run passed --total-timeout {total_timeout:g} s after {len(outcomes)} of {len(vectors)}"
                break
            question = {k: v for k, v in vector.items() if k not in ("output", "error")}
            answer, problem, timed_out = runner.ask(question)
            status = "failed"
            if not problem:
                try:
                    status, problem = _compare(vector, answer)
                except RecursionError:
                    status, problem = "failed", "the answer is nested too deep to compare"
            outcomes.append(Outcome(path=path, vector=vector, status=status, answer=answer, problem=problem))
            in_a_row = in_a_row + 1 if timed_out else 0
            if in_a_row >= max_timeouts:
                stopped = (
                    f"{in_a_row} vectors in a row timed out (--max-timeouts {max_timeouts}); "
                    f"stopped after {len(outcomes)} of {len(vectors)}"
                )
                break
    finally:
        runner.close()
    return CheckReport(outcomes=tuple(outcomes), stopped=stopped)


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
    if report.stopped:
        lines += ["", f"STOPPED: {report.stopped}"]
    lines += ["", f"{verdict}: {totals[2]} failed, {totals[3]} skipped, {totals[1]} passed"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command line


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number of seconds, got {text!r}")
    return value


MAX_COUNT = 1000
"""Most generated vectors per rule and function ``vectors write --count`` accepts (a bound on the work asked)."""


def _vector_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected 0 to {MAX_COUNT}, got {text!r}")
    return value


def _positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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
        type=_vector_count,
        default=DEFAULT_COUNT,
        metavar="N",
        help=f"generated vectors per rule and function, 0 to {MAX_COUNT} (default {DEFAULT_COUNT})",
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
    check.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"per vector, every read and write included; the implementation is killed past it "
        f"(default {DEFAULT_TIMEOUT:g})",
    )
    check.add_argument(
        "--total-timeout",
        type=_positive_seconds,
        default=DEFAULT_TOTAL_TIMEOUT,
        metavar="SECONDS",
        help=f"for the whole run (default {DEFAULT_TOTAL_TIMEOUT:g})",
    )
    check.add_argument(
        "--max-timeouts",
        type=_positive_count,
        default=DEFAULT_MAX_TIMEOUTS,
        metavar="K",
        help=f"stop after K vectors in a row timed out (default {DEFAULT_MAX_TIMEOUTS})",
    )
    check.add_argument(
        "--max-answer-bytes",
        type=_positive_count,
        default=MAX_ANSWER_BYTES,
        metavar="N",
        help=f"most bytes of one answer (one line with --jsonl); more fails the vector (default {MAX_ANSWER_BYTES})",
    )
    check.add_argument("--report", metavar="FILE", help="also write a JSON report here")
    answer = sub.add_parser(
        "answer",
        help="kvspec's own answer to vectors on stdin (the reference implementation of the contract)",
        description="Read one vector on stdin and print kvspec's answer; with --jsonl, one per line until EOF.",
    )
    answer.add_argument("--jsonl", action="store_true", help="one vector per line in, one answer per line out")


def _answer_stream(stdin: IO[str], out: TextIO, *, jsonl: bool) -> int:
    lines: Iterator[str] = iter(stdin.readline, "") if jsonl else iter([stdin.read()])
    for number, line in enumerate(lines, start=1):
        if line.strip():
            answer = _answer_line(line, where=f"line {number}" if jsonl else "stdin")
            print(json.dumps(answer, sort_keys=True), file=out, flush=True)
    return 0


def _answer_line(line: str, *, where: str) -> dict[str, Json]:
    """kvspec's answer to one vector's text; ConfigError (one line) when the text is not a vector."""
    try:
        vector = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"vectors answer: {where}: expected one JSON vector, got {line[:60]!r} ({exc})") from None
    if not isinstance(vector, dict) or not isinstance(vector.get("function"), str) or "input" not in vector:
        raise ConfigError(
            f"vectors answer: {where}: expected a JSON object with 'function' and 'input', got {line[:60]!r}"
        )
    try:
        return answer_vector(vector)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
        raise ConfigError(
            f"vectors answer: {where}: the input does not fit {vector['function']} "
            f"({type(exc).__name__}: {str(exc)[:100]})"
        ) from None


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
        total_timeout=args.total_timeout,
        max_timeouts=args.max_timeouts,
        max_answer_bytes=args.max_answer_bytes,
    )
    out.write(render_report(report, root=Path(args.directory)))
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if report.stopped:
        print(f"kvspec vectors check: stopped: {report.stopped}", file=sys.stderr)
    return 0 if report.ok else 1
