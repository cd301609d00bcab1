"""One source of pins (issue 24, item 5): every row of kvspec/spec/pins.py is in the vectors, the docs and the tests.

The vectors' outputs are computed by the reference (``kvspec vectors write``);
here each row's stated output is compared with the reference's answer and with
the committed vector, each rule's table must be rendered on a spec page, and
the property tests must carry the rows as ``@example``s or parameters.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_offload
import test_reference
import test_spec

from kvspec.spec.pins import PINS, Pin, Raises, pins_for
from kvspec.tools._vectors import answer_vector

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "vectors"
ROWS = [(pin, function) for pin in PINS for function in pin.expected]


def _answer(expected: object) -> dict[str, Any]:
    """A row's expected value as the vector answer the reference gives."""
    if isinstance(expected, Raises):
        return {"error": expected.error}
    return {"output": expected}


def _found(answer: dict[str, Any]) -> dict[str, Any]:
    return {"error": answer["error"]["class"]} if "error" in answer else {"output": answer["output"]}


@pytest.mark.parametrize(("pin", "function"), ROWS, ids=[f"{p.rule}/{f}/{p.name}" for p, f in ROWS])
def test_every_pin_is_a_committed_vector_the_reference_answers(pin: Pin, function: str) -> None:
    path = VECTORS / pin.rule / function / f"{pin.name}.json"
    assert path.is_file(), f"{path.relative_to(ROOT)} missing; regenerate with: kvspec vectors write vectors"
    vector = json.loads(path.read_text(encoding="utf-8"))
    assert vector["description"] == pin.description
    assert _found(vector) == _answer(pin.expected[function]), "the committed vector disagrees with the pin"
    assert _found(answer_vector(vector)) == _answer(pin.expected[function]), "the reference disagrees with the pin"


def test_the_table_is_well_formed() -> None:
    names = [(p.rule, p.name) for p in PINS]
    assert len(names) == len(set(names)), "a pin's name is its vector's case name: unique per rule"
    assert all(p.source.strip() and p.expected for p in PINS)


def test_sw1_is_the_union_of_the_old_pin_sets() -> None:
    # Before: the docs and test_spec had 4 (32, 128, 2048, 1024), test_vectors 4 (32, 128, 2048, 16),
    # test_reference 6 (+ 16, 17), the vectors 7 (+ 1); the table holds all seven.
    pinned = {(p.inputs["window"], p.inputs["block_size"]): p.expected["get_blocks_per_sw"] for p in pins_for("SW-1")}
    assert pinned == {
        (32, 16): [3],
        (128, 16): [9],
        (2048, 16): [129],
        (1024, 16): [65],
        (16, 16): [2],
        (17, 16): [3],
        (1, 16): [2],
    }


def _hooks() -> Any:
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("kvspec_docs_hooks_pins", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rule", sorted({p.rule for p in PINS}))
def test_every_pin_is_rendered_on_its_spec_page(rule: str) -> None:
    marker = f"<!-- kvspec:pins:{rule} -->"
    pages = [p.name for p in sorted((ROOT / "docs" / "spec").glob("*.md")) if marker in p.read_text(encoding="utf-8")]
    assert len(pages) == 1, f"{marker} must be on exactly one spec page, found {pages}"
    table = _hooks().pins_snippets()[f"pins:{rule}"]
    for pin in pins_for(rule):
        (row,) = [line for line in table.splitlines() if line.startswith(f"| `{pin.name}` |")]
        assert pin.source in row
        for expected in pin.expected.values():
            assert (expected.error if isinstance(expected, Raises) else json.dumps(expected)) in row


def _examples(test: Callable[..., object]) -> list[dict[str, Any]]:
    return [dict(e.kwargs) for e in getattr(test, "hypothesis_explicit_examples", [])]


def _parameters(test: Callable[..., object]) -> list[tuple[Any, ...]]:
    (mark,) = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    return [tuple(values) for values in mark.args[1]]


def test_the_property_tests_carry_every_pin() -> None:
    for pin in pins_for("SW-1"):
        window, block = pin.inputs["window"], pin.inputs["block_size"]
        expected = pin.expected["get_blocks_per_sw"]
        assert {"window": window, "block_size": block} in _examples(
            test_spec.test_the_budget_covers_every_window_the_consumer_needs
        ), pin.name
        assert (window, block, *expected) in _parameters(test_reference.test_blocks_per_sw_pins), pin.name
    window_examples = _examples(test_spec.test_a_window_needs_what_the_next_token_attends_to)
    for pin in pins_for("WIN-1"):
        wanted = test_spec.window_example(pin.inputs)
        assert wanted is None or wanted in window_examples, pin.name
    clip_examples = [e["case"] for e in _examples(test_reference.test_clip_keeps_each_budgeted_tail)]
    for pin in pins_for("CLIP-1"):
        ids, budgets = pin.inputs["block_ids"], pin.inputs["budgets"]
        if ids and not isinstance(pin.expected["get_exchange_clipped_blocks"], Raises):
            assert any(c[0].to_lists() == ids and c[1] == budgets for c in clip_examples), pin.name
    hit_examples = _examples(test_offload.test_hit_matches_the_token_model)
    for pin in pins_for("OFF-5"):
        if not isinstance(pin.expected["get_offload_hit_tokens"], Raises):
            present, tokens = pin.inputs["present"], (pin.inputs["num_tokens"], pin.inputs["local_hit_tokens"])
            assert any(e["case"][2] == present and e["case"][3:] == tokens for e in hit_examples), pin.name
