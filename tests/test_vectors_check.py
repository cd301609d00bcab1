"""`kvspec vectors check` against hostile implementations: every read is bounded in time and size (issue 23)."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvspec.cli import main
from kvspec.vectors import check_vectors

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
HOSTILE = Path(__file__).resolve().parent / "vector_impls" / "hostile.py"


@pytest.fixture(scope="module")
def few_vectors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four committed SW-1 vectors: enough for a run of several vectors, cheap to ask."""
    folder = tmp_path_factory.mktemp("few") / "SW-1" / "get_blocks_per_sw"
    folder.mkdir(parents=True)
    for name in ("w1_b16", "w16_b16", "w17_b16", "w32_b16"):
        shutil.copy(ROOT / "vectors" / "SW-1" / "get_blocks_per_sw" / f"{name}.json", folder)
    return folder.parent.parent


def _command(mode: str, pidfile: Path | None = None) -> str:
    argv = [sys.executable, "-S", str(HOSTILE), mode] + ([str(pidfile)] if pidfile else [])
    return shlex.join(argv)


def _within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``'s result, failing the test (not hanging it) when it takes longer than ``seconds``."""
    result: list[T] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s: a read without a deadline"
    return result[0]


def _gone(pidfile: Path) -> None:
    for pid in map(int, pidfile.read_text().split()):
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
            os.kill(pid, 0)


def test_a_hanging_jsonl_implementation_times_out_is_killed_and_stops_the_run(
    few_vectors: Path, tmp_path: Path
) -> None:
    # Only the arguments the old check_vectors had: it waited forever here (issue 23, finding 6).
    pids = tmp_path / "pids"
    report = _within(10, lambda: check_vectors(few_vectors, _command("hang", pids), jsonl=True, timeout=0.15))
    assert [o.status for o in report.outcomes] == ["failed"] * 3  # DEFAULT_MAX_TIMEOUTS
    assert "no answer within the timeout" in report.outcomes[0].problem
    assert "3 vectors in a row timed out" in report.stopped
    assert not report.ok
    _gone(pids)


def test_a_hanging_one_shot_implementation_costs_k_timeouts_not_n(few_vectors: Path, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    started = time.monotonic()
    report = _within(10, lambda: check_vectors(few_vectors, _command("hang", pids), timeout=0.15, max_timeouts=2))
    assert len(report.outcomes) == 2
    assert time.monotonic() - started < 5
    _gone(pids)


@pytest.mark.parametrize("jsonl", [False, True], ids=["one-shot", "jsonl"])
def test_endless_output_fails_the_vector_at_the_byte_bound(few_vectors: Path, tmp_path: Path, jsonl: bool) -> None:
    pids = tmp_path / "pids"
    report = _within(
        10,
        lambda: check_vectors(
            few_vectors, _command("spam", pids), jsonl=jsonl, timeout=5, max_answer_bytes=100_000, total_timeout=30
        ),
    )
    outcomes = report.outcomes
    assert len(outcomes) == 4
    assert all("exceeds 100000 bytes" in o.problem for o in outcomes), outcomes[0].problem
    _gone(pids)


def test_the_whole_run_is_bounded(few_vectors: Path) -> None:
    report = _within(10, lambda: check_vectors(few_vectors, _command("slow"), jsonl=True, total_timeout=0.15))
    assert "--total-timeout 0.15 s" in report.stopped
    assert len(report.outcomes) < 4


def test_an_implementation_that_dies_fails_each_vector_and_is_restarted(few_vectors: Path) -> None:
    report = _within(10, lambda: check_vectors(few_vectors, _command("die"), jsonl=True, timeout=5))
    outcomes = report.outcomes
    assert len(outcomes) == 4
    assert all("closed its output" in o.problem or "closed its input" in o.problem for o in outcomes)
    assert not report.stopped


def test_the_command_line_says_the_run_stopped(few_vectors: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    argv = ["vectors", "check", str(few_vectors), "--jsonl", "--timeout", "0.15", "--max-timeouts", "1"]
    status = _within(10, lambda: main([*argv, "--command", _command("hang")], out=out))
    assert status == 1
    assert "STOPPED: 1 vectors in a row timed out" in out.getvalue()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvspec vectors check: stopped: 1 vectors in a row timed out (--max-timeouts 1); stopped after 1 of 4"
    ]


# --------------------------------------------------------------------------- issue 37: the vector files themselves


@pytest.mark.parametrize(("kind", "named"), [("zero", "a character device"), ("fifo", "a FIFO")])
def test_vector_files_are_regular_files_only(
    few_vectors: Path, tmp_path: Path, kind: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link to /dev/zero was read without end (1 GiB and on), a FIFO hung the run: both refused by name."""
    folder = tmp_path / "vectors"
    shutil.copytree(few_vectors, folder)
    odd = folder / "SW-1" / "get_blocks_per_sw" / "odd.json"
    if kind == "zero":
        odd.symlink_to("/dev/zero")
    else:
        os.mkfifo(odd)
    argv = ["vectors", "check", str(folder), "--command", _command("die")]
    status = _within(5.0, lambda: main(argv, out=io.StringIO()))
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"odd.json: expected a regular file, got {named}" in err
    assert len(err.splitlines()) == 1, err


def test_vector_files_are_read_up_to_a_bound(tmp_path: Path) -> None:
    from kvspec.core._errors import ConfigError
    from kvspec.tools._vectors_check import MAX_VECTOR_BYTES, read_vector_file

    big = tmp_path / "big.json"
    big.write_bytes(b" " * 200)
    assert read_vector_file(big, limit=200) == " " * 200
    with pytest.raises(ConfigError, match=r"big\.json: expected at most 100 bytes, got 200"):
        read_vector_file(big, limit=100)
    largest = max(path.stat().st_size for path in (ROOT / "vectors").glob("*/*/*.json"))
    assert largest * 100 < MAX_VECTOR_BYTES  # the bound leaves room for far larger vectors
