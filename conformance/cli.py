"""The ``kvspec conform`` command: run the suite against a backend and report by rule."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import secrets
import sys
from collections.abc import Sequence
from typing import TextIO

import attrs

from kvspec import ConfigError, KVSpecError
from kvspec.rules import RULES, Level
from kvspec.transport import Backend, is_factory_of, load_backend, parse_backend_options
from kvspec.transport.pace import PACES

from ._cases import select_cases
from ._connector import Connector
from ._context import DEFAULT_MAX_EXAMPLES
from ._report import CaseResult, Outcome, connector_tested
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
        type=_positive_int,
        default=DEFAULT_MAX_EXAMPLES,
        metavar="N",
        help=f"hypothesis examples per generated case (default {DEFAULT_MAX_EXAMPLES})",
    )
    parser.add_argument(
        "--time-scale",
        type=_time_scale,
        default=os.environ.get("KVSPEC_CONFORM_TIME_SCALE"),  # a str default goes through type= (argparse)
        metavar="X",
        help=(
            "multiply every time the suite relies on by X: deadlines, leases, drain bounds, quiet periods and "
            "injected fault delays (slow backends; default 1.0 for in-process backends, 2.0 for backends whose "
            "agents run in other processes, 4.0 with --peer)"
        ),
    )
    parser.add_argument(
        "--shrink",
        action="store_true",
        help="let hypothesis minimise a failing generated scenario (shorter reproducer, slower failing runs)",
    )
    parser.add_argument(
        "--integrity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the drivers' integrity check (INT-1, page digests with INT-2's XXH3-128) in every scenario, so the "
        "integrity cases run on any backend: on by default (off with --peer, whose pools are on the other host); "
        "--no-integrity turns it off",
    )
    parser.add_argument(
        "--pace",
        choices=PACES,
        help="run the backend under a sound pacing wrapper (kvspec.transport.pace): slow = every transfer takes "
        "several polls and some time, notifications arrive late; jitter = random delays, completions in any order; "
        "pieces = every transfer moves in 32 pieces, one per poll (NIXL without a progress thread). "
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
        "vllm:moriio, vllm:nixl, vllm:nixl-push, vllm:mooncake or vllm:offloading run vLLM's own, "
        "vllm:MODULE:CLASS any vLLM connector class (needs kvspec[vllm]); sglang:mooncake, sglang:nixl or "
        "sglang:mori SGLang 0.5.23's own (needs kvspec[sglang])",
    )
    parser.add_argument(
        "--vllm-extra",
        action="append",
        default=[],
        metavar="KEY=VALUE|FILE.json",
        help="with --connector vllm:...: kv_connector_extra_config (int/float/bool converted) or a JSON file; "
        "repeatable",
    )
    parser.add_argument(
        "--allow-vllm-version",
        action="store_true",
        help="with --connector vllm:...: run on a vLLM release the adapters were not verified on (warn, not refuse)",
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
        help="a file of CASE_ID=REASON lines (# comments allowed), as --expect-fail; or a list kvspec ships, "
        "e.g. vllm:nixl or sglang:mooncake",
    )
    parser.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="run the producer's agent and pool on 'kvspec agent serve' there (two hosts; "
        "token from --token-file or KVSPEC_AGENT_TOKEN)",
    )
    parser.add_argument("--token-file", metavar="F", help="with --peer: file holding the shared token")
    parser.add_argument(
        "--allow-log",
        action="append",
        default=[],
        metavar="REGEX",
        help="an error line the backend may log (a regular expression): any other error it logs outside a case that "
        "injects a fault fails the run; repeatable",
    )
    parser.add_argument(
        "--backend-logs",
        action="store_true",
        help="show every line the backend's worker processes write, its known noise too "
        "(as KVSPEC_BACKEND_LOGS=1; KVSPEC_BACKEND_LOGS=0 shows none)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--junit", metavar="PATH", help="write the report as JUnit XML")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every case in the report")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _time_scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive finite number (also read from KVSPEC_CONFORM_TIME_SCALE), got {text!r}"
        )
    return value


def _split(values: Sequence[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _options(values: Sequence[str]) -> dict[str, object]:
    return parse_backend_options(values)  # a ConfigError is reported by run() as a backend that cannot load


def _peer_options(backend: str, peer: str | None, options: dict[str, object]) -> dict[str, object]:
    """With ``--peer``: the bind address and interfaces that route to the peer, unless ``--option`` gave them."""
    if not peer:
        return options
    from kvspec.remote import derived_options, parse_address, route_source

    try:
        host, _ = parse_address(peer)
    except ConfigError:
        return options  # --peer itself is reported in one line when the suite connects
    return {**derived_options(backend, route_source(host), options), **options}


# Built-in backends' loopback defaults: (option, default) that cannot reach another host.
_LOOPBACK_DEFAULTS = {"torch": ("host", "127.0.0.1"), "nixl": ("net_devices", "lo"), "mooncake": ("host", "127.0.0.1")}


def _loopback_to_a_remote_peer(backend: str, peer: str | None, options: dict[str, object]) -> str | None:
    """One clear line, before any case runs, when the local agent would stay on loopback but the peer is not there."""
    if not peer or backend not in _LOOPBACK_DEFAULTS:
        return None
    from kvspec.remote import is_loopback, parse_address

    try:
        host, _ = parse_address(peer)
    except ConfigError:
        return None
    key, default = _LOOPBACK_DEFAULTS[backend]
    value = options.get(key, default)
    if is_loopback(host) or not (value == default or value == "lo"):
        return None
    return (
        f"the local {backend} agent would use {key}={value}, which cannot reach {host}; "
        f"no interface routes there (or --option {key} says loopback): give --option {key}=... for the interface "
        f"that reaches {host}" + (" (UCX_NET_DEVICES in the environment sets it too)" if key == "net_devices" else "")
    )


def _load_connector(path: str, extra: Sequence[str] = ()) -> tuple[Connector, tuple[tuple[str, str], ...]]:
    """The connector ``--connector`` names, and what the report says was tested; one line for anything wrong."""
    from kvspec.integrations.vllm import import_path

    if path.startswith("sglang:"):
        from kvspec.integrations.sglang import make_connector

        if extra:
            raise SystemExit("kvspec conform: --vllm-extra needs --connector vllm:...")
        try:
            adapter = make_connector(path.partition(":")[2])
        except KVSpecError as exc:
            raise SystemExit(f"kvspec conform: --connector {path}: {exc}") from None
        return adapter, connector_tested(adapter)
    if path.startswith("vllm:"):
        from kvspec.integrations.vllm import parse_vllm_extra, vllm_connector

        try:
            connector = vllm_connector(path.partition(":")[2], extra_config=parse_vllm_extra(extra))
        except KVSpecError as exc:
            raise SystemExit(f"kvspec conform: --connector {path}: {exc}") from None
        return connector, connector_tested(connector)
    if extra:
        raise SystemExit("kvspec conform: --vllm-extra needs --connector vllm:...")
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"kvspec conform: --connector expects 'module:factory', got {path!r}")
    try:
        factory = import_path(path, "--connector")
    except KVSpecError as exc:
        raise SystemExit(f"kvspec conform: {exc}") from None
    if not is_factory_of(factory, Connector, _CONNECTOR_HOOKS):
        # Never call an arbitrary callable (os:system) on the strength of a command-line string.
        raise SystemExit(
            f"kvspec conform: --connector {path}: expected a Connector class, "
            "or a function annotated to return a Connector"
        )
    made: object = factory()
    if not isinstance(made, Connector):
        raise SystemExit(f"kvspec conform: {path} did not return a Connector (clip, pair, plan, admission, handshake)")
    if not callable(getattr(made, "kvspec_replay", None)):
        # Reproducers replay the factory that was given, not the class it happened to return.
        replay = (f"from {module_name} import {attr} as ConnectorUnderTest\n", "ConnectorUnderTest()")
        with contextlib.suppress(AttributeError, TypeError):
            setattr(made, "kvspec_replay", lambda: replay)  # noqa: B010
    return made, (("connector", path),)


_CONNECTOR_HOOKS = tuple(name for name in vars(Connector) if not name.startswith("_"))


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
    for pattern in args.allow_log:
        try:
            re.compile(pattern)
        except re.error as exc:
            print(f"kvspec conform: --allow-log {pattern!r}: expected a regular expression ({exc})", file=sys.stderr)
            return 2
    if args.backend_logs:
        os.environ["KVSPEC_BACKEND_LOGS"] = "1"  # read by the relay of every worker's stderr, as it writes each line
    if args.pace_seed is not None and args.pace is None:
        print("kvspec conform: --pace-seed: expected --pace slow, jitter or pieces with it", file=sys.stderr)
        return 2
    if args.connector and args.connector.startswith("vllm:"):
        # From vLLM's metadata, before anything imports vLLM (tens of seconds on a cold machine) or opens a backend.
        from kvspec.integrations.vllm import check_vllm_version

        try:
            warning = check_vllm_version(allow=args.allow_vllm_version)
        except KVSpecError as exc:
            print(f"kvspec conform: {exc}", file=sys.stderr)
            return 2
        if warning:
            print(f"kvspec conform: {warning}", file=sys.stderr)
    options = _peer_options(args.backend, args.peer, _options(args.option))
    problem = _loopback_to_a_remote_peer(args.backend, args.peer, options)
    if problem:
        print(f"kvspec conform: --peer {args.peer}: {problem}", file=sys.stderr)
        return 2
    try:
        backend = load_backend(args.backend, **options)
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
        from kvspec.integrations.expectations import read_expected

        try:
            lines += read_expected(args.expect_fail_file)
        except KVSpecError as exc:
            print(f"kvspec conform: --expect-fail-file: {exc}", file=sys.stderr)
            return 2
    try:
        expected = parse_expected_failures(lines)
    except ValueError as exc:
        print(f"kvspec conform: {exc}", file=sys.stderr)
        return 2
    connector, tested = _load_connector(args.connector, args.vllm_extra) if args.connector else (None, ())
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
            allow_logs=args.allow_log,
        )
    finally:
        backend.close()
    report = attrs.evolve(report, backend=args.backend, tested=report.tested + tested)
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
    args = parser.parse_args(argv)
    from kvspec.cli import run_command  # the one place CLI errors become one line

    return run_command("kvspec conform", lambda: run(args), sys.stdout)
