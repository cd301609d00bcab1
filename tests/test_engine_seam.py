"""Only the engine modules allocate request tables (issue 36, item 6; kvspec/drivers/_engine.py).

* No module of kvspec/ or conformance/ but the engine modules builds a block allocator,
  calls an allocator's ``allocate``/``allocate_groups``/``claim``, builds a table shape,
  keeps a free list of a pool's block ids, or imports kvspec.drivers._tables.
* The scenario gets its tables from kvspec's engine roles: one producer table and one
  consumer suffix per request, the case's named ids passed as claims.

Each static check is shown to catch the code it forbids (the sources of before the change).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kvspec_conformance import Request, Scenario, run_scenario
from kvspec_conformance.configs import full, make_config, sw

from kvspec.exchange import ConsumerEngine, ProducerEngine

ROOT = Path(__file__).resolve().parent.parent

# The engine module and the one module it owns: where request tables are allocated.
ENGINE_MODULES = frozenset({"kvspec/drivers/_engine.py", "kvspec/drivers/_tables.py"})

_ALLOCATOR_METHODS = frozenset({"allocate", "allocate_groups", "claim"})
_TABLE_BUILDERS = frozenset({"BlockAllocator", "get_producer_table_shape", "get_suffix_counts"})


def _mentions(node: ast.AST, name: str) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
        for n in ast.walk(node)
    )


def _is_descending_range(node: ast.Call) -> bool:
    """``range(... num_blocks ..., ..., -1)``: a free list over a pool's block ids, handed out by ``pop()``."""
    if not (isinstance(node.func, ast.Name) and node.func.id == "range" and len(node.args) == 3):
        return False
    step = node.args[2]
    negative = isinstance(step, ast.UnaryOp) and isinstance(step.op, ast.USub)
    return negative and _mentions(node.args[0], "num_blocks")


def table_allocations(source: str | ast.Module) -> list[str]:
    """Every place a source allocates request tables itself, by what it calls."""
    tree = ast.parse(source) if isinstance(source, str) else source
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "kvspec.drivers._tables":
            found.append("import kvspec.drivers._tables")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in _TABLE_BUILDERS:
            found.append(f"{func.id}()")
        elif isinstance(func, ast.Attribute) and func.attr in _ALLOCATOR_METHODS | _TABLE_BUILDERS:
            found.append(f".{func.attr}()")
        elif _is_descending_range(node):
            found.append("a free list over num_blocks")
    return found


def _sources() -> dict[str, ast.Module]:
    paths = [*sorted((ROOT / "kvspec").rglob("*.py")), *sorted((ROOT / "conformance").rglob("*.py"))]
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in paths}


def test_only_the_engine_modules_allocate_request_tables() -> None:
    sources = _sources()
    assert set(sources) >= ENGINE_MODULES
    found = {
        path: names
        for path, tree in sources.items()
        if path not in ENGINE_MODULES and (names := table_allocations(tree))
    }
    assert found == {}, "request tables allocated outside kvspec/drivers/_engine.py"


def test_the_engine_module_does_allocate() -> None:
    found = table_allocations((ROOT / "kvspec/drivers/_engine.py").read_text())
    assert "BlockAllocator()" in found
    assert ".allocate_groups()" in found
    assert ".claim()" in found


@pytest.mark.parametrize(
    "before",
    [
        # conformance/_scenario.py: its own allocator and tables.
        "self.free: list[int] = list(range(num_blocks - 1, 0, -1))\n",
        "groups.append([NULL_BLOCK_ID] * skipped + [self.p_alloc.allocate() for _ in range(total - skipped)])\n",
        "self.c_alloc.claim(block_id)\n",
        # conformance/_offload_scenario.py: its GPU free list.
        "self.free_blocks = list(range(self.config.num_blocks - 1, 0, -1))\n",
        # kvspec/drivers/_exchange.py: the endpoints' allocator and table.
        "self.allocator = BlockAllocator(config.num_blocks, on_free=on_free)\n",
        "real = self.allocator.allocate_groups([1, 2])\n",
        "from kvspec.drivers._tables import BlockAllocator\n",
    ],
)
def test_the_check_catches_what_the_suite_and_the_endpoints_did(before: str) -> None:
    assert table_allocations(before)


def test_the_check_leaves_a_pool_scan_alone() -> None:
    # Reading every block of a pool is not allocating one.
    assert table_allocations("for block in range(config.num_blocks):\n    pass\n") == []


def test_the_scenario_gets_its_tables_from_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, bool]] = []
    table, suffix = ProducerEngine.allocate_table, ConsumerEngine.allocate_suffix

    def allocate_table(self: ProducerEngine, request_id: str | None, **kwargs: object) -> object:
        calls.append(("producer", str(request_id), kwargs.get("claim") is not None))
        return table(self, request_id, **kwargs)  # type: ignore[arg-type]

    def allocate_suffix(self: ConsumerEngine, request_id: str | None, **kwargs: object) -> object:
        calls.append(("consumer", str(request_id), kwargs.get("claim") is not None))
        return suffix(self, request_id, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ProducerEngine, "allocate_table", allocate_table)
    monkeypatch.setattr(ConsumerEngine, "allocate_suffix", allocate_suffix)
    scenario = Scenario(
        config=make_config(full(), sw(8)),
        requests=[
            Request(request_id="fresh", num_tokens=20, prefix_hit_tokens=8),
            Request(request_id="named", num_tokens=4, producer_block_ids=[[5], [6]], consumer_block_ids=[[7], [8]]),
        ],
    )
    result = run_scenario(scenario)
    assert result.ok, result.summary()
    assert sorted(calls) == [
        ("consumer", "fresh", False),
        ("consumer", "named", True),
        ("producer", "fresh", False),
        ("producer", "named", True),
    ]


# A class of the suite holds data, fault timing and the oracle; engine work is kvspec's (issue 36, item 6).
MAX_CLASS_LINES = 250


def long_classes(source: str | ast.Module, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    """Every class of a source with ``limit`` lines or more, with its length."""
    tree = ast.parse(source) if isinstance(source, str) else source
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            lines = node.end_lineno - node.lineno + 1
            if lines >= limit:
                found.append((node.name, lines))
    return found


def test_every_class_of_the_suite_is_under_250_lines() -> None:
    found = {
        path: classes
        for path, tree in _sources().items()
        if path.startswith("conformance/") and (classes := long_classes(tree))
    }
    assert found == {}, "a class of the suite grew past 250 lines: move engine work to kvspec.exchange"


def test_the_length_check_catches_a_long_class() -> None:
    source = "class _Play:\n" + "    x = 1\n" * 300
    assert long_classes(source) == [("_Play", 301)]
