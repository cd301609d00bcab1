"""``kvspec agent serve``: the remote half of a two-host suite run.

Theory of operation. One :class:`AgentServer` listens on one TCP address and
serves one authenticated client at a time (a second connection is told it is
busy and closed). For that client it owns:

* pools (:class:`kvspec.testing.PagePool` in shared memory, so the backend's
  worker processes attach them), bounded together by ``max_pool`` bytes, and
  filled with the oracle's keyed pattern by :mod:`kvspec.testing`'s own fill
  functions, so the bytes are exactly those a local run writes;
* agents of the backend it was started with, each registered with one pool;
* the handles those agents posted.

Every request names a pool, an agent or a handle by the id the server gave
it; a name it did not give this client, a descriptor outside the agent's
pool or a read outside a region is refused. When the client goes away,
everything it owned is closed; SIGTERM closes the agents, frees the pools and
stops the backend's workers before the process exits.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import attrs

from kvspec._descriptors import DescriptorList, check_descriptors
from kvspec._enums import TransferMode
from kvspec._errors import ConfigError, KVSpecError, PlanError, TransportError
from kvspec._models import BlockIds
from kvspec._vectors import decode_config
from kvspec.testing import PagePool, allocate_pool, fill_background, fill_producer_pages
from kvspec.transport import Backend, TransferHandle, Transport, load_backend
from kvspec.transport._registry import parse_backend_options

from ._wire import (
    HEADER_LIMIT,
    PRE_AUTH_HEADER_LIMIT,
    AgentAuthError,
    AgentRefusedError,
    WireError,
    client_mac,
    digest,
    digest_key,
    digest_pages,
    new_nonce,
    no_delay,
    page_table,
    recv_frame,
    send_frame,
    server_mac,
)

__all__ = ["AgentServer", "capabilities_to_json"]

MAX_AGENTS = 8  # per client: the suite uses one at a time
_Header = dict[str, Any]
_Reply = tuple[dict[str, Any], bytes]
_READ_LIMIT = 64 << 20  # one explanatory read
_NOTE_LIMIT = 1 << 20
_PAYLOAD_LIMIT = 64 << 20  # a request payload: descriptors, metadata or a notification


def capabilities_to_json(transport: Transport | Backend) -> dict[str, Any]:
    """A backend's or agent's capabilities as a JSON object."""
    caps = transport.capabilities
    body = {f.name: getattr(caps, f.name) for f in attrs.fields(type(caps))}
    body["modes"] = sorted(mode.value for mode in caps.modes)
    return body


@attrs.define(eq=False)
class _Pool:
    pool: PagePool
    table: list[tuple[int, int, int]]
    snapshot: bytes | None = None


@attrs.define(eq=False)
class _Agent:
    transport: Transport
    pool: int | None = None
    handles: dict[int, TransferHandle] = attrs.Factory(dict)
    killed: bool = False


@attrs.define(eq=False)
class _Session:
    sock: socket.socket
    peer: str
    key: bytes
    pools: dict[int, _Pool] = attrs.Factory(dict)
    agents: dict[int, _Agent] = attrs.Factory(dict)
    next_id: int = 1

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _int(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError(f"request field {name!r}: expected an int, got {value!r}")
    return value


def _str(header: dict[str, Any], name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise WireError(f"request field {name!r}: expected a string, got {value!r}")
    return value


def _log(message: str) -> None:
    print(f"kvspec agent: {message}", file=sys.stderr, flush=True)


class AgentServer:
    """Serves one backend's agents and pools to one authenticated client at a time.

    ``token`` is the shared secret (at least 16 bytes); ``max_pool`` bounds
    the bytes of all pools one client holds at once; ``options`` are the
    backend factory's keyword options (:func:`kvspec.transport.load_backend`).
    """

    def __init__(
        self,
        backend: str,
        *,
        host: str,
        port: int,
        token: bytes,
        max_pool: int = 1 << 30,
        options: dict[str, object] | None = None,
        auth_timeout: float = 10.0,
        request_timeout: float = 60.0,
        log: Callable[[str], None] = _log,
    ) -> None:
        if len(token) < 16:
            raise AgentAuthError(f"AgentServer.token: expected at least 16 bytes, got {len(token)}")
        if max_pool <= 0:
            raise ConfigError(f"AgentServer.max_pool: expected a positive number of bytes, got {max_pool}")
        self._token = token
        self._max_pool = max_pool
        self._auth_timeout = auth_timeout
        self._request_timeout = request_timeout
        self._log = log
        self._backend = load_backend(backend, **(options or {}))
        try:
            self._listener = socket.create_server((host, port), reuse_port=False)
        except BaseException:
            self._backend.close()
            raise
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._session: _Session | None = None
        self._stopping = False
        self._closed = False

    @property
    def backend(self) -> Backend:
        """The backend whose agents this server runs."""
        return self._backend

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler)."""
        self._stopping = True

    def serve_forever(self, *, handle_sigterm: bool = False) -> None:
        """Serve until :meth:`stop` (or SIGTERM when ``handle_sigterm``); then close everything."""
        if handle_sigterm:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.stop())
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        try:
            while not self._stopping:
                for key, _ in selector.select(timeout=0.2):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    elif self._session is not None and not self._serve_one(self._session):
                        selector.unregister(self._session.sock)
                        self._end_session()
        finally:
            selector.close()
            self.close()

    def close(self) -> None:
        """End the client's session, close every agent and pool and the backend's workers; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._end_session()
        with contextlib.suppress(OSError):
            self._listener.close()
        try:
            self._backend.close()
        except KVSpecError as exc:
            self._log(f"closing the backend: {exc}")

    # -- connections

    def _accept(self, selector: selectors.BaseSelector) -> None:
        sock, address = self._listener.accept()
        peer = f"{address[0]}:{address[1]}"
        if self._session is not None:
            self._log(f"refused {peer}: another client is connected")
            with contextlib.suppress(OSError):
                sock.settimeout(1.0)
                send_frame(sock, _error(AgentRefusedError("another client is connected; one client at a time")))
            sock.close()
            return
        session = self._authenticate(sock, peer)
        if session is None:
            sock.close()
            return
        self._session = session
        selector.register(sock, selectors.EVENT_READ)
        self._log(f"serving {peer}")

    def _authenticate(self, sock: socket.socket, peer: str) -> _Session | None:
        """Challenge-response with the shared secret before anything else (constant-time comparison)."""
        sock.settimeout(self._auth_timeout)
        no_delay(sock)
        nonce = new_nonce()
        try:
            send_frame(sock, {"op": "challenge", "agent": "kvspec", "version": 1, "nonce": nonce.hex()})
            header, _ = recv_frame(sock, header_limit=PRE_AUTH_HEADER_LIMIT, payload_limit=0)
            mac = bytes.fromhex(_str(header, "mac"))
            theirs = bytes.fromhex(_str(header, "nonce"))
            if header.get("op") != "auth" or len(theirs) < 16:
                raise WireError("expected an auth frame with a nonce of at least 16 bytes")
        except (OSError, ValueError, WireError) as exc:
            self._log(f"refused {peer}: no valid authentication ({type(exc).__name__})")
            return None
        if not hmac.compare_digest(mac, client_mac(self._token, nonce, theirs)):
            self._log(f"refused {peer}: wrong token")
            with contextlib.suppress(OSError):
                send_frame(sock, _error(AgentAuthError("authentication failed: wrong token")))
            return None
        try:
            send_frame(sock, {"ok": True, "mac": server_mac(self._token, nonce, theirs).hex()})
        except OSError:
            return None
        sock.settimeout(self._request_timeout)
        return _Session(sock=sock, peer=peer, key=digest_key(self._token, nonce, theirs))

    def _serve_one(self, session: _Session) -> bool:
        """Answer one request; False when the client is gone or broke the framing."""
        try:
            header, payload = recv_frame(session.sock, header_limit=HEADER_LIMIT, payload_limit=_PAYLOAD_LIMIT)
        except (OSError, WireError) as exc:
            if not isinstance(exc, ConnectionError):
                self._log(f"dropping {session.peer}: {exc}")
            return False
        op = header.get("op")
        handler = _HANDLERS.get(op) if isinstance(op, str) else None
        reply_payload: bytes | memoryview = b""
        try:
            if handler is None:
                raise AgentRefusedError(f"request op: expected one of {sorted(_HANDLERS)}, got {op!r}")
            reply, reply_payload = handler(self, session, header, payload)
            reply["ok"] = True
        except KVSpecError as exc:
            reply = _error(exc)
        except Exception as exc:  # a bug here must not take the server down with the client's pools
            self._log(f"internal error on {op!r}: {traceback.format_exc()}")
            reply = {"ok": False, "error": {"type": "InternalError", "message": f"{type(exc).__name__}: {exc}"}}
        try:
            send_frame(session.sock, reply, reply_payload)
        except OSError:
            return False
        return op != "bye"

    def _end_session(self) -> None:
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

    def _agent(self, session: _Session, header: dict[str, Any]) -> _Agent:
        agent_id = _int(header, "agent")
        agent = session.agents.get(agent_id)
        if agent is None:
            raise AgentRefusedError(f"agent {agent_id}: not an agent this agent server gave this client")
        return agent

    def _handle(self, agent: _Agent, header: dict[str, Any]) -> tuple[int, TransferHandle]:
        handle_id = _int(header, "handle")
        handle = agent.handles.get(handle_id)
        if handle is None:
            raise AgentRefusedError(f"handle {handle_id}: not a transfer this agent posted for this client")
        return handle_id, handle

    # -- requests: (header, payload) -> (reply header, reply payload)

    def _hello(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        return {"backend": self._backend.name, "capabilities": capabilities_to_json(self._backend)}, b""

    def _pool_create(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        config = decode_config(header.get("config"))
        size = sum(tensor.size for tensor in config.kv_cache_tensors)
        held = sum(region.nbytes for pool in session.pools.values() for region in pool.pool.regions)
        if held + size > self._max_pool:
            raise AgentRefusedError(
                f"pool.create: expected at most {self._max_pool - held} more bytes (--max-pool {self._max_pool}, "
                f"{held} held), got a config of {size} bytes"
            )
        pool_id = session.new_id()
        session.pools[pool_id] = _Pool(pool=allocate_pool(config, prefix="kvspec_agent"), table=page_table(config))
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
        block_ids = BlockIds(header.get("block_ids"))
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
            block_ends=None if ends is None else tuple(int(e) for e in ends),
        )
        return {}, b""

    def _pool_digests(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        buffers = [region.buffer for region in pool.pool.regions]
        regions = [digest(session.key, buffer).hex() for buffer in buffers]
        pages = digest_pages(session.key, pool.table, buffers) if header.get("pages") else b""
        return {"regions": regions}, pages

    def _pool_snapshot(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        pool.snapshot = digest_pages(session.key, pool.table, [region.buffer for region in pool.pool.regions])
        return {"pages": len(pool.table)}, b""

    def _pool_compare(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        pool = self._pool(session, header)
        if pool.snapshot is None:
            raise AgentRefusedError(f"pool.compare: pool {header['pool']} has no snapshot (pool.snapshot first)")
        now = digest_pages(session.key, pool.table, [region.buffer for region in pool.pool.regions])
        size = len(now) // max(1, len(pool.table))
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
        transport = self._backend.create_agent(_str(header, "name"))
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
        return {"peer": self._agent(session, header).transport.add_remote_agent(payload)}, b""

    def _agent_remove_remote(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        self._agent(session, header).transport.remove_remote_agent(_str(header, "peer"))
        return {}, b""

    def _agent_post(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        agent = self._agent(session, header)
        if agent.pool is None:
            raise AgentRefusedError(f"agent.post: agent {header['agent']} has no pool registered")
        mode = TransferMode(_str(header, "mode"))
        if len(payload) % 40:
            raise WireError(f"agent.post payload: expected 5 int64 columns (40 bytes a row), got {len(payload)} bytes")
        count = len(payload) // 40
        columns = [memoryview(payload)[i * 8 * count : (i + 1) * 8 * count].cast("q").tolist() for i in range(5)]
        descriptors = DescriptorList.from_columns(
            local_region=columns[0],
            local_offset=columns[1],
            remote_region=columns[2],
            remote_offset=columns[3],
            nbytes=columns[4],
        )
        # This side's memory is checked here, whatever the backend does: nothing outside the pool moves.
        local_sizes = [region.nbytes for region in session.pools[agent.pool].pool.regions]
        unbounded = [1 << 62] * (descriptors.bounds.regions[1] + 1)
        try:
            check_descriptors(descriptors, local_sizes=local_sizes, remote_sizes=unbounded)
        except PlanError as exc:
            raise PlanError(f"agent.post: a descriptor is outside the agent's pool: {exc}") from None
        note = header.get("notification")
        handle = agent.transport.post(
            mode,
            descriptors,
            peer=_str(header, "peer"),
            notification=None if note is None else bytes.fromhex(str(note)),
        )
        handle_id = session.new_id()
        agent.handles[handle_id] = handle
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
        agent = self._agent(session, header)
        del session.agents[header["agent"]]
        agent.transport.close()
        return {}, b""

    def _agent_kill(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        """Kill the agent's worker process at once (a peer lost without a goodbye); close it if it has none."""
        agent = self._agent(session, header)
        pid = getattr(agent.transport, "pid", None)
        in_process = bool(getattr(agent.transport, "in_process", False))
        agent.killed = True
        if isinstance(pid, int) and pid > 0 and pid != os.getpid() and not in_process:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return {"killed": pid}, b""
        with contextlib.suppress(TransportError):
            agent.transport.close()
        return {"killed": None}, b""

    def _bye(self, session: _Session, header: _Header, payload: bytes) -> _Reply:
        return {}, b""


def _seed(header: dict[str, Any], name: str) -> int | str:
    value = header.get(name, 0)
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise WireError(f"request field {name!r}: expected an int or a string, got {value!r}")
    return value


def _error(exc: KVSpecError) -> dict[str, Any]:
    body: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, TransportError):
        body["reason"] = exc.reason.value
    return {"ok": False, "error": body}


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
    from ._client import parse_address
    from ._wire import read_token

    host, port = parse_address(args.listen)
    token = read_token(args.token_file)
    server = AgentServer(
        args.backend,
        host=host,
        port=port,
        token=token,
        max_pool=args.max_pool,
        options=parse_backend_options(args.option),
    )
    signal.signal(signal.SIGINT, lambda signum, frame: server.stop())
    print(f"kvspec agent: serving {args.backend} on {server.address[0]}:{server.address[1]}", file=out, flush=True)
    server.serve_forever(handle_sigterm=True)
    print("kvspec agent: stopped", file=out, flush=True)
    return 0
