"""The ``torch`` backend: each agent is a worker process moving bytes with torch.distributed point-to-point ops.

Theory of operation:

- :meth:`TorchDistributedBackend.create_agent` starts one worker process
  (``multiprocessing`` spawn) and returns a :class:`TorchAgent`, a proxy
  implementing :class:`kvspec.transport.Transport` over a pipe. This process
  never imports torch; only the workers do.
- ``register_memory`` takes shared-memory regions (``MemoryRegion.shm_name``);
  the worker maps the same bytes, so data lands in the caller's pools without
  passing through this process.
- ``add_remote_agent`` pairs two workers once each side has added the other:
  two control connections on ``host`` (127.0.0.1 by default), authenticated
  with a key only the two workers can derive (docs/backends/torch.md,
  Security), and one two-rank process group (gloo on ``interface``,
  ``GLOO_SOCKET_IFNAME``, ``lo`` by default) whose rendezvous runs over those
  control connections (no store listens).
  ``post`` validates every descriptor here, before anything moves (PLAN-1),
  coalesces adjacent descriptors into runs, and hands them to the worker.
- ``check`` asks the worker; a transfer whose peer process dies or that
  outlives ``timeout_s`` ends FAILED (FAIL-1). Every call to a worker is
  bounded, so no call hangs the caller.
- ``close`` resets the worker and the backend keeps it for the next
  ``create_agent`` (spawning a process and importing torch takes seconds;
  a conformance run creates two agents per scenario).
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import attrs

from kvspec.core._descriptors import merge_columns
from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import BackendUnavailableError, ConfigError, PlanError, TransportError, decode_error
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
    unreadable_metadata_error,
)
from kvspec.transport._pairkey import parse_nonce, parse_public
from kvspec.transport.backend_logs import relay_lines, send_stderr_lines

__all__ = ["TorchAgent", "TorchDistributedBackend"]

_PENDING = TransferStatus(state=TransferState.PENDING)
_COLUMNS = ("local_region", "local_offset", "remote_region", "remote_offset", "nbytes")

INSTALL_HINT = (
    "the 'torch' backend needs PyTorch: pip install 'kvspec[torch]' "
    "(for the CPU build first: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)"
)

CAPABILITIES = Capabilities(
    modes=frozenset({TransferMode.READ, TransferMode.WRITE}),
    notifications=True,
    cross_process=True,
    integrity=False,
    # A transfer starts at its first check, which always reports PENDING.
    observable_in_flight=True,
)

# Extra seconds a pipe call waits beyond the worker's own timeout before the worker counts as hung.
_PIPE_SLACK_S = 5.0
_STATES = {"pending": TransferState.PENDING, "done": TransferState.DONE, "failed": TransferState.FAILED}


def _require_torch() -> None:
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise BackendUnavailableError(INSTALL_HINT)


_INTERFACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}$")


def _check_interface(interface: object) -> None:
    """A Linux interface name: 1 to 15 characters, no spaces or slashes."""
    if not isinstance(interface, str) or not _INTERFACE.match(interface):
        raise ConfigError(
            f"TorchDistributedBackend.interface: expected a network interface name such as 'lo' or 'eth0', "
            f"got {interface!r}"
        )


def _check_host(host: object) -> None:
    """An IPv4 address in dotted form (the control sockets are IPv4)."""
    try:
        ipaddress.IPv4Address(host if isinstance(host, str) else "")
    except ValueError:
        raise ConfigError(
            f"TorchDistributedBackend.host: expected an IPv4 address such as '127.0.0.1', got {host!r}"
        ) from None


def _worker_entry(
    conn: Connection, events: Connection, name: str, options: dict[str, Any], logs: Connection | None = None
) -> None:
    """Process target: pin gloo to the chosen interface (``lo`` by default), then import torch and serve.

    ``logs`` carries every line written to the worker's stderr (gloo's and torch's C++ logs too) to the parent,
    which relays them (kvspec.transport.backend_logs).
    """
    if logs is not None:
        send_stderr_lines(logs.send_bytes)
    os.environ["GLOO_SOCKET_IFNAME"] = options["interface"]
    from kvspec.transport import _torch_worker

    _torch_worker.main(conn, events, name, options)


class TorchDistributedBackend:
    """Agents in separate processes joined pairwise by torch.distributed process groups.

    ``process_group`` is ``"gloo"`` (tested, CPU) or ``"module:function"``
    building a group from ``(store, rank, world_size, timeout)``, importable
    in the workers (e.g. to try NCCL where device memory is registered).
    ``timeout_s`` bounds pairing, every transfer and every worker call.
    Pages smaller than ``stage_below`` bytes on average are packed into
    ``chunk_bytes`` messages through ``ring`` staging buffers per transfer.
    ``check_wait_s`` is how long a check of a transfer polled in a tight
    loop waits in the worker; ``threads`` is ``torch.set_num_threads`` in the
    workers; ``prestart`` workers are started (and waited for) here, and up
    to ``max_idle`` closed agents' workers are kept for reuse.

    ``host`` is the IPv4 address the workers' control sockets bind to and
    advertise in their agent metadata, and ``interface`` the network
    interface gloo uses (``GLOO_SOCKET_IFNAME``); the defaults,
    ``"127.0.0.1"`` and ``"lo"``, keep every byte on loopback. Across hosts,
    give both for the NIC that reaches the peer (docs/backends/torch.md).
    """

    def __init__(
        self,
        *,
        process_group: str = "gloo",
        timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
        interface: str = "lo",
        host: str = "127.0.0.1",
        chunk_bytes: int = 1 << 20,
        stage_below: int = 32 << 10,
        ring: int = 8,
        check_wait_s: float = 0.001,
        threads: int = 1,
        max_idle: int = 4,
        prestart: int = 2,
    ) -> None:
        _require_torch()
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ConfigError(
                f"TorchDistributedBackend: expected positive timeouts, got {timeout_s}, {start_timeout_s}"
            )
        if chunk_bytes <= 0 or ring <= 0:
            raise ConfigError(
                f"TorchDistributedBackend: expected positive chunk_bytes and ring, got {chunk_bytes}, {ring}"
            )
        _check_interface(interface)
        _check_host(host)
        self._options: dict[str, Any] = {
            "process_group": process_group,
            "timeout_s": float(timeout_s),
            "interface": interface,
            "host": host,
            "chunk_bytes": int(chunk_bytes),
            "stage_below": int(stage_below),
            "ring": int(ring),
            "threads": int(threads),
        }
        self._start_timeout_s = float(start_timeout_s)
        self._check_wait_s = float(check_wait_s)
        self._context = multiprocessing.get_context("spawn")
        self._agents: list[TorchAgent] = []
        self._idle: list[_WorkerProcess] = []
        self._max_idle = max(max_idle, prestart)
        self._lock = threading.Lock()
        self._prestart(prestart)

    @property
    def name(self) -> str:
        """``"torch"``."""
        return "torch"

    @property
    def capabilities(self) -> Capabilities:
        """READ and WRITE, notifications, agents in separate processes."""
        return CAPABILITIES

    @property
    def timeout_s(self) -> float:
        """The bound on pairing, each transfer, and each call to a worker."""
        return float(self._options["timeout_s"])

    def _spawn(self, name: str) -> _WorkerProcess:
        parent, child = self._context.Pipe(duplex=True)
        events, events_child = self._context.Pipe(duplex=False)
        logs, logs_child = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_worker_entry,
            args=(child, events_child, name, self._options, logs_child),
            name=f"kvspec-torch-{name}",
            daemon=True,
        )
        process.start()
        child.close()
        events_child.close()
        logs_child.close()
        relay_lines(logs.recv_bytes, source=f"torch worker {process.pid}")
        return _WorkerProcess(process=process, conn=parent, events=events)

    def _prestart(self, count: int) -> None:
        """Start ``count`` workers now and wait until they are ready, so the first agents start warm."""
        spawned = [self._spawn("idle") for _ in range(count)]
        try:
            for worker in spawned:
                worker.wait_ready(self._start_timeout_s)
        except TransportError:
            for worker in spawned:
                _kill(worker.process)
            raise
        self._idle.extend(spawned)

    def create_agent(self, name: str) -> TorchAgent:
        """An agent named ``name`` in its own process: an idle worker if one is kept, else a new one.

        A new process starts in the background; the agent's first call waits for it.
        """
        with self._lock:
            reused = self._idle.pop() if self._idle else None
        agent = TorchAgent(
            name=name,
            worker=reused or self._spawn(name),
            start_timeout_s=self._start_timeout_s,
            call_timeout_s=self.timeout_s + _PIPE_SLACK_S,
            check_wait_s=self._check_wait_s,
            recycle=self._recycle,
        )
        if reused is not None:
            reused.generation = agent._call("rename", name)
        with self._lock:
            self._agents.append(agent)
        return agent

    def _recycle(self, agent: TorchAgent, worker: _WorkerProcess) -> bool:
        """Keep a reset worker for the next agent; False when the backend has enough idle ones."""
        with self._lock:
            if agent in self._agents:
                self._agents.remove(agent)
            if len(self._idle) >= self._max_idle:
                return False
            self._idle.append(worker)
            return True

    def close(self) -> None:
        """Close every agent this backend started and end every worker process."""
        with self._lock:
            agents, self._agents = self._agents, []
            self._max_idle = 0
        for agent in agents:
            agent.close()
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            _stop(worker.process, worker.conn)
            worker.events.close()


@attrs.define(kw_only=True)
class _WorkerProcess:
    """One worker process and the parent's end of its pipe; outlives the agents it serves."""

    process: BaseProcess
    conn: Connection
    events: Connection
    generation: int = 0
    torch_version: str | None = None
    startup_s: float | None = None

    def wait_ready(self, timeout_s: float) -> None:
        """Take the worker's ``ready`` message (once); raises TransportError if it never comes."""
        if self.torch_version is not None:
            return
        if not self.conn.poll(timeout_s):
            raise TransportError(f"torch worker did not start within {timeout_s} s")
        try:
            _, _, self.torch_version, self.startup_s = self.conn.recv()
        except (EOFError, OSError):
            raise TransportError(f"torch worker exited during start-up (exit code {self.process.exitcode})") from None


class TorchAgent:
    """Proxy for one worker process; implements :class:`kvspec.transport.Transport`."""

    def __init__(
        self,
        *,
        name: str,
        worker: _WorkerProcess,
        start_timeout_s: float,
        call_timeout_s: float,
        check_wait_s: float,
        recycle: Callable[[TorchAgent, _WorkerProcess], bool] | None = None,
    ) -> None:
        self._name = name
        self._recycle = recycle
        self._worker = worker
        self._process = worker.process
        self._conn = worker.conn
        self._events = worker.events
        self._events_lock = threading.Lock()
        self._events_dead = False
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = call_timeout_s
        self._check_wait_s = check_wait_s
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._local_sizes: list[int] = []
        self._peer_sizes: dict[str, list[int]] = {}
        self._peer_pids: dict[str, int] = {}
        self._handles: dict[int, TransferHandle] = {}
        self._started: set[int] = set()
        self._status: dict[int, TransferStatus] = {}  # final states from the worker's events
        self._reported: set[int] = set()  # transfers check has answered DONE for
        self._last_check: dict[int, float] = {}
        self._inbox: list[Notification] = []

    def __repr__(self) -> str:
        return f"TorchAgent(name={self._name!r}, pid={self.pid})"

    # ------------------------------------------------------------------- process

    @property
    def name(self) -> str:
        """This agent's name."""
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        """Same as the backend's."""
        return CAPABILITIES

    @property
    def pid(self) -> int:
        """The worker process id (tests assert the two endpoints differ)."""
        pid = self._process.pid
        if pid is None:
            raise TransportError(f"agent {self._name!r}: worker process was never started")
        return pid

    def peer_pid(self, peer: str) -> int:
        """The process id of a peer added with :meth:`add_remote_agent`."""
        try:
            return self._peer_pids[peer]
        except KeyError:
            raise unknown_peer_error(self._name, peer) from None

    @property
    def alive(self) -> bool:
        """Whether the worker process is still running."""
        return self._process.is_alive()

    @property
    def torch_version(self) -> str | None:
        """``torch.__version__`` in the worker, once it has started."""
        return self._worker.torch_version

    @property
    def startup_s(self) -> float | None:
        """Seconds the worker took to set up after importing torch."""
        return self._worker.startup_s

    def _wait_started(self) -> None:
        try:
            self._worker.wait_ready(self._start_timeout_s)
        except TransportError as exc:
            self._break(str(exc))

    def _break(self, why: str) -> Any:
        self._broken = f"agent {self._name!r}: {why}"
        raise TransportError(self._broken, reason=FailureReason.TRANSFER_ERROR)

    def _call(self, op: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One request, one reply; raises TransportError if the worker is gone or silent."""
        if self._closed:
            raise closed_agent_error(self._name)
        if self._broken is not None:
            raise TransportError(self._broken, reason=FailureReason.TRANSFER_ERROR)
        with self._lock:
            self._wait_started()
            try:
                self._conn.send((op, *args))
                if not self._conn.poll(self._call_timeout_s if timeout_s is None else timeout_s):
                    self._break(f"worker did not answer {op!r} within the timeout")
                reply = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                self._break(f"worker process died (exit code {self._process.exitcode})")
        if reply[0] == "ok":
            return reply[1]
        # A _Failure carries its reason; any other worker error is a refused post.
        raise decode_error(reply[1], where=f"agent {self._name!r}", default_reason=FailureReason.POST_FAILED)

    def call_in_worker(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``fn(worker, *args)`` in the worker process (benchmarks and tests; ``fn`` must pickle)."""
        return self._call("call", fn, args, timeout_s=timeout_s)

    # ------------------------------------------------------------------- Transport

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Attach each region's shared memory in the worker; regions must carry ``shm_name``."""
        names: list[str] = []
        for index, region in enumerate(regions):
            if region.shm_name is None:
                raise ConfigError(
                    f"torch backend: region {index} has no shm_name; agents live in other processes, "
                    "so register multiprocessing.shared_memory regions (kvspec.testing.allocate_pool)"
                )
            names.append(region.shm_name)
        sizes = [region.nbytes for region in regions]
        self._call("register", names, sizes)
        self._local_sizes.extend(sizes)

    def get_agent_metadata(self) -> bytes:
        """JSON naming the worker's control address, its public DH value and nonce (no secret), and region sizes."""
        metadata: bytes = self._call("metadata")
        return metadata

    def add_remote_agent(self, metadata: bytes) -> str:
        """Pair with the peer's worker (control connections and a process group); returns its name."""
        try:
            meta = json.loads(metadata)
            sizes = [int(n) for n in meta["regions"]]
            pid = int(meta["pid"])
            parse_public(meta["dh"], "metadata.dh")
            parse_nonce(meta["nonce"], "metadata.nonce")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise unreadable_metadata_error(self._name, f"not torch-backend agent metadata: {exc}") from None
        name: str = self._call("add_peer", metadata)
        self._peer_sizes[name] = sizes
        self._peer_pids[name] = pid
        return name

    def remove_remote_agent(self, peer: str) -> None:
        """Forget ``peer``; its transfers not yet seen DONE by ``check`` end FAILED ``peer_disconnected``."""
        self._call("remove_peer", peer)
        self._peer_sizes.pop(peer, None)
        self._peer_pids.pop(peer, None)
        self._drain()
        for xid, handle in self._handles.items():
            if handle.peer == peer and xid not in self._reported:
                failed = self._status.get(xid)
                if failed is None or failed.state is not TransferState.FAILED:
                    self._status[xid] = TransferStatus(
                        state=TransferState.FAILED,
                        reason=FailureReason.PEER_DISCONNECTED,
                        detail=f"peer {peer!r} was removed",
                    )

    def post(
        self,
        mode: TransferMode,
        descriptors: Sequence[Descriptor],
        *,
        peer: str,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Validate every descriptor (PLAN-1), coalesce adjacent ones, start the transfer in the worker."""
        if not isinstance(mode, TransferMode):
            raise PlanError(f"post: expected a TransferMode, got {mode!r}")
        if self._closed:
            raise closed_agent_error(self._name)
        if peer not in self._peer_sizes:
            raise unknown_peer_error(self._name, peer)
        table = check_descriptors(descriptors, local_sizes=self._local_sizes, remote_sizes=self._peer_sizes[peer])
        # Fewer, larger runs mean fewer gloo messages.
        runs = list(zip(*merge_columns(*(table.column(name) for name in _COLUMNS)), strict=True))
        xid: int = self._call("post", mode.value, runs, peer, notification)
        handle = TransferHandle(transfer_id=xid, peer=peer, mode=mode)
        self._handles[xid] = handle
        return handle

    def _own(self, handle: TransferHandle) -> int:
        if self._handles.get(handle.transfer_id) is not handle:
            raise unknown_handle_error(self._name, handle.transfer_id)
        return handle.transfer_id

    def _drain(self, wait_s: float = 0.0) -> None:
        """Apply the worker's events (transfer outcomes, notifications), waiting up to ``wait_s`` for one."""
        with self._events_lock:
            timeout = wait_s
            while not self._events_dead:
                try:
                    if not self._events.poll(timeout):
                        return
                    event = self._events.recv()
                except (EOFError, OSError):
                    self._events_dead = True
                    return
                timeout = 0.0
                kind, generation = event[0], event[1]
                if generation != self._worker.generation:
                    continue  # addressed to an earlier agent served by the same process
                if kind == "state":
                    _, _, xid, state, reason, detail = event
                    if xid in self._handles and xid not in self._reported:
                        self._status[xid] = TransferStatus(
                            state=_STATES[state],
                            reason=None if reason is None else FailureReason(reason),
                            detail=detail,
                        )
                elif kind == "notif":
                    self._inbox.append(Notification(peer=event[2], message=event[3]))

    def _worker_gone(self, detail: str) -> TransferStatus:
        # This agent's own worker is gone: its transfers can only have failed.
        return TransferStatus(state=TransferState.FAILED, reason=FailureReason.TRANSFER_ERROR, detail=detail)

    def check(self, handle: TransferHandle) -> TransferStatus:
        """Where the transfer stands; FAILED when the peer died or the timeout passed (FAIL-1).

        The first check starts the transfer and answers PENDING; later ones read
        the outcomes the worker pushes, without a round trip.
        """
        if self._closed:
            raise closed_agent_error(self._name)
        xid = self._own(handle)
        if xid not in self._started:
            self._started.add(xid)
            try:
                self._call("start", xid)
            except TransportError as exc:
                if self._broken is None:
                    raise
                return self._worker_gone(str(exc))
            self._drain()
            status = self._status.get(xid)
            return status if status is not None and status.state is TransferState.FAILED else _PENDING
        # Polled again right away: wait a little for an event instead of spinning a core.
        tight = time.monotonic() - self._last_check.get(xid, 0.0) < self._check_wait_s
        self._drain(self._check_wait_s if tight and xid not in self._status else 0.0)
        self._last_check[xid] = time.monotonic()
        status = self._status.get(xid)
        if status is None:
            if self._events_dead or not self._process.is_alive():
                self._broken = self._broken or f"agent {self._name!r}: worker process died"
                return self._worker_gone(self._broken)
            return _PENDING
        if status.state is TransferState.DONE:
            self._reported.add(xid)
        return status

    def release(self, handle: TransferHandle) -> None:
        """Forget the handle. A READ still in flight is waited for (bounded), so no byte lands afterwards."""
        xid = self._own(handle)
        del self._handles[xid]
        for table in (self._status, self._last_check):
            table.pop(xid, None)
        self._started.discard(xid)
        self._reported.discard(xid)
        if self._broken is None and not self._closed:
            self._call("release", xid)

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send ``message`` over the control connection to ``peer``."""
        if self._closed:
            raise closed_agent_error(self._name)
        if peer not in self._peer_sizes:
            raise unknown_peer_error(self._name, peer)
        self._call("notify", peer, bytes(message))

    def get_notifications(self) -> list[Notification]:
        """What peers sent, in arrival order (pushed by the worker as it arrives; no round trip)."""
        if self._closed:
            raise closed_agent_error(self._name)
        self._drain()
        drained, self._inbox = self._inbox, []
        return drained

    def close(self) -> None:
        """End the agent: its worker is reset for reuse by the backend, or stopped. Idempotent.

        Its peers see it disconnect; later calls on this object raise TransportError.
        """
        if self._closed:
            return
        healthy = self._broken is None and self._process.is_alive()
        if healthy and self._recycle is not None:
            try:
                self._call("reset")
            except TransportError:
                healthy = False
            else:
                self._closed = True
                if self._recycle(self, self._worker):
                    return
        self._closed = True
        if healthy:
            _stop(self._process, self._conn)
        else:
            self._conn.close()
            _kill(self._process)


def _stop(process: BaseProcess, conn: Connection) -> None:
    """Ask a worker to exit, then make sure it did."""
    with contextlib.suppress(OSError, EOFError):
        conn.send(("close",))
        if conn.poll(5.0):
            conn.recv()
    conn.close()
    process.join(5.0)
    _kill(process)


def _kill(process: BaseProcess) -> None:
    """End a worker for sure (its rendezvous lives in the process: nothing is left on disk)."""
    if process.is_alive():
        process.kill()
    process.join(5.0)
