"""What a backend logs: its worker processes' stderr and its Python loggers' errors, relayed, sorted and captured.

Worker backends (NIXL, Mooncake) start each agent in a process of its own
whose stderr is a pipe: :func:`relay_stderr` reads it line by line in a
thread, hands every line to the listeners :func:`capture_backend_logs`
installed, and writes it to this process's stderr as ``KVSPEC_BACKEND_LOGS``
says:

- unset (the default): every line, except the backend's known noise (its
  ``quiet_lines``, e.g. Mooncake's ``Local segment descriptor not found``,
  hundreds a run);
- ``1`` or ``all``: every line, noise included;
- ``0`` or ``none``: nothing (the listeners still get every line).

A line is an *error* when it reads like one (glog's ``E``/``F`` prefix,
``ERROR``, ``FATAL``, a Python traceback) and is not known noise. The
conformance suite fails a run on an error a case did not expect, as NIXL's
own test main exits non-zero on any error log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO

import attrs

__all__ = [
    "BackendLogLine",
    "capture_backend_logs",
    "is_error_line",
    "relay_lines",
    "relay_stderr",
    "send_stderr_lines",
    "terminal_mode",
]

# glog, abseil: "E1207 00:17:03.123456 42 file.cc:12] ..."; c10, gloo: "[E socket.cpp:12] ..."; UCX: "... ERROR ...".
_ERROR = re.compile(r"^\[?[EF]\d{4} |^\[?[EF] [\w./-]+:\d+\]|\bERROR\b|\bFATAL\b|^Traceback \(most recent call last\):")
MAX_LINE = 4096  # bytes of one line kept; a longer one goes on as the next line (a worker cannot grow us)
_MODES = {"": "default", "1": "all", "all": "all", "0": "none", "none": "none"}


@attrs.frozen(kw_only=True)
class BackendLogLine:
    """One line a backend logged: where from (``"mooncake worker 123"``, ``"logger nixl"``), the text, and whether
    it is an error (a known-noise line never is)."""

    source: str
    text: str
    error: bool
    at: float = attrs.field(factory=time.monotonic)  # when it arrived here (time.monotonic)


def is_error_line(text: str, quiet: Sequence[str] = ()) -> bool:
    """Whether ``text`` reads as an error log line and is not one of the ``quiet`` (known-noise) substrings."""
    return bool(_ERROR.search(text)) and not any(q in text for q in quiet)


def terminal_mode() -> str:
    """``default``, ``all`` or ``none``: which worker lines reach this process's stderr (``KVSPEC_BACKEND_LOGS``)."""
    value = os.environ.get("KVSPEC_BACKEND_LOGS", "").strip().lower()
    return _MODES.get(value, "default")


_listeners: list[Callable[[BackendLogLine], None]] = []
_lock = threading.Lock()


def _emit(line: BackendLogLine) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(line)


def relay_lines(receive: Callable[[], bytes], *, source: str, quiet: Sequence[str] = ()) -> threading.Thread:
    """Call ``receive`` for lines (``b""``, EOFError or OSError ends) in a daemon thread; each to the listeners
    and, as :func:`terminal_mode` says, to this process's stderr."""

    def run() -> None:
        with contextlib.suppress(OSError, ValueError, EOFError):
            while raw := receive():
                text = raw[:MAX_LINE].decode("utf-8", "replace").rstrip("\r\n")
                noise = any(q in text for q in quiet)
                _emit(BackendLogLine(source=source, text=text, error=not noise and is_error_line(text)))
                mode = terminal_mode()
                if mode == "all" or (mode == "default" and not noise):
                    with contextlib.suppress(OSError, ValueError):
                        sys.stderr.write(text + "\n")
                        sys.stderr.flush()

    thread = threading.Thread(target=run, name=f"kvspec-logs-{source}", daemon=True)
    thread.start()
    return thread


def relay_stderr(stream: IO[bytes], *, source: str, quiet: Sequence[str] = ()) -> threading.Thread:
    """Relay a worker's stderr pipe line by line (:func:`relay_lines`), then close it."""

    def receive() -> bytes:
        line = stream.readline(MAX_LINE)
        if not line:
            stream.close()
        return line

    return relay_lines(receive, source=source, quiet=quiet)


def send_stderr_lines(send: Callable[[bytes], None]) -> None:
    """In a worker: point file descriptor 2 at a pipe and ``send`` each line written to it (C++ engines' logs too).

    For workers whose parent cannot pipe their stderr itself (``multiprocessing``
    spawn); the parent relays what ``send`` carries with :func:`relay_lines`.
    """
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    stream = os.fdopen(read, "rb")

    def run() -> None:
        with contextlib.suppress(OSError, ValueError, EOFError):
            while line := stream.readline(MAX_LINE):
                send(line)

    threading.Thread(target=run, name="kvspec-stderr", daemon=True).start()


class _ErrorRecords(logging.Handler):
    """Hands every record at ERROR or above, from the loggers it is attached to, to ``sink``."""

    def __init__(self, sink: Callable[[BackendLogLine], None]) -> None:
        super().__init__(level=logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            first = record.getMessage().splitlines()[0] if record.getMessage() else ""
        except Exception:  # a record whose arguments do not format is still an error line
            first = str(record.msg)
        self.sink(BackendLogLine(source=f"logger {record.name}", text=f"{record.levelname}: {first}", error=True))


@contextlib.contextmanager
def capture_backend_logs(loggers: Iterable[str] = ()) -> Iterator[list[BackendLogLine]]:
    """Collect every worker line, and the ERROR records of ``loggers`` (names), while the block runs."""
    lines: list[BackendLogLine] = []
    handler = _ErrorRecords(lines.append)
    targets = [logging.getLogger(name) for name in dict.fromkeys(loggers)]
    with _lock:
        _listeners.append(lines.append)
    for logger in targets:
        logger.addHandler(handler)
    try:
        yield lines
    finally:
        for logger in targets:
            logger.removeHandler(handler)
        with _lock:
            _listeners.remove(lines.append)
