"""Run the conformance suite inside your own pytest suite: subclass :class:`BackendSuite`.

Example, in your project's ``tests/test_kvspec_conformance.py``::

    from kvspec_conformance import BackendSuite
    from mypkg.transport import make_backend

    class TestMyBackend(BackendSuite):
        backend_factory = staticmethod(make_backend)
        rules = None            # or ["CLIP-1", "WIN-1"]
        levels = None           # or ["MUST"]
        max_examples = 15

Every case becomes one test, named by its case id; a case whose capability the
backend lacks is skipped with the reason; a failure shows the reproducer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import pytest

from kvspec.transport import Backend

from ._cases import Case, select_cases
from ._connector import Connector, ReferenceConnector
from ._context import DEFAULT_MAX_EXAMPLES, CaseContext
from ._report import Outcome
from ._runner import run_case

__all__ = ["BackendSuite"]


def _spec_of(factory: Callable[[], Backend]) -> str:
    """``module:name`` of the factory, for reproducers (``load_backend`` can load it back)."""
    module = getattr(factory, "__module__", None) or "your_module"
    name = getattr(factory, "__qualname__", None) or getattr(factory, "__name__", "factory")
    return f"{module}:{name}"


class BackendSuite:
    """Base class: set ``backend_factory`` (a zero-argument callable returning a Backend)."""

    backend_factory: ClassVar[Callable[[], Backend]]
    connector_factory: ClassVar[Callable[[], Connector] | None] = None
    rules: ClassVar[Sequence[str] | None] = None
    levels: ClassVar[Sequence[str] | None] = None
    max_examples: ClassVar[int] = DEFAULT_MAX_EXAMPLES
    time_scale: ClassVar[float] = 1.0
    shrink: ClassVar[bool] = False

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "kvspec_case" in metafunc.fixturenames:
            cases = select_cases(rules=self.rules, levels=self.levels)
            metafunc.parametrize("kvspec_case", cases, ids=[c.id for c in cases])

    @pytest.fixture(scope="class")
    @classmethod
    def kvspec_context(cls) -> Iterator[CaseContext]:
        """One backend for the whole class, closed at the end."""
        backend = cls.backend_factory()
        factory = cls.connector_factory
        context = CaseContext(
            backend=backend,
            backend_spec=_spec_of(cls.backend_factory),
            connector=factory() if factory is not None else ReferenceConnector(),
            max_examples=cls.max_examples,
            time_scale=cls.time_scale,
            shrink=cls.shrink,
        )
        try:
            yield context
        finally:
            backend.close()

    def test_conformance(self, kvspec_case: Case, kvspec_context: CaseContext) -> None:
        """One conformance case against this class's backend."""
        result = run_case(kvspec_case, kvspec_context)
        if result.outcome is Outcome.SKIPPED:
            pytest.skip(result.message)
        if result.is_failure:
            text = f"[{result.level.value}] {result.case_id}: {result.title}\n\n{result.message}"
            if result.reproducer:
                text += f"\n\nReproducer (paste into python):\n\n{result.reproducer}"
            pytest.fail(text, pytrace=False)
