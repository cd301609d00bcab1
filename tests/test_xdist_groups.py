"""How tests/conftest.py splits the run over pytest-xdist workers: what must share a worker does.

Decision 94 in decisions-testing.md.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from conftest import XDIST_LONGEST_FIRST, _group_by_scope, _xdist_group


@attrs.define
class _FixtureDef:
    scope: str


@attrs.define
class _FixtureInfo:
    name2fixturedefs: dict[str, tuple[_FixtureDef, ...]]


@attrs.define
class _Item:
    """The few attributes of a pytest item the grouping reads."""

    nodeid: str
    cls: type | None = None
    scopes: tuple[str, ...] = ()
    marks: list[Any] = attrs.Factory(list)

    @property
    def _fixtureinfo(self) -> _FixtureInfo:
        return _FixtureInfo({f"f{i}": (_FixtureDef(scope),) for i, scope in enumerate(self.scopes)})

    def get_closest_marker(self, name: str) -> Any:
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, marker: Any) -> None:
        self.marks.append(marker.mark)


class TestSuite:
    """A stand-in class for class-scoped fixtures."""


def _group(item: _Item) -> str | None:
    return _xdist_group(item)  # type: ignore[arg-type]


def test_modules_that_build_the_checkout_or_namespaces_share_one_worker() -> None:
    # Two setuptools builds of the checkout at once collide in build/ and *.egg-info (seen with plain -n 2).
    assert _group(_Item("tests/test_packaging.py::test_sdist_contents")) == "builds-the-checkout"
    assert _group(_Item("tests/test_conformance_cli.py::test_suite_runs_from_an_installed_wheel")) == (
        "builds-the-checkout"
    )
    assert _group(_Item("tests/test_two_hosts.py::test_torch_suite_across_two_hosts", scopes=("module",))) == "netns"
    assert _group(_Item("tests/test_off_loopback.py::test_nixl_traffic_goes_over_the_chosen_net_devices")) == "netns"


def test_a_shared_fixture_keeps_its_class_or_module_on_one_worker() -> None:
    assert _group(_Item("tests/test_x.py::TestSuite::test_a", cls=TestSuite, scopes=("class", "function"))) == (
        "test_x::TestSuite"
    )
    assert _group(_Item("tests/test_x.py::test_b", scopes=("module",))) == "test_x"
    assert _group(_Item("tests/test_x.py::TestSuite::test_c", cls=TestSuite, scopes=("class", "module"))) == "test_x"
    # Function and session scopes tie a test to nothing: it may run on either worker.
    assert _group(_Item("tests/test_x.py::test_d", scopes=("function", "session"))) is None


def test_an_explicit_group_mark_wins_and_the_longest_units_start_first() -> None:
    marked = _Item("tests/test_x.py::test_e", marks=[pytest.mark.xdist_group("mine").mark])
    assert _group(marked) == "mine"
    items = [
        _Item("tests/test_a.py::test_plain"),
        _Item("tests/test_docs.py::test_examples_run"),
        _Item("tests/test_two_hosts.py::test_nixl_suite_across_two_hosts", scopes=("module",)),
        _Item("tests/test_nixl_backend.py::TestConformance::test_x", cls=TestSuite, scopes=("class",)),
    ]
    _group_by_scope(items)  # type: ignore[arg-type]
    assert [i.nodeid.split("::")[0] for i in items] == [
        "tests/test_two_hosts.py",
        "tests/test_nixl_backend.py",
        "tests/test_docs.py",
        "tests/test_a.py",
    ]
    assert items[0].get_closest_marker("xdist_group").args == ("netns",)
    assert items[-1].get_closest_marker("xdist_group") is None
    assert XDIST_LONGEST_FIRST[0] == "netns"
