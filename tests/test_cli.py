"""Tests of the ``kvspec`` command line (``plan``, ``conform`` wiring)."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import types
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

import kvspec
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


def test_plan_json_reports_state_and_attention_bytes_per_group() -> None:
    """Qwen3-Next at 128k: a GDN group moves one slot of conv + recurrent state, not the padding (STATE-2, PLAN-1)."""
    status, text = run("plan", "qwen3-next-80b", "--tokens", "131072", "--json")
    assert status == 0
    data = json.loads(text)
    conv, recurrent = (8192 * 3 * 2, 32 * 128 * 128 * 2)  # (2*16*128 + 32*128, kernel - 1) and (32, 128, 128), bf16
    states = [g for g in data["groups"] if g["role"] == "state"]
    (full,) = [g for g in data["groups"] if g["role"] == "attention"]
    assert [g["num_layers"] for g in states] == [12, 12, 12]
    for group in states:
        assert group["state"] == {"mamba_type": "gdn_attention", "tensor_bytes": [conv, recurrent]}
        assert group["page_size"] > group["bytes_per_page"] == conv + recurrent  # padded page; the padding stays
        assert group["blocks_clipped"] == 1
        assert group["bytes_clipped"] == 12 * (conv + recurrent)
    # FA: 2 heads x (256 + 256) x 2 B per token; B = 544 so the page holds the state; 131072 tokens -> 241 blocks.
    assert full["state"] is None
    assert full["page_size"] == full["bytes_per_page"] == 544 * 2 * 512 * 2
    assert full["bytes_clipped"] == 241 * 12 * full["page_size"]
    total = data["total"]
    assert total["state_bytes_clipped"] == 36 * (conv + recurrent)
    assert total["attention_bytes_clipped"] == full["bytes_clipped"]
    assert total["bytes_clipped"] == total["state_bytes_clipped"] + total["attention_bytes_clipped"]


def test_plan_table_of_a_state_sliding_window_and_full_attention_model() -> None:
    status, text = run("plan", "hymba-1.5b", "--tokens", "131072")
    assert status == 0
    assert "mamba (mamba1)" in text
    assert "sliding_window" in text
    assert "full_attention" in text
    assert "one slot per state group, STATE-2" in text


def test_plan_of_a_state_only_model_and_a_full_hit() -> None:
    _, text = run("plan", "mamba-130m", "--tokens", "4096", "--json")
    (group,) = json.loads(text)["groups"]
    assert group["bytes_clipped"] == 24 * (1536 * 3 + 1536 * 16) * 4  # 24 layers, one unpadded float32 state each
    _, text = run("plan", "mamba-130m", "--tokens", "4096", "--prefix-hit", "4096", "--json")
    assert json.loads(text)["total"]["bytes_clipped"] == 0  # H == T: the consumer's own state is h(H) (STATE-4)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_plan_admits_the_whole_config_state_groups_included(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ADM-1 takes the whole config, state groups and all, as the exchange does.

    Decision 167 in decisions-offload.md.
    """
    seen: list[tuple[str, ...]] = []
    admit = kvspec.check_hybrid_support

    def spy(config: Any, **kwargs: Any) -> None:
        seen.append(tuple(g.kv_cache_spec.kind.value for g in config.kv_cache_groups))
        admit(config, **kwargs)

    monkeypatch.setattr("kvspec.cli.check_hybrid_support", spy)
    status, _ = run("plan", "hymba-1.5b", "--tokens", "256", "--mode", mode, "--json")
    assert status == 0
    assert len(seen) == 1
    assert "mamba" in seen[0]
    assert {"full_attention", "sliding_window"} <= set(seen[0])


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


def test_plan_works_on_the_chunked_local_and_dsa_presets() -> None:
    # CACHE-1: Llama 4 Scout's chunked-local groups move the chunk the next token is in (C=8192, B=16): for
    # T = 20000 that chunk starts at 16384, so blocks 1024 .. 1249; DeepSeek V3.2's indexer is a group of its own.
    status, text = run("plan", "llama-4-scout", "--tokens", "20000", "--json")
    assert status == 0, text
    groups = json.loads(text)["groups"]
    assert [g["kind"] for g in groups] == ["chunked_local"] * 3 + ["full_attention"]
    assert [g["blocks_clipped"] for g in groups] == [226, 226, 226, 1250]
    status, text = run("plan", "deepseek-v3.2", "--tokens", "20000", "--prefix-hit", "1024")
    assert status == 0, text
    assert "indexer" in text
    assert "2.1 KiB" in text  # 16 tokens of 132-byte indexer rows: its own page size, not the MLA latent's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("plan", "no-such-model", "--tokens", "10"), "ConfigError"),
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


# --------------------------------------------------------------------------- bad input: one line, never a traceback

VECTORS = Path(__file__).resolve().parent.parent / "vectors"
_SW1 = ["{tmp}/vectors"]  # one vector, copied by the test


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


_SERVE = ("agent", "serve", "loopback", "--listen")
BAD_INPUTS: dict[str, tuple[str, ...]] = {
    "plan-huge-tokens": ("plan", "gemma-3-27b", "--tokens", "1000000000"),  # MemoryError, after minutes
    "plan-float-tokens": ("plan", "gemma-3-27b", "--tokens", "1e9"),  # argparse's usage: several lines
    "unknown-command": ("no-such-command",),
    "conform-unknown-option": ("conform", "loopback", "--option", "no_such_key=1", "-q"),  # TypeError
    "conform-not-a-backend": ("conform", "os:system", "-q"),  # called os.system()
    "conform-missing-connector": ("conform", "loopback", "--connector", "no_such_module:make", "-q"),
    "conform-connector-not-a-connector": ("conform", "loopback", "--connector", "os:system", "-q"),  # os.system()
    "conform-bad-max-examples": ("conform", "loopback", "--max-examples", "-1", "-q"),  # ran, exit 0
    "conform-nan-time-scale": ("conform", "loopback", "--time-scale", "nan", "-q"),  # every case failed, silently
    "conform-bad-time-scale-env": ("conform", "loopback", "-q"),  # KVSPEC_CONFORM_TIME_SCALE=abc: ValueError
    "vectors-check-unsplittable": ("vectors", "check", *_SW1, "--command", 'a "b'),  # ValueError
    "vectors-check-unwritable-report": ("vectors", "check", *_SW1, "--command", "true", "--report", "/nonexistent/r"),
    "vectors-write-into-a-file": ("vectors", "write", "{file}"),  # NotADirectoryError
    "vectors-write-huge-count": ("vectors", "write", "{tmp}/out", "--count", "100000000000"),  # ran for hours
    "vectors-answer-not-json": ("vectors", "answer"),  # stdin: not json
    "vectors-answer-not-a-vector": ("vectors", "answer", "--jsonl"),  # stdin: [1]
    "agent-missing-token-file": (
        "agent",
        "serve",
        "loopback",
        "--listen",
        "127.0.0.1:1",
        "--token-file",
        "/nonexistent",
    ),
    "agent-token-file-is-a-directory": (
        "agent",
        "serve",
        "loopback",
        "--listen",
        "127.0.0.1:1",
        "--token-file",
        "{tmp}",
    ),
    "agent-port-in-use": ("agent", "serve", "loopback", "--listen", "127.0.0.1:{port}"),  # OSError
    "agent-unbindable-address": ("agent", "serve", "loopback", "--listen", "192.0.2.1:5000"),  # OSError
    "agent-unknown-option": ("agent", "serve", "loopback", "--listen", "127.0.0.1:{port}", "--option", "x=1"),
    "agent-not-a-backend": ("agent", "serve", "os:system", "--listen", "127.0.0.1:{port}"),
    "vllm-audit-huge-requests": ("vllm-audit", "--requests", "100000000000000000"),  # ran for ever
}
STDIN = {"vectors-answer-not-json": "not json\n", "vectors-answer-not-a-vector": "[1]\n"}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_a_non_zero_exit(
    name: str,
    tmp_path: Path,
    busy_port: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "a-file").write_text("x")
    one = tmp_path / "vectors" / "SW-1" / "get_blocks_per_sw"
    one.mkdir(parents=True)
    shutil.copy(VECTORS / "SW-1" / "get_blocks_per_sw" / "w32_b16.json", one)
    argv = [a.format(tmp=tmp_path, file=tmp_path / "a-file", port=busy_port) for a in BAD_INPUTS[name]]
    monkeypatch.setenv("KVSPEC_AGENT_TOKEN", "3f9a1c07e5b2d864")
    if name == "conform-bad-time-scale-env":
        monkeypatch.setenv("KVSPEC_CONFORM_TIME_SCALE", "abc")
    monkeypatch.setattr(sys, "stdin", io.StringIO(STDIN.get(name, "")))
    try:
        status = main(argv, out=io.StringIO())
    except SystemExit as stop:  # argparse's usage errors
        status = stop.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvspec"), err


def test_a_connector_spec_never_calls_what_is_not_a_connector_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--connector module:attr` names a callable; kvspec must not call one that is not a Connector factory.
    marker = tmp_path / "called"
    (tmp_path / "side_effects.py").write_text(f"def make():\n    open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status = main(["conform", "loopback", "--connector", "side_effects:make", "-q"], out=io.StringIO())
    err = capsys.readouterr().err
    assert status == 2, err
    assert not marker.exists()
    assert "expected a Connector class" in err
    assert len(err.splitlines()) == 1, err


def test_a_closed_pipe_ends_quietly() -> None:
    # `kvspec plan ... | head -1`: the reader is gone before kvspec writes.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvspec", "plan", "gemma-3-27b", "--tokens", "4096", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert err == b""
    assert proc.returncode == 141  # as a command SIGPIPE killed


def _default_sigint() -> None:
    # A test run started in the background of a shell without job control inherits SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler: give the child the terminal's default, as a user's shell does.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvspec", "vectors", "answer", "--jsonl"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    vector = (VECTORS / "SW-1" / "get_blocks_per_sw" / "w32_b16.json").read_text()
    proc.stdin.write(json.dumps(json.loads(vector)) + "\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"output": [3]}  # it is in its loop, waiting for the next line
    proc.send_signal(signal.SIGINT)
    # Wait with its input still open: closing it at once (communicate) raced the signal, and a loaded machine
    # could deliver the end of input first, which ends the loop normally (exit 0).
    proc.wait(timeout=60)
    proc.stdin.close()
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == 130
    assert err == "kvspec vectors: interrupted\n"
