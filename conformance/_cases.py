"""The case registry: every conformance case with its rule id, level and required capabilities."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs

from kvspec import TransferMode
from kvspec.rules import RULES, Level, get_rule
from kvspec.transport import Capabilities

if TYPE_CHECKING:
    from ._context import CaseContext

__all__ = [
    "CAPABILITIES",
    "Case",
    "CaseFailure",
    "CaseSkip",
    "all_cases",
    "case",
    "catalogue",
    "missing_capabilities",
    "select_cases",
]

CaseFunction = Callable[["CaseContext"], None]

# Capability names a case may require, and how to read each from a backend's Capabilities.
CAPABILITIES: dict[str, Callable[[Capabilities], bool]] = {
    "read": lambda c: TransferMode.READ in c.modes,
    "write": lambda c: TransferMode.WRITE in c.modes,
    "notifications": lambda c: c.notifications,
    "cross_process": lambda c: c.cross_process,
    "integrity": lambda c: c.integrity,
    "observable_in_flight": lambda c: c.observable_in_flight,
    "immediate_cancel": lambda c: c.immediate_cancel,
    # The suite registers pools it allocated itself with both agents: not when one agent is on another host.
    "local_pools": lambda c: not c.remote_pools,
    # One agent lives in `kvspec agent serve`, which the suite can kill (peer loss across hosts).
    "remote_pools": lambda c: c.remote_pools,
}

_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class CaseFailure(AssertionError):
    """A case found the backend (or connector) breaking its rule; ``reproducer`` is pasteable Python."""

    def __init__(self, message: str, *, reproducer: str | None = None) -> None:
        self.reproducer = reproducer
        super().__init__(message)


class CaseSkip(Exception):
    """A case does not apply to this backend; ``reason`` says why (never counted as a pass)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@attrs.frozen(kw_only=True)
class Case:
    """One conformance case: ``id`` is ``"RULE/slug"``, e.g. ``"CLIP-1/sw-tail-keeps-last-n"``."""

    id: str
    rule: str
    level: Level
    title: str
    requires: frozenset[str]
    func: CaseFunction = attrs.field(repr=False)

    @property
    def slug(self) -> str:
        """The part of the id after the rule."""
        return self.id.partition("/")[2]


_REGISTRY: dict[str, Case] = {}


def case(
    rule: str,
    slug: str,
    *,
    level: Level | str | None = None,
    requires: Iterable[str] = (),
) -> Callable[[CaseFunction], CaseFunction]:
    """Register a case for ``rule``; its title is the first line of the function's docstring.

    ``level`` defaults to the rule's level; ``requires`` names capabilities from
    :data:`CAPABILITIES` without which the case is skipped with a reason.
    """
    rule_obj = get_rule(rule)
    if not _SLUG.match(slug):
        raise ValueError(f"case slug: expected lowercase words joined by '-', got {slug!r}")
    needs = frozenset(requires)
    unknown = needs - set(CAPABILITIES)
    if unknown:
        raise ValueError(f"case {rule}/{slug}: unknown capabilities {sorted(unknown)}; known {sorted(CAPABILITIES)}")
    case_level = rule_obj.level if level is None else Level(level)

    def register(func: CaseFunction) -> CaseFunction:
        case_id = f"{rule}/{slug}"
        if case_id in _REGISTRY:
            raise ValueError(f"case {case_id} is registered twice")
        doc = (func.__doc__ or "").strip().splitlines()
        _REGISTRY[case_id] = Case(
            id=case_id,
            rule=rule,
            level=case_level,
            title=doc[0] if doc else slug.replace("-", " "),
            requires=needs,
            func=func,
        )
        return func

    return register


def _load_cases() -> None:
    # Importing the case modules registers them.
    from . import cases  # noqa: F401


def all_cases() -> tuple[Case, ...]:
    """Every registered case, ordered by rule (as in docs/spec/index.md) then id."""
    _load_cases()
    order = {rule.id: index for index, rule in enumerate(RULES)}
    return tuple(sorted(_REGISTRY.values(), key=lambda c: (order[c.rule], c.id)))


def select_cases(
    *,
    rules: Iterable[str] | None = None,
    levels: Iterable[Level | str] | None = None,
) -> tuple[Case, ...]:
    """Cases whose rule id or case id (or its prefix) is in ``rules`` and whose level is in ``levels``."""
    chosen = all_cases()
    if rules:
        wanted = [r.strip() for r in rules if r.strip()]
        known = {c.rule for c in chosen}
        for pattern in wanted:
            if pattern not in known and not any(c.id.startswith(pattern) for c in chosen):
                raise ValueError(f"--rule {pattern!r} matches no rule or case; rules: {', '.join(r.id for r in RULES)}")
        chosen = tuple(c for c in chosen if c.rule in wanted or any(c.id.startswith(p) for p in wanted))
    if levels:
        wanted_levels = {Level(str(level).upper()) for level in levels}
        chosen = tuple(c for c in chosen if c.level in wanted_levels)
    return chosen


def missing_capabilities(case: Case, capabilities: Capabilities) -> list[str]:
    """The capabilities ``case`` needs that a backend lacks."""
    return sorted(name for name in case.requires if not CAPABILITIES[name](capabilities))


def catalogue() -> dict[str, list[Case]]:
    """Rule id -> its cases, for every rule (in docs/spec/index.md order); raises if a case cites an unknown rule.

    The docs build renders this and fails when a rule has no case.
    """
    cases = all_cases()
    table: dict[str, list[Case]] = {rule.id: [] for rule in RULES}
    for c in cases:
        if c.rule not in table:
            raise ValueError(f"case {c.id} cites unknown rule {c.rule!r}")
        table[c.rule].append(c)
    return table
