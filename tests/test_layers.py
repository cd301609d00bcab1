"""The layers point one way: the spec never loads a transport, a driver or a tool (docs/explanation/layers.md).

Two checks keep it so. Statically, every ``kvspec`` module imports only from its
own layer or the layers below. At run time, each layer is imported alone in a
fresh interpreter and the kvspec modules it loaded are compared with what its
layer allows. A mutant of the layering (the planner importing a transport
module again) is shown to fail the static check.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top; a module may import from its own layer and the ones below.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("base", frozenset({"kvspec._enums", "kvspec._deprecation", "kvspec._version"})),
    ("errors", frozenset({"kvspec._errors"})),
    ("data", frozenset({"kvspec._models", "kvspec._descriptors", "kvspec._rules"})),
    (
        "definitions",
        frozenset(
            {
                "kvspec.spec",
                "kvspec.spec.admission",
                "kvspec.spec.coverage",
                "kvspec.spec.offload",
                "kvspec.spec.pairing",
                "kvspec.spec.pins",
                "kvspec.spec.plan",
                "kvspec.spec.state",
                "kvspec.spec.window",
            }
        ),
    ),
    (
        "rules",
        frozenset({"kvspec._reference", "kvspec._offload", "kvspec._messages", "kvspec._presets", "kvspec._integrity"}),
    ),
    (
        "protocol",
        frozenset({"kvspec._plan", "kvspec._codec", "kvspec._handshake", "kvspec._session", "kvspec._offload_session"}),
    ),
    ("reports", frozenset({"kvspec._schema", "kvspec._summary"})),
    (
        "spec",
        frozenset({"kvspec", "kvspec.presets", "kvspec.rules", "kvspec.schema", "kvspec.summary", "kvspec.models"}),
    ),
    (
        "transport",
        frozenset(
            {
                "kvspec.transport",
                "kvspec.transport._base",
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
                "kvspec._connector",
                "kvspec._driver",
                "kvspec._engine",
                "kvspec._exchange",
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
                "kvspec.integrations.vllm",
                "kvspec.integrations.vllm_audit",
                "kvspec.integrations.vllm_offload_audit",
                "kvspec.integrations.sglang",
                "kvspec.integrations.sglang_audit",
            }
        ),
    ),
    (
        "tools",
        frozenset(
            {
                "kvspec.cli",
                "kvspec.__main__",
                "kvspec.vectors",
                "kvspec._vectors",
                "kvspec._vector_cases",
                "kvspec._vectors_check",
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
    source = SOURCES["kvspec._plan"].read_text(encoding="utf-8")
    mutant = source.replace(
        "from kvspec._descriptors import DescriptorList", "from kvspec.transport._base import DescriptorList"
    )
    assert mutant != source
    assert _upward_imports("kvspec._plan", mutant) == ["kvspec.transport._base"]


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
        ("kvspec", "spec"),
        ("kvspec._plan", "spec"),
        ("kvspec._descriptors", "spec"),
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
    loaded = _loaded_by("kvspec._plan")
    assert "kvspec._plan" in loaded
    assert not {m for m in loaded if m.startswith("kvspec.transport")}
