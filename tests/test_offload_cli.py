"""Tests of ``kvspec plan MODEL --tokens N --offload`` (OFF-3, OFF-5, OFF-6, OFF-9)."""

from __future__ import annotations

import io
import json

import pytest

from kvspec.cli import main


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out=out)
    return status, out.getvalue()


def test_offload_json_matches_the_rules() -> None:
    status, text = run("plan", "gpt-oss-20b", "--tokens", "1000", "--offload", "--json")
    assert status == 0
    data = json.loads(text)
    sliding, full = data["groups"]
    # 1000 tokens: 62 complete 16-token chunks per group (OFF-3); a full hit ends at 62 * 16 = 992 (OFF-5).
    assert data["hit_tokens"] == 992
    assert sliding["chunks_stored"] == full["chunks_stored"] == 62
    # The window (W=128, B=16) reloads positions [865, 991]: blocks 54..61, 8 blocks (OFF-6).
    assert sliding["blocks_loaded"] == 8
    assert full["blocks_loaded"] == 62
    block_bytes = sliding["chunk_bytes"]  # f = 1: one block per chunk
    assert sliding["bytes_loaded"] == 8 * block_bytes
    assert data["total"]["bytes_stored"] == sum(g["bytes_stored"] for g in data["groups"])


def test_offload_with_blocks_per_chunk_loads_whole_needed_chunks() -> None:
    status, text = run("plan", "gemma-3-1b", "--tokens", "4096", "--offload", "--blocks-per-chunk", "3", "--json")
    assert status == 0
    data = json.loads(text)
    assert data["blocks_per_chunk"] == 3
    assert data["hit_tokens"] == 85 * 48  # 85 complete 48-token chunks
    window = data["groups"][0]
    # W=512, B=16: T = 4080 needs blocks [223, 255): 32 blocks (<= cdiv(512 + 15, 16) = 33), from chunks 74..84.
    assert (window["blocks_loaded"], window["chunks_loaded"]) == (32, 11)


def test_offload_text_table() -> None:
    status, text = run("plan", "gemma-3-27b", "--tokens", "131072", "--offload")
    assert status == 0
    assert text.startswith("google/gemma-3-27b-it: offload of 131072 tokens, f=1 (hash block 16)")
    assert "a full hit loads 131071 tokens" in text
    assert "a full hit reads 16.8% of what the request stored" in text


def test_offload_of_a_state_model_keeps_state_at_block_ends() -> None:
    # Offload needs prefix caching, so state groups are in align mode by default (OFF-9): every state preset plans.
    status, text = run("plan", "qwen3-next-80b", "--tokens", "4096", "--offload", "--json")
    assert status == 0
    data = json.loads(text)
    state = [g for g in data["groups"] if g["kind"] == "mamba"]
    assert len(state) == 3
    # 4096 tokens on 544-token blocks: 7 complete chunks stored; a hit restores one state slot (OFF-6, OFF-9).
    assert data["hit_tokens"] == 7 * 544
    assert all((g["chunks_stored"], g["blocks_loaded"]) == (7, 1) for g in state)


def test_offload_with_state_cache_mode_none_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = run("plan", "qwen3-next-80b", "--tokens", "4096", "--offload", "--state-cache-mode", "none")
    assert status == 2
    err = capsys.readouterr().err
    assert "OFF-9" in err
    assert "use --state-cache-mode align" in err


def test_offload_f_above_one_with_mixed_block_sizes_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = run("plan", "gemma-4-31b", "--tokens", "4096", "--offload", "--blocks-per-chunk", "2")
    assert status == 2
    assert "expected 1 when groups differ in block size (group 0 has 16, group 5 has 32), got 2" in (
        capsys.readouterr().err
    )
