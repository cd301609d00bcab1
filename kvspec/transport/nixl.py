"""The NIXL backend: each agent is a NIXL agent (UCX backend) in its own worker process, or one in this process.

Theory of operation:

* :class:`NixlBackend` checks that NIXL is installed (without importing it)
  and :meth:`NixlBackend.create_agent` starts one worker process per agent
  (:mod:`kvspec.transport._nixl_worker`) and returns a :class:`NixlAgent`
  proxy that implements :class:`kvspec.transport.Transport` over a pipe.
  The agent named ``in_process`` instead runs the same worker code in this
  process, called directly, as an engine runs its own agent.
* Regions must be ``multiprocessing.shared_memory`` blocks
  (``MemoryRegion.shm_name``); the worker attaches them by name and registers
  them with NIXL as host DRAM. Device memory (VRAM) is not supported.
* Every worker runs with ``UCX_NET_DEVICES=lo`` (the ``net_devices`` option; the environment's
  ``UCX_NET_DEVICES`` when set), so UCX listens on those devices alone. ``post`` checks the
  descriptors here and queues the request; it reaches the worker with the
  next call, and the first ``check`` starts it, as loopback moves nothing
  until polled. By default UCX moves data with CMA (``process_vm_readv``/``writev``),
  so ``transfer()`` completes inside that check and a transfer is never seen
  in flight; ``tls="tcp"`` sets ``UCX_TLS=tcp``, which is slower but truly
  asynchronous (``observable_in_flight``), for the in-flight and disconnect
  cases.
* Every pipe call has a deadline (``call_timeout``), so a wedged or dead
  worker becomes a :class:`kvspec.TransportError`, never a hang; a transfer
  still in flight after ``transfer_timeout`` reports ``FAILED(TIMEOUT)``.

Failure mapping (docs/backends/nixl.md, Failures): a descriptor outside
either side's registered regions raises :class:`kvspec.PlanError` at post,
before NIXL sees it (PLAN-1); an unknown peer raises
:class:`kvspec.TransportError`; a request NIXL refuses anyway reports
``FAILED(POST_FAILED)`` at the first check; ``nixlRemoteDisconnectError``
once the transfer started reports ``FAILED(PEER_DISCONNECTED)``; any other
NIXL error or an ``"ERR"`` state reports ``FAILED(TRANSFER_ERROR)`` (FAIL-1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import re
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Self, cast

from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import BackendUnavailableError, ConfigError, PlanError, TransportError, decode_error
from kvspec.transport import _nixl_worker
from kvspec.transport._base import (
    Capabilities,
    Descriptor,
    MemoryRegion,
    Notification,
    TransferHandle,
    TransferState,
    TransferStatus,
    check_descriptors,
    closed_agent_error,
    unknown_handle_error,
    unknown_peer_error,
)
from kvspec.transport.backend_logs import relay_stderr

__all__ = ["INSTALL_HINT", "NixlAgent", "NixlBackend", "WorkerAgent", "WorkerBackend", "find_nixl"]

INSTALL_HINT = (
    "pip install numpy && pip install --no-deps nixl-cu12 "
    "(or pip install 'kvspec[nixl]' after installing torch==2.13.0, so that pip does not pull a CUDA torch)"
)

# The names the worker tries, in the same order.
_NIXL_MODULES = _nixl_worker.NIXL_MODULES
_PENDING = TransferStatus(state=TransferState.PENDING)
_DONE = TransferStatus(state=TransferState.DONE)


def find_nixl() -> str | None:
    """The import name of the installed NIXL Python API, found without importing it, or ``None``."""
    for name in _NIXL_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def _require_nixl() -> None:
    missing = [name for name in ("numpy",) if importlib.util.find_spec(name) is None]
    if find_nixl() is None:
        missing.insert(0, "nixl")
    if missing:
        raise BackendUnavailableError(f"the nixl backend needs {' and '.join(missing)}: {INSTALL_HINT}")


class WorkerAgent:
    """One agent (Transport) of a worker-process backend: a proxy for an agent in a worker process, or the agent.

    Shared by the NIXL and Mooncake backends (:mod:`kvspec.transport.mooncake`):
    a subclass names its engine (``label``) and the worker module that serves
    it (``protocol``: its ``handle`` answers a request in process, its
    ``unpack_metadata`` reads a peer's region table). What follows describes
    NIXL; Mooncake's worker behaves the same way towards this proxy.

    In a worker process (the default), calls are forwarded over a pipe and
    answered within ``call_timeout`` seconds, and the worker polls NIXL
    whenever it is idle, so this agent may stay passive (no calls) without
    stalling its peer. In this process (``NixlBackend(in_process=NAME)``),
    calls go straight to NIXL: no pipe, no call timeout, and NIXL progresses
    only when this agent is called, so a passive agent must poll
    :meth:`get_notifications`, as the :class:`kvspec.transport.Transport`
    contract asks.
    """

    label: ClassVar[str]
    protocol: ClassVar[ModuleType]

    def __init__(
        self,
        name: str,
        process: subprocess.Popen[bytes] | None,
        conn: Connection | None,
        *,
        capabilities: Capabilities,
        call_timeout: float,
        recycle: Callable[[subprocess.Popen[bytes], Connection], None] | None = None,
        worker: Any = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._name = name
        self._recycle = recycle
        self._on_close = on_close  # called once this agent's worker process has stopped
        # Exactly one of the two: a worker process and its pipe, or the worker object in this process.
        if (worker is None) == (process is None or conn is None):
            raise ConfigError(f"{type(self).__name__}: expected a worker process and its pipe, or an in-process worker")
        self._process = process
        self._conn = conn
        self._worker = worker
        self._capabilities = capabilities
        self._call_timeout = call_timeout
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._final: dict[int, TransferStatus] = {}
        self._handles: set[int] = set()
        self._ids = itertools.count(1)
        # Posts checked here wait, in order, to travel with the next call in one message.
        self._queued: dict[int, tuple[object, ...]] = {}
        import numpy  # the nixl extra's dependency; checked by NixlBackend, imported only now

        self._np = numpy
        self._local_sizes: tuple[int, ...] = ()
        self._peer_sizes: dict[str, tuple[int, ...]] = {}  # peer name -> its region sizes, from its metadata

    # -- identity

    @property
    def name(self) -> str:
        """This agent's name (also its NIXL agent name)."""
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        """Both modes, notifications, cross-process; in flight only over tcp."""
        return self._capabilities

    @property
    def pid(self) -> int:
        """The id of the process NIXL runs in: the worker's, or this process's when in process."""
        return os.getpid() if self._process is None else self._process.pid

    @property
    def in_process(self) -> bool:
        """Whether the NIXL agent runs in this process (``NixlBackend(in_process=...)``)."""
        return self._worker is not None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # -- the pipe

    def _call(self, op: str, *args: object, timeout: float | None = None) -> object:
        with self._lock:
            if self._closed:
                raise closed_agent_error(self._name)
            if self._broken is not None:
                raise TransportError(self._broken, reason=FailureReason.TRANSFER_ERROR)
            queued, self._queued = self._queued, {}
            request: tuple[object, ...] = ("batch", list(queued.values()), (op, *args)) if queued else (op, *args)
            if self._worker is not None:
                reply = self.protocol.handle(self._worker, request)
            else:
                reply = self._ask(op, request, self._call_timeout if timeout is None else timeout)
            if queued:
                _, post_replies, reply = reply
                for transfer_id, post_reply in zip(queued, post_replies, strict=True):
                    self._settle(transfer_id, post_reply)
        if reply[0] == "ok":
            return reply[1]
        raise decode_error(reply[1])

    def _ask(self, op: str, request: tuple[object, ...], limit: float) -> Any:
        """Send ``request`` to the worker process and wait up to ``limit`` seconds for its reply."""
        assert self._process is not None
        assert self._conn is not None
        try:
            self._conn.send(request)
            if not self._conn.poll(limit):
                self._break(f"{self.label} agent {self._name!r}: no answer to {op!r} within {limit} s; worker stopped")
                raise TransportError(self._broken or "", reason=FailureReason.TIMEOUT)
            return self._conn.recv()
        except (EOFError, OSError):
            self._break(f"{self.label} agent {self._name!r}: worker process exited (code {self._process.poll()})")
            raise TransportError(self._broken or "", reason=FailureReason.TRANSFER_ERROR) from None

    def _settle(self, transfer_id: int, reply: tuple[Any, ...]) -> None:
        """Apply a post's reply: an ended request (nothing to move) or one NIXL refused is final."""
        if reply[0] == "ok":
            status = _status(*reply[1])
        else:
            error = decode_error(reply[1])
            refused = not isinstance(error, TransportError)  # a plan or config error: the post was refused
            why = FailureReason.POST_FAILED if refused else _reason(getattr(error, "reason", None))
            status = TransferStatus(state=TransferState.FAILED, reason=why, detail=str(error))
        if status.state is not TransferState.PENDING and transfer_id in self._handles:
            self._final[transfer_id] = status

    def _break(self, why: str) -> None:
        """Give up on the worker: kill it so it cannot act later on a request we abandoned."""
        self._broken = why
        if self._process is not None:
            _stop(self._process, grace=0.0)

    # -- memory and peers

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Attach each shared-memory region in the worker and register it with NIXL as DRAM.

        Each region's ``buffer`` must start at byte 0 of its ``shm_name`` block
        (as :func:`kvspec.testing.allocate_pool` makes them); the worker maps
        ``region.nbytes`` bytes from there.
        """
        table: list[tuple[str, int]] = []
        for index, region in enumerate(regions, start=len(self._local_sizes)):
            if region.shm_name is None:
                raise ConfigError(
                    f"{type(self).__name__}.register_memory: region {index} has no shm_name; the {self.label} backend "
                    "runs agents "
                    "in other processes and needs multiprocessing.shared_memory regions (kvspec.testing.allocate_pool)"
                )
            table.append((region.shm_name, region.nbytes))
        self._call("register", table)
        self._local_sizes += tuple(n for _, n in table)

    def get_agent_metadata(self) -> bytes:
        """NIXL's metadata wrapped with this agent's name and region table; pass it to the peer out of band."""
        return cast(bytes, self._call("metadata"))

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata; the same bytes again are a no-op.

        A peer restarted under the same name must be removed first
        (:meth:`remove_remote_agent`), as NIXL requires.
        """
        name = cast(str, self._call("add_peer", bytes(metadata)))
        # The worker accepted it, so it parses; keep the peer's region sizes to check posts here.
        _, regions, _ = self.protocol.unpack_metadata(bytes(metadata))
        self._peer_sizes[name] = tuple(n for _, n in regions)
        return name

    def remove_remote_agent(self, peer: str) -> None:
        """Forget a peer and disconnect from it; its transfers in flight fail as disconnected."""
        self._call("remove_peer", peer)
        self._peer_sizes.pop(peer, None)

    # -- transfers

    def post(
        self,
        mode: TransferMode,
        descriptors: Sequence[Descriptor],
        *,
        peer: str,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Check every descriptor against both sides' regions (PLAN-1) and create the NIXL request.

        Bytes move from the first :meth:`check` on, which calls NIXL's
        ``transfer()``; over CMA that call does the whole copy and returns DONE.
        """
        if not isinstance(mode, TransferMode):
            raise PlanError(f"post: expected a TransferMode, got {mode!r}")
        if self._closed:
            raise closed_agent_error(self._name)
        remote_sizes = self._peer_sizes.get(peer)
        if remote_sizes is None:
            raise unknown_peer_error(self._name, peer)
        # A DescriptorList (what TransferPlan.to_descriptors returns) is already packed (PLAN-1).
        table = check_descriptors(descriptors, local_sizes=self._local_sizes, remote_sizes=remote_sizes)
        # In process the worker reads the list's own buffer; a pipe needs bytes.
        packed = table.view() if self._worker is not None and sys.byteorder == "little" else table.to_bytes()
        op = "READ" if mode is TransferMode.READ else "WRITE"
        message = None if notification is None else bytes(notification)
        with self._lock:
            if self._closed:
                raise closed_agent_error(self._name)
            transfer_id = next(self._ids)
            # Checked here already, so the request can travel with the next call (the first check,
            # usually): one round trip per request, and nothing moves before it is polled.
            bounds = table.bounds
            block = bounds.smallest_nbytes if bounds.smallest_nbytes == bounds.largest_nbytes else 0
            self._queued[transfer_id] = ("post", transfer_id, op, packed, peer, message, block)
            self._handles.add(transfer_id)
        return TransferHandle(transfer_id=transfer_id, peer=peer, mode=mode)

    def check(self, handle: TransferHandle) -> TransferStatus:
        """Report PENDING, DONE or FAILED with a reason; a dead worker reports FAILED, never hangs."""
        if self._closed:
            raise closed_agent_error(self._name)
        final = self._final.get(handle.transfer_id)
        if final is not None:
            return final
        if handle.transfer_id not in self._handles:
            raise unknown_handle_error(self._name, handle.transfer_id)
        try:
            reply = self._call("check", handle.transfer_id)
        except TransportError as exc:
            if self._closed:
                raise
            status = TransferStatus(state=TransferState.FAILED, reason=_reason(exc.reason), detail=str(exc))
        else:
            status = _status(*cast(tuple[str, "str | None", str], reply))
        # The post travelled with this check: NIXL may have refused it, or it had nothing to move.
        status = self._final.get(handle.transfer_id, status)
        if status.state is not TransferState.PENDING:
            self._final[handle.transfer_id] = status
        return status

    def release(self, handle: TransferHandle) -> None:
        """Drop a handle; NIXL cancels a transfer still in flight as far as it can."""
        if handle.transfer_id not in self._handles:
            return
        self._handles.discard(handle.transfer_id)
        if self._final.pop(handle.transfer_id, None) is not None:
            return  # the worker released the NIXL request when it ended
        with self._lock:
            if self._queued.pop(handle.transfer_id, None) is not None:
                return  # never sent: nothing moved, nothing to cancel
        if self._broken is None and not self._closed:
            self._call("release", handle.transfer_id)

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer`` without data."""
        if self._closed:
            raise closed_agent_error(self._name)
        if peer not in self._peer_sizes:
            raise unknown_peer_error(self._name, peer)
        self._call("notify", peer, bytes(message))

    def get_notifications(self) -> Sequence[Notification]:
        """Drain the notifications the worker has collected, in arrival order."""
        drained = cast(list[tuple[str, bytes]], self._call("notifs"))
        return [Notification(peer=peer, message=message) for peer, message in drained]

    def info(self) -> dict[str, object]:
        """The worker's pid, UCX backend parameters and ``UCX_*`` environment (for reports)."""
        return cast(dict[str, object], self._call("info"))

    def close(self) -> None:
        """End the NIXL agent; its worker process goes back to the backend for reuse, or stops. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._final.clear()
            self._handles.clear()
            if self._worker is not None:
                self._queued.clear()
                try:
                    self._worker.close()
                except Exception as exc:
                    raise TransportError(f"{self.label} agent {self._name!r}: could not tear down: {exc}") from None
                return
            assert self._process is not None
            assert self._conn is not None
            if self._broken is None:
                op = "close" if self._recycle is None else "retire"
                self._queued.clear()  # never sent, so never started
                try:
                    self._conn.send((op,))
                    done = self._conn.poll(min(self._call_timeout, 10.0)) and self._conn.recv()[0] == "ok"
                except (EOFError, OSError):
                    done = False
                if done and self._recycle is not None and self._process.poll() is None:
                    self._recycle(self._process, self._conn)
                    return
            self._conn.close()
            _stop(self._process, grace=5.0)
            if self._on_close is not None:
                self._on_close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, pid={self.pid}, closed={self._closed})"


class NixlAgent(WorkerAgent):
    """One NIXL agent (Transport): a proxy for an agent in a worker process, or the agent itself."""

    label: ClassVar[str] = "nixl"
    protocol: ClassVar[ModuleType] = _nixl_worker


def _status(state: str, reason: str | None, detail: str) -> TransferStatus:
    if state == "pending":
        return _PENDING
    if state == "done":
        return _DONE
    return TransferStatus(state=TransferState.FAILED, reason=_reason(reason), detail=detail)


def _reason(value: str | None) -> FailureReason:
    try:
        return FailureReason(value)
    except ValueError:
        return FailureReason.TRANSFER_ERROR


def _kill_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10.0)


def _close_worker(process: subprocess.Popen[bytes], conn: Connection) -> None:
    """Ask an idle worker to exit, then make sure it did."""
    try:
        conn.send(("close",))
        if conn.poll(5.0):
            conn.recv()
    except (EOFError, OSError):
        pass
    conn.close()
    _stop(process, grace=5.0)


@contextlib.contextmanager
def _environment(settings: Mapping[str, str]) -> Iterator[None]:
    """Set ``settings`` in ``os.environ`` for the block, then put back what was there."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stop(process: subprocess.Popen[bytes], *, grace: float) -> None:
    """Wait ``grace`` seconds for the worker to exit, then kill it and reap it."""
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10.0)


def _rdma_devices() -> list[str]:
    """The RDMA devices the kernel lists (``/sys/class/infiniband``); none on a machine without RDMA NICs."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


# A UCX device name: an interface (lo, eth0, veth-a) or an RDMA port (mlx5_0:1); "all" too.
_DEVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,31}$")


class WorkerBackend:
    """Creates agents of one engine, one worker process each (Backend); shared by NIXL and Mooncake.

    A subclass sets ``label``, ``agent_class``, ``protocol`` (the worker module),
    ``install_hint`` and ``in_process_env`` (the environment prefixes an
    in-process agent is created under), calls :meth:`_init_workers` from its
    ``__init__`` and defines :meth:`worker_env`.
    """

    label: ClassVar[str]
    agent_class: ClassVar[type[WorkerAgent]]
    protocol: ClassVar[ModuleType]
    install_hint: ClassVar[str]
    in_process_env: ClassVar[tuple[str, ...]]
    # Substrings of worker stderr lines that are the engine's known noise: kept off the terminal unless
    # KVSPEC_BACKEND_LOGS=1, and never counted as errors (kvspec.transport.backend_logs).
    quiet_lines: ClassVar[tuple[str, ...]] = ()

    def _init_workers(
        self,
        *,
        capabilities: Capabilities,
        options: dict[str, object],
        call_timeout: float,
        start_timeout: float,
        max_idle_workers: int,
        in_process: str | None,
        worker_command: Sequence[str] | None,
        spare_workers: int = 0,
    ) -> None:
        """Check the options every worker backend shares and set up the worker bookkeeping.

        ``spare_workers`` processes are kept started ahead of ``create_agent``,
        for a backend whose workers are never reused.
        """
        for field, value in (("call_timeout", call_timeout), ("start_timeout", start_timeout)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(
                    f"{type(self).__name__}.{field}: expected a positive number of seconds, got {value!r}"
                )
        if in_process is not None and (not isinstance(in_process, str) or not in_process):
            raise ConfigError(f"{type(self).__name__}.in_process: expected an agent name or None, got {in_process!r}")
        self._in_process = in_process
        self._options = options
        self._call_timeout = float(call_timeout)
        self._start_timeout = float(start_timeout)
        # A benchmark may run its own worker script that adds requests (benchmarks/bench_nixl.py).
        self._worker_command = list(worker_command or [sys.executable, "-m", self.protocol.__name__])
        self._capabilities = capabilities
        self._agents: list[WorkerAgent] = []
        self._idle: list[tuple[subprocess.Popen[bytes], Connection]] = []
        self._max_idle = max_idle_workers
        self._spare_count = spare_workers
        self._spares: list[tuple[subprocess.Popen[bytes], Connection]] = []
        self._closing = False
        # A backend dropped without close() must not leave workers polling behind it.
        self._processes: list[subprocess.Popen[bytes]] = []
        weakref.finalize(self, _kill_all, self._processes)

    @property
    def name(self) -> str:
        """The backend's name (``label``)."""
        return self.label

    @property
    def capabilities(self) -> Capabilities:
        """What agents of this backend can do."""
        return self._capabilities

    def worker_env(self) -> dict[str, str]:
        """The environment a worker process starts with."""
        raise NotImplementedError

    def _package_env(self) -> dict[str, str]:
        """This process's environment, with kvspec's package root first on ``PYTHONPATH``."""
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        return env

    def create_agent(self, name: str) -> WorkerAgent:
        """Start an agent called ``name`` in a worker process (a reused one when available)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{type(self).__name__}.create_agent: expected a non-empty name, got {name!r}")
        for agent in self._agents:
            if agent.name == name and not agent.closed:
                raise TransportError(
                    f"{self.label}: an agent named {name!r} already exists", reason=FailureReason.PROTOCOL
                )
        if name == self._in_process:
            return self._local_agent(name)
        while self._idle:
            process, conn = self._idle.pop()
            try:
                return self._started(name, process, conn, ("start", name))
            except TransportError:
                continue  # that worker is gone or broken; it was stopped, try the next
        while self._spares:
            process, conn = self._spares.pop(0)
            try:
                return self._started(name, process, conn, ("start", name, self._options))
            except TransportError:
                continue  # that spare died; it was stopped, try the next
        return self._started(name, *self._spawn(name), self._options)

    def _spawn(self, name: str) -> tuple[subprocess.Popen[bytes], Connection]:
        """Start a worker process for the agent ``name`` (``"-"``: a spare, named by its start request)."""
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [*self._worker_command, str(theirs.fileno()), name],
                pass_fds=(theirs.fileno(),),
                env=self.worker_env(),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,  # relayed line by line: sorted, captured by the suite (backend_logs)
            )
        finally:
            theirs.close()
        if process.stderr is not None:
            relay_stderr(process.stderr, source=f"{self.label} worker {process.pid}", quiet=self.quiet_lines)
        self._processes[:] = [p for p in self._processes if p.poll() is None] + [process]
        return process, Connection(ours.detach())

    def _top_up(self) -> None:
        """Start spare workers up to ``spare_workers`` when an agent closed, so that they load their engine
        between the caller's runs rather than during one (a spare starting costs a core for a moment).
        """
        while len(self._spares) < self._spare_count and not self._closing:
            self._spares.append(self._spawn("-"))

    def _local_agent(self, name: str) -> WorkerAgent:
        """Start the agent ``name`` in this process, under the workers' engine settings (``in_process_env``)."""
        settings = {k: v for k, v in self.worker_env().items() if k.startswith(self.in_process_env)}
        with _environment(settings):
            try:
                worker = self.protocol.Worker(name, dict(self._options))
            except ImportError as exc:
                why = f"the {self.label} backend could not import its engine ({exc}): {self.install_hint}"
                raise BackendUnavailableError(why) from None
            except Exception as exc:
                raise TransportError(f"{self.label}: could not start agent {name!r} in this process: {exc}") from None
        agent = self.agent_class(
            name, None, None, capabilities=self._capabilities, call_timeout=self._call_timeout, worker=worker
        )
        self._agents = [a for a in self._agents if not a.closed]
        self._agents.append(agent)
        return agent

    def _started(self, name: str, process: subprocess.Popen[bytes], conn: Connection, request: object) -> WorkerAgent:
        """Send the start request and wait for the agent; stop the worker on any failure."""
        try:
            conn.send(request)
            if not conn.poll(self._start_timeout):
                raise TransportError(f"{self.label}: agent {name!r} did not start within {self._start_timeout} s")
            reply = conn.recv()
        except (EOFError, OSError):
            conn.close()
            _stop(process, grace=1.0)
            raise TransportError(
                f"{self.label}: worker for agent {name!r} exited at start (code {process.poll()})"
            ) from None
        except BaseException:
            conn.close()
            _stop(process, grace=0.0)
            raise
        if reply[0] != "ok":
            conn.close()
            _stop(process, grace=5.0)
            error = decode_error(reply[1])
            if isinstance(error, BackendUnavailableError):
                raise BackendUnavailableError(
                    f"the {self.label} worker could not import its engine ({error}): {self.install_hint}"
                )
            raise TransportError(str(error))
        recycle = self._take_back if self._max_idle > 0 else None
        agent = self.agent_class(
            name,
            process,
            conn,
            capabilities=self._capabilities,
            call_timeout=self._call_timeout,
            recycle=recycle,
            on_close=self._top_up if self._spare_count else None,
        )
        self._agents = [a for a in self._agents if not a.closed]
        self._agents.append(agent)
        return agent

    def _take_back(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        """Keep a retired worker for the next agent, up to ``max_idle_workers``."""
        if len(self._idle) < self._max_idle:
            self._idle.append((process, conn))
        else:
            _close_worker(process, conn)

    def close(self) -> None:
        """Stop every worker this backend started."""
        self._closing = True
        for agent in self._agents:
            agent.close()
        self._agents.clear()
        while self._idle:
            _close_worker(*self._idle.pop())
        while self._spares:
            process, conn = self._spares.pop()
            conn.close()  # a spare waiting for its start request exits on end of file
            # A spare started when the last agent closed may still be loading its engine (tens of seconds on a
            # busy machine) before it reads that end of file: it gets the start deadline, not a fixed 5 s.
            _stop(process, grace=self._start_timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NixlBackend(WorkerBackend):
    """Creates NIXL agents, one worker process each (Backend).

    Options (all keyword-only, all passable through ``load_backend("nixl", ...)``):

    - ``tls``: ``None`` (UCX default: CMA for data, tcp on lo for wire-up and
      notifications) or ``"tcp"`` (``UCX_TLS=tcp``: asynchronous, observable
      in flight, about 10x slower).
    - ``env``: extra environment for the workers, e.g. ``{"UCX_LOG_LEVEL": "info"}``.
    - ``ucx_params``: UCX backend parameters, e.g. ``{"ucx_error_handling_mode": "none"}``.
    - ``net_devices``: ``UCX_NET_DEVICES`` of the workers and the in-process
      agent: the network devices UCX may use (and listen on), comma-separated
      (default: ``UCX_NET_DEVICES`` where the environment sets it, else
      ``"lo"``: loopback only). Across hosts, the NIC that reaches the peer,
      e.g. ``"eth0"`` or ``"mlx5_0:1"``; ``kvspec agent serve`` and ``kvspec
      conform --peer`` derive it from their addresses.
    - ``call_timeout``: seconds any call may wait for its worker (default 60).
    - ``start_timeout``: seconds a worker may take to start (default 60).
    - ``transfer_timeout``: seconds a transfer may stay in flight before it
      reports ``FAILED(TIMEOUT)``; ``None`` waits forever (default 60).
    - ``poll_interval``: seconds between an idle worker's NIXL polls (default 0.0005).
    - ``max_idle_workers``: worker processes of closed agents kept to host the
      next agents (a fresh NIXL agent in a warm process starts in ~20 ms
      instead of ~0.5 s); 0 stops every worker with its agent (default 4).
    - ``in_process``: the name of one agent to run in this process instead of
      a worker, as an engine runs its own agent: no pipe round trip per call,
      and no call timeout. Its UCX context is created under the workers'
      ``UCX_*``/``NIXL_*`` environment (``UCX_NET_DEVICES=lo`` included),
      which is set for that moment only. The other agents still run in
      workers, so each transfer still crosses two processes (default none).
    """

    label: ClassVar[str] = "nixl"
    agent_class: ClassVar[type[WorkerAgent]] = NixlAgent
    protocol: ClassVar[ModuleType] = _nixl_worker
    install_hint: ClassVar[str] = INSTALL_HINT
    in_process_env: ClassVar[tuple[str, ...]] = ("UCX_", "NIXL_")

    def __init__(
        self,
        *,
        tls: str | None = None,
        env: Mapping[str, str] | None = None,
        ucx_params: Mapping[str, str] | None = None,
        call_timeout: float = 60.0,
        start_timeout: float = 60.0,
        transfer_timeout: float | None = 60.0,
        poll_interval: float = 0.0005,
        max_idle_workers: int = 4,
        in_process: str | None = None,
        worker_command: Sequence[str] | None = None,
        net_devices: str | None = None,
    ) -> None:
        _require_nixl()
        source = ""
        if net_devices is None:  # the user's UCX_NET_DEVICES is kept; loopback otherwise, never every interface
            net_devices = os.environ.get("UCX_NET_DEVICES", "").strip() or "lo"
            source = " (from UCX_NET_DEVICES)" if "UCX_NET_DEVICES" in os.environ else ""
        if not isinstance(net_devices, str) or not all(_DEVICE.match(d) for d in net_devices.split(",")):
            raise ConfigError(
                f"NixlBackend.net_devices: expected UCX device names, comma-separated (e.g. 'lo', 'eth0', "
                f"'mlx5_0:1'), got {net_devices!r}{source}"
            )
        self._net_devices = net_devices
        if tls not in (None, "tcp"):
            raise ConfigError(f"NixlBackend.tls: expected None or 'tcp', got {tls!r}")
        if not isinstance(poll_interval, (int, float)) or not 0 < poll_interval <= 1:
            raise ConfigError(f"NixlBackend.poll_interval: expected seconds in (0, 1], got {poll_interval!r}")
        self._tls = tls
        self._env = dict(env or {})
        capabilities = Capabilities(
            modes=frozenset({TransferMode.READ, TransferMode.WRITE}),
            notifications=True,
            cross_process=True,
            integrity=False,
            observable_in_flight=tls == "tcp",
        )
        options: dict[str, object] = {
            "ucx_params": dict(ucx_params or {}),
            "transfer_timeout": transfer_timeout,
            "poll_interval": float(poll_interval),
        }
        self._init_workers(
            capabilities=capabilities,
            options=options,
            call_timeout=call_timeout,
            start_timeout=start_timeout,
            max_idle_workers=max_idle_workers,
            in_process=in_process,
            worker_command=worker_command,
        )

    def create_agent(self, name: str) -> NixlAgent:
        """Start a NIXL agent called ``name`` in a worker process (a reused one when available)."""
        return cast(NixlAgent, super().create_agent(name))

    def worker_env(self) -> dict[str, str]:
        """The environment a worker starts with: ``UCX_NET_DEVICES`` (loopback by default), ``UCX_TLS`` in tcp mode."""
        env = self._package_env()
        # Loopback unless told otherwise (docs/backends/nixl.md, Environment and options).
        env["UCX_NET_DEVICES"] = self._net_devices
        if self._tls is not None:
            env["UCX_TLS"] = self._tls
        env.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent start at INFO
        if not _rdma_devices():
            # Without an RDMA device UCX's ib modules serve nothing, and once libibverbs is installed (the
            # mooncake extra needs it) an in-process agent crashes at interpreter exit in their teardown.
            env.setdefault("UCX_MODULES", "^ib")
        env.update(self._env)
        return env
