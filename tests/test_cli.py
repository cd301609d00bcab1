"""Tests of the ``kvspec`` command line (``plan``, ``conform`` wiring)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import types
from importlib.metadata import EntryPoint

import pytest

import kvspec.cli
from kvspec.cli import main
from kvspec.presets import get_preset


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out=out)
    return status, out.getvalue()


def test_plan_json_matches_the_reference_counts() -> None:
    status, text = run("plan", "gpt-oss-20b", "--tokens", "1000", "--json")
    assert status == 0
    data = json.loads(text)
    assert data["model"] == "openai/gpt-oss-20b"
    sliding, full = data["groups"]
    # SW-1: W=128, B=16 -> budget 9; 1000 tokens need [873, 999] -> blocks 54..62, 9 blocks.
    assert sliding["kind"] == "sliding_window"
    assert sliding["blocks_unclipped"] == 63
    assert sliding["blocks_clipped"] == 9
    assert full["blocks_unclipped"] == full["blocks_clipped"] == 63
    total = data["total"]
    assert total["bytes_clipped"] == sum(g["bytes_clipped"] for g in data["groups"])
    assert total["bytes_saved"] == total["bytes_unclipped"] - total["bytes_clipped"]
    assert sliding["bytes_clipped"] == 9 * sliding["num_layers"] * sliding["page_size"]
    assert total["descriptors_clipped"] >= 1


def test_plan_accepts_hf_id_and_alias_alike() -> None:
    preset = get_preset("gemma-3-27b")
    _, by_alias = run("plan", preset.alias, "--tokens", "4096", "--json")
    _, by_id = run("plan", preset.hf_id, "--tokens", "4096", "--json")
    assert json.loads(by_alias) == json.loads(by_id)


def test_full_prefix_hit_moves_nothing() -> None:
    _, text = run("plan", "gemma-3-1b", "--tokens", "512", "--prefix-hit", "512", "--json")
    data = json.loads(text)
    assert data["total"]["bytes_clipped"] == 0
    assert data["total"]["descriptors_clipped"] == 0


def test_plan_table_and_write_mode() -> None:
    status, text = run("plan", "gemma-3-27b", "--tokens", "8192", "--prefix-hit", "1024", "--mode", "write")
    assert status == 0
    assert "mode write" in text
    assert "clipping saves" in text
    assert "sliding_window" in text
    assert "full_attention" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("plan", "no-such-model", "--tokens", "10"), "ConfigError"),
        (("plan", "qwen3-next-80b", "--tokens", "10"), "UnsupportedHybridError"),
        (("plan", "gemma-3-27b", "--tokens", "100", "--prefix-hit", "5"), "BlockAlignmentError"),
    ],
)
def test_errors_exit_2_with_a_named_error(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _ = run(*argv)
    assert status == 2
    assert message in capsys.readouterr().err


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(SystemExit, match=r"^2$") as info:  # argparse exits with status 2
        run("plan", "gemma-3-27b", "--tokens", "-3")
    assert info.value.code == 2


def _suite_entry_point(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """Make the ``kvspec.suite`` group hold ``conform = value`` (nothing when ``value`` is None)."""
    found = [] if value is None else [EntryPoint(name="conform", value=value, group="kvspec.suite")]

    def entry_points(*, group: str) -> list[EntryPoint]:
        assert group == "kvspec.suite"
        return found

    monkeypatch.setattr(kvspec.cli, "entry_points", entry_points)


@pytest.mark.parametrize("registered", [False, True], ids=["no-entry-point", "module-not-importable"])
def test_conform_without_the_suite_cli_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, registered: bool
) -> None:
    _suite_entry_point(monkeypatch, "kvspec_conformance.cli" if registered else None)
    monkeypatch.setitem(sys.modules, "kvspec_conformance.cli", None)
    status, _ = run("conform", "loopback")
    assert status == 2
    assert "conformance suite is not importable" in capsys.readouterr().err


def test_python_dash_m_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvspec", "plan", "llama-3.1-8b", "--tokens", "64", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout)["groups"][0]["blocks_clipped"] == 4


def test_conform_delegates_to_the_suite_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("backend")
        parser.add_argument("--rule", action="append")
        parser.add_argument("-q", "--quiet", action="store_true")

    def run_suite(args: argparse.Namespace) -> int:
        seen.update(vars(args))
        return 1

    # Any module the kvspec.suite entry point names serves `kvspec conform`; kvspec does not know the suite's name.
    fake = types.ModuleType("fake_suite_cli")
    fake.add_arguments = add_arguments  # type: ignore[attr-defined]
    fake.run = run_suite  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_suite_cli", fake)
    _suite_entry_point(monkeypatch, "fake_suite_cli")
    # Options may come before the backend name, as in `kvspec conform -q loopback`.
    status, _ = run("conform", "-q", "loopback", "--rule", "WIN-1")
    assert status == 1
    assert (seen["backend"], seen["rule"], seen["quiet"]) == ("loopback", ["WIN-1"], True)
