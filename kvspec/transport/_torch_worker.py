"""The process behind one torch.distributed agent: attaches shared memory and moves bytes over process groups.

Theory of operation (one worker per agent, started by
:class:`kvspec.transport.torch_dist.TorchDistributedBackend`):

- The main thread serves the parent's proxy over a ``multiprocessing`` pipe:
  one request, one reply, never blocked longer than the backend's timeout.
  A second pipe carries events the other way as they happen (a transfer
  ended, a notification arrived), so the proxy answers ``check`` and
  ``get_notifications`` without a round trip. Events carry the worker's
  generation (bumped on ``reset``) so a proxy ignores an earlier life's.
- Every pair of agents shares two control connections on the backend's ``host`` (127.0.0.1 by default; one per
  direction, ``TCP_NODELAY``) and one two-rank process group (gloo by default)
  that rendezvous over those connections (:class:`_ChannelStore`: no
  ``TCPStore``, no listening socket besides the control listener and gloo's
  own). Control messages are framed JSON
  (:mod:`kvspec.transport._wire`, bounded): nothing a peer sends is unpickled.
- A control connection is accepted only from a worker whose metadata this
  worker was given by ``add_remote_agent``: both derive a pair key from their
  ephemeral Diffie-Hellman keys (:mod:`kvspec.transport._pairkey`; the
  metadata carries public values only, a fresh key after ``reset``) and
  prove it to each other before any other frame. Pairing therefore needs
  ``add_remote_agent`` on both sides; until the peer has added this agent,
  ``post`` waits (bounded by the timeout).
- Data moves with ``send``/``recv`` on that group, straight from and into
  views of the shared pools; runs of many small pages are packed into a few
  large messages through a small ring of staging buffers, because gloo's
  cost per message dominates small pages (docs/backends/torch.md, Measured).
- READ: the initiator asks the peer to send, then posts its receives. WRITE:
  the initiator asks the peer to receive, then sends; the peer acknowledges
  once every byte is in its pool, and only then queues the post's
  notification (DONE-1).
- A control connection that closes means the peer process is gone: every
  transfer with that peer becomes FAILED ``peer_disconnected`` (FAIL-1); a
  transfer past its deadline becomes FAILED ``timeout`` and the pair is
  dropped, so late bytes cannot land in blocks reused since.
- A posted transfer starts moving at the proxy's first ``check`` (which
  reports PENDING), so a transfer can always be observed in flight, and
  nothing moves for a request the engine gave up on before polling it.
- ``reset`` returns the process to a blank agent so the backend can hand it
  out again: starting a process and importing torch takes seconds, pairing
  a few milliseconds.
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import itertools
import json
import mmap
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.distributed import ProcessGroupGloo, Store  # type: ignore[attr-defined]  # re-exported at run time

from kvspec.core._errors import encode_error
from kvspec.transport._pairkey import (
    NONCE_BYTES,
    PairKeyError,
    SessionKey,
    connector_mac,
    listener_mac,
    parse_nonce,
    parse_public,
)
from kvspec.transport._wire import WireError, recv_frame, send_frame

__all__ = ["main"]

# (local_region, local_offset, remote_region, remote_offset, nbytes), already validated and coalesced.
Run = tuple[int, int, int, int, int]
# (region, offset, nbytes) on one side.
Span = tuple[int, int, int]

_TAG_MASK = (1 << 30) - 1
_MAX_PAGE_VIEWS = 1 << 17  # per table: 128k views of a region
_MAX_PAGE_TABLES = 16  # distinct (region, page size) tables kept
_DEBUG = bool(os.environ.get("KVSPEC_TORCH_DEBUG"))
# Control frames: before authentication only the small auth frames; after it, span lists ride in the payload.
_PRE_AUTH_HEADER_LIMIT = 1024
_HEADER_LIMIT = 64 << 10
_PAYLOAD_LIMIT = 64 << 20  # ~2.8 million spans of 24 bytes, or one notification
# Connections authenticating at once, all sources together and from one source address. A newcomer beyond
# either bound takes the slot of that source's (or the busiest source's) oldest idle connection, or is closed.
_MAX_PENDING_AUTH = 32
_MAX_PENDING_PER_SOURCE = 4
_FIRST_FRAME_S = 3.0  # a connection without a complete first frame by then is closed (the connector sends at once)
_SPAN = struct.Struct("<QQQ")


def _log(*parts: object) -> None:
    """Trace control events to stderr when ``KVSPEC_TORCH_DEBUG`` is set."""
    if _DEBUG:
        print(f"[kvspec-torch {os.getpid()} {time.monotonic():.4f}]", *parts, file=sys.stderr, flush=True)


def _warn(name: str, text: str) -> None:
    """One line on stderr for what an operator should see (a refused connection, a malformed frame)."""
    print(f"kvspec torch worker {name!r} (pid {os.getpid()}): {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- shared memory


def _attach(shm_name: str, nbytes: int) -> mmap.mmap:
    """Map a ``multiprocessing.shared_memory`` block without registering it with a resource tracker.

    Attaching through ``SharedMemory`` on Python < 3.13 registers the block with
    the tracker, which then unlinks the owner's block when this process exits.
    """
    fd = os.open(os.path.join("/dev/shm", shm_name.lstrip("/")), os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- chunking


def _chunks(spans: Sequence[Span], chunk_bytes: int) -> list[list[Span]]:
    """Group consecutive spans into messages of at most ``chunk_bytes`` (a larger span travels alone).

    Both sides compute the same grouping from the same span list and size.
    """
    chunks: list[list[Span]] = []
    current: list[Span] = []
    size = 0
    for span in spans:
        if current and size + span[2] > chunk_bytes:
            chunks.append(current)
            current, size = [], 0
        current.append(span)
        size += span[2]
    if current:
        chunks.append(current)
    return chunks


# --------------------------------------------------------------------------- state


class _Failure(Exception):
    """A transfer or peer failed; ``reason`` is a ``FailureReason`` value."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class _Peer:
    def __init__(self, meta: dict[str, Any], my_uid: str) -> None:
        self.meta = meta
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.rank = 0 if my_uid < self.uid else 1
        self.peer_rank = 1 - self.rank
        self.out: socket.socket | None = None
        self.out_lock = threading.Lock()
        self.close_lock = threading.Lock()
        self.out_closed = False
        self.connected = threading.Event()  # set once the outgoing connection is up (or closed)
        self.group: Any = None
        self.store: _ChannelStore | None = None  # the rendezvous, kept as long as the group
        self.ready = threading.Event()
        # Set once add_remote_agent may return: the pair is ready, dead, or waits for the peer to add us.
        self.settled = threading.Event()
        self.dead: _Failure | None = None
        self.op_lock = threading.Lock()
        # Each pairing has a session per side; a hello with a new session means the peer re-added us.
        self.session = secrets.token_hex(8)
        self.remote_session: str | None = None

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        try:
            with self.out_lock:
                if self.out is None or self.out_closed:
                    raise _Failure("peer_disconnected", f"no control connection to peer {self.name!r}")
                send_frame(self.out, header, payload)
        except (OSError, EOFError, ValueError) as exc:
            raise _Failure("peer_disconnected", f"peer {self.name!r} is gone: {exc}") from exc

    def attach_out(self, conn: socket.socket) -> None:
        """Adopt the outgoing connection, unless the peer was dropped meanwhile."""
        with self.close_lock:
            if not self.out_closed:
                self.out = conn
                self.connected.set()
                return
        conn.close()
        raise _Failure("peer_disconnected", f"peer {self.name!r} was dropped while connecting")

    def close_out(self) -> None:
        """Close the outgoing connection exactly once, never while a send uses it.

        Two threads closing one descriptor number is the classic bug: the second
        close hits whatever socket reused the number in between. So: shut the
        socket down first (which wakes a send blocked on a stopped peer), then
        close it under the send lock, once.
        """
        with self.close_lock:
            if self.out_closed:
                return
            self.out_closed = True
            self.connected.set()
            out = self.out
        if out is None:
            return
        with contextlib.suppress(OSError, ValueError):
            _shutdown(out.fileno())  # through a duplicate; the original is closed below, once
        with self.out_lock, contextlib.suppress(OSError):
            out.close()


class _Pending:
    """A control connection still authenticating: its source address and how far it got.

    ``stage`` is ``"silent"`` (no complete first frame yet), ``"waiting"`` (a
    first frame from a uid not added here yet: it waits for
    ``add_remote_agent``) or ``"proving"`` (the MAC exchange, short). Silent
    and waiting connections are idle: a newcomer may take their slot.
    """

    def __init__(self, sock: socket.socket, address: tuple[str, int]) -> None:
        self.sock = sock
        self.address = address
        self.source = address[0]
        self.stage = "silent"
        self.evicted = False

    def evict(self) -> None:
        """Wake the thread serving it (it closes the socket: one owner, one close); the caller notifies the lock."""
        self.evicted = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def _victim(pending: Sequence[_Pending], source: str) -> _Pending | None:
    """The connection a newcomer from ``source`` replaces, if any (``pending`` is oldest first).

    Under the per-source bound, that source's oldest silent connection, else
    its oldest waiting one; under the global bound, the same from the source
    holding the most slots, so one source cannot keep the others out. A
    connection proving its key is never replaced.
    """
    count = {p.source: sum(q.source == p.source for q in pending) for p in pending}
    full = count.get(source, 0) >= _MAX_PENDING_PER_SOURCE
    # Else the busiest source first (a stable sort: the one seen first on ties).
    candidates = [source] if full else sorted(count, key=lambda s: -count[s])
    for candidate in candidates:
        for stage in ("silent", "waiting"):
            for entry in pending:
                if entry.source == candidate and entry.stage == stage:
                    return entry
    return None


class _Transfer:
    def __init__(
        self, xid: int, peer: _Peer, mode: str, runs: list[Run], notification: bytes | None, timeout_s: float
    ) -> None:
        self.xid = xid
        self.peer = peer
        self.mode = mode
        self.runs = runs
        self.notification = notification
        self.timeout_s = timeout_s
        self.deadline = 0.0  # set when it starts
        self.started = False
        self.state = "pending"
        self.reason: str | None = None
        self.detail = ""
        self.released = False


class _Worker:
    """All state of one agent's process; methods named ``op_*`` answer the proxy's requests."""

    def __init__(self, name: str, options: dict[str, Any], events: Connection) -> None:
        self.name = name
        self.generation = 0
        self.events: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        threading.Thread(target=self._emit_loop, args=(events,), name="kvspec-events", daemon=True).start()
        self.options = options
        self.timeout_s: float = options["timeout_s"]
        self.chunk_bytes: int = options["chunk_bytes"]
        self.stage_below: int = options["stage_below"]
        self.ring: int = options["ring"]
        self.lock = threading.Condition()
        self.maps: list[mmap.mmap] = []
        self.tensors: list[torch.Tensor] = []
        # (region, page bytes) -> every page-aligned view of that region, built once in C++ by
        # unbind(): a Python-level narrow() per page costs ~2 us, 2 ms per 1000-page request.
        self.page_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.peers: dict[str, _Peer] = {}  # by uid
        # Metadata given by add_remote_agent, by uid: the only workers whose connections are accepted.
        self.authorized: dict[str, dict[str, Any]] = {}
        self.pair_keys: dict[str, bytes] = {}
        self.pending: list[_Pending] = []  # connections authenticating, oldest first
        self.transfers: dict[int, _Transfer] = {}
        self.counter = itertools.count(1)
        self.spare_rings: list[list[torch.Tensor]] = []
        # Groups of dropped peers are destroyed in their own thread: a destructor may wait for pending ops.
        self.graveyard: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.closed = False
        self.group_factory = _resolve_group_factory(options["process_group"])
        threading.Thread(target=self._reap, name="kvspec-reaper", daemon=True).start()
        threading.Thread(target=self._expire_loop, name="kvspec-expire", daemon=True).start()
        # One listening socket for the life of the process (closing a socket another thread blocks on
        # frees its descriptor number for reuse while that thread still holds it).
        self.host: str = options.get("host", "127.0.0.1")
        self.listener = _listen(self.host)
        threading.Thread(target=self._accept_loop, name="kvspec-accept", daemon=True).start()
        self._new_identity()

    def _new_identity(self) -> None:
        """A fresh uid and DH key: connections and hellos addressed to an earlier life of this process are refused."""
        self.uid = f"{time.time_ns():x}-{os.getpid()}-{secrets.token_hex(4)}"
        self.session_key = SessionKey()

    def _emit_loop(self, events: Connection) -> None:
        """Write events in order; a proxy slow to read them blocks only this thread."""
        while True:
            event = self.events.get()
            if event is None:
                return
            try:
                events.send(event)
            except (OSError, ValueError):
                return  # the parent is gone; the main loop exits on its own pipe

    def _emit(self, *event: Any) -> None:
        self.events.put((event[0], self.generation, *event[1:]))

    def _expire_loop(self) -> None:
        """Fail transfers past their deadline (FAIL-1); the pair is dropped so late bytes cannot land."""
        while not self.closed:
            time.sleep(0.05)
            now = time.monotonic()
            with self.lock:
                late = [t for t in self.transfers.values() if t.started and t.state == "pending" and now > t.deadline]
                for transfer in late:
                    self._finish(transfer, _Failure("timeout", f"transfer exceeded {transfer.timeout_s} s"))
            for transfer in late:
                self._drop_peer(transfer.peer, _Failure("timeout", f"peer {transfer.peer.name!r} timed out"))

    def _reap(self) -> None:
        while True:
            group = self.graveyard.get()
            del group

    # ----------------------------------------------------------------------- metadata and peers

    def metadata(self) -> dict[str, Any]:
        host, port = self.listener.getsockname()
        return {
            "kvspec_torch": 1,
            "name": self.name,
            "uid": self.uid,
            "pid": os.getpid(),
            "host": host,
            "port": port,
            "dh": self.session_key.public_hex,
            "nonce": self.session_key.nonce.hex(),
            "regions": [t.numel() for t in self.tensors],
            "process_group": self.options["process_group"],
        }

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, address = self.listener.accept()
            except OSError:
                continue
            entry = _Pending(sock, address)
            with self.lock:
                crowded = (
                    len(self.pending) >= _MAX_PENDING_AUTH
                    or sum(p.source == entry.source for p in self.pending) >= _MAX_PENDING_PER_SOURCE
                )
                victim = _victim(self.pending, entry.source) if crowded else None
                if victim is not None:
                    self.pending.remove(victim)
                if victim is not None or not crowded:
                    self.pending.append(entry)
                if victim is not None:
                    victim.evict()
                    self.lock.notify_all()  # a victim waiting for add_remote_agent gives up
            if victim is None and crowded:
                _warn(self.name, f"refused a control connection from {address[0]}:{address[1]}: too many pending")
                sock.close()
                continue
            threading.Thread(target=self._serve_connection, args=(entry,), name="kvspec-peer", daemon=True).start()

    def _serve_connection(self, entry: _Pending) -> None:
        """Authenticate one incoming control connection (in its own thread: a slow client blocks no one)."""
        sock, address = entry.sock, entry.address
        _no_delay(sock)
        guard = _Deadline(sock, self.timeout_s)
        try:
            uid = self._authenticate_incoming(entry)
        except Exception as exc:  # whatever the connector sent, one line and the connection is closed
            guard.cancel()
            why = "evicted: a newer connection needed its slot" if entry.evicted else None
            _warn(self.name, f"refused a control connection from {address[0]}:{address[1]}: {why or _describe(exc)}")
            sock.close()
            return
        finally:
            with self.lock:
                if entry in self.pending:
                    self.pending.remove(entry)
        if not guard.cancel():
            sock.close()  # the deadline shut it down in the meantime
            return
        sock.settimeout(None)
        self._reader(sock, uid)

    def _pair_key(self, meta: dict[str, Any]) -> bytes:
        """The key shared with the worker of ``meta`` (computed once per pairing)."""
        uid = meta["uid"]
        key = self.pair_keys.get(uid)
        if key is None:
            peer_public = parse_public(meta["dh"], "metadata.dh")
            key = self.session_key.pair_key(self.uid, uid, peer_public, parse_nonce(meta["nonce"], "metadata.nonce"))
            self.pair_keys[uid] = key
        return key

    def _authenticate_incoming(self, entry: _Pending) -> str:
        """The listener's half of the handshake; returns the connector's uid, or raises why it was refused.

        1. connector: ``{op: auth, from: its uid, to: our uid, nonce}``;
        2. listener: ``{op: wait}`` first when the connector's metadata was not added here yet, then, once it is,
           ``{op: auth, nonce, mac}``;
        3. connector: ``{op: auth, mac}``, checked in constant time.

        The first frame must be complete within ``_FIRST_FRAME_S`` (the connector sends it at once); until then the
        connection counts as silent, and while it waits for ``add_remote_agent`` as waiting: either may be evicted
        for a newcomer (:func:`_victim`).
        """
        sock = entry.sock
        first_frame_s = min(_FIRST_FRAME_S, self.timeout_s)
        try:
            header, _ = recv_frame(
                sock,
                header_limit=_PRE_AUTH_HEADER_LIMIT,
                payload_limit=0,
                deadline=time.monotonic() + first_frame_s,
            )
        except TimeoutError:
            raise _Failure("protocol", f"first frame: expected within {first_frame_s} s, got none") from None
        sock.settimeout(self.timeout_s)  # the rest of the handshake: the whole-handshake deadline still holds
        if header.get("op") != "auth":
            raise _Failure("protocol", f"first frame: expected op 'auth', got {header.get('op')!r:.40}")
        uid, target = header.get("from"), header.get("to")
        if not isinstance(uid, str) or target != self.uid:
            raise _Failure("protocol", "auth.to: addressed to another agent or an earlier life of this worker")
        theirs = parse_nonce(header.get("nonce"), "auth.nonce")
        with self.lock:
            known = uid in self.authorized
            entry.stage = "proving" if known else "waiting"
        if not known:
            send_frame(sock, {"op": "wait"})  # the connector's add_remote_agent returns; pairing goes on
        with self.lock:
            added = self.lock.wait_for(
                lambda: uid in self.authorized or self.closed or entry.evicted, timeout=self.timeout_s
            )
            if entry.evicted or not added:
                raise _Failure("protocol", f"auth.from: agent uid {uid!r:.80} was not added here (add_remote_agent)")
            meta = self.authorized.get(uid)
            if meta is None:
                raise _Failure("protocol", "worker closed")
            entry.stage = "proving"
            key = self._pair_key(meta)
            my_uid = self.uid
        mine = secrets.token_bytes(NONCE_BYTES)
        send_frame(sock, {"op": "auth", "nonce": mine.hex(), "mac": listener_mac(key, uid, my_uid, theirs, mine).hex()})
        header, _ = recv_frame(sock, header_limit=_PRE_AUTH_HEADER_LIMIT, payload_limit=0)
        mac = header.get("mac")
        expected = connector_mac(key, uid, my_uid, theirs, mine)
        if header.get("op") != "auth" or not isinstance(mac, str) or not hmac.compare_digest(mac, expected.hex()):
            raise _Failure("protocol", "auth.mac: the connector does not hold the pair key")
        return uid

    def _connect(self, meta: dict[str, Any], waiting: threading.Event) -> socket.socket:
        """Open and authenticate a control connection to the worker of ``meta`` (the connector's half)."""
        with self.lock:
            key = self._pair_key(meta)
            my_uid = self.uid
        # The listener answers once its side added our metadata: wait as long as pairing may take.
        sock = socket.create_connection((meta["host"], meta["port"]), timeout=self.timeout_s)
        try:
            _no_delay(sock)
            mine = secrets.token_bytes(NONCE_BYTES)
            send_frame(sock, {"op": "auth", "from": my_uid, "to": meta["uid"], "nonce": mine.hex()})
            header, _ = recv_frame(sock, header_limit=_PRE_AUTH_HEADER_LIMIT, payload_limit=0)
            if header.get("op") == "wait":
                waiting.set()
                header, _ = recv_frame(sock, header_limit=_PRE_AUTH_HEADER_LIMIT, payload_limit=0)
            theirs = parse_nonce(header.get("nonce"), "auth.nonce")
            mac = header.get("mac")
            expected = listener_mac(key, my_uid, meta["uid"], mine, theirs)
            if not isinstance(mac, str) or not hmac.compare_digest(mac, expected.hex()):
                raise _Failure("peer_disconnected", "auth.mac: the listener does not hold the pair key")
            send_frame(sock, {"op": "auth", "mac": connector_mac(key, my_uid, meta["uid"], mine, theirs).hex()})
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return sock

    def _peer_by_name(self, name: str) -> _Peer:
        with self.lock:
            for peer in self.peers.values():
                if peer.name == name:
                    return peer
        raise _Failure("peer_disconnected", f"unknown or disconnected peer {name!r} (add_remote_agent first)")

    def _current(self, peer: _Peer) -> bool:
        """Whether ``peer`` is this life's live entry (messages from older pairings are ignored)."""
        return peer.dead is None and self.peers.get(peer.uid) is peer

    def _entry(self, meta: dict[str, Any], remote_session: str | None = None) -> tuple[_Peer, bool]:
        """The live peer for ``meta`` and whether it is new (then its connection is still to be opened)."""
        with self.lock:
            peer = self.peers.get(meta["uid"])
            if peer is not None and peer.dead is None and peer.remote_session in (None, remote_session):
                if remote_session is not None:
                    peer.remote_session = remote_session
                _log(self.name, "known peer", peer.name, peer.uid, "ready", peer.ready.is_set())
                return peer, False
            if remote_session is None and peer is not None and peer.dead is None:
                _log(self.name, "known peer", peer.name, peer.uid, "ready", peer.ready.is_set())
                return peer, False
            for old in [p for p in self.peers.values() if p.name == meta["name"] or p.uid == meta["uid"]]:
                # A restarted peer (same name, new process) or a new pairing replaces the old one.
                self._drop_peer(old, _Failure("peer_disconnected", f"peer {old.name!r} was replaced"))
                self.peers.pop(old.uid, None)
            peer = _Peer(meta, self.uid)
            _log(self.name, "new peer", peer.name, peer.uid, "rank", peer.rank, "session", remote_session)
            peer.remote_session = remote_session
            self.peers[peer.uid] = peer
        return peer, True

    def _open(self, peer: _Peer) -> None:
        """Connect to a new peer, say hello, and (as rank 0) start the rendezvous; raises ``_Failure``."""
        try:
            peer.attach_out(self._connect(peer.meta, peer.settled))
            # (our session, the uid we address, the session of theirs we answer or None)
            peer.send({"op": "hello", "session": peer.session, "target": peer.uid, "answered": peer.remote_session})
        except Exception as exc:  # refused, reset, timed out, or a listener without the pair key
            failure = _Failure("peer_disconnected", f"cannot pair with peer {peer.name!r}: {_describe(exc)}")
            self._drop_peer(peer, failure)
            raise failure from exc
        if peer.rank == 0:
            # The rendezvous runs on this pair's control connections (no store listens): rank 0 keeps the keys.
            peer.store = _ChannelStore(peer, self.timeout_s)
            peer.send({"op": "group"})
            self._start_group(peer)

    def _answers_live_pairing(self, uid: str, answered: str | None) -> bool:
        """A hello that answers one of our sessions counts only while that session's entry lives."""
        if answered is None:
            return True  # the peer starts a new pairing
        with self.lock:
            entry = self.peers.get(uid)
            return entry is not None and entry.dead is None and entry.session == answered

    def _start_group(self, peer: _Peer) -> None:
        """Form the pair's process group in a thread, through the rendezvous in ``peer.store``."""
        store = peer.store

        def form() -> None:
            try:
                timeout = datetime.timedelta(seconds=self.timeout_s)
                peer.group = self.group_factory(store, peer.rank, 2, timeout)
            except Exception as exc:
                self._drop_peer(peer, _Failure("peer_disconnected", f"process group with {peer.name!r}: {exc}"))
            peer.ready.set()
            peer.settled.set()

        threading.Thread(target=form, name="kvspec-group", daemon=True).start()

    def _drop_peer(self, peer: _Peer, failure: _Failure) -> None:
        _log(self.name, "drop", peer.name, peer.uid, failure.reason, failure.detail)
        with self.lock:
            if peer.dead is None:
                peer.dead = failure
            for transfer in list(self.transfers.values()):
                if transfer.peer is peer:
                    self._finish(transfer, failure)
            if peer.store is not None:
                peer.store.close()  # a rendezvous still waiting gives up
            if peer.group is not None or peer.store is not None:
                self.graveyard.put((peer.group, peer.store))
                peer.group = peer.store = None
            self.lock.notify_all()
        peer.ready.set()
        peer.settled.set()
        peer.close_out()

    def _reader(self, sock: socket.socket, uid: str) -> None:
        """Serve one authenticated incoming control connection from the worker ``uid`` until it closes."""
        peer: _Peer | None = None
        try:
            while True:
                header, payload = recv_frame(sock, header_limit=_HEADER_LIMIT, payload_limit=_PAYLOAD_LIMIT)
                kind = header.get("op")
                _log(self.name, "recv", kind, peer.name if peer else None)
                if kind == "hello":
                    session, target, answered = header.get("session"), header.get("target"), header.get("answered")
                    if not isinstance(session, str) or not isinstance(answered, (str, type(None))):
                        raise _Failure("protocol", "hello: expected string session and answered (or null)")
                    with self.lock:
                        meta = self.authorized.get(uid)
                    if meta is None or target != self.uid or not self._answers_live_pairing(uid, answered):
                        break  # for an earlier life of this process, or a pairing dropped since
                    peer, new = self._entry(meta, session)
                    if new:
                        self._open(peer)
                    continue
                with self.lock:
                    current = peer is not None and self._current(peer)
                if peer is None or not current:
                    continue
                if kind == "group":
                    if peer.rank != 1 or peer.store is not None:
                        raise _Failure("protocol", "group: expected once per pairing, from the rank-0 worker")
                    peer.store = _ChannelStore(peer, self.timeout_s)
                    self._start_group(peer)
                elif kind == "store":
                    if peer.rank != 0 or peer.store is None:
                        raise _Failure("protocol", "store: expected only from the rank-1 worker of a pairing")
                    _field(header, "id", int)
                    reply = peer.store.serve(header, payload)
                    if reply is not None:  # else a wait, answered by the set that completes it
                        peer.send(*reply)
                elif kind == "store_reply":
                    if peer.rank != 1 or peer.store is None:
                        raise _Failure("protocol", "store_reply: expected only by the rank-1 worker of a pairing")
                    peer.store.answer(header, payload)
                elif kind == "notif":
                    self._emit("notif", peer.name, payload)
                elif kind == "read_req":
                    self._serve_read(peer, _field(header, "xid", int), _field(header, "tag", int), _spans(payload))
                elif kind == "write_req":
                    size = _field(header, "notif_bytes", int)
                    if not -1 <= size <= len(payload):
                        raise _Failure("protocol", f"write_req.notif_bytes: expected -1 to {len(payload)}, got {size}")
                    notification = payload[:size] if size >= 0 else None
                    spans = _spans(payload[max(size, 0) :])
                    self._serve_write(peer, _field(header, "xid", int), _field(header, "tag", int), spans, notification)
                elif kind == "write_done":
                    self._remote_done(peer, _field(header, "xid", int), None)
                elif kind == "write_failed":
                    failure = _Failure(_field(header, "reason", str), _field(header, "detail", str))
                    self._remote_done(peer, _field(header, "xid", int), failure)
                else:
                    raise _Failure("protocol", f"op: expected a control message, got {kind!r:.40}")
        except (OSError, EOFError):
            pass
        except _Failure as exc:
            if exc.reason == "protocol" and not self.closed:
                _warn(self.name, f"dropped the control connection from {uid!r}: {exc.detail}")
        except (WireError, ValueError, KeyError, TypeError, RecursionError) as exc:
            if not self.closed:
                _warn(self.name, f"dropped the control connection from {uid!r}: {_describe(exc)}")
        except Exception as exc:
            _log(self.name, "reader failed", repr(exc))
        finally:
            _quiet(sock.close)
            if peer is not None and not self.closed:
                self._drop_peer(peer, _Failure("peer_disconnected", f"peer {peer.name!r} closed its connection"))

    # ----------------------------------------------------------------------- data path

    def _views(self, spans: Sequence[Span]) -> list[torch.Tensor]:
        views = []
        for r, off, n in spans:
            table = self._page_table(r, n) if off % n == 0 else None
            views.append(table[off // n] if table is not None else self.tensors[r].narrow(0, off, n))
        return views

    def _page_table(self, region: int, n: int) -> tuple[torch.Tensor, ...] | None:
        """All views of ``region`` cut into ``n``-byte pages, cached for the common page sizes."""
        key = (region, n)
        table = self.page_views.get(key)
        if table is None:
            tensor = self.tensors[region]
            count = tensor.numel() // n
            # Only worth it for page-sized runs; merged runs of odd lengths use narrow().
            if count == 0 or count > _MAX_PAGE_VIEWS or len(self.page_views) >= _MAX_PAGE_TABLES:
                return None
            table = tensor.narrow(0, 0, count * n).view(count, n).unbind(0)
            self.page_views[key] = table
        return table

    def _send_spans(self, peer: _Peer, spans: Sequence[Span], tag: int) -> None:
        """Send ``spans`` in order and wait until gloo has taken every byte; raises on failure."""
        group = peer.group
        timeout = _td(self.timeout_s)
        if not _staged(spans, self.stage_below):
            with peer.op_lock:
                works = [group.send([view], peer.peer_rank, tag) for view in self._views(spans)]
            for work in works:
                work.wait(timeout)
            return
        # A ring of staging buffers: chunk i reuses the buffer of chunk i - ring once that send is done.
        buffers = self._take_buffers()
        in_flight: list[Any] = [None] * len(buffers)
        try:
            for index, chunk in enumerate(_chunks(spans, self.chunk_bytes)):
                slot = index % len(buffers)
                if in_flight[slot] is not None:
                    in_flight[slot].wait(timeout)
                tensor = self._views(chunk)[0] if len(chunk) == 1 else _gather(buffers[slot], self._views(chunk))
                with peer.op_lock:
                    in_flight[slot] = group.send([tensor], peer.peer_rank, tag)
            for work in in_flight:
                if work is not None:
                    work.wait(timeout)
        finally:
            if all(work is None or work.is_completed() for work in in_flight):
                self._give_buffers(buffers)

    def _recv_spans(self, peer: _Peer, spans: Sequence[Span], tag: int) -> Callable[[], None]:
        """Post receives for ``spans``; returns a function that waits for them (and scatters staged chunks)."""
        group = peer.group
        timeout = _td(self.timeout_s)
        if not _staged(spans, self.stage_below):
            with peer.op_lock:
                works = [group.recv([view], peer.peer_rank, tag) for view in self._views(spans)]

            def wait_direct() -> None:
                for work in works:
                    work.wait(timeout)

            return wait_direct
        chunks = _chunks(spans, self.chunk_bytes)
        buffers = self._take_buffers()
        posted: list[Any] = []

        def post(index: int) -> None:
            chunk = chunks[index]
            if len(chunk) == 1:
                tensor = self._views(chunk)[0]
            else:
                tensor = buffers[index % len(buffers)].narrow(0, 0, sum(n for _, _, n in chunk))
            with peer.op_lock:
                posted.append(group.recv([tensor], peer.peer_rank, tag))

        for index in range(min(len(buffers), len(chunks))):
            post(index)

        def wait_staged() -> None:
            for index, chunk in enumerate(chunks):
                posted[index].wait(timeout)
                if len(chunk) > 1:
                    _scatter(buffers[index % len(buffers)], self._views(chunk))
                if index + len(buffers) < len(chunks):
                    post(index + len(buffers))
            # Only a transfer that ended cleanly returns its buffers: a failed one may still be written.
            self._give_buffers(buffers)

        return wait_staged

    def _take_buffers(self) -> list[torch.Tensor]:
        """A ring of staging buffers, reused across transfers so their pages are already mapped."""
        with self.lock:
            if self.spare_rings:
                return self.spare_rings.pop()
        return [torch.zeros(self.chunk_bytes, dtype=torch.uint8) for _ in range(self.ring)]

    def _give_buffers(self, buffers: list[torch.Tensor]) -> None:
        with self.lock:
            self.spare_rings.append(buffers)

    def _finish(self, transfer: _Transfer, failure: _Failure | None) -> None:
        """Record the outcome once (caller holds the lock)."""
        if transfer.state != "pending":
            return
        if failure is None:
            transfer.state = "done"
        else:
            transfer.state, transfer.reason, transfer.detail = "failed", failure.reason, failure.detail
        self._emit("state", transfer.xid, transfer.state, transfer.reason, transfer.detail)
        if transfer.released:
            self.transfers.pop(transfer.xid, None)
        self.lock.notify_all()

    def _complete(self, transfer: _Transfer, failure: _Failure | None) -> None:
        with self.lock:
            self._finish(transfer, failure)

    def _remote_done(self, peer: _Peer, xid: int, failure: _Failure | None) -> None:
        with self.lock:
            transfer = self.transfers.get(xid)
            if transfer is not None and transfer.peer is peer:
                self._finish(transfer, failure)

    def _spawn(self, target: Callable[[], None]) -> None:
        threading.Thread(target=target, name="kvspec-xfer", daemon=True).start()

    def _serve_read(self, peer: _Peer, xid: int, tag: int, spans: list[Span]) -> None:
        """The peer reads from us: send our spans from a thread so this connection keeps being served."""

        def send() -> None:
            try:
                self._wait_ready(peer)  # a peer that paired from its side alone may be here first
                self._send_spans(peer, spans, tag)
            except Exception as exc:
                self._drop_peer(peer, _gloo_failure(peer, exc))

        self._spawn(send)

    def _serve_write(self, peer: _Peer, xid: int, tag: int, spans: list[Span], notification: bytes | None) -> None:
        """The peer writes to us: receive, then queue its notification, then acknowledge (DONE-1)."""

        def land() -> None:
            try:
                self._wait_ready(peer)
                wait = self._recv_spans(peer, spans, tag)
                wait()
            except Exception as exc:
                failed = {"op": "write_failed", "xid": xid, "reason": "transfer_error", "detail": f"receiving: {exc}"}
                _quiet(peer.send, failed)
                return
            with self.lock:
                if not self._current(peer):
                    return  # the writer gave up on us; its transfer is FAILED, so no notification
                if notification is not None:
                    self._emit("notif", peer.name, notification)
            _quiet(peer.send, {"op": "write_done", "xid": xid})

        self._spawn(land)

    # ----------------------------------------------------------------------- proxy requests

    def op_register(self, shm_names: list[str], sizes: list[int]) -> None:
        for shm_name, size in zip(shm_names, sizes, strict=True):
            mapped = _attach(shm_name, size)
            self.maps.append(mapped)
            self.tensors.append(torch.frombuffer(mapped, dtype=torch.uint8, count=size))

    def op_metadata(self) -> bytes:
        return json.dumps(self.metadata(), sort_keys=True).encode()

    def op_add_peer(self, metadata: bytes) -> str:
        """Accept connections from the agent of ``metadata`` and start pairing with it (in the background).

        Returns once paired, or once the peer's worker says it has not added this agent yet; pairing then
        completes when it does, and ``post`` waits for that (bounded).
        """
        meta = _parse_metadata(metadata)
        _log(self.name, "add_peer", meta.get("name"), meta.get("uid"), "me", self.uid)
        if meta["uid"] == self.uid:
            raise _Failure("post_failed", "add_remote_agent: this is the agent's own metadata")
        if meta.get("process_group") != self.options["process_group"]:
            raise _Failure(
                "post_failed",
                f"add_remote_agent: peer uses process group {meta.get('process_group')!r}, "
                f"this agent {self.options['process_group']!r}",
            )
        with self.lock:
            known = self.authorized.get(meta["uid"])
            if known is not None and (known["dh"], known["nonce"]) != (meta["dh"], meta["nonce"]):
                detail = f"add_remote_agent: metadata.dh: agent {meta['uid']!r} was added with another key"
                raise _Failure("post_failed", detail)
            self.authorized[meta["uid"]] = meta
            self.lock.notify_all()
        peer, new = self._entry(meta)
        if new:
            self._spawn(lambda: _quiet(self._open, peer))
        # Paired, failed, or waiting for the peer's add_remote_agent (so two sequential calls do not deadlock).
        peer.settled.wait(self.timeout_s)
        if peer.dead is not None:
            raise _Failure(peer.dead.reason, peer.dead.detail)
        return peer.name

    def _wait_ready(self, peer: _Peer) -> None:
        if not peer.ready.wait(self.timeout_s):
            raise _Failure(
                "timeout",
                f"process group with {peer.name!r} not formed within {self.timeout_s} s "
                "(has the peer added this agent's metadata with add_remote_agent?)",
            )
        if peer.dead is not None:
            raise peer.dead

    def op_remove_peer(self, name: str) -> None:
        peer = self._peer_by_name(name)
        self._drop_peer(peer, _Failure("peer_disconnected", f"peer {name!r} was removed"))
        with self.lock:
            self.peers.pop(peer.uid, None)
            self.authorized.pop(peer.uid, None)
            self.pair_keys.pop(peer.uid, None)

    def op_post(self, mode: str, runs: list[Run], peer_name: str, notification: bytes | None) -> int:
        """Record the transfer; it starts at the first check (see the module docstring)."""
        peer = self._peer_by_name(peer_name)
        if peer.dead is not None:
            raise _Failure(peer.dead.reason, peer.dead.detail)
        self._wait_ready(peer)
        xid = next(self.counter)
        with self.lock:
            self.transfers[xid] = _Transfer(xid, peer, mode, runs, notification, self.timeout_s)
        return xid

    def _start(self, transfer: _Transfer) -> None:
        """Post this side's ops and ask the peer for its side."""
        transfer.started = True
        transfer.deadline = time.monotonic() + transfer.timeout_s
        peer, xid, notification = transfer.peer, transfer.xid, transfer.notification
        tag = ((xid << 1) | peer.rank) & _TAG_MASK
        local: list[Span] = [(lr, lo, n) for lr, lo, _, _, n in transfer.runs]
        remote: list[Span] = [(rr, ro, n) for _, _, rr, ro, n in transfer.runs]
        if transfer.mode == "read":
            # Ask first: the peer builds and posts its sends while this side posts its receives.
            peer.send({"op": "read_req", "xid": xid, "tag": tag}, _pack_spans(remote))
            wait = self._recv_spans(peer, local, tag)

            def land() -> None:
                try:
                    wait()
                except Exception as exc:
                    self._complete(transfer, _gloo_failure(peer, exc))
                    return
                self._complete(transfer, None)
                if notification is not None:
                    _quiet(peer.send, {"op": "notif"}, notification)

            self._spawn(land)
        else:
            size = -1 if notification is None else len(notification)
            payload = (notification or b"") + _pack_spans(remote)
            peer.send({"op": "write_req", "xid": xid, "tag": tag, "notif_bytes": size}, payload)

            def send() -> None:
                try:
                    self._send_spans(peer, local, tag)
                except Exception as exc:
                    self._complete(transfer, _gloo_failure(peer, exc))
                # DONE comes with the peer's write_done, once the bytes are in its pool.

            self._spawn(send)

    def op_start(self, xid: int) -> None:
        """The proxy's first check of a transfer: start it (its outcome comes as an event)."""
        with self.lock:
            transfer = self.transfers.get(xid)
            if transfer is None:
                raise _Failure("post_failed", f"unknown or released transfer {xid}")
            if transfer.started or transfer.state != "pending":
                return
        try:
            self._start(transfer)
        except _Failure as failure:
            self._complete(transfer, failure)
        except Exception as exc:
            self._complete(transfer, _gloo_failure(transfer.peer, exc))

    def op_release(self, xid: int) -> None:
        """Forget a transfer; a READ in flight is waited for (bounded) so no byte lands afterwards (SM-2)."""
        with self.lock:
            transfer = self.transfers.get(xid)
            if transfer is None:
                return
            transfer.released = True
            if transfer.state == "pending" and not transfer.started:
                self._finish(transfer, _Failure("aborted", "released before it started"))
            elif transfer.state == "pending" and transfer.mode == "read":
                # gloo cannot cancel a posted receive: let it land (or fail) before the caller reuses the blocks.
                remaining = max(0.0, transfer.deadline - time.monotonic())
                self.lock.wait_for(lambda: transfer.state != "pending", timeout=remaining)
            stuck = transfer.state == "pending" and transfer.mode == "read"
            if transfer.state != "pending":
                self.transfers.pop(xid, None)
        if stuck:
            self._drop_peer(transfer.peer, _Failure("timeout", f"peer {transfer.peer.name!r} timed out"))
            with self.lock:
                self.transfers.pop(xid, None)

    def op_notify(self, peer_name: str, message: bytes) -> None:
        peer = self._peer_by_name(peer_name)
        if peer.dead is not None:
            raise _Failure(peer.dead.reason, peer.dead.detail)
        peer.send({"op": "notif"}, message)

    def op_call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        return fn(self, *args)

    # ----------------------------------------------------------------------- helpers for op_call

    def process_group(self, peer_name: str) -> tuple[Any, int]:
        """The process group shared with ``peer_name`` and the peer's rank in it (benchmarks use this)."""
        peer = self._peer_by_name(peer_name)
        self._wait_ready(peer)
        return peer.group, peer.peer_rank

    def region(self, index: int) -> torch.Tensor:
        """The uint8 tensor over registered region ``index``."""
        return self.tensors[index]

    def op_reset(self) -> None:
        """Become a blank agent again (the backend reuses this process for a new agent)."""
        with self.lock:
            peers = list(self.peers.values())
        for peer in peers:
            self._drop_peer(peer, _Failure("peer_disconnected", f"agent {self.name!r} closed"))
        with self.lock:
            self.peers.clear()
            self.authorized.clear()
            self.pair_keys.clear()
            self.transfers.clear()
            self.generation += 1
            # Views still used by ops in flight keep their mapping alive; the rest is unmapped when dropped.
            self.tensors, self.maps = [], []
            self.page_views = {}
            self._new_identity()

    def op_rename(self, name: str) -> int:
        """Take a new agent's name; returns the generation its events carry."""
        self.name = name
        return self.generation

    def close(self) -> None:
        self.closed = True
        for peer in list(self.peers.values()):
            self._drop_peer(peer, _Failure("peer_disconnected", "agent closed"))
        with self.lock:
            self.lock.notify_all()  # handshakes waiting for an add_remote_agent give up
        _quiet(self.listener.close)


# --------------------------------------------------------------------------- rendezvous over the pair channel

# Bounds on one pairing's rendezvous keys (gloo sets one ~170-byte key per rank): a peer beyond them is dropped.
_STORE_KEYS = 64
_STORE_KEY_CHARS = 256
_STORE_VALUE_BYTES = 64 << 10
_STORE_TOTAL_BYTES = 1 << 20
_STORE_WAITS = 16  # rank 1's waits parked on rank 0 at once
_STORE_VERBS = ("set", "get", "add", "check", "wait")


class _ChannelStore(Store):
    """The rendezvous of one pairing as frames on its authenticated control connections: no listening socket.

    Rank 0 holds the keys (bounded: ``_STORE_*``) and serves rank 1's
    ``store`` frames from its reader thread without ever blocking: a ``wait``
    for keys not set yet is parked (at most ``_STORE_WAITS``) and answered by
    the ``set`` that completes it. Rank 1 sends each call as a frame and waits
    for its ``store_reply``. Only the calls gloo and NCCL rendezvous with
    (``set``, ``get``, ``add``, ``check``, ``wait``) are served; the others raise.
    """

    def __init__(self, peer: _Peer, timeout_s: float) -> None:
        super().__init__()
        self._peer = peer
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._values: dict[str, bytes] = {}
        self._parked: list[tuple[int, list[str]]] = []  # rank 0: (request id, keys) of rank 1's waits
        self._replies: dict[int, tuple[dict[str, Any], bytes]] = {}  # rank 1: answers by request id
        self._ids = itertools.count(1)
        self._closed = False

    # ----- the torch.distributed.Store interface (called by the process group, from C++)

    def set(self, key: str, value: str | bytes) -> None:
        self._request("set", [key], value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        header, value = self._request("get", [key])
        if not header.get("found"):
            raise KeyError(f"rendezvous key {key!r} vanished")
        return value

    def add(self, key: str, amount: int) -> int:
        header, _ = self._request("add", [key], amount=int(amount))
        return int(header["amount"])

    def check(self, keys: list[str]) -> bool:
        header, _ = self._request("check", list(keys))
        return bool(header.get("found"))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        if self._peer.rank == 1:
            self._request("wait", list(keys), timeout_s=seconds)
            return
        with self._cond:
            ready = self._cond.wait_for(lambda: self._closed or self._holds(keys), seconds) and not self._closed
        if not ready:
            raise TimeoutError(f"rendezvous with {self._peer.name!r}: keys {keys} not set within {seconds} s")

    # ----- both ranks

    def _request(
        self, verb: str, keys: list[str], value: bytes = b"", amount: int = 0, timeout_s: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        header = {"op": "store", "verb": verb, "keys": keys, "amount": amount}
        if self._peer.rank == 0:
            reply = self.serve(header, value)
            if reply is None:  # never: rank 0 waits on its own keys (see wait), only rank 1's waits are parked
                raise TimeoutError(f"rendezvous with {self._peer.name!r}: {verb} {keys}: parked")
            return reply
        seconds = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + seconds
        with self._cond:
            ident = next(self._ids)
        # Rank 0 may start the rendezvous before this side's own connection to it is up: wait for that.
        self._peer.connected.wait(self._timeout_s)
        self._peer.send({**header, "id": ident}, value)
        with self._cond:
            self._cond.wait_for(lambda: ident in self._replies or self._closed, max(0.0, deadline - time.monotonic()))
            if ident not in self._replies:
                why = "the pair was dropped" if self._closed else f"no answer within {seconds} s"
                raise TimeoutError(f"rendezvous with {self._peer.name!r}: {verb} {keys}: {why}")
            return self._replies.pop(ident)

    def answer(self, header: dict[str, Any], payload: bytes) -> None:
        """Rank 1: the reply to one of our requests (at most 16 kept unclaimed)."""
        ident = _field(header, "id", int)
        with self._cond:
            if len(self._replies) < 16:
                self._replies[ident] = (header, payload)
                self._cond.notify_all()

    def close(self) -> None:
        """Wake every call waiting on this pairing: it is over."""
        with self._cond:
            self._closed = True
            self._parked.clear()
            self._cond.notify_all()

    # ----- rank 0: the keys

    def _holds(self, keys: list[str]) -> bool:
        return all(k in self._values for k in keys)

    def serve(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes] | None:
        """Carry out one request (ours or rank 1's) at once: its reply, or ``None`` for a wait parked until a set.

        ``_Failure`` ``protocol`` when the request breaks a bound. A set answers the waits it completes.
        """
        verb, keys = header.get("verb"), header.get("keys")
        if verb not in _STORE_VERBS:
            raise _Failure("protocol", f"store.verb: expected one of {_STORE_VERBS}, got {verb!r:.40}")
        if not isinstance(keys, list) or not 0 < len(keys) <= 16:
            raise _Failure("protocol", "store.keys: expected a list of 1 to 16 keys")
        if not all(isinstance(k, str) and 0 < len(k) <= _STORE_KEY_CHARS for k in keys):
            raise _Failure("protocol", f"store.keys: expected strings of 1 to {_STORE_KEY_CHARS} characters")
        key = keys[0]
        reply: dict[str, Any] = {"op": "store_reply", "id": header.get("id"), "found": False, "amount": 0}
        with self._cond:
            if verb in ("check", "wait"):
                reply["found"] = self._holds(keys)
                if verb == "wait" and not reply["found"]:
                    if len(self._parked) >= _STORE_WAITS:
                        raise _Failure("protocol", f"store.wait: expected at most {_STORE_WAITS} waits at once")
                    self._parked.append((_field(header, "id", int), keys))
                    return None
                return reply, b""
            if verb == "get":
                value = self._values.get(key)
                reply["found"] = value is not None
                return reply, value or b""
            if verb == "add":
                amount = _field(header, "amount", int)
                try:
                    total = int(self._values.get(key, b"0")) + amount
                except ValueError:
                    raise _Failure("protocol", f"store.add: key {key!r:.80} holds no integer") from None
                payload = str(total).encode()
                reply["amount"] = total
            if len(payload) > _STORE_VALUE_BYTES:
                raise _Failure("protocol", f"store.value: expected at most {_STORE_VALUE_BYTES} bytes")
            old = self._values.get(key)
            if old is None and len(self._values) >= _STORE_KEYS:
                raise _Failure("protocol", f"store.keys: expected at most {_STORE_KEYS} keys per pairing")
            used = sum(map(len, self._values.values())) - len(old or b"") + len(payload)
            if used > _STORE_TOTAL_BYTES:
                raise _Failure("protocol", f"store: expected at most {_STORE_TOTAL_BYTES} bytes per pairing")
            self._values[key] = payload
            self._cond.notify_all()
            done = [ident for ident, wanted in self._parked if self._holds(wanted)]
            self._parked = [(ident, wanted) for ident, wanted in self._parked if ident not in done]
        for ident in done:  # outside the lock: a send may block on a slow peer
            _quiet(self._peer.send, {"op": "store_reply", "id": ident, "found": True, "amount": 0})
        return reply, b""


# --------------------------------------------------------------------------- helpers


def _shutdown(fd: int) -> None:
    """Shut a connected socket down through a duplicate descriptor (the original is closed by its owner)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


def _no_delay(sock: socket.socket) -> None:
    """Control messages are small and often back to back: without this, Nagle's algorithm and delayed
    ACKs hold the second one for 40 ms."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _listen(host: str) -> socket.socket:
    """The control listener, on ``host`` (the backend's ``host`` option; 127.0.0.1 by default), any free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _no_delay(sock)
    sock.bind((host, 0))
    sock.listen(64)
    return sock


def _field(header: dict[str, Any], name: str, kind: type) -> Any:
    """``header[name]``, which must be a ``kind`` (an int within 64 bits); else a protocol failure naming it."""
    value: Any = header.get(name)
    in_range = kind is not int or (isinstance(value, int) and -(1 << 63) <= value < 1 << 64)
    if not isinstance(value, kind) or isinstance(value, bool) or not in_range:
        op = header.get("op")
        raise _Failure("protocol", f"{op}.{name}: expected {kind.__name__}, got {value!r:.40}")
    return value


def _pack_spans(spans: Sequence[Span]) -> bytes:
    return b"".join(_SPAN.pack(*span) for span in spans)


def _spans(payload: bytes) -> list[Span]:
    if len(payload) % _SPAN.size:
        raise _Failure("protocol", f"spans: expected a multiple of {_SPAN.size} bytes, got {len(payload)}")
    return list(_SPAN.iter_unpack(payload))


def _parse_metadata(metadata: bytes) -> dict[str, Any]:
    """A peer's metadata (JSON), every field this worker uses checked; ``_Failure`` naming the field."""
    try:
        meta = json.loads(metadata)
    except (ValueError, RecursionError) as exc:
        raise _Failure("post_failed", f"add_remote_agent: metadata: expected JSON ({_describe(exc)})") from None
    if not isinstance(meta, dict) or meta.get("kvspec_torch") != 1:
        raise _Failure("post_failed", "add_remote_agent: metadata.kvspec_torch: expected 1")
    for name, kind in (("name", str), ("uid", str), ("host", str), ("port", int), ("dh", str), ("nonce", str)):
        if not isinstance(meta.get(name), kind):
            raise _Failure("post_failed", f"add_remote_agent: metadata.{name}: expected {kind.__name__}")
    try:
        parse_public(meta["dh"], "metadata.dh")
        parse_nonce(meta["nonce"], "metadata.nonce")
    except PairKeyError as exc:
        raise _Failure("post_failed", f"add_remote_agent: {exc}") from None
    return meta


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _Failure):
        return exc.detail
    return f"{type(exc).__name__}: {exc}"[:300]


class _Deadline:
    """Shuts ``sock`` down when the handshake is not over after ``seconds`` (one deadline for all of it)."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._lock = threading.Lock()
        self._over = False
        self._sock = sock
        sock.settimeout(seconds)
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if not self._over:
                self._over = True
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> bool:
        """Stop the timer; ``False`` when it had already fired."""
        self._timer.cancel()
        with self._lock:
            fired = self._over
            self._over = True
        return not fired


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _staged(spans: Sequence[Span], stage_below: int) -> bool:
    """Pack spans into staging messages when they are many and small on average."""
    return len(spans) > 1 and sum(n for _, _, n in spans) < stage_below * len(spans)


def _gather(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Pack ``views`` into the front of ``buffer`` (one ``torch.cat``: no per-page Python call)."""
    packed = buffer.narrow(0, 0, sum(view.numel() for view in views))
    torch.cat(list(views), out=packed)
    return packed


def _scatter(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    offset = 0
    for view in views:
        n = view.numel()
        view.copy_(buffer.narrow(0, offset, n))
        offset += n


def _gloo_failure(peer: _Peer, exc: BaseException) -> _Failure:
    if peer.dead is not None:
        return peer.dead
    text = str(exc)
    if "closed by peer" in text or "Connection reset" in text:
        return _Failure("peer_disconnected", f"peer {peer.name!r}: {text}")
    if "Timed out" in text or "timeout" in text.lower():
        return _Failure("timeout", f"peer {peer.name!r}: {text}")
    return _Failure("transfer_error", f"peer {peer.name!r}: {text}")


def _quiet(fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(Exception):  # best effort: the peer may already be gone
        fn(*args)


def _resolve_group_factory(spec: str) -> Callable[..., Any]:
    """``"gloo"``, or ``"module:function"`` taking ``(store, rank, world_size, timeout)``."""
    if spec == "gloo":
        return ProcessGroupGloo
    from kvspec.transport._registry import import_named_module  # the working directory stays off sys.path

    module_name, _, attr = spec.partition(":")
    factory: Callable[..., Any] = getattr(import_named_module(module_name), attr)
    return factory


def main(conn: Connection, events: Connection, name: str, options: dict[str, Any]) -> None:
    """Serve the proxy's requests until it says ``close`` or its pipe closes; push events on ``events``."""
    started = time.perf_counter()
    # Copies here are single memcpy's; intra-op thread pools only contend for the few cores with gloo.
    torch.set_num_threads(options["threads"])
    worker = _Worker(name, options, events)
    conn.send(("ready", os.getpid(), torch.__version__, time.perf_counter() - started))
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                break
            op, args = request[0], request[1:]
            if op == "close":
                worker.close()
                conn.send(("ok", None))
                break
            try:
                result = getattr(worker, f"op_{op}")(*args)
                reply: tuple[Any, ...] = ("ok", result)
            except _Failure as exc:
                reply = ("err", encode_error(exc))
            except Exception as exc:
                reply = ("err", encode_error(exc, message=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            conn.send(reply)
    finally:
        worker.closed = True
        # Skip interpreter teardown: destroying groups of dead peers can block.
        os._exit(0)
