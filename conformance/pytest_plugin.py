"""Run the conformance suite inside your own pytest suite: subclass :class:`BackendSuite`.

Example, in your project's ``tests/test_kvspec_conformance.py``::

    from kvspec_conformance import BackendSuite
    from mypkg.transport import make_backend

    class TestMyBackend(BackendSuite):
        backend_factory = staticmethod(make_backend)
        rules = None            # or ["CLIP-1", "WIN-1"]
        levels = None           # or ["MUST"]
        max_examples = 15
        xfail_cases = {"FAIL-1/lost-notification": "our notifications are never lost (issue 12)"}

Every case is one test method, named from its case id by :func:`case_test_name`
(``CLIP-1/sw-tail-keeps-last-n`` is ``test_clip_1_sw_tail_keeps_last_n``), as
zarr's store tests are: a subclass marks one known failure with
``xfail_cases``, or overrides that one method. A case whose capability the
backend lacks is skipped with the reason; a failure shows the reproducer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar

import pytest

import kvspec
from kvspec.transport import Backend, Pace, PacedBackend

from ._cases import Case, all_cases, select_cases
from ._connector import Connector, ReferenceConnector
from ._context import DEFAULT_MAX_EXAMPLES, CaseContext, PacedSpec, default_time_scale
from ._report import Outcome, connector_tested
from ._runner import run_case

__all__ = ["BackendSuite", "case_test_name"]

CaseTest = Callable[["BackendSuite", CaseContext, pytest.FixtureRequest], None]


def case_test_name(case_id: str) -> str:
    """The name of the test method that runs ``case_id``: ``"CLIP-1/sw-tail"`` -> ``"test_clip_1_sw_tail"``."""
    return "test_" + re.sub(r"[^a-z0-9]+", "_", case_id.lower()).strip("_")


def _spec_of(factory: Callable[[], Backend]) -> str:
    """``module:name`` of the factory, for reproducers (``load_backend`` can load it back)."""
    module = getattr(factory, "__module__", None) or "your_module"
    name = getattr(factory, "__qualname__", None) or getattr(factory, "__name__", "factory")
    return f"{module}:{name}"


def _case_test(case: Case) -> CaseTest:
    def test(self: BackendSuite, kvspec_context: CaseContext, request: pytest.FixtureRequest) -> None:
        # Each case's report names what was tested, as the CLI's does; per test, so it survives pytest-xdist.
        request.node.user_properties.extend(_tested(kvspec_context))
        self.check_case(case, kvspec_context)

    test.__name__ = test.__qualname__ = case_test_name(case.id)
    test.__doc__ = f"[{case.level.value}] {case.id}: {case.title}"
    test.kvspec_case = case  # type: ignore[attr-defined]
    return test


def _tested(context: CaseContext) -> list[tuple[str, str]]:
    """What the report names as tested: the backend, kvspec, the protocol, the connector and its engine's release."""
    fields = {"backend": str(context.backend_spec), "kvspec_version": kvspec.__version__}
    fields["protocol_version"] = ".".join(map(str, kvspec.PROTOCOL_VERSION))
    return list({**fields, **dict(connector_tested(context.connector))}.items())


def _is_generated(value: object) -> bool:
    return callable(value) and hasattr(value, "kvspec_case")


class BackendSuite:
    """Base class: set ``backend_factory`` (a zero-argument callable returning a Backend).

    ``rules`` and ``levels`` select cases as ``kvspec conform --rule/--level``
    do; the others' methods are removed from the subclass. ``xfail_cases``
    maps case ids to the reason each is a known failure (strict: a case that
    starts passing fails the run, so the entry is removed once fixed).
    ``integrity`` is the drivers' integrity check (INT-1) in every scenario:
    ``None`` (the default) turns it on unless the pools are remote, as
    ``kvspec conform`` does; ``False`` is ``--no-integrity``. ``pace = "slow"``
    or ``"jitter"`` (with ``pace_seed``) runs every case under :class:`kvspec.transport.PacedBackend` (as ``kvspec
    conform --pace``). To replace one case, define its method (see :func:`case_test_name`); to wrap
    every case, override :meth:`check_case`.
    """

    backend_factory: ClassVar[Callable[[], Backend]]
    connector_factory: ClassVar[Callable[[], Connector] | None] = None
    rules: ClassVar[Sequence[str] | None] = None
    levels: ClassVar[Sequence[str] | None] = None
    max_examples: ClassVar[int] = DEFAULT_MAX_EXAMPLES
    time_scale: ClassVar[float | None] = None
    shrink: ClassVar[bool] = False
    integrity: ClassVar[bool | None] = None
    pace: ClassVar[str | None] = None
    pace_seed: ClassVar[int] = 0
    xfail_cases: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        known = {c.id: c for c in all_cases()}
        unknown = sorted(set(cls.xfail_cases) - set(known))
        if unknown:
            raise ValueError(f"{cls.__name__}.xfail_cases: unknown case ids {unknown}")
        selected = {c.id for c in select_cases(rules=cls.rules, levels=cls.levels)}
        for case_id, case in known.items():
            name = case_test_name(case_id)
            current = getattr(cls, name, None)
            if current is not None and not _is_generated(current):
                continue  # this class (or a parent) replaced the case with its own test
            if case_id not in selected:
                setattr(cls, name, None)  # not a test of this class: pytest collects only callables
                continue
            test = _case_test(case)
            reason = cls.xfail_cases.get(case_id)
            if reason is not None:
                test = pytest.mark.xfail(reason=reason, strict=True)(test)
            setattr(cls, name, test)

    @pytest.fixture(scope="class")
    @classmethod
    def kvspec_context(cls, record_testsuite_property: Callable[[str, object], None]) -> Iterator[CaseContext]:
        """One backend for the whole class, closed at the end; what it tests goes in the JUnit report's properties."""
        backend = cls.backend_factory()
        factory = cls.connector_factory
        spec = _spec_of(cls.backend_factory)
        tested: Backend = backend
        if cls.pace is not None:
            pace = Pace.named(cls.pace, seed=cls.pace_seed)
            spec, tested = PacedSpec(spec, pace), PacedBackend(backend, pace)
        context = CaseContext(
            backend=tested,
            backend_spec=spec,
            connector=factory() if factory is not None else ReferenceConnector(),
            max_examples=cls.max_examples,
            time_scale=default_time_scale(backend) if cls.time_scale is None else cls.time_scale,
            shrink=cls.shrink,
            integrity=not tested.capabilities.remote_pools if cls.integrity is None else cls.integrity,
        )
        try:
            context.warm_up()  # imports and set-up before the first case's clock starts
            for name, value in _tested(context):
                record_testsuite_property(name, value)
            yield context
        finally:
            backend.close()

    def check_case(self, case: Case, context: CaseContext) -> None:
        """Run one case against this class's backend: skip with the reason, or fail with the reproducer."""
        result = run_case(case, context)
        if result.outcome is Outcome.SKIPPED:
            pytest.skip(result.message)
        if result.is_failure:
            text = f"[{result.level.value}] {result.case_id}: {result.title}\n\n{result.message}"
            if result.reproducer:
                text += f"\n\nReproducer (paste into python):\n\n{result.reproducer}"
            pytest.fail(text, pytrace=False)


def _check_names() -> None:
    names = [case_test_name(c.id) for c in all_cases()]
    if len(set(names)) != len(names):  # pragma: no cover - guards the registry
        raise ValueError("two case ids map to one test method name")


_check_names()
for _case in all_cases():
    setattr(BackendSuite, case_test_name(_case.id), _case_test(_case))
del _case
