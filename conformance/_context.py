"""What a case sees: the backend under test, the connector, the budget, and assertion helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import attrs
from hypothesis import HealthCheck, Phase, settings

from kvspec import ConsumerState, FailureReason, KVSpecError, format_error
from kvspec.transport import Backend, Capabilities, Pace
from kvspec.transport.pace import PACES

from ._cases import CaseFailure, CaseSkip
from ._connector import Connector, ReferenceConnector
from ._scenario import Scenario, ScenarioResult, connector_replay, run_scenario

__all__ = ["DEFAULT_MAX_EXAMPLES", "CaseContext", "PacedSpec", "default_time_scale"]

DEFAULT_MAX_EXAMPLES = 15

F = TypeVar("F", bound=Callable[..., object])


class PacedSpec(str):
    """A backend spec under a pace: the name as a string, and as Python (its ``repr``) the paced backend.

    Reproducers write ``backend={spec!r}``; under ``--pace`` that must rebuild
    the paced backend, with its seed, in a script that imports nothing more.
    """

    pace: Pace

    def __new__(cls, spec: str, pace: Pace) -> PacedSpec:
        made = super().__new__(cls, spec)
        made.pace = pace
        return made

    def __repr__(self) -> str:
        module = "__import__('kvspec.transport.pace', fromlist=['paced'])"
        pace = self.pace
        if pace.name in PACES and Pace.named(pace.name, seed=pace.seed) == pace:
            return f"{module}.paced({str(self)!r}, {pace.name!r}, seed={pace.seed})"
        return f"(lambda m: m.paced({str(self)!r}, m.{pace!r}))({module})"


def default_time_scale(backend: Backend) -> float:
    """The time scale a run uses when none is given: 1 in-process, 2 in other processes, 4 on another host.

    The fault cases' deadlines and leases (a few tenths of a second) are sized
    for an in-process backend; a backend whose agents run in other processes
    (``Capabilities.cross_process``) pays a pipe or socket round trip per call,
    so its deadlines, leases, drain bounds and quiet periods are doubled
    (decision 68 in decisions-testing.md). One whose producer lives on another host
    (``Capabilities.remote_pools``, ``kvspec conform --peer``) also pays the
    network and the agent server's relay on every call, so they are doubled
    again (decision 97 in decisions-hosts.md). ``--time-scale`` overrides it.
    """
    if backend.capabilities.remote_pools:
        return 4.0
    return 2.0 if backend.capabilities.cross_process else 1.0


@attrs.define(kw_only=True)
class CaseContext:
    """Handed to every case function.

    ``backend_spec`` is how the reproducer names the backend (e.g.
    ``"loopback"`` or ``"mypkg.transport:make_backend"``). ``shrink`` lets
    hypothesis minimise a failing generated scenario (slower on a failing
    backend, shorter reproducer). ``integrity`` turns on the drivers'
    integrity check (INT-1) in every scenario; the backend then counts as
    having the ``integrity`` capability, whatever it declares.
    """

    backend: Backend
    backend_spec: str
    connector: Connector = attrs.field(factory=ReferenceConnector)
    max_examples: int = DEFAULT_MAX_EXAMPLES
    time_scale: float = 1.0
    shrink: bool = False
    integrity: bool = False
    last_reproducer: str | None = None
    errors_expected: bool = False
    """Set while a case injects a fault or loses a peer: the backend's error logs are then expected (the runner
    resets it per case; :meth:`expect_error_logs` and :meth:`run` set it)."""

    @property
    def capabilities(self) -> Capabilities:
        """The backend's declared capabilities; ``integrity`` too when the drivers provide it (INT-1)."""
        declared = self.backend.capabilities
        return attrs.evolve(declared, integrity=True) if self.integrity and not declared.integrity else declared

    def expect_error_logs(self) -> None:
        """The case is about to inject a fault or lose a peer: the backend may log errors, and that is right."""
        self.errors_expected = True

    def warm_up(self) -> None:
        """Make the connector under test ready before any case: its ``warm_up()``, where it has one.

        An engine adapter imports its engine's modules there (SGLang's take 27 s
        cold), so that no case's deadline pays for them (FAIL-1). Within a
        scenario the sessions' clock does not count a long call either (``_clock.py``).
        """
        warm_up = getattr(self.connector, "warm_up", None)
        if callable(warm_up):
            warm_up()

    def run(self, scenario: Scenario) -> ScenarioResult:
        """Play a scenario on the backend under test and remember it as the reproducer."""
        timed = ("abort_after_polls", "disconnect_after_polls", "kill_peer_after_polls")
        if scenario.faults is not None or any(getattr(r, f) is not None for r in scenario.requests for f in timed):
            self.expect_error_logs()
        if self.time_scale != 1.0:
            scenario = scenario.scaled(self.time_scale)
        if self.integrity and not scenario.integrity:
            scenario = attrs.evolve(scenario, integrity=True)
        self.last_reproducer = scenario.to_python(self.backend_spec, connector_replay(self.connector))
        return run_scenario(scenario, backend=self.backend, connector=self.connector)

    def fail(self, message: str) -> CaseFailure:
        """A failure carrying the last scenario as reproducer; ``raise ctx.fail(...)``."""
        return CaseFailure(message, reproducer=self.last_reproducer)

    def skip(self, reason: str) -> CaseSkip:
        """``raise ctx.skip(reason)`` when the case does not apply."""
        return CaseSkip(reason)

    def hypothesis(self, func: F) -> F:
        """Apply the suite's hypothesis budget to a ``@given`` test run inside a case."""
        phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if self.shrink else [])
        wrapped: F = settings(
            max_examples=self.max_examples,
            phases=phases,
            deadline=None,
            database=None,
            derandomize=True,
            print_blob=False,
            suppress_health_check=list(HealthCheck),
        )(func)
        return wrapped

    # -- assertions on a scenario's result

    def expect(
        self,
        result: ScenarioResult,
        *,
        loaded: Iterable[str] = (),
        failed: Mapping[str, FailureReason | Iterable[FailureReason] | None] | None = None,
        errors: Mapping[str, type[KVSpecError]] | None = None,
        rule: str,
    ) -> None:
        """Check a result: oracle clean, the named requests LOADED or FAILED (with a reason), REL-1 and SM-1 held.

        ``failed`` maps request ids to the accepted reason(s), or ``None`` for
        any reason (an ABORTED request counts as failed, reason ``aborted``);
        ``errors`` maps request ids to the kvspec error type that
        must have stopped them before any byte moved. ``rule`` names the rule
        the case checks, for the message.
        """
        if result.refused is not None:
            # A connector that refuses the scenario fails the case with its own words, never a KeyError.
            refused = format_error(result.refused)
            raise self.fail(f"{rule}: the scenario was refused before any request ran: {refused}")
        problems: list[str] = []
        if result.early_completions:
            problems.append("completion was reported before the data was visible (DONE-1):")
            problems += ["  " + e for e in result.early_completions]
        if result.mismatches:
            problems.append("pages differ from the oracle (read both pools directly):")
            problems += ["  " + str(m) for m in result.mismatches[:12]]
            if len(result.mismatches) > 12:
                problems.append(f"  ... and {len(result.mismatches) - 12} more")
        problems += list(result.problems)
        for rid in loaded:
            o = result.outcome(rid)
            if not o.loaded:
                problems.append(
                    f"{rid}: expected LOADED, got {o.consumer_state.name} "
                    f"(reason {o.reason.value if o.reason else None}, error {_name(o.error)}, {o.detail})"
                )
        for rid, accepted in (failed or {}).items():
            o = result.outcome(rid)
            # An abort is a failure with reason ABORTED (SM-2); both end with blocks that hold no KV.
            if o.consumer_state not in (ConsumerState.FAILED, ConsumerState.ABORTED):
                problems.append(f"{rid}: expected FAILED, got {o.consumer_state.name} (FAIL-1)")
                continue
            if o.reason is None:
                problems.append(f"{rid}: FAILED without a typed reason (FAIL-1)")
            if accepted is not None:
                reasons = {accepted} if isinstance(accepted, FailureReason) else set(accepted)
                if o.reason not in reasons:
                    wanted = sorted(r.value for r in reasons)
                    problems.append(f"{rid}: FAILED with reason {o.reason}, expected one of {wanted}")
        for rid, error in (errors or {}).items():
            o = result.outcome(rid)
            if not isinstance(o.error, error) or o.posted:
                problems.append(
                    f"{rid}: expected {error.__name__} before any transfer was posted, got error {_name(o.error)}, "
                    f"posted={o.posted}, state {o.consumer_state.name}"
                )
        for o in result.outcomes.values():
            if o.releases_sent != 1:
                problems.append(
                    f"{o.request_id}: the consumer sent {o.releases_sent} releases, expected exactly 1 (REL-1)"
                )
            if not o.producer_state.is_terminal:
                problems.append(
                    f"{o.request_id}: the producer still holds its blocks in {o.producer_state.name} (SM-1)"
                )
        if problems:
            raise self.fail(f"{rule}: " + "\n".join(problems) + "\n\nscenario result:\n" + result.summary())


def _name(error: KVSpecError | None) -> str | None:
    """The class name of the error that stopped a request, as the report shows it."""
    return None if error is None else type(error).__name__
