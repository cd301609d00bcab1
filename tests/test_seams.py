"""The seams between kvspec and its suite are public and point one way (issue 24, docs/explanation/layers.md).

* kvspec_conformance (conformance/) uses only public kvspec names: no ``kvspec._x`` module,
  no ``from kvspec... import _x``, no ``kvspec._x`` attribute.
* kvspec imports nothing of kvspec_conformance, not even through ``importlib.import_module("...")``:
  its CLI finds the suite through the ``kvspec.suite`` entry point.
* Every error class kvspec raises is defined in kvspec/core/_errors.py.
* The engine steps are written once: only the engine roles (kvspec/drivers/_engine.py) create exchange
  sessions; the endpoints and the suite's scenarios play through them (decision 181 in decisions-protocol.md).

Each check is shown to catch the code it forbids (the sources of before the change).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import kvspec
import kvspec.cli

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _trees(folder: str) -> dict[str, ast.Module]:
    """Every module under ``folder``, parsed once for all checks."""
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in sorted((ROOT / folder).rglob("*.py"))}


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _parsed(source: str | ast.Module) -> ast.Module:
    return ast.parse(source) if isinstance(source, str) else source


def private_kvspec_names(source: str | ast.Module) -> list[str]:
    """Every private kvspec module or name a source imports or reaches through an attribute."""
    found: list[str] = []
    for node in ast.walk(_parsed(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvspec":
            if _is_private(node.module):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "kvspec" and _is_private(a.name)]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = [node.attr]
            base = node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id == "kvspec":
                found.append(".".join(["kvspec", *reversed(chain)]))
    return found


def suite_imports(source: str | ast.Module) -> list[str]:
    """Every import of kvspec_conformance: statements, and module names given to importlib or __import__."""
    found: list[str] = []
    for node in ast.walk(_parsed(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Call):
            # importlib.import_module("kvspec_conformance.cli"), __import__(...), find_spec(...)
            names = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        else:
            continue
        found += [name for name in names if name.split(".")[0] == "kvspec_conformance"]
    return found


def test_the_suite_uses_only_public_kvspec_names() -> None:
    found = {path: names for path, tree in _trees("conformance").items() if (names := private_kvspec_names(tree))}
    assert found == {}, "the suite uses private kvspec names"


def test_the_private_name_check_catches_what_the_suite_did() -> None:
    before = (
        "import kvspec\n"
        "from kvspec.drivers._driver import Driver\n"
        "from kvspec.core._models import _DTYPE_SIZES\n"
        "from kvspec.transport._registry import parse_backend_options\n"
        "from kvspec.connector import ReferenceConnector\n"
        "import kvspec.reference._offload\n"
        "sizes = kvspec.core._models._DTYPE_SIZES\n"
    )
    assert set(private_kvspec_names(before)) == {
        "kvspec.drivers._driver",
        "kvspec.core._models",
        "kvspec.core._models._DTYPE_SIZES",
        "kvspec.transport._registry",
        "kvspec.reference._offload",
    }


def test_kvspec_never_imports_the_suite() -> None:
    found = {path: names for path, tree in _trees("kvspec").items() if (names := suite_imports(tree))}
    assert found == {}, "kvspec modules import the conformance suite"


def test_the_suite_import_check_catches_the_old_cli() -> None:
    before = 'import importlib\ndef _suite_cli():\n    return importlib.import_module("kvspec_conformance.cli")\n'
    assert suite_imports(before) == ["kvspec_conformance.cli"]
    assert suite_imports("from kvspec_conformance import run_suite\n") == ["kvspec_conformance"]


def test_the_cli_finds_the_suite_through_its_entry_point_group() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'[project.entry-points."{kvspec.cli.SUITE_ENTRY_POINT_GROUP}"]\nconform = "kvspec_conformance.cli"' in (
        pyproject
    )


def error_classes_outside(source: str | ast.Module) -> list[str]:
    """Classes a module defines whose name says they are errors (``...Error``) or that derive from one."""
    found = []
    for node in ast.walk(_parsed(source)):
        if isinstance(node, ast.ClassDef):
            bases = [
                b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases
            ]
            if node.name.endswith("Error") or any(b.endswith("Error") for b in bases):
                found.append(node.name)
    return found


def test_every_error_class_is_defined_in_kvspec_errors() -> None:
    trees = _trees("kvspec").items()
    found = {
        path: names
        for path, tree in trees
        if path != "kvspec/core/_errors.py" and (names := error_classes_outside(tree))
    }
    assert found == {}, "error classes defined outside kvspec/core/_errors.py"


def test_the_error_class_check_catches_a_class_defined_elsewhere() -> None:
    before = (
        "class WireError(KVSpecError, ValueError):\n    pass\n"
        "class OffloadingDisagreementError(BlockAlignmentError):\n    pass\n"
    )
    assert error_classes_outside(before) == ["WireError", "OffloadingDisagreementError"]


# Where an exchange session may be created: the engine roles, and the session module itself.
_PLAYERS = ("kvspec/drivers/_exchange.py", "conformance/_scenario.py")


def sessions_created(source: str | ast.Module) -> list[str]:
    """Every ``ConsumerSession(...)`` or ``ProducerSession.create(...)``/``ProducerSession(...)`` call in a source."""
    found: list[str] = []
    for node in ast.walk(_parsed(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("ConsumerSession", "ProducerSession"):
            found.append(func.id)
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and (func.value.id, func.attr) == ("ProducerSession", "create")
        ):
            found.append("ProducerSession.create")
    return found


def test_the_endpoints_and_the_scenarios_create_no_session_of_their_own() -> None:
    trees = {**_trees("kvspec"), **_trees("conformance")}
    found = {path: names for path in _PLAYERS if (names := sessions_created(trees[path]))}
    assert found == {}, "an engine step written outside kvspec.exchange.ProducerEngine/ConsumerEngine"
    assert sessions_created(trees["kvspec/drivers/_engine.py"]) == ["ProducerSession.create", "ConsumerSession"]


def test_the_session_creation_check_catches_what_the_scenario_did() -> None:
    before = (
        "producer = ProducerSession.create(request_id=spec.request_id, producer_engine_id='producer')\n"
        "consumer = ConsumerSession(params=params, consumer_engine_id='consumer', consumer_block_ids=ids)\n"
    )
    assert sessions_created(before) == ["ProducerSession.create", "ConsumerSession"]
