"""The process behind one NIXL agent: owns a ``nixl_agent`` and serves its proxy over a pipe.

Theory of operation (docs/backends/nixl.md, How it is built):

* The parent (:mod:`kvspec.transport.nixl`) starts ``python -m
  kvspec.transport._nixl_worker FD NAME`` with ``UCX_NET_DEVICES=lo`` (and
  ``UCX_TLS=tcp`` in tcp mode) and talks to it over one end of a socket pair,
  ``FD``, with pickled ``(op, *args)`` requests and ``("ok", value)`` /
  ``("err", error)`` replies, ``error`` a :func:`kvspec.core._errors.encode_error` dict.
* The agent runs with its progress thread off (the library default spins a
  whole core); while no request is waiting, the loop calls
  ``get_new_notifs()`` every ``poll_interval`` seconds, because an agent that
  never calls into NIXL stalls its peer's first transfer (the wire-up never
  completes) and never collects notifications.
* Memory is the parent's ``multiprocessing.shared_memory`` blocks, attached by
  name with ``mmap`` (not ``SharedMemory``, whose resource tracker would unlink
  the parent's blocks when this process is killed) and registered as DRAM.
* Metadata is NIXL's own blob wrapped with this agent's name and region table,
  so the initiator can check every descriptor before NIXL sees it; it travels
  through the parents, never through NIXL's listener (which binds 0.0.0.0).
* ``post`` checks every descriptor and creates the NIXL request (prepared
  lists, or merged descriptors through ``initialize_xfer``); the first
  ``check`` calls ``transfer()``, which over CMA does the whole copy.

This module imports nothing from kvspec beyond the package itself; a worker
starts in about the time NIXL's UCX backend takes to initialise (~0.4 s).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvspec.core._descriptors import merge_columns
from kvspec.core._errors import BackendUnavailableError, RequestError, TransportError, encode_error

__all__ = [
    "METADATA_MAGIC",
    "NIXL_MODULES",
    "RequestError",
    "Worker",
    "answer",
    "handle",
    "main",
    "pack_metadata",
    "unpack_columns",
    "unpack_metadata",
]

# Import names of the NIXL Python API, in order of preference (nixl-cu12 wheel first).
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")

METADATA_MAGIC = b"KVSPEC-NIXL\x01"

# Prepared lists cover every block of every region; above this many blocks (both sides together),
# requests fall back to merged initialize_xfer lists (prep of 32768 blocks takes ~3.4 ms).
_MAX_PREPPED = 1 << 18

# Reply kinds the proxy maps onto kvspec errors.
PLAN = "plan"
TRANSPORT = "transport"
CONFIG = "config"
UNAVAILABLE = "unavailable"


def pack_metadata(
    name: str, regions: list[tuple[int, int]], nixl_metadata: bytes, *, magic: bytes = METADATA_MAGIC
) -> bytes:
    """Wrap NIXL's metadata (or another engine's, under its own ``magic``) with the agent's name and regions."""
    header = json.dumps({"name": name, "regions": regions, "pid": os.getpid()}).encode()
    return magic + struct.pack("<I", len(header)) + header + nixl_metadata


def unpack_metadata(blob: bytes, *, magic: bytes = METADATA_MAGIC) -> tuple[str, list[tuple[int, int]], bytes]:
    """Inverse of :func:`pack_metadata`; raises ``RequestError`` on foreign bytes."""
    start = len(magic)
    if not blob.startswith(magic) or len(blob) < start + 4:
        engine = magic[len(b"KVSPEC-") : -1].decode(errors="replace")
        raise RequestError(TRANSPORT, f"peer metadata is not from a kvspec {engine} agent", "protocol")
    (size,) = struct.unpack_from("<I", blob, start)
    try:
        header = json.loads(blob[start + 4 : start + 4 + size])
        name = str(header["name"])
        regions = [(int(a), int(n)) for a, n in header["regions"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise RequestError(TRANSPORT, f"unreadable peer metadata ({exc!r})", "protocol") from None
    return name, regions, bytes(blob[start + 4 + size :])


def unpack_columns(np: Any, packed: bytes | memoryview) -> Any:
    """A 5 x N int64 array: ``local_region, local_offset, remote_region, remote_offset, nbytes`` rows."""
    return np.frombuffer(packed, dtype="<i8").reshape(5, -1)


def _import_nixl() -> tuple[Any, Any]:
    """The NIXL API module and its bindings (which hold the exception classes)."""
    errors = []
    for module_name in NIXL_MODULES:
        try:
            api = importlib.import_module(module_name)
            bindings = importlib.import_module(f"{module_name}._bindings")
        except ImportError as exc:
            errors.append(f"{module_name}: {exc}")
            continue
        return api, bindings
    raise ImportError("; ".join(errors))


class _Shm:
    """One attached shared-memory block, mapped without a resource tracker."""

    def __init__(self, shm_name: str, nbytes: int) -> None:
        import _posixshmem  # type: ignore[import-not-found]  # the primitive SharedMemory uses, minus its tracker

        fd = _posixshmem.shm_open("/" + shm_name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise RequestError(CONFIG, f"shared memory {shm_name!r} has {size} bytes, region needs {nbytes}")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)


class _Xfer:
    """One posted transfer as the worker tracks it."""

    __slots__ = ("detail", "handle", "peer", "posted_at", "reason", "started", "state")

    def __init__(self, handle: Any, peer: str, state: str, reason: str | None = None, detail: str = "") -> None:
        self.handle = handle
        self.peer = peer
        self.posted_at = time.monotonic()
        self.state = state  # "pending" | "done" | "failed"
        self.started = False  # transfer() called (at the first check)
        self.reason = reason
        self.detail = detail

    def status(self) -> tuple[str, str | None, str]:
        return self.state, self.reason, self.detail


class Worker:
    """The NIXL agent and the tables the proxy's requests refer to."""

    label = "NIXL"

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        import numpy as np

        self.np = np
        self.api, self.bindings = _import_nixl()
        self.name = name
        # The UCX settings the agent was created under (in process they are set for that moment only).
        self.ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        self.transfer_timeout: float | None = options.get("transfer_timeout")
        self.poll_interval: float = float(options.get("poll_interval", 0.0005))
        config = self.api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self.agent = self.api.nixl_agent(name, config)
        self.agent.create_backend("UCX", dict(options.get("ucx_params") or {}))
        self.shms: list[_Shm] = []
        self.registrations: list[Any] = []
        self.views: list[Any] = []  # numpy views, kept so addresses stay valid
        self.region_base = np.zeros(0, dtype=np.int64)
        self.region_size = np.zeros(0, dtype=np.int64)
        self.peers: dict[str, tuple[bytes, Any, Any]] = {}  # name -> (metadata, bases, sizes)
        self.xfers: dict[int, _Xfer] = {}
        self.local_lists: dict[int, tuple[Any, Any]] = {}  # block size -> (prepared list, first index per region)
        self.remote_lists: dict[tuple[str, int], tuple[Any, Any]] = {}  # (peer, block size) -> the same
        self.unreleased: list[Any] = []
        self.notifs: list[tuple[str, bytes]] = []
        self.ops: dict[str, Callable[..., Any]] = {
            "register": self.register,
            "metadata": self.metadata,
            "add_peer": self.add_peer,
            "remove_peer": self.remove_peer,
            "post": self.post,
            "check": self.check,
            "release": self.release,
            "notify": self.notify,
            "notifs": self.drain_notifs,
            "info": self.info,
        }

    # -- memory and peers

    def register(self, regions: list[tuple[str, int]]) -> None:
        np = self.np
        descs = []
        for shm_name, nbytes in regions:
            shm = _Shm(shm_name, nbytes)
            view = np.frombuffer(shm.map, dtype=np.uint8, count=nbytes)
            descs.append((int(view.ctypes.data), nbytes, 0, ""))
            self.shms.append(shm)
            self.views.append(view)
        if descs:
            self.registrations.append(self.agent.register_memory(descs, "DRAM"))
        self._drop_lists()
        self.region_base = np.array([int(v.ctypes.data) for v in self.views], dtype=np.int64)
        self.region_size = np.array([int(v.nbytes) for v in self.views], dtype=np.int64)

    def metadata(self) -> bytes:
        regions = [(int(a), int(n)) for a, n in zip(self.region_base, self.region_size, strict=True)]
        return pack_metadata(self.name, regions, self.agent.get_agent_metadata())

    def add_peer(self, blob: bytes) -> str:
        name, regions, nixl_md = unpack_metadata(blob)
        known = self.peers.get(name)
        if known is not None:
            if known[0] == blob:
                return name  # idempotent for the same bytes
            # NIXL refuses new metadata under a loaded name (nixlNotAllowedError) and then
            # forgets the old one; refuse here instead so the loaded peer stays usable.
            raise RequestError(
                TRANSPORT,
                f"peer {name!r} is already loaded with other metadata (a restarted agent?): "
                "call remove_remote_agent first",
                "protocol",
            )
        try:
            loaded = self.agent.add_remote_agent(nixl_md)
        except Exception as exc:
            raise RequestError(TRANSPORT, f"NIXL could not load peer {name!r}: {_describe(exc)}", "protocol") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            raise RequestError(TRANSPORT, f"peer metadata names {name!r} but NIXL loaded {loaded!r}", "protocol")
        np = self.np
        bases = np.array([a for a, _ in regions], dtype=np.int64)
        sizes = np.array([n for _, n in regions], dtype=np.int64)
        self.peers[name] = (blob, bases, sizes)
        return name

    def remove_peer(self, name: str) -> None:
        if self.peers.pop(name, None) is None:
            return
        for xfer in self.xfers.values():
            if xfer.peer == name and xfer.state == "pending":
                # Cancel first, so that nothing lands after FAILED is reported (SM-2).
                xfer.state, xfer.reason = "failed", "peer_disconnected"
                xfer.detail = f"peer {name!r} was removed while the transfer was in flight"
                self._cancel(xfer)
        self._drop_lists(name)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            raise RequestError(TRANSPORT, f"NIXL could not remove peer {name!r}: {_describe(exc)}") from None

    def _peer(self, name: str) -> tuple[bytes, Any, Any]:
        peer = self.peers.get(name)
        if peer is None:
            raise RequestError(
                TRANSPORT,
                f"agent {self.name!r}: unknown or disconnected peer {name!r} (add_remote_agent first)",
                "peer_disconnected",
            )
        return peer

    # -- transfers

    def merged_descs(self, columns: tuple[Any, ...], peer: str) -> tuple[Any, Any]:
        """Nx3 (address, nbytes, device) lists, rows that continue each other on both sides merged."""
        np = self.np
        # initialize_xfer does not merge adjacent rows (docs/backends/nixl.md); the shared merge does (PLAN-1).
        lr, lo, rr, ro, n = merge_columns(*columns)
        zeros = np.zeros(len(n), dtype=np.int64)
        local = np.column_stack((self.region_base[lr] + lo, n, zeros)).astype(np.uint64)
        remote = np.column_stack((self.peers[peer][1][rr] + ro, n, zeros)).astype(np.uint64)
        return local, remote

    def prepped(self, columns: Any, peer: str, size: int) -> tuple[Any, Any, Any, Any] | None:
        """(local list, indices, remote list, indices) when every row is one whole, aligned ``size``-byte block.

        Lists cover every block of every region and are prepared once per
        block size (and peer); NIXL merges adjacent indices itself. This runs
        once per request, on data the last copy has pushed out of the caches,
        so it sticks to two or three whole-array numpy calls.
        """
        np = self.np
        lists = self._lists(peer, size)
        if lists is None:
            return None
        offsets = columns[1::2]  # local and remote offsets, 2 x N
        if size & (size - 1) == 0:
            # Power-of-two blocks: all aligned iff no low bit is set in any offset.
            if int(np.bitwise_or.reduce(offsets, axis=None)) & (size - 1):
                return None
            lidx, ridx = np.right_shift(offsets, size.bit_length() - 1, dtype=np.int32, casting="unsafe")
        else:
            blocks, rest = np.divmod(offsets, size)
            if rest.any():
                return None
            lidx, ridx = blocks.astype(np.int32)
        (local, local_first), (remote, remote_first) = lists
        # Region 0 starts at index 0, so one region needs no lookup of first indexes.
        if len(local_first) > 1:
            lidx = lidx + local_first[columns[0]].astype(np.int32)
        if len(remote_first) > 1:
            ridx = ridx + remote_first[columns[2]].astype(np.int32)
        return local, lidx, remote, ridx

    def _lists(self, peer: str, size: int) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
        """Both prepared lists for ``size``-byte blocks, made on first use; ``None`` when they would be too long."""
        local = self.local_lists.get(size)
        remote = self.remote_lists.get((peer, size))
        if local is not None and remote is not None:
            return local, remote
        remote_base, remote_size = self.peers[peer][1], self.peers[peer][2]
        if int((self.region_size // size).sum()) + int((remote_size // size).sum()) > _MAX_PREPPED:
            return None
        if local is None:
            local = self.local_lists[size] = self._prep("NIXL_INIT_AGENT", self.region_base, self.region_size, size)
        if remote is None:
            remote = self.remote_lists[(peer, size)] = self._prep(peer, remote_base, remote_size, size)
        return local, remote

    def _prep(self, agent_name: str, bases: Any, sizes: Any, size: int) -> tuple[Any, Any]:
        """A prepared list of every ``size``-byte block of every region, and each region's first index."""
        np = self.np
        counts = sizes // size
        first = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(counts)[:-1]))
        rows = np.zeros((int(counts.sum()), 3), dtype=np.uint64)
        for base, count, at in zip(bases, counts, first, strict=True):
            rows[at : at + count, 0] = int(base) + np.arange(count, dtype=np.uint64) * size
        rows[:, 1] = size
        return self.agent.prep_xfer_dlist(agent_name, rows, "DRAM"), first

    def _drop_lists(self, peer: str | None = None) -> None:
        """Release prepared lists: a peer's (it left), or all of them (regions changed)."""
        doomed = [k for k in self.remote_lists if peer is None or k[0] == peer]
        handles = [self.remote_lists.pop(k)[0] for k in doomed]
        if peer is None:
            handles += [h for h, _ in self.local_lists.values()]
            self.local_lists.clear()
        for handle in handles:
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(handle)

    def post(
        self,
        xfer_id: int,
        mode: str,
        packed: bytes | memoryview,
        peer: str,
        notification: bytes | None,
        block: int = 0,
    ) -> tuple[str, str | None, str]:
        """Create the request ``xfer_id`` (the proxy numbers them and sends them with its next call).

        ``block`` is every descriptor's ``nbytes`` when they are all the same
        (from the list's bounds), else 0.
        """
        self._peer(peer)
        if not packed:
            # Nothing to move; NIXL rejects empty lists, so only the notification travels.
            if notification is not None:
                self.notify(peer, notification)
            return ("done", None, "")
        # The proxy checked every row against the same two region tables (PLAN-1) before sending
        # it; NIXL checks again against its registrations, so a row it does not know fails the post.
        columns = unpack_columns(self.np, packed)
        agent = self.agent
        message = notification if notification is not None else b""
        try:
            prepped = self.prepped(columns, peer, block) if block else None
            if prepped is not None:
                handle = agent.make_prepped_xfer(mode, *prepped, message)
            else:
                local, remote = self.merged_descs(columns, peer)
                handle = agent.initialize_xfer(
                    mode, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer, message
                )
        except self.bindings.nixlRemoteDisconnectError as exc:
            raise RequestError(TRANSPORT, f"peer {peer!r} is gone: {_describe(exc)}", "peer_disconnected") from None
        except Exception as exc:
            # Both tables were checked above, so a refusal here (nixlNotFoundError, nixlInvalidParamError)
            # means NIXL's view of the registrations differs from ours.
            raise RequestError(TRANSPORT, f"NIXL refused the request: {_describe(exc)}", "post_failed") from None
        # Nothing moves until the first check (as on loopback): over CMA transfer() does the whole
        # copy and sends the notification, so starting here would leave no moment in which a
        # release (cancel) or a lost peer could still stop the request.
        self.xfers[xfer_id] = _Xfer(handle, peer, "pending")
        return ("pending", None, "")

    def _begin(self, xfer: _Xfer) -> None:
        xfer.started = True
        try:
            state = self.agent.transfer(xfer.handle)
        except Exception as exc:
            # The request was posted, so bytes may have moved: report FAILED, do not raise.
            self._fail_from(xfer, exc)
        else:
            self._apply(xfer, state)

    def _report(self, xfer_id: int, xfer: _Xfer) -> tuple[str, str | None, str]:
        """The status; a transfer that ended is released at once (the proxy keeps its final status)."""
        if xfer.state != "pending":
            self.release(xfer_id)
        return xfer.status()

    def _apply(self, xfer: _Xfer, state: str) -> None:
        if state == "DONE":
            xfer.state = "done"
        elif state != "PROC":
            xfer.state, xfer.reason, xfer.detail = "failed", "transfer_error", f"NIXL reported {state!r}"

    def _fail_from(self, xfer: _Xfer, exc: Exception) -> None:
        if isinstance(exc, self.bindings.nixlRemoteDisconnectError):
            reason, what = "peer_disconnected", f"peer {xfer.peer!r} disconnected"
        else:
            reason, what = "transfer_error", "NIXL transfer failed"
        xfer.state, xfer.reason, xfer.detail = "failed", reason, f"{what}: {_describe(exc)}"

    def _xfer(self, xfer_id: int) -> _Xfer:
        xfer = self.xfers.get(xfer_id)
        if xfer is None:
            raise RequestError(TRANSPORT, f"agent {self.name!r}: unknown or released handle {xfer_id}")
        return xfer

    def check(self, xfer_id: int) -> tuple[str, str | None, str]:
        xfer = self._xfer(xfer_id)
        if xfer.state == "pending" and not xfer.started:
            self._begin(xfer)
        elif xfer.state == "pending":
            try:
                self._apply(xfer, self.agent.check_xfer_state(xfer.handle))
            except Exception as exc:
                self._fail_from(xfer, exc)
        if xfer.state == "pending" and self.transfer_timeout is not None:
            waited = time.monotonic() - xfer.posted_at
            if waited > self.transfer_timeout:
                xfer.state, xfer.reason = "failed", "timeout"
                xfer.detail = f"still in flight after {waited:.1f} s (transfer_timeout={self.transfer_timeout} s)"
        return self._report(xfer_id, xfer)

    def release(self, xfer_id: int) -> None:
        xfer = self.xfers.pop(xfer_id, None)
        if xfer is not None:
            self._cancel(xfer)

    def _cancel(self, xfer: _Xfer) -> None:
        """Release the NIXL request, which cancels it if still active."""
        if xfer.handle is None:
            return
        handle, xfer.handle = xfer.handle, None
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            # NIXL cannot cancel it yet; keep it alive and retry at close (never free live memory).
            self.unreleased.append(handle)

    # -- notifications

    def notify(self, peer: str, message: bytes) -> None:
        self._peer(peer)
        try:
            self.agent.send_notif(peer, message)
        except self.bindings.nixlRemoteDisconnectError as exc:
            raise RequestError(TRANSPORT, f"peer {peer!r} is gone: {_describe(exc)}", "peer_disconnected") from None
        except Exception as exc:
            raise RequestError(TRANSPORT, f"NIXL could not notify {peer!r}: {_describe(exc)}") from None

    def poll(self) -> None:
        """Progress NIXL and collect notifications; called whenever the proxy is quiet."""
        try:
            new = self.agent.get_new_notifs()
        except Exception:
            return  # a broken peer connection; transfers report it through check
        for peer, messages in new.items():
            sender = peer.decode() if isinstance(peer, bytes) else str(peer)
            self.notifs.extend((sender, bytes(m)) for m in messages)

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        self.poll()
        drained, self.notifs = self.notifs, []
        return drained

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "ucx_params": dict(self.agent.get_backend_params("UCX")),
            "env": dict(self.ucx_env),
        }

    def close(self) -> None:
        """Tear the NIXL agent down (handles, peers, registrations) and unmap the shared memory."""
        for xfer in self.xfers.values():
            if xfer.handle is not None:
                self.unreleased.append(xfer.handle)
        self.xfers.clear()
        for handle in self.unreleased:
            # NIXL frees what it cannot cancel with the agent.
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)
        self.unreleased.clear()
        self._drop_lists()
        for peer in list(self.peers):
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(peer)
        self.peers.clear()
        for registration in self.registrations:
            self.agent.deregister_memory(registration)
        self.registrations.clear()
        del self.agent
        self.views.clear()
        for shm in self.shms:
            shm.map.close()
        self.shms.clear()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def answer(worker: Any, op: str, args: list[Any]) -> tuple[Any, ...]:
    """Run one request; ``("ok", value)`` or ``("err", error)`` (:func:`kvspec.core._errors.encode_error`)."""
    try:
        return ("ok", worker.ops[op](*args))
    except RequestError as exc:
        return ("err", encode_error(exc.error()))
    except Exception as exc:  # a bug or an unexpected NIXL error: report it, keep serving
        return ("err", encode_error(TransportError(f"{op} failed in the {worker.label} worker: {_describe(exc)}")))


def handle(worker: Any, request: tuple[Any, ...]) -> tuple[Any, ...]:
    """Answer one request of the proxy (``close`` and ``retire`` excepted).

    ``("batch", [post requests], (op, *args))`` carries the posts the proxy
    queued since its last call, ahead of that call, in one message; the reply
    is ``("batch", [post replies], reply)``.
    """
    op, *args = request
    if op == "batch":
        posts, (inner_op, *inner_args) = args
        post_replies = [answer(worker, post_op, post_args) for post_op, *post_args in posts]
        return ("batch", post_replies, answer(worker, inner_op, inner_args))
    return answer(worker, op, args)


def serve(conn: Connection, worker: Any) -> str:
    """Answer requests until ``close`` or ``retire`` (returned) or until the parent goes away
    (``"eof"``); poll NIXL in between.
    """
    while True:
        if not conn.poll(worker.poll_interval):
            worker.poll()
            continue
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return "eof"  # the parent died: nothing left to serve
        if request[0] in ("close", "retire"):
            return str(request[0])
        reply = handle(worker, request)
        try:
            conn.send(reply)
        except OSError:
            return "eof"


def _start(conn: Connection, name: str, options: dict[str, Any], worker_class: Callable[..., Any]) -> Any:
    """Create the agent and answer the proxy's start request; ``None`` when it could not start."""
    try:
        worker = worker_class(name, options)
    except ImportError as exc:
        conn.send(("err", encode_error(BackendUnavailableError(str(exc)))))
        return None
    except Exception as exc:
        conn.send(("err", encode_error(TransportError(f"could not start agent {name!r}: {_describe(exc)}"))))
        return None
    conn.send(("ok", os.getpid()))
    return worker


def main(
    argv: list[str] | None = None,
    extra_ops: dict[str, Callable[..., Any]] | None = None,
    worker_class: Callable[..., Any] = Worker,
) -> None:
    """Entry point: ``python -m kvspec.transport._nixl_worker FD NAME``; options arrive first on the pipe.

    A retired agent's process waits for ``("start", NAME)`` and runs a fresh
    NIXL agent under that name: starting a process and UCX costs ~0.5 s, a
    further agent in the same process ~20 ms. ``extra_ops`` lets a benchmark
    add requests that run next to the agent. ``worker_class`` makes the
    agent; the Mooncake worker (:mod:`kvspec.transport._mooncake_worker`) passes its own.
    """
    fd_text, name = (sys.argv[1:] if argv is None else argv)[:2]
    conn = Connection(int(fd_text))
    try:
        first = conn.recv()
    except (EOFError, OSError):
        os._exit(0)  # a spare worker whose backend closed before using it
    # A spare (started ahead, named "-") learns its name with its options: ("start", NAME, options).
    options: dict[str, Any] = first[2] if isinstance(first, tuple) else first
    name = first[1] if isinstance(first, tuple) else name
    while (worker := _start(conn, name, options, worker_class)) is not None:
        for op_name, op in (extra_ops or {}).items():
            worker.ops[op_name] = lambda *args, _op=op, _worker=worker: _op(_worker, *args)
        how = serve(conn, worker)
        try:
            worker.close()
        except Exception as exc:
            how = "eof" if how == "eof" else "failed"
            with contextlib.suppress(OSError):
                conn.send(("err", encode_error(TransportError(f"could not tear down agent: {_describe(exc)}"))))
        del worker
        if how in ("eof", "failed"):
            break
        conn.send(("ok", None))
        if how == "close":
            break
        try:
            request = conn.recv()  # retired: idle, with no NIXL agent, until started again or closed
        except (EOFError, OSError):
            break
        if request[0] != "start":
            conn.send(("ok", None))
            break
        name = request[1]
    conn.close()
    # Skip interpreter teardown (UCX objects finalised out of order only produce
    # warnings), but flush C stdio so that UCX_LOG_FILE logs are complete.
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)
    os._exit(0)


if __name__ == "__main__":
    main()
