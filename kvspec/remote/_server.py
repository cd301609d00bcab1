"""``kvspec agent serve``: the remote half of a two-host suite run.

Theory of operation. One :class:`AgentServer` listens on one TCP address and
serves one authenticated client at a time (a second connection is told it is
busy and closed). Handshakes run in threads of their own, at most
``max_pending`` at once and ``max_pending_per_host`` from one address, each
under one deadline for the whole handshake. A connection that finds the slots
full takes the slot of the oldest handshake that has sent nothing yet, of its
own address when that address holds its share, else of the address holding
the most (:meth:`AgentServer._evict`): the real client answers its challenge
at once, so silent or byte-dribbling connections, even from the client's own
address, hold neither the accept loop nor the real client, and SIGTERM wakes
the loop at once. A source whose handshakes keep failing is refused for a
while (online guessing, :class:`_Guesses`). The client's connection has TCP
keepalive, and a client silent for ``idle_timeout`` seconds is dropped, so
one that vanished without a FIN frees what it held. For that client it owns:

* pools (:class:`kvspec.testing.PagePool` in shared memory, so the backend's
  worker processes attach them), bounded together by ``max_pool`` bytes, and
  filled with the oracle's keyed pattern by :mod:`kvspec.testing`'s own fill
  functions, so the bytes are exactly those a local run writes;
* agents of the backend it was started with, each registered with one pool;
* the handles those agents posted and did not release yet, ``POST_COST``
  bytes each plus their descriptors and notification, bounded together by
  ``max_posted`` bytes.

After the handshake every frame is tagged and every payload encrypted
(:mod:`kvspec.transport._wire`), so an agent's metadata, which opens its
worker's memory to whoever can reach it (UCX over TCP), never crosses in the
clear. Every request names a pool, an agent or a handle by the id the server gave
it; a name it did not give this client, a descriptor outside the agent's
pool or a read outside a region is refused. A field of the wrong type is a
:class:`kvspec.MalformedMessageError` naming it. Every allocation a request
causes is bounded before it is made: pools with their bookkeeping
(``PAGE_COST`` bytes a page) by ``max_pool``, the rest by the per-request
limits below. Page digests hash each distinct page extent once, and a pool
whose distinct pages hold more bytes than its tensors (overlapping pages) is
charged for them, so a digest's work is bounded by the bytes charged; it
stops at SIGTERM. A killed agent (``agent.kill``, through its worker's process
object, never a bare pid) answers nothing but ``agent.close``. When the client goes away,
everything it owned is closed; SIGTERM closes the agents, frees the pools and
stops the backend's workers before the process exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import select
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

from kvspec.core._descriptors import DescriptorList, check_descriptors
from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import ConfigError, KVSpecError, MalformedMessageError, PlanError, TransportError, encode_error
from kvspec.core._models import BlockIds
from kvspec.testing import PagePool, allocate_pool, fill_background, fill_producer_pages
from kvspec.tools._vectors import decode_config
from kvspec.transport import Backend, TransferHandle, Transport, load_backend
from kvspec.transport._netaddr import derived_options
from kvspec.transport._registry import parse_backend_options
from kvspec.transport._wire import (
    DIGEST_SIZE,
    HEADER_LIMIT,
    PRE_AUTH_HEADER_LIMIT,
    AgentAuthError,
    AgentRefusedError,
    FrameMac,
    PayloadSeal,
    WireError,
    check_token,
    client_mac,
    digest_key,
    frame_key,
    keep_alive,
    new_nonce,
    no_delay,
    page_table,
    payload_key,
    recv_frame,
    require_aead,
    send_frame,
    server_mac,
)

__all__ = ["AgentServer", "capabilities_to_json"]

MAX_AGENTS = 8  # per client: the suite uses one at a time
PAGE_COST = 320  # bytes of bookkeeping a pool's page costs (page table entry, digests), charged to --max-pool
MAX_DESCRIPTORS = 1 << 20  # per agent.post
MAX_NAME = 256  # characters of an agent's or a peer's name
POST_COST = 4096  # bytes an unreleased post is charged beyond its descriptors and notification (its handle)
DESCRIPTOR_COST = 40  # bytes an unreleased post is charged a descriptor (its five int64 columns)
_Header = dict[str, Any]
_Reply = tuple[dict[str, Any], bytes]
_READ_LIMIT = 64 << 20  # one explanatory read
_NOTE_LIMIT = 1 << 20
_PAYLOAD_LIMIT = 64 << 20  # a request payload: descriptors, metadata or a notification
_GUESS_HOSTS = 4096  # sources whose failed handshakes are remembered (oldest forgotten first)
_DIGEST_CHUNK = 16 << 20  # a region is hashed in pieces this large, SIGTERM looked at between them


def capabilities_to_json(transport: Transport | Backend) -> dict[str, Any]:
    """A backend's or agent's capabilities as a JSON object."""
    caps = transport.capabilities
    body = {f.name: getattr(caps, f.name) for f in attrs.fields(type(caps))}
    body["modes"] = sorted(mode.value for mode in caps.modes)
    return body


@attrs.define(eq=False)
class _Pool:
    pool: PagePool
    extents: list[tuple[int, int, int]]  # the distinct (tensor, offset, size) of the page table, in order
    index: array[int]  # page -> its extent: aliasing pages (layers sharing a tensor) are hashed once
    charge: int  # bytes counted against --max-pool: the regions (or the distinct pages, if more), PAGE_COST a page
    snapshot: bytes | None = None


def _distinct_pages(table: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], array[int]]:
    """The distinct extents of ``table`` in first-seen order, and each page's index into them."""
    position: dict[tuple[int, int, int], int] = {}
    index = array("I", (position.setdefault(page, len(position)) for page in table))
    return list(position), index


@attrs.define(eq=False)
class _Agent:
    transport: Transport
    pool: int | None = None
    handles: dict[int, TransferHandle] = attrs.Factory(dict)
    charges: dict[int, int] = attrs.Factory(dict)  # handle -> bytes it counts against max_posted
    killed: bool = False


@attrs.define(eq=False)
class _Session:
    sock: socket.socket
    peer: str
    key: bytes
    mac: FrameMac
    seal: PayloadSeal
    pools: dict[int, _Pool] = attrs.Factory(dict)
    agents: dict[int, _Agent] = attrs.Factory(dict)
    next_id: int = 1
    last_request: float = attrs.Factory(time.monotonic)
    posted: int = 0  # bytes its agents' unreleased posts count against max_posted

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedMessageError(f"request field {name!r}: expected an int, got {_show(value)}")
    return value


def _str(header: dict[str, Any], name: str, limit: int = MAX_NAME) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise MalformedMessageError(f"request field {name!r}: expected a string, got {_show(value)}")
    if len(value) > limit:
        raise MalformedMessageError(f"request field {name!r}: expected at most {limit} characters, got {len(value)}")
    return value


def _int_list(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise MalformedMessageError(f"request field {name!r}: expected a list of ints, got {_show(value)}")
    return value


class _Guesses:
    """Failed handshakes per source host, to limit online guessing of the token; bounded memory.

    After ``limit`` failures within ``window`` seconds a host is refused for
    1 s, then 2 s, 4 s ... (at most ``window``) after each further failure. At
    most ``_GUESS_HOSTS`` hosts are remembered; the oldest is forgotten first.
    """

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._hosts: OrderedDict[str, tuple[int, float, float]] = OrderedDict()  # failures, since, refused until
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._hosts)

    def refused_for(self, host: str, now: float) -> float:
        """Seconds ``host`` is still refused (0 when it may try)."""
        with self._lock:
            entry = self._hosts.get(host)
            return 0.0 if entry is None else max(0.0, entry[2] - now)

    def failed(self, host: str, now: float) -> None:
        """Count one failed handshake of ``host``."""
        with self._lock:
            count, since, until = self._hosts.pop(host, (0, now, 0.0))
            if now - since > self.window and now >= until:
                count, since = 0, now
            count += 1
            if count >= self.limit:
                until = now + min(self.window, 2.0 ** (count - self.limit))
            self._hosts[host] = (count, since, until)
            while len(self._hosts) > _GUESS_HOSTS:
                self._hosts.popitem(last=False)

    def succeeded(self, host: str) -> None:
        """Forget ``host``'s failures."""
        with self._lock:
            self._hosts.pop(host, None)


def _log(message: str) -> None:
    print(f"kvspec agent: {message}", file=sys.stderr, flush=True)


class AgentServer:
    """Serves one backend's agents and pools to one authenticated client at a time.

    ``token`` is the shared secret (:func:`kvspec.remote.read_token`'s checks);
    ``max_pool`` bounds the bytes of all pools one client holds at once, their
    bookkeeping included; ``max_posted`` the bytes its unreleased posts hold
    (``POST_COST`` a post, ``DESCRIPTOR_COST`` a descriptor, and the
    notification); ``options`` are the backend factory's keyword options
    (:func:`kvspec.transport.load_backend`). ``auth_timeout`` bounds a whole
    handshake, ``max_pending`` the handshakes in progress at once
    (``max_pending_per_host`` from one source address; a newcomer past them
    takes the slot of the oldest silent one); after ``auth_failures`` failed
    handshakes within ``auth_window`` seconds a source host is refused for a
    while. A client that sends no request for ``idle_timeout`` seconds is
    dropped and everything it held is freed. The backend's interface options
    come from ``host`` (:func:`kvspec.remote.derived_options`) unless
    ``options`` or the environment (``UCX_NET_DEVICES``) name them. A port in
    use or an address that cannot be bound is a :class:`kvspec.ConfigError`
    naming it.
    """

    def __init__(
        self,
        backend: str,
        *,
        host: str,
        port: int,
        token: bytes,
        max_pool: int = 1 << 30,
        max_posted: int = 256 << 20,
        options: dict[str, object] | None = None,
        auth_timeout: float = 10.0,
        request_timeout: float = 60.0,
        idle_timeout: float = 600.0,
        max_pending: int = 16,
        max_pending_per_host: int = 4,
        auth_failures: int = 5,
        auth_window: float = 60.0,
        log: Callable[[str], None] = _log,
    ) -> None:
        check_token(token, "AgentServer.token")
        if max_pool <= 0:
            raise ConfigError(f"AgentServer.max_pool: expected a positive number of bytes, got {max_pool}")
        if max_posted <= 0:
            raise ConfigError(f"AgentServer.max_posted: expected a positive number of bytes, got {max_posted}")
        if not idle_timeout > 0:
            raise ConfigError(f"AgentServer.idle_timeout: expected a positive number of seconds, got {idle_timeout}")
        if max_pending <= 0 or auth_failures <= 0:
            raise ConfigError(
                f"AgentServer: expected positive max_pending and auth_failures, got {max_pending}, {auth_failures}"
            )
        self._token = token
        self._max_pool = max_pool
        self._max_posted = max_posted
        self._auth_timeout = auth_timeout
        self._request_timeout = request_timeout
        self._idle_timeout = idle_timeout
        self._max_pending = max_pending
        self._max_pending_per_host = max_pending_per_host
        self._guesses = _Guesses(auth_failures, auth_window)
        self._log = log
        require_aead()  # before the backend starts: a missing package is one line saying how to install it
        given = dict(options or {})
        # The backend faces the address it serves (NIXL's UCX listens on that interface alone); options win.
        self._backend = load_backend(backend, **{**derived_options(backend, host, given), **given})
        try:
            self._listener = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            self._backend.close()
            raise ConfigError(
                f"agent serve --listen {host}:{port}: cannot listen there ({exc.strerror or exc})"
            ) from None
        except BaseException:
            self._backend.close()
            raise
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._lock = threading.Lock()  # guards _session, _pending and _closed across handshake threads
        self._pending: dict[socket.socket, str] = {}  # socket -> source host, oldest first
        self._wake_r, self._wake_w = socket.socketpair()  # a handshake thread wakes the loop with a new session
        self._session: _Session | None = None
        self._stopping = False
        self._closed = False

    @property
    def backend(self) -> Backend:
        """The backend whose agents this server runs."""
        return self._backend

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler); it wakes the loop at once.

        A request being read ends at once (the client's socket is shut for
        reading); one being answered stops at its next page (digests).
        """
        self._stopping = True
        session = self._session
        if session is not None:
            with contextlib.suppress(OSError):
                session.sock.shutdown(socket.SHUT_RD)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")

    def serve_forever(self, *, handle_sigterm: bool = False) -> None:
        """Serve until :meth:`stop` (or SIGTERM when ``handle_sigterm``); then close everything."""
        if handle_sigterm:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.stop())
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        serving: socket.socket | None = None
        try:
            while not self._stopping:
                for key, _ in selector.select(timeout=0.2):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    elif self._session is not None and not self._serve_one(self._session):
                        self._end_session()
                session = self._session
                if session is not None and time.monotonic() - session.last_request > self._idle_timeout:
                    self._log(f"dropping {session.peer}: no request for {self._idle_timeout:g} s (--idle-timeout)")
                    self._end_session()
                    session = None
                if serving is not None and (session is None or session.sock is not serving):
                    selector.unregister(serving)
                    serving = None
                if session is not None and serving is None:
                    serving = session.sock
                    selector.register(serving, selectors.EVENT_READ)
        finally:
            selector.close()
            self.close()

    def close(self) -> None:
        """End the client's session and pending handshakes, close every agent, pool and worker; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        for sock in pending:  # the handshake threads see the socket shut and return
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._end_session()
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        try:
            self._backend.close()
        except KVSpecError as exc:
            self._log(f"closing the backend: {exc}")

    # -- connections

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError as exc:  # e.g. out of file descriptors: the loop goes on
            self._log(f"accept failed: {exc}")
            return
        with contextlib.suppress(OSError):
            keep_alive(sock)  # the client's connection: a host that vanishes without a FIN is noticed
        host, peer = str(address[0]), f"{address[0]}:{address[1]}"
        wait = self._guesses.refused_for(host, time.monotonic())
        evicted: tuple[socket.socket, str] | None = None
        with self._lock:
            if wait > 0:
                why: AgentRefusedError | None = AgentRefusedError(
                    f"too many failed authentications from {host}; retry in {wait:.1f} s"
                )
            elif self._session is not None:
                why = AgentRefusedError("another client is connected; one client at a time")
            else:
                evicted, why = self._evict(host)
                if why is None:
                    self._pending[sock] = host
        if evicted is not None:
            self._log(f"evicted the oldest silent handshake from {evicted[1]}: its slot went to {peer}")
            with contextlib.suppress(OSError):  # its handshake thread sees the socket shut, logs and closes it
                evicted[0].shutdown(socket.SHUT_RDWR)
        if why is not None:
            self._log(f"refused {peer}: {why}")
            _refuse(sock, why)
            return
        threading.Thread(
            target=self._handshake, args=(sock, host, peer), name=f"kvspec-auth-{peer}", daemon=True
        ).start()

    def _evict(self, host: str) -> tuple[tuple[socket.socket, str] | None, AgentRefusedError | None]:
        """Make room for a handshake from ``host`` (the lock held): the pending socket to shut and its host, or why not.

        Within the limits nothing is evicted. Past ``max_pending_per_host``
        the oldest silent handshake of ``host`` itself gives way; past
        ``max_pending`` the oldest silent one of the address holding the most
        slots. Silent: nothing waiting to be read on it (a client answers its
        challenge at once; bytes a slow frame already gave count for nothing).
        So one source can take only its own slots, however many it opens.
        """
        counts: dict[str, int] = {}
        for pending_host in self._pending.values():
            counts[pending_host] = counts.get(pending_host, 0) + 1
        if counts.get(host, 0) >= self._max_pending_per_host:
            victim_host = host
        elif len(self._pending) >= self._max_pending:
            victim_host = max(counts, key=lambda h: counts[h])  # first reached on a tie: the oldest
        else:
            return None, None
        for candidate, pending_host in self._pending.items():  # oldest first
            if pending_host == victim_host and _silent(candidate):
                del self._pending[candidate]  # its thread, finding it gone, never makes it the session
                return (candidate, victim_host), None
        if victim_host == host:
            return None, AgentRefusedError(
                f"{self._max_pending_per_host} handshakes from {host} in progress; retry later"
            )
        return None, AgentRefusedError(f"{self._max_pending} handshakes already in progress; retry later")

    def _handshake(self, sock: socket.socket, host: str, peer: str) -> None:
        """A handshake thread: authenticate, then hand the session to the loop (or refuse: busy, stopping)."""
        session = None
        try:
            session = self._authenticate(sock, host, peer)
        finally:
            with self._lock:
                evicted = self._pending.pop(sock, None) is None
                if evicted:
                    session = None  # its slot went to a newer connection as it answered: it lost the race
                taken = session is not None and (self._session is not None or self._closed or self._stopping)
                if session is not None and not taken:
                    self._session = session
        if session is None or taken:
            if taken:
                _refuse(sock, AgentRefusedError("another client is connected; one client at a time"))
            else:
                sock.close()
            return
        self._log(f"serving {peer}")
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")

    def _authenticate(self, sock: socket.socket, host: str, peer: str) -> _Session | None:
        """Challenge-response with the shared secret before anything else, all under one deadline."""
        deadline = time.monotonic() + self._auth_timeout
        nonce = new_nonce()
        try:
            no_delay(sock)
            sock.settimeout(self._auth_timeout)
            send_frame(sock, {"op": "challenge", "agent": "kvspec", "version": 3, "nonce": nonce.hex()})
            header, _ = recv_frame(sock, header_limit=PRE_AUTH_HEADER_LIMIT, payload_limit=0, deadline=deadline)
            if header.get("op") != "auth":
                raise WireError(f"expected an auth frame, got op {_show(header.get('op'))}")
            mac = bytes.fromhex(_str(header, "mac"))
            theirs = bytes.fromhex(_str(header, "nonce"))
            if len(theirs) < 16:
                raise WireError(f"auth nonce: expected at least 16 bytes, got {len(theirs)}")
        except (OSError, ValueError) as exc:
            self._log(f"refused {peer}: no valid authentication ({type(exc).__name__}: {exc})")
            return None
        if not hmac.compare_digest(mac, client_mac(self._token, nonce, theirs)):
            self._guesses.failed(host, time.monotonic())
            self._log(f"refused {peer}: wrong token")
            _refuse(sock, AgentAuthError("authentication failed: wrong token"), close=False)
            return None
        self._guesses.succeeded(host)
        try:
            send_frame(sock, {"ok": True, "mac": server_mac(self._token, nonce, theirs).hex()})
        except OSError:
            return None
        sock.settimeout(self._request_timeout)
        key, tags = digest_key(self._token, nonce, theirs), frame_key(self._token, nonce, theirs)
        seal = PayloadSeal(payload_key(self._token, nonce, theirs), "server")
        return _Session(sock=sock, peer=peer, key=key, mac=FrameMac(tags, "server"), seal=seal)

    def _serve_one(self, session: _Session) -> bool:
        """Answer one request; False when the client is gone or broke the framing (one log line)."""
        try:
            header, sealed = recv_frame(
                session.sock,
                header_limit=HEADER_LIMIT,
                payload_limit=_PAYLOAD_LIMIT + PayloadSeal.TAG_SIZE,
                deadline=time.monotonic() + self._request_timeout,
                mac=session.mac,
            )
            op = header.get("op")
            name = op if isinstance(op, str) else ""
            payload = session.seal.open(name, sealed)  # every payload is encrypted; one that does not open ends it
        except (OSError, KVSpecError) as exc:
            if not isinstance(exc, ConnectionError):
                self._log(f"dropping {session.peer}: {exc}")
            return False
        session.last_request = time.monotonic()
        handler = _HANDLERS.get(op) if isinstance(op, str) else None
        reply_payload: bytes | memoryview = b""
        try:
            if handler is None:
                raise AgentRefusedError(f"request op: expected one of {sorted(_HANDLERS)}, got {_show(op)}")
            reply, reply_payload = handler(self, session, header, payload)
            reply["ok"] = True
        except KVSpecError as exc:
            reply = _error(exc)
        except Exception as exc:  # a bug here must not take the server down with the client's pools
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self._log(f"internal error on {op!r}: {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})")
            reply = {"ok": False, "error": encode_error(exc, message=f"{type(exc).__name__}: {exc}")}
        try:
            send_frame(session.sock, reply, session.seal.seal(name, reply_payload), session.mac)
        except OSError:
            return False
        return op != "bye"

    def _end_session(self) -> None:
        with self._lock:
            session, self._session = self._session, None
        if session is None:
            return
        for agent in session.agents.values():
            try:
                agent.transport.close()
            except KVSpecError as exc:
                self._log(f"closing agent {agent.transport.name!r}: {exc}")
        for pool in session.pools.values():
            pool.pool.close()
        with contextlib.suppress(OSError):
            session.sock.close()
        self._log(f"session with {session.peer} ended")

    # -- ownership

    def _pool(self, session: _Session, header: dict[str, Any]) -> _Pool:
        pool_id = _int(header, "pool")
        pool = session.pools.get(pool_id)
        if pool is None:
            raise AgentRefusedError(f"pool {pool_id}: not a pool this agent server gave this client")
        return pool

    def _agent(self, session: _Session, header: dict[str, Any], *, killed_ok: bool = False) -> _Agent:
        agent_id = _int(header, "agent")
        agent = session.agents.get(agent_id)
        if agent is None:
            raise AgentRefusedError(f"agent {agent_id}: not an agent this agent server gave this client")
        if agent.killed and not killed_ok:
            raise TransportError(
                f"agent {agent_id}: killed by agent.kill; only agent.close is accepted",
                reason=FailureReason.PEER_DISCONNECTED,
            )
        return agent

    def _handle(self, agent: _Agent, header: dict[str, Any]) -> tuple[int, TransferHandle]:
        handle_id = _int(header, "handle")
        handle = agent.handles.get(handle_id)
        if handle is None:
            raise AgentRefusedError(f"handle {handle_id}: not a transfer this agent posted for this client")
        return handle_id, handle

    # -- requests: (header, payload) -> (reply header, reply payload)

    def _hello(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        # idle_timeout: the client says hello when it has nothing else to say for a third of it
        caps = capabilities_to_json(self._backend)
        return {"backend": self._backend.name, "capabilities": caps, "idle_timeout": self._idle_timeout}, b""

    def _pool_create(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        """A pool for ``config``; its regions and its bookkeeping (``PAGE_COST`` a page) count against --max-pool."""
        try:
            config = decode_config(header.get("config"))
        except KVSpecError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MalformedMessageError(
                f"request field 'config': expected a KV-cache config object ({type(exc).__name__}: {exc})"
            ) from None
        pages = config.num_blocks * sum(len(group.layer_names) for group in config.kv_cache_groups)
        charge = sum(tensor.size for tensor in config.kv_cache_tensors) + pages * PAGE_COST
        held = sum(pool.charge for pool in session.pools.values())
        if held + charge > self._max_pool:
            raise AgentRefusedError(
                f"pool.create config: expected at most {self._max_pool - held} more bytes (--max-pool "
                f"{self._max_pool}, {held} held), got {charge} ({pages} pages at {PAGE_COST} bytes of bookkeeping "
                "each, plus the tensors)"
            )
        extents, index = _distinct_pages(page_table(config))
        # Layers sharing a tensor alias whole pages (hashed once); pages that overlap only in part are each hashed,
        # so their bytes are charged where they exceed the regions': a digest never hashes more than was charged.
        hashed = sum(size for _, _, size in extents)
        tensors = sum(tensor.size for tensor in config.kv_cache_tensors)
        if hashed > tensors:
            charge += hashed - tensors
            if held + charge > self._max_pool:
                raise AgentRefusedError(
                    f"pool.create config: expected at most {self._max_pool - held} more bytes (--max-pool "
                    f"{self._max_pool}, {held} held), got {charge}: its pages overlap, and hashing them takes "
                    f"{hashed} bytes against {tensors} bytes of tensors"
                )
        pool_id = session.new_id()
        pool = allocate_pool(config, prefix="kvspec_agent")
        session.pools[pool_id] = _Pool(pool=pool, extents=extents, index=index, charge=charge)
        return {"pool": pool_id, "sizes": [t.size for t in config.kv_cache_tensors]}, b""

    def _pool_destroy(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        if any(agent.pool == header["pool"] and not agent.killed for agent in session.agents.values()):
            raise AgentRefusedError(f"pool {header['pool']}: still registered with an open agent; close it first")
        pool.pool.close()
        del session.pools[header["pool"]]
        return {}, b""

    def _pool_fill_background(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        fill_background(pool.pool, seed=_seed(header, "seed"))
        return {}, b""

    def _pool_fill_pages(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        ends = header.get("block_ends")
        raw = header.get("block_ids")
        if not isinstance(raw, list) or not all(isinstance(ids, list) for ids in raw):
            raise MalformedMessageError(
                f"request field 'block_ids': expected a list of lists of ints, got {_show(raw)}"
            )
        block_ids = BlockIds(raw)
        config = pool.pool.config
        if len(block_ids) not in (0, config.num_groups) or any(len(ids) > config.num_blocks for ids in block_ids):
            raise AgentRefusedError(
                f"pool.fill_pages block_ids: expected {config.num_groups} lists of at most {config.num_blocks} ids"
            )
        for ids in block_ids:
            for block in ids:
                if not 0 <= block < pool.pool.config.num_blocks:
                    raise AgentRefusedError(
                        f"pool.fill_pages: block {block} is outside pool {header['pool']} "
                        f"(expected 0..{pool.pool.config.num_blocks - 1})"
                    )
        fill_producer_pages(
            pool.pool,
            block_ids,
            num_tokens=_int(header, "num_tokens"),
            salt=_seed(header, "salt"),
            block_ends=None if ends is None else tuple(_int_list(ends, "block_ends")),
        )
        return {}, b""

    def _digest(self, key: bytes, data: memoryview) -> bytes:
        """``digest(key, data)`` (keyed BLAKE2b), hashed in pieces so SIGTERM is not held by a large region."""
        hasher = hashlib.blake2b(digest_size=DIGEST_SIZE, key=key)
        for start in range(0, len(data), _DIGEST_CHUNK):
            self._check_stopping()
            hasher.update(data[start : start + _DIGEST_CHUNK])
        return hasher.digest()

    def _check_stopping(self) -> None:
        if self._stopping:
            raise AgentRefusedError("the agent server is stopping (SIGTERM)")

    def _page_digests(self, session: _Session, pool: _Pool) -> bytes:
        """Every page's digest in page-table order (``digest_pages``), each distinct extent hashed once."""
        buffers = [region.buffer for region in pool.pool.regions]
        hashed = []
        for tensor, offset, size in pool.extents:
            self._check_stopping()
            hashed.append(self._digest(session.key, buffers[tensor][offset : offset + size]))
        return b"".join(map(hashed.__getitem__, pool.index))

    def _pool_digests(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        regions = [self._digest(session.key, region.buffer).hex() for region in pool.pool.regions]
        pages = self._page_digests(session, pool) if header.get("pages") else b""
        return {"regions": regions}, pages

    def _pool_snapshot(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        pool.snapshot = self._page_digests(session, pool)
        return {"pages": len(pool.index)}, b""

    def _pool_compare(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        if pool.snapshot is None:
            raise AgentRefusedError(f"pool.compare: pool {header['pool']} has no snapshot (pool.snapshot first)")
        now = self._page_digests(session, pool)
        size = len(now) // max(1, len(pool.index))
        old = pool.snapshot
        starts = range(0, len(now), size)
        changed = [i for i, at in enumerate(starts) if now[at : at + size] != old[at : at + size]]
        return {"changed": changed}, b""

    def _pool_read(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        index, offset, nbytes = _int(header, "region"), _int(header, "offset"), _int(header, "nbytes")
        regions = pool.pool.regions
        if not 0 <= index < len(regions) or offset < 0 or nbytes < 0 or offset + nbytes > regions[index].nbytes:
            raise AgentRefusedError(
                f"pool.read: region {index} bytes [{offset}, {offset + nbytes}) are outside pool {header['pool']}"
            )
        if nbytes > _READ_LIMIT:
            raise AgentRefusedError(f"pool.read: expected at most {_READ_LIMIT} bytes per read, got {nbytes}")
        return {}, bytes(regions[index].buffer[offset : offset + nbytes])

    def _agent_create(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        if len(session.agents) >= MAX_AGENTS:
            raise AgentRefusedError(f"agent.create: expected at most {MAX_AGENTS} agents per client")
        name = _str(header, "name")
        transport = self._backend.create_agent(name)
        agent_id = session.new_id()
        session.agents[agent_id] = _Agent(transport=transport)
        return {"agent": agent_id, "name": transport.name, "capabilities": capabilities_to_json(transport)}, b""

    def _agent_register(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        agent = self._agent(session, header)
        pool = self._pool(session, header)
        if agent.pool is not None:
            raise AgentRefusedError(f"agent.register: agent {header['agent']} already has pool {agent.pool}")
        agent.transport.register_memory(pool.pool.regions)
        agent.pool = header["pool"]
        return {}, b""

    def _agent_metadata(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        return {}, self._agent(session, header).transport.get_agent_metadata()

    def _agent_add_remote(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        agent = self._agent(session, header)
        try:
            return {"peer": agent.transport.add_remote_agent(payload)}, b""
        except KVSpecError:
            raise
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            raise MalformedMessageError(
                f"agent.add_remote payload: expected a {self._backend.name} agent's metadata ({type(exc).__name__})"
            ) from None

    def _agent_remove_remote(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        self._agent(session, header).transport.remove_remote_agent(_str(header, "peer"))
        return {}, b""

    def _agent_post(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        agent = self._agent(session, header)
        if agent.pool is None:
            raise AgentRefusedError(f"agent.post: agent {header['agent']} has no pool registered")
        try:
            mode = TransferMode(_str(header, "mode"))
        except ValueError:
            raise MalformedMessageError(
                f"request field 'mode': expected one of {[m.value for m in TransferMode]}, got {_show(header['mode'])}"
            ) from None
        peer = _str(header, "peer")
        note = header.get("notification")
        try:
            notification = None if note is None else bytes.fromhex(_str(header, "notification", 2 * _NOTE_LIMIT))
        except ValueError:
            raise MalformedMessageError(
                f"request field 'notification': expected hex digits, got {_show(note)}"
            ) from None
        if len(payload) % 40:
            raise MalformedMessageError(
                f"agent.post payload: expected 5 int64 columns (40 bytes a row), got {len(payload)} bytes"
            )
        count = len(payload) // 40
        if count > MAX_DESCRIPTORS:
            raise AgentRefusedError(f"agent.post payload: expected at most {MAX_DESCRIPTORS} descriptors, got {count}")
        charge = POST_COST + DESCRIPTOR_COST * count + (0 if notification is None else len(notification))
        held = session.posted
        if held + charge > self._max_posted:
            raise AgentRefusedError(
                f"agent.post: expected at most {self._max_posted - held} more bytes of unreleased posts "
                f"(--max-posted {self._max_posted}, {held} held), got {charge} ({count} descriptors at "
                f"{DESCRIPTOR_COST} bytes, {POST_COST} a post, plus the notification); release finished posts"
            )
        # Views, not lists: the columns are packed one at a time, nothing sized by a descriptor's values.
        columns = [memoryview(payload)[i * 8 * count : (i + 1) * 8 * count].cast("q") for i in range(5)]
        if count and (min(columns[2]) < 0 or min(columns[3]) < 0):
            raise PlanError("agent.post: a descriptor has a negative remote region or offset")
        # This side's memory is checked here, whatever the backend does: nothing outside the pool moves. The
        # remote side (the peer's memory) is the peer's to check; mirroring the local columns into it keeps
        # check_descriptors from sizing anything by a remote region number.
        local_sizes = [region.nbytes for region in session.pools[agent.pool].pool.regions]
        local_only = DescriptorList.from_columns(
            local_region=columns[0],
            local_offset=columns[1],
            remote_region=columns[0],
            remote_offset=columns[1],
            nbytes=columns[4],
        )
        try:
            check_descriptors(local_only, local_sizes=local_sizes, remote_sizes=local_sizes)
        except PlanError as exc:
            raise PlanError(f"agent.post: a descriptor is outside the agent's pool: {exc}") from None
        descriptors = DescriptorList.from_columns(
            local_region=columns[0],
            local_offset=columns[1],
            remote_region=columns[2],
            remote_offset=columns[3],
            nbytes=columns[4],
        )
        handle = agent.transport.post(mode, descriptors, peer=peer, notification=notification)
        handle_id = session.new_id()
        agent.handles[handle_id] = handle
        agent.charges[handle_id] = charge
        session.posted += charge
        return {"handle": handle_id}, b""

    def _agent_check(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        agent = self._agent(session, header)
        _, handle = self._handle(agent, header)
        status = agent.transport.check(handle)
        reason = None if status.reason is None else status.reason.value
        return {"state": status.state.value, "reason": reason, "detail": status.detail}, b""

    def _agent_release(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        agent = self._agent(session, header)
        handle_id, handle = self._handle(agent, header)
        del agent.handles[handle_id]
        session.posted -= agent.charges.pop(handle_id, 0)
        agent.transport.release(handle)
        return {}, b""

    def _agent_notify(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        if len(payload) > _NOTE_LIMIT:
            raise AgentRefusedError(f"agent.notify: expected at most {_NOTE_LIMIT} bytes, got {len(payload)}")
        self._agent(session, header).transport.send_notification(_str(header, "peer"), payload)
        return {}, b""

    def _agent_notifications(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        notes = self._agent(session, header).transport.get_notifications()
        return {"notes": [[n.peer, len(n.message)] for n in notes]}, b"".join(n.message for n in notes)

    def _agent_close(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        agent = self._agent(session, header, killed_ok=True)
        del session.agents[header["agent"]]
        session.posted -= sum(agent.charges.values())
        agent.transport.close()
        return {}, b""

    def _agent_kill(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        """Kill the agent's worker at once (a peer lost without a goodbye); close the agent if it has none.

        The kill goes through the worker's process object (``Popen`` or
        ``multiprocessing.Process``), which signals only a child it has not
        reaped, so a pid reused by another process is never signalled. A
        killed agent answers nothing but ``agent.close`` (see :meth:`_agent`).
        """
        agent = self._agent(session, header)
        agent.killed = True
        process = getattr(agent.transport, "_process", None)
        kill = getattr(process, "kill", None)
        if callable(kill) and not getattr(agent.transport, "in_process", False):
            kill()
            return {"killed": getattr(process, "pid", None)}, b""
        with contextlib.suppress(TransportError):
            agent.transport.close()
        return {"killed": None}, b""

    def _bye(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        return {}, b""


def _silent(sock: socket.socket) -> bool:
    """Whether nothing waits to be read on ``sock``, asked without waiting (its own timeout would make recv wait)."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except (OSError, ValueError):  # closed meanwhile by its handshake thread: its slot is being given back
        return False
    return not poller.poll(0)


def _seed(header: dict[str, Any], name: str) -> int | str:
    value = header.get(name, 0)
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise WireError(f"request field {name!r}: expected an int or a string, got {value!r}")
    return value


def _refuse(sock: socket.socket, why: KVSpecError, *, close: bool = True) -> None:
    """Tell a connection why it is refused, without waiting on it (the frame fits any send buffer)."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        send_frame(sock, _error(why))
    if close:
        sock.close()


def _error(exc: KVSpecError) -> dict[str, Any]:
    return {"ok": False, "error": encode_error(exc)}


_Handler = Callable[[AgentServer, _Session, _Header, bytes], _Reply]
_HANDLERS: dict[str, _Handler] = {
    "hello": AgentServer._hello,
    "bye": AgentServer._bye,
    "pool.create": AgentServer._pool_create,
    "pool.destroy": AgentServer._pool_destroy,
    "pool.fill_background": AgentServer._pool_fill_background,
    "pool.fill_pages": AgentServer._pool_fill_pages,
    "pool.digests": AgentServer._pool_digests,
    "pool.snapshot": AgentServer._pool_snapshot,
    "pool.compare": AgentServer._pool_compare,
    "pool.read": AgentServer._pool_read,
    "agent.create": AgentServer._agent_create,
    "agent.register": AgentServer._agent_register,
    "agent.metadata": AgentServer._agent_metadata,
    "agent.add_remote": AgentServer._agent_add_remote,
    "agent.remove_remote": AgentServer._agent_remove_remote,
    "agent.post": AgentServer._agent_post,
    "agent.check": AgentServer._agent_check,
    "agent.release": AgentServer._agent_release,
    "agent.notify": AgentServer._agent_notify,
    "agent.notifications": AgentServer._agent_notifications,
    "agent.close": AgentServer._agent_close,
    "agent.kill": AgentServer._agent_kill,
}


def serve_command(args: Any, out: Any) -> int:
    """``kvspec agent serve``: serve until SIGTERM or SIGINT; every agent and pool is closed on the way out."""
    from kvspec.transport._wire import read_token

    from ._client import parse_address

    host, port = parse_address(args.listen)
    token = read_token(args.token_file)  # a ConfigError or AgentAuthError naming the file, before the backend loads
    server = AgentServer(
        args.backend,
        host=host,
        port=port,
        token=token,
        max_pool=args.max_pool,
        max_posted=args.max_posted,
        idle_timeout=args.idle_timeout,
        options=parse_backend_options(args.option),
    )
    signal.signal(signal.SIGINT, lambda signum, frame: server.stop())
    print(f"kvspec agent: serving {args.backend} on {server.address[0]}:{server.address[1]}", file=out, flush=True)
    server.serve_forever(handle_sigterm=True)
    print("kvspec agent: stopped", file=out, flush=True)
    return 0
