"""A backend's error logs fail a conformance run unless a case expected them; worker noise stays off the terminal."""

from __future__ import annotations

import io
import os
import sys
import time

import pytest
from kvspec_conformance import run_suite
from kvspec_conformance.cli import main
from mutants import LogsErrors

from kvspec.transport.backend_logs import capture_backend_logs, is_error_line, relay_stderr

NOISE = "E1207 00:17:03.123456 42 transfer_metadata.cpp:611] Local segment descriptor not found"
ERROR = "E1207 00:17:03.200000 42 nixl_agent.cpp:9] postXferReq: remote agent 'p' was disconnected"


def _relay(lines: list[str], monkeypatch: pytest.MonkeyPatch, mode: str | None) -> tuple[list[object], str]:
    """Relay ``lines`` through a pipe as a worker's stderr; what the listeners got and what the terminal showed."""
    if mode is None:
        monkeypatch.delenv("KVSPEC_BACKEND_LOGS", raising=False)
    else:
        monkeypatch.setenv("KVSPEC_BACKEND_LOGS", mode)
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    read, write = os.pipe()
    with capture_backend_logs() as got:
        thread = relay_stderr(os.fdopen(read, "rb"), source="mooncake worker 7", quiet=("Local segment descriptor",))
        with os.fdopen(write, "wb") as stream:
            stream.write("".join(line + "\n" for line in lines).encode())
        thread.join(5)
    return list(got), terminal.getvalue()


def test_known_noise_stays_off_the_terminal_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    got, shown = _relay([NOISE, "started", ERROR], monkeypatch, None)
    assert shown == f"started\n{ERROR}\n"
    assert [(line.text, line.error) for line in got] == [(NOISE, False), ("started", False), (ERROR, True)]  # type: ignore[attr-defined]
    assert _relay([NOISE, ERROR], monkeypatch, "1")[1] == f"{NOISE}\n{ERROR}\n"
    got, shown = _relay([NOISE, ERROR], monkeypatch, "0")
    assert shown == ""
    assert len(got) == 2


def test_a_long_line_is_cut_not_grown(monkeypatch: pytest.MonkeyPatch) -> None:
    got, _ = _relay(["x" * 10_000], monkeypatch, "0")
    assert [len(line.text) for line in got] == [4096, 4096, 10_000 - 8192]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (ERROR, True),
        ("[E socket.cpp:12] connection reset", True),
        ("[1733 ] ucp_worker.c:1 UCX  ERROR failed to connect", True),
        ("Traceback (most recent call last):", True),
        ("I1207 00:17:03.1 42 x.cc:1] started", False),
        ("W1207 00:17:03.1 42 x.cc:1] slow", False),
        ("Everything fine, no Errors here", False),
    ],
)
def test_error_lines(text: str, error: bool) -> None:
    assert is_error_line(text) is error


def test_an_unexpected_error_log_fails_the_run_naming_the_line() -> None:
    """Every byte right, yet an error logged at each post: the run fails on the log; an allow-list clears it."""
    backend = LogsErrors()
    try:
        report = run_suite(backend, rules=["DONE-1/transport-post-check-release"])
        allowed = run_suite(backend, rules=["DONE-1/transport-post-check-release"], allow_logs=["completion queue"])
    finally:
        backend.close()
    assert [r.outcome.value for r in report.results] == ["passed"]
    assert not report.passed
    assert report.log_errors[0].startswith(
        "during DONE-1/transport-post-check-release: logger mutants: ERROR: xfer read to producer: unexpected"
    )
    assert "the backend logged errors no case expected" in report.render()
    assert report.to_dict()["log_errors"] == list(report.log_errors)
    assert "backend-logs" in report.to_junit()
    assert allowed.passed
    assert allowed.expected_log_errors == len(report.log_errors)


def test_errors_logged_while_a_fault_is_injected_are_expected() -> None:
    backend = LogsErrors()
    try:
        report = run_suite(backend, rules=["FAIL-1/partial-transfer"])
    finally:
        backend.close()
    assert report.passed, report.render()
    assert report.expected_log_errors > 0


def test_a_late_line_after_a_fault_case_is_that_cases() -> None:
    from kvspec_conformance._runner import _Window, judge_logs

    from kvspec.transport.backend_logs import BackendLogLine

    now = time.monotonic()
    windows = [
        _Window(case_id="FAIL-1/a", began=now, ended=now + 1, allowed=True),
        _Window(case_id="DONE-1/b", began=now + 1.1, ended=now + 3, allowed=False),
    ]

    def line(at: float) -> BackendLogLine:
        return BackendLogLine(source="w", text="E boom", error=True, at=now + at)

    unexpected, expected = judge_logs([line(1.05), line(1.5), line(2.5), line(3.5), line(-1)], windows, grace=1.0)
    assert expected == 2
    assert unexpected == ["during DONE-1/b: w: E boom", "after DONE-1/b: w: E boom", "before the first case: w: E boom"]


def test_a_bad_allow_log_pattern_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loopback", "--allow-log", "(", "--rule", "ADM-1"]) == 2
    assert capsys.readouterr().err.startswith("kvspec conform: --allow-log '(': expected a regular expression")


def test_a_worker_process_stderr_is_relayed_and_sorted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker backend pipes each worker's stderr through the relay: its error reaches the suite, its noise not."""
    from kvspec import KVSpecError
    from kvspec.transport.mooncake import MooncakeBackend, find_mooncake

    if not find_mooncake():
        pytest.skip("needs the mooncake extra (the worker plumbing is NIXL's and Mooncake's, one class)")
    monkeypatch.setenv("KVSPEC_BACKEND_LOGS", "0")
    script = f"import sys; sys.stderr.write({NOISE + chr(10) + ERROR + chr(10)!r}); sys.exit(3)"
    backend = MooncakeBackend(worker_command=[sys.executable, "-c", script], spare_workers=0, start_timeout=20)
    with capture_backend_logs() as got:
        with pytest.raises(KVSpecError):
            backend.create_agent("p")
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    backend.close()
    assert [(line.text, line.error) for line in got] == [(NOISE, False), (ERROR, True)]
    assert got[0].source.startswith("mooncake worker ")
