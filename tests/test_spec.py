"""kvspec.spec, the normative definitions: its layer, its pins, its place in the docs (SW-1, WIN-1, HMA-1, PLAN-1).

The fast paths are compared with these definitions in tests/test_fast_paths.py;
here: the spec imports nothing above models and errors, every public name that
has no faster form IS the definition, the pinned values of the spec pages hold, and
every rule with a definition is included from source on its docs/spec page.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import config_from_specs, configs

import kvspec
import kvspec.spec as plain
from kvspec import KVCacheConfig, SlidingWindowSpec
from kvspec.spec.pins import pins_for

T = TypeVar("T", bound=Callable[..., None])

ROOT = Path(__file__).resolve().parent.parent
SPEC_DIR = ROOT / "kvspec" / "spec"
# What the definitions may build on: the models, the errors, the enums below them, and each other; and, until
# 0.3.0, the shim that keeps a definition's deprecated positional spelling on the definition itself.
ALLOWED = frozenset({"kvspec.core._models", "kvspec.core._errors", "kvspec.core._enums", "kvspec.core._deprecation"})
RULE_IDS = re.compile(r"\(((?:[A-Z]{2,5}-\d+)(?:, [A-Z]{2,5}-\d+)*)\)\.?\s*$")
MARKER = re.compile(r"^[ \t]*<!--\s*kvspec:spec:(?P<module>\w+)\.(?P<name>\w+)\s*-->[ \t]*$", re.MULTILINE)


def spec_imports(source: str) -> set[str]:
    """Every kvspec module a source imports, outside kvspec.spec itself."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found |= {n for n in names if n.split(".")[0] == "kvspec" and not n.startswith("kvspec.spec")}
    return found


@pytest.mark.parametrize("path", sorted(SPEC_DIR.glob("*.py")), ids=lambda p: p.name)
def test_the_spec_imports_only_models_and_errors(path: Path) -> None:
    assert spec_imports(path.read_text(encoding="utf-8")) <= ALLOWED


def test_the_import_check_catches_a_spec_module_that_imports_the_planner() -> None:
    source = (SPEC_DIR / "plan.py").read_text(encoding="utf-8")
    mutant = source.replace("from kvspec.core._errors import PlanError", "from kvspec.protocol._plan import PlanError")
    assert mutant != source
    assert spec_imports(mutant) - ALLOWED == {"kvspec.protocol._plan"}


def definitions() -> dict[str, tuple[str, ...]]:
    """``module.name`` of every public definition in kvspec.spec, with the rule ids its docstring ends with."""
    found: dict[str, tuple[str, ...]] = {}
    for module in ("admission", "caches", "coverage", "offload", "pairing", "parallel", "plan", "window"):
        for node in ast.parse((SPEC_DIR / f"{module}.py").read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                rules = RULE_IDS.search(ast.get_docstring(node) or "")
                found[f"{module}.{node.name}"] = tuple(rules[1].split(", ")) if rules else ()
    return found


def test_every_definition_ends_its_docstring_with_its_rule_ids() -> None:
    unnamed = sorted(name for name, rules in definitions().items() if not rules and name != "window.check_count")
    assert not unnamed, f"kvspec.spec functions whose docstring does not end with (RULE-ID): {unnamed}"


def test_every_rule_with_a_definition_is_included_from_source_on_a_spec_page() -> None:
    """A rule id used on a docs/spec page whose definition lives in kvspec.spec is shown from the source."""
    pages = {p: p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs" / "spec").glob("*.md"))}
    defined = definitions()
    included: set[str] = set()
    for page, text in pages.items():
        for match in MARKER.finditer(text):
            name = f"{match['module']}.{match['name']}"
            source = (SPEC_DIR / f"{match['module']}.py").read_text(encoding="utf-8")
            found = rf"^((def|class) {match['name']}\b|{match['name']}\s*[:=])"  # a function, class or constant
            assert re.search(found, source, re.MULTILINE), f"{page.name}: no {name}"
            included |= set(defined.get(name, ()))
    used = {rule for text in pages.values() for rule in re.findall(r"\b[A-Z]{2,5}-\d+\b", text)}
    with_definition = {rule for rules in defined.values() for rule in rules}
    missing = sorted((used & with_definition) - included)
    assert not missing, f"rules with a kvspec.spec definition not included from source in docs/spec: {missing}"


def test_public_names_without_a_faster_form_are_the_definitions() -> None:
    for name in (
        "is_full_attention_spec",
        "is_hma_required",
        "check_hybrid_support",
        "get_blocks_per_sw",
        "get_token_basis_group",
        "get_needed_token_range",
        "get_needed_block_range",
        "get_block_ends",
        "BlockPairs",
        "TokenBasis",
        "PageCopy",
    ):
        assert getattr(kvspec, name) is getattr(plain, name), name
    # Two keep their deprecated positional spelling, on the definition itself (until 0.3.0).
    assert kvspec.get_logical_block_count is plain.get_logical_block_count
    assert kvspec.get_num_skipped_tokens is plain.get_num_skipped_tokens


def test_every_name_in_kvspec_and_kvspec_spec_is_one_object() -> None:
    """``kvspec.X is kvspec.spec.X`` for every shared name; the fast twins live apart, under ``kvspec.fast``."""
    import kvspec.fast

    shared = set(kvspec.__all__) & set(plain.__all__)
    assert {"compute_transfer_pairs", "compute_block_pairs", "get_exchange_clipped_blocks"} <= shared
    different = {name for name in shared if getattr(kvspec, name) is not getattr(plain, name)}
    assert not different, sorted(different)
    # A fast twin is another object than its definition, under the definition's own name, and named as fast.
    for name in kvspec.fast.__all__:
        fast = getattr(kvspec.fast, name)
        assert name in plain.__all__, name
        assert fast is not getattr(plain, name), name
        assert fast.__name__ == name, name


def with_pins(rule: str, to_example: Callable[[Mapping[str, Any]], dict[str, Any] | None]) -> Callable[[T], T]:
    """Add an ``@example`` for every pin of ``rule`` in kvspec/spec/pins.py that ``to_example`` maps (not None)."""

    def decorate(test: T) -> T:
        for pin in pins_for(rule):
            arguments = to_example(pin.inputs)
            if arguments is not None:
                test = example(**arguments).via(f"{rule} pin {pin.name}")(test)
        return test

    return decorate


def window_example(given: Mapping[str, Any]) -> dict[str, Any] | None:
    """A WIN-1 pin as the window property's arguments: sliding-window rows whose hit is whole blocks."""
    window, block, hit = given["window"], given["block_size"], given["prefix_hit_tokens"]
    if window is None or hit % block:
        return None
    return {"window": window, "block_size": block, "num_tokens": given["num_tokens"], "hit_blocks": hit // block}


def sw(window: int, block_size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=window)


@given(window=st.integers(1, 4096), block_size=st.sampled_from([1, 2, 4, 8, 16, 32]))
@with_pins("SW-1", lambda given: {"window": given["window"], "block_size": given["block_size"]})
def test_the_budget_covers_every_window_the_consumer_needs(window: int, block_size: int) -> None:
    """SW-1's budget is never below the blocks WIN-1 needs, for every T (SW-1, WIN-1).

    The pinned budgets are the SW-1 rows of kvspec/spec/pins.py (the table the spec page renders).
    """
    pins = {(p.inputs["window"], p.inputs["block_size"]): p.expected["get_blocks_per_sw"] for p in pins_for("SW-1")}
    spec = sw(window, block_size)
    (budget,) = plain.get_blocks_per_sw(config_from_specs([spec]))
    assert [budget] == pins.get((window, block_size), [budget])
    for num_tokens in range(window, window + 2 * block_size + 1):  # includes (T-W+1) % B == 0 and (T-W+2) % B == 0
        needed = plain.get_needed_block_range(spec, num_tokens=num_tokens, prefix_hit_tokens=0)
        assert len(needed) <= budget


@given(config=configs(kinds=("full", "mla", "sw", "sw_mla", "chunked", "mamba")), flag=st.booleans())
def test_hma_is_required_exactly_when_a_group_is_not_full_attention(config: KVCacheConfig, flag: bool) -> None:
    kinds = [group.kv_cache_spec.kind.value for group in config.kv_cache_groups]
    expected = not flag and any(kind not in ("full_attention", "mla") for kind in kinds)
    assert plain.is_hma_required(config, disable_hybrid_kv_cache_manager=flag) == expected, kinds


@given(
    window=st.integers(1, 64),
    block_size=st.sampled_from([1, 4, 16]),
    num_tokens=st.integers(0, 200),
    hit_blocks=st.integers(0, 8),
)
@with_pins("WIN-1", window_example)
def test_a_window_needs_what_the_next_token_attends_to(
    window: int, block_size: int, num_tokens: int, hit_blocks: int
) -> None:
    """Position t is needed iff C lacks it and the token at T attends it (T - t < W); blocks cover them (WIN-1)."""
    spec = sw(window, block_size)
    hit = min(hit_blocks * block_size, num_tokens - num_tokens % block_size)
    tokens = plain.get_needed_token_range(spec, num_tokens=num_tokens, prefix_hit_tokens=hit)
    assert list(tokens) == [t for t in range(num_tokens) if t >= hit and num_tokens - t < window]
    blocks = plain.get_needed_block_range(spec, num_tokens=num_tokens, prefix_hit_tokens=hit)
    assert list(blocks) == sorted({t // block_size for t in tokens})


# --------------------------------------------------------------------------- lifecycle and offload tables


def test_the_sessions_and_the_offload_reference_use_the_spec_tables() -> None:
    """One copy of each table and check: the sessions and the reference import theirs from kvspec.spec."""
    import kvspec.exchange
    import kvspec.protocol._offload_session as offload_session
    import kvspec.protocol._session as session
    import kvspec.reference._offload as reference_offload
    from kvspec.spec import lifecycle, offload

    for name in ("PRODUCER_TRANSITIONS", "CONSUMER_TRANSITIONS", "PRODUCER_DEADLINES", "CONSUMER_DEADLINES"):
        assert getattr(session, name) is getattr(lifecycle, name), name
    assert kvspec.ReleaseOutcome is lifecycle.ReleaseOutcome
    assert kvspec.FailureInfo is lifecycle.FailureInfo
    assert kvspec.exchange.OffloadState is offload.OffloadState is offload_session.OffloadState
    for name in ("get_store_set", "get_load_set", "map_sub_blocks", "OffloadConfig", "StoreSet", "LoadSet"):
        assert getattr(reference_offload, name) is getattr(offload, name), name


def test_loaded_is_entered_only_on_done_or_a_prefix_hit() -> None:
    """DONE-1 as a table check: a FAILING request that sees DONE must not become LOADED."""
    from kvspec.spec.lifecycle import (
        CONSUMER_TRANSITIONS,
        ConsumerEvent,
        ConsumerState,
        Transition,
        check_loaded_rows,
    )

    check_loaded_rows(CONSUMER_TRANSITIONS)
    revived = Transition(
        source=ConsumerState.FAILING,
        event=ConsumerEvent.TRANSFER_DONE,
        target=ConsumerState.LOADED,
        modes=frozenset({kvspec.TransferMode.READ}),
    )
    with pytest.raises(kvspec.ConfigError, match=r"FAILING --transfer_done--> LOADED in read mode.*DONE-1"):
        check_loaded_rows((*CONSUMER_TRANSITIONS, revived))


def test_a_key_is_present_only_when_whole_and_evicted_only_when_idle() -> None:
    """OFF-4's key lifecycle: a partial chunk never becomes present; a key under a load is not evicted."""
    from kvspec.spec.offload import KeyEvent, KeyState, get_next_key_state, is_chunk_present

    assert get_next_key_state(KeyState.STORING, KeyEvent.STORED_IN_PART) is KeyState.PARTIAL
    with pytest.raises(kvspec.ConfigError, match=r"state partial: expected no 'load' here \(OFF-4\)"):
        get_next_key_state(KeyState.PARTIAL, KeyEvent.LOAD)
    with pytest.raises(kvspec.ConfigError, match=r"state loading: expected no 'evict' here \(OFF-4\)"):
        get_next_key_state(KeyState.LOADING, KeyEvent.EVICT)
    assert is_chunk_present(sub_blocks_written=3, blocks_per_chunk=3, copies_in_flight=0)
    assert not is_chunk_present(sub_blocks_written=2, blocks_per_chunk=3, copies_in_flight=0)
    assert not is_chunk_present(sub_blocks_written=3, blocks_per_chunk=3, copies_in_flight=1)


# --------------------------------------------------------------------------- HS-1, VER-1, INT-1


def test_the_handshake_codec_and_digester_use_the_spec_definitions() -> None:
    """One copy of HS-1, VER-1 and INT-1: the handshake, messages and digester import theirs from kvspec.spec."""
    import kvspec.protocol._handshake as handshake_module
    import kvspec.reference._integrity as digester_module
    import kvspec.reference._messages as messages
    from kvspec.spec import handshake, integrity, versions

    # kvspec's form keeps the deprecated positional spelling around the definition until 0.3.0.
    assert kvspec.check_compatibility.__wrapped__ is handshake.check_compatibility  # type: ignore[attr-defined]
    for name in ("GROUP_FIELDS", "RANK_FIELDS", "get_differences", "check_cache_compatibility"):
        assert getattr(handshake_module, name) is getattr(handshake, name), name
    assert kvspec.PROTOCOL_VERSION is messages.PROTOCOL_VERSION is versions.PROTOCOL_VERSION
    for name in ("DIGEST_HEX_LENGTH", "is_block_digest"):
        assert getattr(digester_module, name) is getattr(integrity, name), name
    assert kvspec.BlockDigests == integrity.BlockDigests
