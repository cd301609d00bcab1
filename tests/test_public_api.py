"""Keep the public API honest: every exported name exists and every module says its one job."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> import name (the suite lives in conformance/ but imports as kvspec_conformance).
PACKAGES = {"kvspec": "kvspec", "conformance": "kvspec_conformance"}


def _module_files() -> list[tuple[str, Path]]:
    found = []
    for folder, import_name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append((".".join([import_name, *parts]), path))
    return found


MODULES = _module_files()
# kvspec.models only serves deprecated names (tests/test_deprecations.py covers it).
DEPRECATED_MODULES = {"kvspec.models"}
# A vLLM connector class: importing it imports vLLM (tens of seconds); the vLLM tests check its __all__
# (tests/test_vllm_own_connector.py).
ENGINE_MODULES = {"kvspec.integrations.vllm_guard"}
PUBLIC_MODULES = [
    name
    for name, _ in MODULES
    if not any(part.startswith("_") for part in name.split("."))
    and name not in DEPRECATED_MODULES
    and name not in ENGINE_MODULES
]


@pytest.mark.parametrize(("name", "path"), MODULES, ids=[name for name, _ in MODULES])
def test_module_opens_with_a_one_line_summary(name: str, path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstring = ast.get_docstring(tree, clean=False)
    assert docstring, f"{name} ({path}) has no module docstring"
    assert docstring == docstring.lstrip(), f"{name}: the summary must start on the docstring's first line"
    lines = docstring.strip().splitlines()
    summary = lines[0]
    assert summary.endswith("."), f"{name}: the summary line should be a sentence ending in '.': {summary!r}"
    # PEP 257: a longer docstring separates the summary from the rest by a blank line.
    assert len(lines) == 1 or not lines[1].strip(), f"{name}: the summary must be one line, then a blank line"


@pytest.mark.parametrize(("name", "path"), MODULES, ids=[name for name, _ in MODULES])
def test_module_declares_all(name: str, path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    targets = [
        target.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    ]
    assert "__all__" in targets, f"{name} ({path}) does not declare __all__"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_exported_name_exists(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
    missing = [attr for attr in exported if not hasattr(module, attr)]
    assert not missing, f"{name}.__all__ names what {name} does not define: {missing}"


@pytest.mark.parametrize(
    "name",
    [
        "kvspec",
        "kvspec.exchange",
        "kvspec.presets",
        "kvspec.rules",
        "kvspec.schema",
        "kvspec.summary",
        "kvspec.testing",
        "kvspec.transport",
        "kvspec_conformance",
    ],
)
def test_package_exports_are_public_and_documented(name: str) -> None:
    module = importlib.import_module(name)
    for attr in module.__all__:
        if attr.startswith("__"):
            continue
        assert not attr.startswith("_"), f"{name}.__all__ exports private name {attr!r}"
        value = getattr(module, attr)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"{name}.{attr} has no docstring"


def test_version_is_the_package_version() -> None:
    import kvspec

    assert kvspec.__version__ == importlib.metadata.version("kvspec")


def test_top_level_is_the_spec_and_tools_live_in_submodules() -> None:
    import kvspec

    # Drivers, presets, the rule registry, schemas and plan reporting are not top-level names any more.
    tools = {"ProducerEndpoint", "run_request", "get_preset", "RULES", "get_rule", "message_schemas", "summarize_plan"}
    assert not tools & set(kvspec.__all__)
    assert kvspec.__all__ == sorted(kvspec.__all__, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))


# Code cites the repository's own docs (docs/spec/...), never notes that live outside it.
_OUTSIDE = re.compile(r"\bresearch\b[^\n]*(§|section|\.md)|shared/research|DESIGN\.md|STYLE habit|\bresearch [A-Z]\d")


def _outside_citations(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _OUTSIDE.search(line)]


def test_the_citation_check_catches_a_note_outside_the_repository() -> None:
    assert _outside_citations("x = 1  # vLLM nulls skipped blocks (research §2.3).") != []
    assert _outside_citations('"""Workload (shared/research/backends.md section 0)."""') != []
    assert _outside_citations("# (docs/spec/alignment-and-coverage.md, WIN-1)") == []


@pytest.mark.parametrize(
    "path",
    [
        *sorted(
            p
            for folder in ("kvspec", "conformance", "tests", "benchmarks", "docs/_gen")
            for p in (ROOT / folder).rglob("*.py")
        ),
        ROOT / "docs" / "hooks.py",
    ],
    ids=str,
)
def test_code_cites_only_the_repository(path: Path) -> None:
    if path.name == "test_public_api.py":
        return  # this file spells the forbidden patterns out
    found = _outside_citations(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)} cites notes outside the repository: {found}"
