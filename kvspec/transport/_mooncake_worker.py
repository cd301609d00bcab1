"""The process behind one Mooncake agent: owns a Transfer Engine and serves its proxy over a pipe.

Theory of operation (docs/backends/mooncake.md, How it is built):

* The parent (:mod:`kvspec.transport.mooncake`) starts ``python -m
  kvspec.transport._mooncake_worker FD NAME`` and talks to it exactly as to a
  NIXL worker: the pipe protocol, the request loop and the start/retire cycle
  are :mod:`kvspec.transport._nixl_worker`'s (``main`` with this module's
  :class:`Worker`).
* The engine runs in P2P handshake mode over TCP (``initialize(host,
  "P2PHANDSHAKE", "tcp", "")``, no etcd); a peer is reached by its session
  name ``host:rpc_port``, which travels in the metadata.
* ``post`` submits one asynchronous batch (``batch_transfer_async_read`` or
  ``_write``, one entry per merged run) and hands its id to a waiter thread,
  which calls ``get_batch_transfer_status`` (it spins, with the GIL released,
  until every task of the batch ended). ``transfer_check_status`` is never
  used: it looks at task 0 only and reports a batch done with most of it
  still in flight (docs/backends/mooncake.md, Traps).
* The engine has no cancel: a released transfer keeps running, a removed peer's
  transfers are drained before they are reported FAILED, and ``close`` drains
  every batch before it unmaps memory (SM-2).
* One engine per process: the backend never reuses a worker (a second engine
  in a process stalls its transfers), so ``close`` is the process's last request.
* A notification is a zero-length ``transfer_sync`` carrying a
  ``TransferNotify(agent name, message)``, sent after the batch ended, so it
  arrives after the data (DONE-1). Messages travel as latin-1 strings.
* Errors are return codes: a submit that returns 0, a status of -1, a sync
  call that returns non-zero. After a -1 the worker probes the peer
  (``send_probe``): unreachable means ``peer_disconnected``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from typing import Any

from kvspec.core._descriptors import merge_columns
from kvspec.transport import _nixl_worker
from kvspec.transport._nixl_worker import CONFIG, TRANSPORT, RequestError, handle, unpack_columns

__all__ = ["METADATA_MAGIC", "Worker", "handle", "main", "pack_metadata", "unpack_metadata"]

METADATA_MAGIC = b"KVSPEC-MOONCAKE\x01"
# A notification names its sender and carries the message; both are short (the engine sends them in one frame).
MAX_NOTIFICATION = 1 << 16
_MAILBOX = 64  # bytes of the private buffer registered so a zero-length notify has a valid address


def pack_metadata(name: str, regions: list[tuple[int, int]], session: str, mailbox: int) -> bytes:
    """The agent's name, regions, engine session name and mailbox address, under Mooncake's magic."""
    engine = json.dumps({"session": session, "mailbox": mailbox}).encode()
    return _nixl_worker.pack_metadata(name, regions, engine, magic=METADATA_MAGIC)


def unpack_metadata(blob: bytes) -> tuple[str, list[tuple[int, int]], bytes]:
    """Inverse of :func:`pack_metadata` (the engine part still packed); ``RequestError`` on foreign bytes."""
    return _nixl_worker.unpack_metadata(blob, magic=METADATA_MAGIC)


def _engine_part(name: str, packed: bytes) -> tuple[str, int]:
    try:
        engine = json.loads(packed)
        return str(engine["session"]), int(engine["mailbox"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RequestError(TRANSPORT, f"unreadable metadata of peer {name!r} ({exc!r})", "protocol") from None


class _Batch:
    """One posted transfer: the engine's batch id and what the waiter thread found."""

    __slots__ = ("batch", "checked", "detail", "done", "notification", "peer", "posted_at", "reason", "state")

    def __init__(self, batch: int, peer: str, notification: bytes | None) -> None:
        self.batch = batch
        self.peer = peer
        self.notification = notification
        self.posted_at = time.monotonic()
        self.state = "pending"  # "pending" | "done" | "failed"; written once, by the waiter thread
        self.reason: str | None = None
        self.detail = ""
        self.done = threading.Event()
        self.checked = False  # the first check answers at once (observable_in_flight)

    def status(self) -> tuple[str, str | None, str]:
        return self.state, self.reason, self.detail


class Worker:
    """The Transfer Engine, its registrations and the batches the proxy's requests refer to."""

    label = "Mooncake"

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        import numpy as np
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        self.np = np
        self.notify_class = TransferNotify
        self.write_op = TransferOpcode.Write  # not WRITE: the wheel's names differ from the engine's docs (Traps)
        self.name = name
        self.host = str(options.get("host", "127.0.0.1"))
        self.transfer_timeout: float | None = options.get("transfer_timeout")
        self.poll_interval: float = float(options.get("poll_interval", 0.0005))
        self.check_wait: float = float(options.get("check_wait", 0.002))
        # Only the mutant in tests/mutants.py sets this: it trusts transfer_check_status, which is wrong.
        self.trust_check_status = bool(options.get("trust_check_status", False))
        self.engine = TransferEngine()
        code = self.engine.initialize(self.host, "P2PHANDSHAKE", "tcp", "")
        if code != 0:
            raise RuntimeError(f"TransferEngine.initialize({self.host!r}, 'P2PHANDSHAKE', 'tcp', '') returned {code}")
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self.mailbox = np.zeros(_MAILBOX, dtype=np.uint8)
        self._register(int(self.mailbox.ctypes.data), _MAILBOX)
        self.shms: list[Any] = []
        self.views: list[Any] = []
        self.region_base = np.zeros(0, dtype=np.int64)
        self.region_size = np.zeros(0, dtype=np.int64)
        self.peers: dict[str, tuple[bytes, Any, Any, str, int]] = {}  # name -> (blob, bases, sizes, session, mailbox)
        self.xfers: dict[int, _Batch] = {}
        self.notifs: list[tuple[str, bytes]] = []
        self.waiting: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self.waiter = threading.Thread(target=self._wait_all, name=f"mooncake-waiter-{name}", daemon=True)
        self.waiter.start()
        self.ops: dict[str, Any] = {
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

    def _register(self, address: int, nbytes: int) -> None:
        code = self.engine.register_memory(address, nbytes)
        if code != 0:
            raise RequestError(TRANSPORT, f"TransferEngine.register_memory({nbytes} bytes) returned {code}")

    def register(self, regions: list[tuple[str, int]]) -> None:
        np = self.np
        for shm_name, nbytes in regions:
            shm = _nixl_worker._Shm(shm_name, nbytes)
            view = np.frombuffer(shm.map, dtype=np.uint8, count=nbytes)
            self.shms.append(shm)
            self.views.append(view)
            self._register(int(view.ctypes.data), nbytes)
        self.region_base = np.array([int(v.ctypes.data) for v in self.views], dtype=np.int64)
        self.region_size = np.array([int(v.nbytes) for v in self.views], dtype=np.int64)

    def metadata(self) -> bytes:
        regions = [(int(a), int(n)) for a, n in zip(self.region_base, self.region_size, strict=True)]
        return pack_metadata(self.name, regions, self.session, int(self.mailbox.ctypes.data))

    def add_peer(self, blob: bytes) -> str:
        name, regions, engine = unpack_metadata(blob)
        known = self.peers.get(name)
        if known is not None:
            if known[0] == blob:
                return name  # idempotent for the same bytes
            raise RequestError(
                TRANSPORT,
                f"peer {name!r} is already loaded with other metadata (a restarted agent?): "
                "call remove_remote_agent first",
                "protocol",
            )
        session, mailbox = _engine_part(name, engine)
        np = self.np
        bases = np.array([a for a, _ in regions], dtype=np.int64)
        sizes = np.array([n for _, n in regions], dtype=np.int64)
        self.peers[name] = (blob, bases, sizes, session, mailbox)
        return name

    def remove_peer(self, name: str) -> None:
        if self.peers.pop(name, None) is None:
            return
        # No cancel in the engine: drain the peer's batches, then report them FAILED, so nothing
        # lands after FAILED is reported (SM-2).
        for xfer in self.xfers.values():
            if xfer.peer == name and xfer.state == "pending":
                xfer.done.wait()  # bounded by the engine's own timeout (MC_TRANSFER_TIMEOUT)
                xfer.state, xfer.reason = "failed", "peer_disconnected"
                xfer.detail = f"peer {name!r} was removed while the transfer was in flight (drained first)"

    def _peer(self, name: str) -> tuple[bytes, Any, Any, str, int]:
        peer = self.peers.get(name)
        if peer is None:
            raise RequestError(
                TRANSPORT,
                f"agent {self.name!r}: unknown or disconnected peer {name!r} (add_remote_agent first)",
                "peer_disconnected",
            )
        return peer

    # -- transfers

    def post(
        self,
        xfer_id: int,
        mode: str,
        packed: bytes | memoryview,
        peer: str,
        notification: bytes | None,
        block: int = 0,
    ) -> tuple[str, str | None, str]:
        """Submit the request ``xfer_id`` as one asynchronous batch; a waiter thread watches it.

        ``block`` (every descriptor's size when they are all equal) is unused:
        the engine takes merged runs.
        """
        _, bases, _, session, _ = self._peer(peer)
        if not packed:
            # Nothing to move; the engine rejects an empty batch, so only the notification travels.
            if notification is not None:
                self.notify(peer, notification)
            return ("done", None, "")
        # The proxy checked every row against both region tables (PLAN-1): over TCP the engine
        # does not check the local side at all (docs/backends/mooncake.md, Traps), so that check is the only one.
        lr, lo, rr, ro, n = merge_columns(*unpack_columns(self.np, packed))
        local = (self.region_base[lr] + lo).tolist()
        remote = (bases[rr] + ro).tolist()
        submit = self.engine.batch_transfer_async_read if mode == "READ" else self.engine.batch_transfer_async_write
        batch = submit(session, local, remote, n.tolist())
        if batch == 0:
            reason, why = self._why_failed(session)
            raise RequestError(TRANSPORT, f"the engine refused the batch (batch id 0): {why}", reason)
        xfer = _Batch(batch, peer, notification)
        self.xfers[xfer_id] = xfer
        self.waiting.put(xfer)
        return ("pending", None, "")

    def _why_failed(self, session: str) -> tuple[str, str]:
        """After a failure code: ``peer_disconnected`` when the peer does not answer a probe."""
        code = self.engine.send_probe(session)
        if code != 0:
            return "peer_disconnected", f"peer session {session} does not answer (send_probe returned {code})"
        return "transfer_error", f"peer session {session} answers, so the engine failed the request itself"

    def _wait_all(self) -> None:
        """The waiter thread: end each submitted batch in turn (``None`` stops it)."""
        while (xfer := self.waiting.get()) is not None:
            try:
                self._wait(xfer)
            except Exception as exc:  # never let the thread die with a batch unreported
                xfer.state, xfer.reason, xfer.detail = "failed", "transfer_error", f"waiter: {exc!r}"
            finally:
                xfer.done.set()

    def _wait(self, xfer: _Batch) -> None:
        if self.trust_check_status:
            # The trap, kept for the mutant: task 0 done is taken for the whole batch done.
            while (code := self.engine.transfer_check_status(xfer.batch)) == 0:
                time.sleep(0.0001)
            code = 0 if code == 1 else -1
        else:
            code = self.engine.get_batch_transfer_status([xfer.batch])
        session = self.peers.get(xfer.peer, (b"", None, None, "", 0))[3]
        if code != 0:
            reason, why = self._why_failed(session) if session else ("peer_disconnected", "peer removed")
            waited = time.monotonic() - xfer.posted_at
            if reason == "transfer_error" and self.transfer_timeout is not None and waited >= self.transfer_timeout:
                reason = "timeout"
            xfer.state, xfer.reason = "failed", reason
            xfer.detail = f"get_batch_transfer_status returned {code} after {waited:.3f} s; {why}"
            return
        if xfer.notification is not None and session:
            try:
                self._send_notify(session, self.peers[xfer.peer][4], xfer.notification)
            except RequestError as exc:
                xfer.state, xfer.reason, xfer.detail = "failed", exc.reason, str(exc)
                return
        xfer.state = "done"

    def check(self, xfer_id: int) -> tuple[str, str | None, str]:
        xfer = self.xfers.get(xfer_id)
        if xfer is None:
            raise RequestError(TRANSPORT, f"agent {self.name!r}: unknown or released handle {xfer_id}")
        # From the second check on, wait a moment for the waiter thread rather than answer PENDING at once:
        # one pipe round trip per check costs the caller more than the short wait (benchmarks/bench_mooncake.py).
        # The first check answers at once, so a transfer in flight is seen PENDING (observable_in_flight).
        if xfer.checked:
            xfer.done.wait(self.check_wait)
        xfer.checked = True
        status = xfer.status()
        if status[0] != "pending":
            del self.xfers[xfer_id]  # the proxy keeps the final status
        return status

    def release(self, xfer_id: int) -> None:
        # No cancel: a pending batch keeps running; the waiter still ends it, and close drains it.
        self.xfers.pop(xfer_id, None)

    # -- notifications

    def _send_notify(self, session: str, mailbox: int, message: bytes) -> None:
        if len(message) > MAX_NOTIFICATION:
            raise RequestError(CONFIG, f"notification: expected at most {MAX_NOTIFICATION} bytes, got {len(message)}")
        notify = self.notify_class(self.name, bytes(message).decode("latin-1"))
        address = int(self.mailbox.ctypes.data)
        code = self.engine.transfer_sync(session, address, mailbox, 0, self.write_op, notify)
        if code != 0:
            reason, why = self._why_failed(session)
            raise RequestError(TRANSPORT, f"transfer_sync (notification) returned {code}: {why}", reason)

    def notify(self, peer: str, message: bytes) -> None:
        _, _, _, session, mailbox = self._peer(peer)
        self._send_notify(session, mailbox, message)

    def poll(self) -> None:
        """Collect notifications; called whenever the proxy is quiet."""
        for notify in self.engine.get_notifies():
            message = notify.msg.encode("latin-1", errors="replace")[:MAX_NOTIFICATION]
            self.notifs.append((str(notify.name)[:256], message))

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        self.poll()
        drained, self.notifs = self.notifs, []
        return drained

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "session": self.session,
            "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
        }

    def close(self) -> None:
        """Drain every batch (the engine cannot cancel one), then unregister and unmap the memory."""
        self.waiting.put(None)
        self.waiter.join()
        self.xfers.clear()
        for address in self.region_base.tolist():  # addresses, not views: a view left bound keeps its map open
            with contextlib.suppress(Exception):
                self.engine.unregister_memory(address)
        with contextlib.suppress(Exception):
            self.engine.unregister_memory(int(self.mailbox.ctypes.data))
        self.views.clear()
        for shm in self.shms:
            shm.map.close()
        self.shms.clear()
        self.peers.clear()


def main(argv: list[str] | None = None, extra_ops: dict[str, Any] | None = None) -> None:
    """Entry point: ``python -m kvspec.transport._mooncake_worker FD NAME`` (the NIXL worker's loop).

    The engine's modules load first, so that a spare worker (``NAME`` ``-``)
    has them loaded when its start request comes; a failed import is reported
    by :class:`Worker` as the backend being unavailable.
    """
    with contextlib.suppress(ImportError):
        import mooncake.engine  # noqa: F401
        import numpy  # noqa: F401
    _nixl_worker.main(argv, extra_ops, worker_class=Worker)


if __name__ == "__main__":
    main()
