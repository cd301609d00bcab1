"""Run selected cases against one backend and collect a :class:`Report`."""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

import kvspec
from kvspec.rules import Level
from kvspec.transport import Backend, FaultyBackend, Pace, PacedBackend, load_backend
from kvspec.transport.backend_logs import BackendLogLine, capture_backend_logs

from ._cases import Case, CaseFailure, CaseSkip, missing_capabilities, select_cases
from ._connector import Connector, ReferenceConnector
from ._context import DEFAULT_MAX_EXAMPLES, CaseContext, PacedSpec, default_time_scale
from ._report import CaseResult, Outcome, Report
from ._scenario import connector_replay

__all__ = ["apply_expected_failures", "judge_logs", "parse_expected_failures", "run_case", "run_suite"]

# The engines' own Python loggers, watched besides the backend's package: their errors count as the backend's.
ENGINE_LOGGERS = ("nixl", "mooncake", "torch.distributed")

Progress = Callable[[int, int, CaseResult], None]


def run_case(case: Case, context: CaseContext) -> CaseResult:
    """Run one case; a missing capability is a skip with its reason, never a pass."""
    started = time.perf_counter()
    missing = missing_capabilities(case, context.capabilities)

    def result(outcome: Outcome, message: str = "", reproducer: str | None = None) -> CaseResult:
        return CaseResult(
            case_id=case.id,
            rule=case.rule,
            level=case.level,
            title=case.title,
            outcome=outcome,
            seconds=time.perf_counter() - started,
            message=message,
            reproducer=reproducer,
        )

    if missing:
        hint = (
            " (the drivers' INT-1 check provides it, on unless kvspec conform --no-integrity)"
            if "integrity" in missing
            else ""
        )
        return result(Outcome.SKIPPED, f"backend lacks capability {', '.join(missing)}{hint}")
    context.last_reproducer = None
    context.errors_expected = False
    # Cases that drive the transport directly have no scenario; they replay as the one case.
    imports, connector = "", ""
    replay = connector_replay(context.connector)
    if replay is not None:  # the connector under test plays the case too
        imports, connector = replay[0], f", connector={replay[1]}"
    whole_case = (
        f"from kvspec_conformance import run_suite\n{imports}\n"
        f"run_suite({context.backend_spec!r}, rules=[{case.id!r}], "
        f"max_examples={context.max_examples}{connector}{'' if context.integrity else ', integrity=False'}).print()\n"
    )
    try:
        case.func(context)
    except CaseSkip as exc:
        return result(Outcome.SKIPPED, exc.reason)
    except CaseFailure as exc:
        return result(Outcome.FAILED, str(exc), exc.reproducer or context.last_reproducer or whole_case)
    except AssertionError as exc:
        return result(Outcome.FAILED, f"{case.rule}: {exc}", context.last_reproducer or whole_case)
    except Exception as exc:
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        message = f"{type(exc).__name__}: {exc}\n" + "".join(tb[-6:])
        return result(Outcome.ERROR, message, context.last_reproducer or whole_case)
    return result(Outcome.PASSED)


def parse_expected_failures(lines: Iterable[str], *, known: Iterable[str] | None = None) -> dict[str, str]:
    """``CASE_ID=REASON`` lines (blank lines and ``#`` comments skipped) as a dict; unknown ids refused.

    Raises ``ValueError`` for a line without ``=`` or a reason, or a case id
    not in ``known`` (every registered case when ``None``).
    """
    ids = set(known) if known is not None else {c.id for c in select_cases()}
    expected: dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        case_id, sep, reason = line.partition("=")
        case_id, reason = case_id.strip(), reason.strip()
        if not sep or not case_id or not reason:
            raise ValueError(f"expected failure: expected CASE_ID=REASON, got {line!r}")
        if case_id not in ids:
            raise ValueError(f"expected failure: no case {case_id!r}; list them with kvspec conform --list")
        expected[case_id] = reason
    return expected


def apply_expected_failures(result: CaseResult, expected: Mapping[str, str]) -> CaseResult:
    """A declared case that failed becomes EXPECTED_FAILURE; one that passed becomes FAILED.

    Errors and skips are left as they are: a crash is never expected, and a
    skipped case says nothing about the deviation.
    """
    reason = expected.get(result.case_id)
    if reason is None:
        return result
    if result.outcome is Outcome.FAILED:
        return attrs.evolve(result, outcome=Outcome.EXPECTED_FAILURE, message=f"expected: {reason}\n{result.message}")
    if result.outcome is Outcome.PASSED:
        return attrs.evolve(
            result,
            outcome=Outcome.FAILED,
            message=(
                f"{result.case_id} was expected to fail ({reason}) but passed: the deviation is gone, "
                "remove its expected failure"
            ),
        )
    return result


def run_suite(
    backend: Backend | str = "loopback",
    *,
    rules: Iterable[str] | None = None,
    levels: Iterable[Level | str] | None = None,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
    connector: Connector | None = None,
    time_scale: float | None = None,
    shrink: bool = False,
    progress: Progress | None = None,
    cases: Sequence[Case] | None = None,
    expected_failures: Mapping[str, str] | None = None,
    integrity: bool | None = None,
    pace: str | Pace | None = None,
    pace_seed: int = 0,
    allow_logs: Sequence[str] = (),
) -> Report:
    """Run the conformance suite and return its report.

    ``backend`` is a Backend or a name for :func:`kvspec.transport.load_backend`
    (built-in, entry point in ``kvspec.backends``, or ``"module:factory"``).
    ``rules`` selects rule ids or case-id prefixes; ``levels`` MUST and/or SHOULD.
    ``expected_failures`` maps case ids to the reason they are known to fail
    (see :func:`apply_expected_failures`). ``time_scale`` multiplies every
    deadline, lease, drain bound and quiet period; ``None`` takes
    :func:`default_time_scale` of the backend. ``integrity`` turns the
    drivers' integrity check (INT-1, with INT-2's negotiated digest) on or off
    in every scenario, so the integrity cases run or skip; ``None`` (the
    default) turns it on, except for a backend whose pools are on another host
    (``--peer``), whose pages the drivers here cannot digest.
    ``pace`` (``"slow"``, ``"jitter"``, ``"pieces"`` or a :class:`kvspec.transport.Pace`) wraps
    the backend in :class:`kvspec.transport.PacedBackend` seeded with
    ``pace_seed``: a correct backend passes every case at any pace.
    ``allow_logs`` are regular expressions of error log lines the run may
    see: any other error the backend logs (a worker's stderr, or an ERROR
    record of its package's or its engine's logger) outside a case that
    injects a fault fails the run (:func:`judge_logs`), as NIXL's own tests do.
    """
    started = time.perf_counter()
    spec = backend if isinstance(backend, str) else f"{type(backend).__module__}:{type(backend).__name__}"
    resolved = load_backend(backend) if isinstance(backend, str) else backend
    paced_with = (Pace.named(pace, seed=pace_seed) if isinstance(pace, str) else pace) if pace is not None else None
    # The report names the pace, given here or by a caller who passed a PacedBackend.
    shown = paced_with or (resolved.pace if isinstance(resolved, PacedBackend) else None)
    inner = resolved
    if paced_with is not None:
        spec = PacedSpec(spec, paced_with)
        resolved = PacedBackend(resolved, paced_with)
    chosen = list(cases) if cases is not None else list(select_cases(rules=rules, levels=levels))
    context = CaseContext(
        backend=resolved,
        backend_spec=spec,
        connector=connector or ReferenceConnector(),
        max_examples=max_examples,
        time_scale=default_time_scale(resolved) if time_scale is None else time_scale,
        shrink=shrink,
        integrity=not resolved.capabilities.remote_pools if integrity is None else integrity,
    )
    results: list[CaseResult] = []
    windows: list[_Window] = []
    with capture_backend_logs(_backend_loggers(inner)) as logged:
        try:
            context.warm_up()  # imports and set-up before the first case's clock starts
            for index, case in enumerate(chosen):
                began = time.monotonic()
                outcome = apply_expected_failures(run_case(case, context), expected_failures or {})
                # A case that failed anyway, or was declared to, may log what it likes: its failure is the report.
                allowed = context.errors_expected or outcome.outcome is not Outcome.PASSED
                windows.append(_Window(case_id=case.id, began=began, ended=time.monotonic(), allowed=allowed))
                results.append(outcome)
                if progress is not None:
                    progress(index + 1, len(chosen), outcome)
        finally:
            if isinstance(backend, str):
                inner.close()
    unexpected, expected_errors = judge_logs(logged, windows, allow=allow_logs, grace=_LOG_GRACE * context.time_scale)
    return Report(
        backend=resolved.name if not isinstance(backend, str) else backend,
        results=tuple(results),
        seconds=time.perf_counter() - started,
        max_examples=max_examples,
        kvspec_version=kvspec.__version__,
        pace=shown.describe() if shown is not None else None,
        log_errors=tuple(unexpected),
        expected_log_errors=expected_errors,
    )


_LOG_GRACE = 1.0  # seconds (scaled) after a case that expected errors during which its late log lines still count


@attrs.frozen(kw_only=True)
class _Window:
    """When one case ran, and whether error logs were expected then."""

    case_id: str
    began: float
    ended: float
    allowed: bool


def _backend_loggers(backend: Backend) -> list[str]:
    """The Python loggers whose errors are the backend's: its package's (under any wrapper) and the engines'."""
    while isinstance(backend, (PacedBackend, FaultyBackend)):
        backend = backend.inner
    package = type(backend).__module__.partition(".")[0]
    return [package, *ENGINE_LOGGERS]


def judge_logs(
    lines: Iterable[BackendLogLine], windows: Sequence[_Window], *, allow: Iterable[str] = (), grace: float = 1.0
) -> tuple[list[str], int]:
    """The error lines no case expected (each named with the case it came during or after), and how many were.

    A line is expected when it came during a case that injected a fault or
    lost a peer (or that failed anyway), after such a case and before the
    next began, or within ``grace`` seconds into the next; or when it matches
    a regular expression of ``allow``.
    """
    patterns = [re.compile(p) for p in allow]
    unexpected: list[str] = []
    expected = 0
    for line in lines:
        if not line.error:
            continue
        if any(p.search(line.text) for p in patterns):
            expected += 1
            continue
        started = [w for w in windows if w.began <= line.at]
        if not started:
            unexpected.append(f"before the first case: {line.source}: {line.text}")
            continue
        last = started[-1]
        during = line.at <= last.ended
        # A late line of the case before, a fault case, arriving just after this one began, is that case's.
        late = len(started) > 1 and started[-2].allowed and line.at - started[-2].ended <= grace
        if last.allowed or (during and late):
            expected += 1
            continue
        where = f"during {last.case_id}" if during else f"after {last.case_id}"
        unexpected.append(f"{where}: {line.source}: {line.text}")
    return unexpected, expected
