"""The ``kvspec conform`` command: run the suite against a backend and report by rule."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from typing import TextIO

import attrs

from kvspec import ConfigError, KVSpecError
from kvspec.rules import RULES, Level
from kvspec.transport import Backend, load_backend
from kvspec.transport._registry import parse_backend_options
from kvspec.transport.pace import PACES

from ._cases import select_cases
from ._connector import Connector
from ._context import DEFAULT_MAX_EXAMPLES
from ._report import CaseResult, Outcome
from ._runner import parse_expected_failures, run_suite

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``conform`` options to ``parser`` (used by ``kvspec conform`` and ``python -m kvspec_conformance``)."""
    parser.add_argument(
        "backend",
        nargs="?",
        default="loopback",
        help="built-in name (loopback, torch, nixl), an entry point of group kvspec.backends, "
        "or 'package.module:factory' (default: loopback)",
    )
    parser.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="ID",
        help="run only this rule (e.g. CLIP-1) or case id prefix (e.g. WIN-1/window); repeat or comma-separate",
    )
    parser.add_argument(
        "--level",
        action="append",
        default=[],
        choices=[level.value for level in Level] + [level.value.lower() for level in Level],
        help="run only cases of this level (MUST, SHOULD); repeatable",
    )
    parser.add_argument(
        "--max-examples",
        type=int,
        default=DEFAULT_MAX_EXAMPLES,
        metavar="N",
        help=f"hypothesis examples per generated case (default {DEFAULT_MAX_EXAMPLES})",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=float(os.environ["KVSPEC_CONFORM_TIME_SCALE"]) if "KVSPEC_CONFORM_TIME_SCALE" in os.environ else None,
        metavar="X",
        help=(
            "multiply every scenario deadline, lease, drain bound and quiet period by X (slow backends; "
            "default 1.0 for in-process backends, 2.0 for backends whose agents run in other processes)"
        ),
    )
    parser.add_argument(
        "--shrink",
        action="store_true",
        help="let hypothesis minimise a failing generated scenario (shorter reproducer, slower failing runs)",
    )
    parser.add_argument(
        "--integrity",
        action="store_true",
        help="turn on the drivers' integrity check (INT-1, page digests) in every scenario; "
        "the integrity cases then run on any backend",
    )
    parser.add_argument(
        "--pace",
        choices=PACES,
        help="run the backend under a sound pacing wrapper (kvspec.transport.pace): slow = every transfer takes "
        "several polls and some time, notifications arrive late; jitter = random delays, completions in any order. "
        "A correct backend passes every case at any pace",
    )
    parser.add_argument(
        "--pace-seed",
        type=int,
        metavar="N",
        help="the pace's seed (default: random, printed in the report header so the run replays)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword option for the backend factory (int/float/bool values are converted); repeatable",
    )
    parser.add_argument(
        "--connector",
        metavar="MODULE:FACTORY",
        help="check your own connector logic (clip, pair, plan, admission, handshake) instead of kvspec's reference; "
        "vllm:moriio, vllm:nixl, vllm:nixl-push or vllm:mooncake run vLLM's own (needs kvspec[vllm])",
    )
    parser.add_argument(
        "--expect-fail",
        action="append",
        default=[],
        metavar="CASE_ID=REASON",
        help="a case known to fail, with the reason: reported as an expected failure, "
        "and as a failure once it passes; repeatable",
    )
    parser.add_argument(
        "--expect-fail-file",
        metavar="PATH",
        help="a file of CASE_ID=REASON lines (# comments allowed), as --expect-fail",
    )
    parser.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="run the producer's agent and pool on 'kvspec agent serve' there (two hosts; "
        "token from --token-file or KVSPEC_AGENT_TOKEN)",
    )
    parser.add_argument("--token-file", metavar="F", help="with --peer: file holding the shared token")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--junit", metavar="PATH", help="write the report as JUnit XML")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every case in the report")


def _split(values: Sequence[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _options(values: Sequence[str]) -> dict[str, object]:
    try:
        return parse_backend_options(values)
    except ConfigError as exc:
        raise SystemExit(f"kvspec conform: {exc}") from None


def _load_connector(path: str) -> Connector:
    import importlib

    if path.startswith("vllm:"):
        from kvspec.integrations.vllm import make_connector

        try:
            return make_connector(path.partition(":")[2])
        except KVSpecError as exc:
            raise SystemExit(f"kvspec conform: --connector {path}: {exc}") from exc
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"kvspec conform: --connector expects 'module:factory', got {path!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    connector = factory()
    if not isinstance(connector, Connector):
        raise SystemExit(f"kvspec conform: {path} did not return a Connector (clip, pair, plan, admission, handshake)")
    return connector


class _Progress:
    """One status line on a terminal, a line per case otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, index: int, total: int, result: CaseResult) -> None:
        mark = {
            Outcome.PASSED: ".",
            Outcome.SKIPPED: "s",
            Outcome.FAILED: "F",
            Outcome.ERROR: "E",
            Outcome.EXPECTED_FAILURE: "x",
        }[result.outcome]
        if self.tty:
            line = f"[{index}/{total}] {mark} {result.case_id} ({result.seconds:.2f}s)"
            self.stream.write("\r\x1b[2K" + line[:100])
            if index == total:
                self.stream.write("\n")
        else:
            self.stream.write(
                f"[{index:>3}/{total}] {result.outcome.value:<7} {result.case_id} ({result.seconds:.2f}s)\n"
            )
        self.stream.flush()


def _peer_backend(local: Backend, address: str, token_file: str | None) -> Backend:
    """The producer's agent and pool on the agent server at ``address``; the consumer's here."""
    from kvspec.remote import AgentClient, PeerBackend, parse_address, read_token

    host, port = parse_address(address)
    client = AgentClient(host, port, read_token(token_file))
    try:
        return PeerBackend(local, client)
    except BaseException:
        client.close()
        raise


def run(args: argparse.Namespace) -> int:
    """Run the suite as ``args`` says; returns the exit status (non-zero when a MUST case failed)."""
    rules = _split(args.rule)
    levels = [level.upper() for level in args.level]
    try:
        cases = select_cases(rules=rules or None, levels=levels or None)
    except ValueError as exc:
        print(f"kvspec conform: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            needs = f"  [needs {', '.join(sorted(c.requires))}]" if c.requires else ""
            print(f"{c.id:<52} {c.level.value:<6} {c.title}{needs}")
        print(f"{len(cases)} cases over {len({c.rule for c in cases})} of {len(RULES)} rules")
        return 0
    try:
        backend = load_backend(args.backend, **_options(args.option))
    except (KVSpecError, ImportError) as exc:
        print(f"kvspec conform: cannot load backend {args.backend!r}: {exc}", file=sys.stderr)
        return 2
    if args.peer:
        try:
            backend = _peer_backend(backend, args.peer, args.token_file)
        except (KVSpecError, OSError) as exc:
            backend.close()
            print(f"kvspec conform: --peer {args.peer}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    lines = list(args.expect_fail)
    if args.expect_fail_file:
        try:
            with open(args.expect_fail_file, encoding="utf-8") as handle:
                lines += handle.read().splitlines()
        except OSError as exc:
            print(f"kvspec conform: --expect-fail-file: {exc}", file=sys.stderr)
            return 2
    try:
        expected = parse_expected_failures(lines)
    except ValueError as exc:
        print(f"kvspec conform: {exc}", file=sys.stderr)
        return 2
    connector = _load_connector(args.connector) if args.connector else None
    progress = None if args.quiet else _Progress(sys.stderr)
    try:
        report = run_suite(
            backend,
            cases=cases,
            max_examples=args.max_examples,
            connector=connector,
            time_scale=args.time_scale,
            shrink=args.shrink,
            progress=progress,
            expected_failures=expected,
            integrity=args.integrity,
            pace=args.pace,
            pace_seed=args.pace_seed if args.pace_seed is not None else secrets.randbelow(1 << 16),
        )
    finally:
        backend.close()
    report = attrs.evolve(report, backend=args.backend)
    report.print(verbose=args.verbose)
    if args.json:
        report.write_json(args.json)
    if args.junit:
        report.write_junit(args.junit)
    return report.exit_status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvspec_conformance [BACKEND] [options]``."""
    parser = argparse.ArgumentParser(
        prog="kvspec conform",
        description="Run the kvspec conformance suite against a transport backend and report by rule.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
