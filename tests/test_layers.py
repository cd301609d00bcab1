"""The layers point one way: the spec never loads a transport, a driver or a tool (docs/explanation/layers.md).

Two checks keep it so. Statically, every ``kvspec`` module imports only from its
own layer or the layers below. At run time, each layer is imported alone in a
fresh interpreter and the kvspec modules it loaded are compared with what its
layer allows. A mutant of the layering (the planner importing a transport
module again) is shown to fail the static check.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top; a module may import from its own layer and the ones below.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("base", frozenset({"kvspec.core", "kvspec.core._enums", "kvspec.core._deprecation", "kvspec._version"})),
    ("errors", frozenset({"kvspec.core._errors"})),
    ("data", frozenset({"kvspec.core._models", "kvspec.core._descriptors", "kvspec.core._rules"})),
    (
        "definitions",
        frozenset(
            {
                "kvspec.spec",
                "kvspec.spec.admission",
                "kvspec.spec.caches",
                "kvspec.spec.coverage",
                "kvspec.spec.digest",
                "kvspec.spec.guard",
                "kvspec.spec.handshake",
                "kvspec.spec.integrity",
                "kvspec.spec.lifecycle",
                "kvspec.spec.offload",
                "kvspec.spec.pairing",
                "kvspec.spec.parallel",
                "kvspec.spec.pins",
                "kvspec.spec.plan",
                "kvspec.spec.state",
                "kvspec.spec.versions",
                "kvspec.spec.window",
            }
        ),
    ),
    (
        "reference",
        frozenset(
            {
                "kvspec.reference",
                "kvspec.reference._reference",
                "kvspec.reference._offload",
                "kvspec.reference._messages",
                "kvspec.reference._presets",
                "kvspec.reference._integrity",
            }
        ),
    ),
    (
        "protocol",
        frozenset(
            {
                "kvspec.protocol",
                "kvspec.protocol._plan",
                "kvspec.protocol._codec",
                "kvspec.protocol._handshake",
                "kvspec.protocol._session",
                "kvspec.protocol._offload_session",
            }
        ),
    ),
    ("reports", frozenset({"kvspec.protocol._schema", "kvspec.protocol._summary"})),
    (
        "api",
        frozenset(
            {
                "kvspec",
                "kvspec.fast",
                "kvspec.presets",
                "kvspec.rules",
                "kvspec.schema",
                "kvspec.summary",
                "kvspec.models",
            }
        ),
    ),
    (
        "transport",
        frozenset(
            {
                "kvspec.transport",
                "kvspec.transport._base",
                "kvspec.transport.backend_logs",
                "kvspec.transport._registry",
                "kvspec.transport._nixl_worker",
                "kvspec.transport._torch_worker",
                "kvspec.transport.faults",
                "kvspec.transport._mooncake_worker",
                "kvspec.transport._netaddr",
                "kvspec.transport._pairkey",
                "kvspec.transport._wire",
                "kvspec.transport.loopback",
                "kvspec.transport.mooncake",
                "kvspec.transport.pace",
                "kvspec.transport.nixl",
                "kvspec.transport.torch_dist",
            }
        ),
    ),
    (
        "drivers",
        frozenset(
            {
                "kvspec.drivers",
                "kvspec.drivers._connector",
                "kvspec.drivers._driver",
                "kvspec.drivers._engine",
                "kvspec.drivers._exchange",
                "kvspec.drivers._tables",
                "kvspec.connector",
                "kvspec.exchange",
                "kvspec.testing",
            }
        ),
    ),
    (
        "integrations",
        frozenset(
            {
                "kvspec.integrations",
                "kvspec.integrations.expectations",
                "kvspec.integrations._vllm_versions",
                "kvspec.integrations.vllm",
                "kvspec.integrations.vllm_audit",
                "kvspec.integrations.vllm_parallel",
                "kvspec.integrations.sglang_parallel",
                "kvspec.integrations.vllm_offload_audit",
                "kvspec.integrations.vllm_guard",
                "kvspec.integrations.sglang",
                "kvspec.integrations.sglang_audit",
            }
        ),
    ),
    (
        "tools",
        frozenset(
            {
                "kvspec.tools",
                "kvspec.cli",
                "kvspec.__main__",
                "kvspec.vectors",
                "kvspec.tools._vectors",
                "kvspec.tools._vector_cases",
                "kvspec.tools._vectors_check",
                "kvspec.tools._guard_selftest",
                "kvspec.remote",
                "kvspec.remote._client",
                "kvspec.remote._server",
            }
        ),
    ),
)
LAYER_OF = {module: index for index, (_, modules) in enumerate(LAYERS) for module in modules}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _kvspec_imports(source: str) -> set[str]:
    """Every kvspec module a source imports, at any depth (a function-level import counts too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvspec":
            if node.module in ("kvspec", "kvspec.transport"):
                # `from kvspec import presets` names a submodule; `from kvspec import X` the package.
                found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in LAYER_OF}
                found |= {node.module} if any(f"{node.module}.{a.name}" not in LAYER_OF for a in node.names) else set()
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kvspec"}
    return found


def _upward_imports(module: str, source: str) -> list[str]:
    own = LAYER_OF[module]
    return sorted(m for m in _kvspec_imports(source) if LAYER_OF.get(m, own) > own)


SOURCES = {_module_name(p): p for p in sorted((ROOT / "kvspec").rglob("*.py"))}


def test_every_module_has_a_layer() -> None:
    assert set(SOURCES) == set(LAYER_OF), "add new kvspec modules to LAYERS (and to docs/explanation/layers.md)"


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_imports_point_down(module: str) -> None:
    upward = _upward_imports(module, SOURCES[module].read_text(encoding="utf-8"))
    assert not upward, f"{module} (layer {LAYERS[LAYER_OF[module]][0]}) imports from above: {upward}"


def test_the_check_catches_a_planner_that_imports_a_transport() -> None:
    # The mutant: the layering this issue removed (DescriptorList imported from the transport package).
    source = SOURCES["kvspec.protocol._plan"].read_text(encoding="utf-8")
    mutant = source.replace(
        "from kvspec.core._descriptors import DescriptorList", "from kvspec.transport._base import DescriptorList"
    )
    assert mutant != source
    assert _upward_imports("kvspec.protocol._plan", mutant) == ["kvspec.transport._base"]


def _loaded_by(module: str) -> set[str]:
    code = (
        f"import json, sys; import {module}; "
        "print(json.dumps(sorted(m for m in sys.modules if m == 'kvspec' or m.startswith('kvspec.'))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    loaded: list[str] = json.loads(out.stdout)
    return set(loaded)


@pytest.mark.parametrize(
    ("module", "highest"),
    [
        ("kvspec", "api"),
        ("kvspec.protocol._plan", "api"),
        ("kvspec.core._descriptors", "api"),
        ("kvspec.transport", "transport"),
        ("kvspec.testing", "drivers"),
        ("kvspec.exchange", "drivers"),
    ],
)
def test_a_layer_imported_alone_loads_nothing_above_it(module: str, highest: str) -> None:
    limit = next(index for index, (name, _) in enumerate(LAYERS) if name == highest)
    above = sorted(m for m in _loaded_by(module) if LAYER_OF.get(m, 0) > limit)
    assert not above, f"importing {module} loaded {above}, above the {highest} layer"


def test_importing_the_spec_loads_no_transport_module() -> None:
    loaded = _loaded_by("kvspec.protocol._plan")
    assert "kvspec.protocol._plan" in loaded
    assert not {m for m in loaded if m.startswith("kvspec.transport")}


# --------------------------------------------------------------------------- the page and the layout

PAGE = ROOT / "docs" / "explanation" / "layers.md"
# Private modules that stay at kvspec's top level: packaging reads the version there.
TOP_LEVEL_PRIVATE = frozenset({"kvspec.__main__", "kvspec._version"})


def _page_hook() -> ModuleType:
    """docs/_gen/layers.py, the build hook that reads the page's table and counts each layer's lines."""
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("kvspec_docs_layers", ROOT / "docs" / "_gen" / "layers.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected_page() -> dict[str, list[str]]:
    return {name: sorted(modules) for name, modules in LAYERS}


def test_the_layers_page_lists_every_module_in_its_layer() -> None:
    page: dict[str, list[str]] = _page_hook().page_layers(PAGE.read_text(encoding="utf-8"))
    expected = _expected_page()
    wrong = {
        name: (sorted(set(page.get(name, [])) ^ set(modules)))
        for name, modules in expected.items()
        if sorted(page.get(name, [])) != modules
    }
    assert list(page) == list(expected), f"docs/explanation/layers.md lists {list(page)}, LAYERS {list(expected)}"
    assert not wrong, f"docs/explanation/layers.md and LAYERS disagree on these layers' modules: {wrong}"


def test_the_page_check_catches_a_module_missing_from_the_page() -> None:
    text = PAGE.read_text(encoding="utf-8")
    mutant = text.replace("`protocol._plan`, ", "", 1)
    assert mutant != text
    assert _page_hook().page_layers(mutant) != _expected_page()


def test_the_docs_build_counts_each_layers_lines() -> None:
    hook = _page_hook()
    # Every count zeroed: the counts must come from the sources, not from the page.
    text = PAGE.read_text(encoding="utf-8")
    stale = "\n".join(re.sub(r"\| \d+ \|", "| 0 |", row) if row.startswith("| ") else row for row in text.split("\n"))
    counted: dict[str, int] = hook.page_line_counts(hook.with_line_counts(stale, ROOT))
    expected = {
        name: sum(len(hook.module_file(m, ROOT).read_text(encoding="utf-8").splitlines()) for m in modules)
        for name, modules in LAYERS
    }
    assert counted == expected


def _flat_private(modules: Iterable[str]) -> list[str]:
    return sorted(
        m for m in modules if m.count(".") == 1 and m.split(".")[1].startswith("_") and m not in TOP_LEVEL_PRIVATE
    )


def test_private_modules_live_in_their_layers_package() -> None:
    assert _flat_private(["kvspec._stray", "kvspec.cli", "kvspec.core._models"]) == ["kvspec._stray"]
    flat = _flat_private(SOURCES)
    assert not flat, f"move {flat} into its layer's package (docs/explanation/layers.md names them)"
