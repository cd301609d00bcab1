"""Every name renamed or moved in 0.2.0 still works, warns, and names its replacement (RENAMES.md)."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest
from strategies import config_from_specs

import kvspec
import kvspec.reference._reference
import kvspec.testing
from kvspec import BlockIds, FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

ROOT = Path(__file__).resolve().parent.parent

# (module, old attribute, the object it must resolve to, the new spelling the warning must name)
MOVED: list[tuple[str, str, str, str]] = [
    *[
        ("kvspec", name, f"kvspec.exchange.{name}", f"kvspec.exchange.{name}")
        for name in (
            "BlockAllocator",
            "ConsumerEndpoint",
            "ConsumerResult",
            "ExchangeResult",
            "ProducerEndpoint",
            "ProducerResult",
            "connect",
            "run_request",
        )
    ],
    *[
        ("kvspec", n, f"kvspec.presets.{n}", f"kvspec.presets.{n}")
        for n in ("ModelPreset", "get_preset", "list_presets")
    ],
    *[("kvspec", n, f"kvspec.rules.{n}", f"kvspec.rules.{n}") for n in ("RULES", "Level", "Rule", "get_rule")],
    *[
        ("kvspec", n, f"kvspec.summary.{n}", f"kvspec.summary.{n}")
        for n in ("GroupSummary", "PlanSummary", "blocks_needed_for", "summarize_plan")
    ],
    ("kvspec", "message_schemas", "kvspec.schema.message_schemas", "kvspec.schema.message_schemas"),
    ("kvspec", "PairedBlocks", "kvspec.BlockPairsLike", "kvspec.BlockPairsLike"),
    ("kvspec", "blocks_per_sw", "kvspec.get_blocks_per_sw", "kvspec.get_blocks_per_sw"),
    ("kvspec", "align_block_ids", "kvspec.compute_block_pairs", "kvspec.compute_block_pairs"),
    *[
        ("kvspec.models", n, f"kvspec.presets.{n}", f"kvspec.presets.{n}")
        for n in ("Layout", "ModelPreset", "get_preset", "list_presets")
    ],
    ("kvspec.testing", "PageCopy", "kvspec.testing.ExpectedPair", "kvspec.testing.ExpectedPair"),
    ("kvspec.testing", "expected_copies", "kvspec.testing.expected_pairs", "kvspec.testing.expected_pairs"),
]


def _resolve(dotted: str) -> object:
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize(("module", "old", "target", "spelling"), MOVED, ids=[f"{m}.{o}" for m, o, _, _ in MOVED])
def test_old_name_warns_and_resolves_to_the_new_object(module: str, old: str, target: str, spelling: str) -> None:
    with pytest.warns(DeprecationWarning, match=re.escape(f"{module}.{old} is deprecated; use {spelling}")):
        value = getattr(importlib.import_module(module), old)
    assert value is _resolve(target)


def test_from_import_of_an_old_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"kvspec\.run_request is deprecated; use kvspec\.exchange"):
        from kvspec import run_request  # type: ignore[attr-defined]  # noqa: F401


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"module 'kvspec' has no attribute 'no_such_name'"):
        kvspec.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_new_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import kvspec.exchange
        import kvspec.presets

        assert kvspec.exchange.run_request is _resolve("kvspec.drivers._exchange.run_request")
        assert kvspec.presets.get_preset("gemma-3-27b").alias


def _config() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    window = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8)
    return config_from_specs([full, window])


def test_validate_hybrid_support_keeps_its_positional_mode_and_warns() -> None:
    config = _config()
    with pytest.warns(DeprecationWarning, match=r"use kvspec\.check_hybrid_support\(config, mode=mode\)"):
        kvspec.reference._reference.validate_hybrid_support(config, "read")


def test_positional_arguments_that_became_keyword_only_warn_and_still_work() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    with pytest.warns(DeprecationWarning, match=r"passing num_tokens= positionally to get_logical_block_count\(\)"):
        assert kvspec.get_logical_block_count(spec, 33) == 3  # type: ignore[call-arg]
    window = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=4)
    with pytest.warns(DeprecationWarning, match=r"passing num_computed_tokens= positionally"):
        assert kvspec.get_num_skipped_tokens(window, 7) == 4  # type: ignore[call-arg]
    assert kvspec.get_logical_block_count(spec, num_tokens=33) == 3


def test_too_many_positional_arguments_are_still_a_type_error() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    with pytest.raises(TypeError, match=r"get_logical_block_count\(\) takes 2 arguments, got 3"):
        kvspec.get_logical_block_count(spec, 1, 2)  # type: ignore[call-arg]


def test_the_deprecated_testing_alias_builds_the_new_class() -> None:
    with pytest.warns(DeprecationWarning, match=r"kvspec\.testing\.PageCopy is deprecated"):
        old: type[kvspec.testing.ExpectedPair] = kvspec.testing.PageCopy  # type: ignore[attr-defined]
    pair = old(group=0, position=1, producer_block=2, consumer_block=3)
    assert isinstance(pair, kvspec.testing.ExpectedPair)
    assert BlockIds([[2]])[0] == (pair.producer_block,)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_aliases_live_until_the_release_renames_md_names() -> None:
    """RENAMES.md: every old name works through 0.2.x and goes in 0.3.0; this version must still carry them."""
    from kvspec.core._deprecation import REMOVED_IN

    renames = (ROOT / "RENAMES.md").read_text(encoding="utf-8")
    assert f"removed in {REMOVED_IN}" in renames, "RENAMES.md and kvspec.core._deprecation.REMOVED_IN disagree"
    assert _release(kvspec.__version__) < _release(REMOVED_IN), (
        f"kvspec {kvspec.__version__} reached {REMOVED_IN}: remove the aliases RENAMES.md lists, and this test"
    )
    assert MOVED, "the aliases RENAMES.md lists must still be tested while they live"
