"""The suite's side of a two-host run: a client of ``kvspec agent serve``, its pools and agents.

Theory of operation. :class:`AgentClient` holds the one authenticated
connection. :class:`RemotePool` is a :class:`kvspec.testing.PagePool` whose
regions are a local *shadow*: every fill is applied to the shadow here and,
with the same arguments, to the real pool on the server, so the shadow holds
what the remote pool must hold. The oracle compares keyed digests of the
remote regions with the shadow's and reads remote bytes only to explain a
difference (:meth:`RemotePool.verified`). :class:`RemoteAgent` is a
:class:`kvspec.transport.Transport` whose every call is a request to the
server's agent. :class:`PeerBackend` puts one role's agent and pool on the
server and the other role's in the local backend.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs

from kvspec.core._descriptors import Descriptor, DescriptorList
from kvspec.core._enums import FailureReason, TransferMode
from kvspec.core._errors import ConfigError, KVSpecError, MalformedMessageError, TransportError, decode_error
from kvspec.core._models import BlockIds, KVCacheConfig
from kvspec.testing import PagePool, allocate_pool, fill_background, fill_producer_pages
from kvspec.tools._vectors import to_json
from kvspec.transport import (
    Backend,
    Capabilities,
    MemoryRegion,
    Notification,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
)
from kvspec.transport._base import closed_agent_error
from kvspec.transport._wire import (
    HEADER_LIMIT,
    PRE_AUTH_HEADER_LIMIT,
    AgentAuthError,
    FrameMac,
    PayloadSeal,
    WireError,
    client_mac,
    digest,
    digest_key,
    frame_key,
    keep_alive,
    new_nonce,
    no_delay,
    payload_key,
    recv_frame,
    require_aead,
    send_frame,
    server_mac,
)

__all__ = ["AgentClient", "PeerBackend", "RemoteAgent", "RemotePool", "parse_address"]

_REPLY_LIMIT = 256 << 20  # a reply payload: a read chunk (32 MiB) or page digests (16 bytes a page)
_READ_CHUNK = 32 << 20


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as a (host, port) pair; :class:`kvspec.ConfigError` when it is not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"agent address: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _remote_error(reply: dict[str, Any], where: str) -> KVSpecError:
    """The kvspec error the server reported, as the same class here where it is one (:func:`decode_error`)."""
    return decode_error(reply.get("error"), where=where)


def _reply_field(reply: dict[str, Any], name: str, kind: type, where: str) -> Any:
    """``reply[name]`` when it is a ``kind``; else :class:`kvspec.MalformedMessageError` naming it (a bad server)."""
    value = reply.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedMessageError(f"{where} reply field {name!r}: expected {kind.__name__}, got {value!r:.60}")
    return value


class AgentClient:
    """One authenticated connection to ``kvspec agent serve``.

    Both ends prove they hold the token, and every later frame carries a tag
    under a key derived from the token and this handshake's nonces
    (:class:`kvspec.transport._wire.FrameMac`), so nobody without the token can
    send a request or a reply on this connection, even one who relayed the
    handshake, and every payload is encrypted under another key from the same
    handshake (:class:`kvspec.transport._wire.PayloadSeal`), so an agent's
    metadata (NIXL's UCX address and registered ranges) never crosses in the
    clear. Every call waits at most ``timeout`` seconds; a broken or silent
    connection raises :class:`kvspec.TransportError` with reason
    ``PEER_DISCONNECTED``, so a driver ends its requests instead of hanging.
    Whatever the server sends, the client raises only kvspec errors.
    """

    def __init__(self, host: str, port: int, token: bytes, *, timeout: float = 30.0) -> None:
        self.address = (host, port)
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._pools: list[RemotePool] = []
        self._timeout = timeout
        self._closing = threading.Event()
        self._last_call = time.monotonic()
        require_aead()  # before connecting: a missing package is one line saying how to install it
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransportError(
                f"agent server {host}:{port}: cannot connect ({exc.strerror or exc})",
                reason=FailureReason.PEER_DISCONNECTED,
            ) from None
        deadline = time.monotonic() + timeout  # one deadline for the whole handshake
        try:
            no_delay(sock)
            keep_alive(sock)  # a server host that vanishes without a FIN is noticed between calls too
            header, _ = recv_frame(sock, header_limit=PRE_AUTH_HEADER_LIMIT, payload_limit=0, deadline=deadline)
            if header.get("ok") is False:
                raise _remote_error(header, f"agent server {host}:{port}")
            if header.get("op") != "challenge":
                raise AgentAuthError(f"agent server {host}:{port}: expected a challenge, got {header.get('op')!r:.60}")
            theirs = bytes.fromhex(str(header.get("nonce", "")))
            if len(theirs) < 16:
                raise AgentAuthError(f"agent server {host}:{port}: expected a nonce of at least 16 bytes")
            mine = new_nonce()
            send_frame(sock, {"op": "auth", "mac": client_mac(token, theirs, mine).hex(), "nonce": mine.hex()})
            reply, _ = recv_frame(sock, header_limit=PRE_AUTH_HEADER_LIMIT, payload_limit=0, deadline=deadline)
            if reply.get("ok") is not True:
                raise _remote_error(reply, f"agent server {host}:{port}")
            proof = bytes.fromhex(str(reply.get("mac", "")))
            if not hmac.compare_digest(proof, server_mac(token, theirs, mine)):
                raise AgentAuthError(f"agent server {host}:{port}: it does not hold the token")
        except (OSError, ValueError) as exc:
            sock.close()
            if isinstance(exc, KVSpecError):
                raise
            raise AgentAuthError(f"agent server {host}:{port}: handshake failed ({exc})") from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.key = digest_key(token, theirs, mine)
        self._mac = FrameMac(frame_key(token, theirs, mine), "client")
        self._seal = PayloadSeal(payload_key(token, theirs, mine), "client")
        hello, _ = self.call("hello")
        self.backend_name = _reply_field(hello, "backend", str, "hello")
        self.capabilities = _capabilities(_reply_field(hello, "capabilities", dict, "hello"))
        idle = hello.get("idle_timeout")  # absent from servers before issue 37
        if isinstance(idle, (int, float)) and not isinstance(idle, bool) and idle > 0:
            threading.Thread(target=self._keep_session, args=(idle / 3,), name="kvspec-agent-ping", daemon=True).start()

    def _keep_session(self, every: float) -> None:
        """Say ``hello`` when no call went out for ``every`` seconds: the server drops only a client that is gone."""
        while not self._closing.wait(every / 2) and self._broken is None:
            if time.monotonic() - self._last_call >= every:
                with contextlib.suppress(KVSpecError):
                    self.call("hello")

    def call(self, op: str, payload: bytes | memoryview = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        """One request and its reply; the server's kvspec error is raised here as the same class."""
        with self._lock:
            if self._broken is not None:
                raise TransportError(self._broken, reason=FailureReason.PEER_DISCONNECTED)
            try:
                send_frame(self._sock, {"op": op, **fields}, self._seal.seal(op, payload), self._mac)
                reply, sealed = recv_frame(
                    self._sock,
                    header_limit=HEADER_LIMIT,
                    payload_limit=_REPLY_LIMIT + PayloadSeal.TAG_SIZE,
                    deadline=time.monotonic() + self._timeout,
                    mac=self._mac,
                )
                body = self._seal.open(op, sealed)
            except (OSError, WireError, AgentAuthError) as exc:
                self._closing.set()
                self._broken = f"agent server {self.address[0]}:{self.address[1]}: connection lost during {op} ({exc})"
                with contextlib.suppress(OSError):
                    self._sock.close()
                raise TransportError(self._broken, reason=FailureReason.PEER_DISCONNECTED) from None
            self._last_call = time.monotonic()
        if reply.get("ok") is not True:
            raise _remote_error(reply, f"agent server {op}")
        return reply, body

    def pool_of(self, regions: Sequence[MemoryRegion]) -> RemotePool:
        """The remote pool whose shadow regions are ``regions`` (what the suite registers with a remote agent)."""
        for pool in self._pools:
            if len(pool.regions) == len(regions) and all(a is b for a, b in zip(pool.regions, regions, strict=True)):
                return pool
        raise ConfigError(
            "RemoteAgent.register_memory: expected the regions of a RemotePool of this client "
            "(a remote agent registers memory on its own host), got other regions"
        )

    def close(self) -> None:
        """Say goodbye and close the connection; the server then frees everything this client held."""
        self._closing.set()
        if self._broken is None:
            with contextlib.suppress(KVSpecError):
                self.call("bye")
        self._broken = self._broken or "the agent client is closed"
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _capabilities(body: dict[str, Any]) -> Capabilities:
    names = {f.name for f in attrs.fields(Capabilities)}
    values: dict[str, Any] = {k: v for k, v in body.items() if k in names and k != "modes"}
    try:
        return Capabilities(modes=frozenset(TransferMode(m) for m in body.get("modes", [])), **values)
    except KVSpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise MalformedMessageError(f"agent server reply field 'capabilities': {type(exc).__name__}: {exc}") from None


class RemotePool(PagePool):
    """A pool on the agent server, with a local shadow of what it must hold (see the module docstring)."""

    def __init__(self, client: AgentClient, config: KVCacheConfig) -> None:
        shadow = [MemoryRegion(buffer=memoryview(bytearray(tensor.size))) for tensor in config.kv_cache_tensors]
        super().__init__(config, shadow)
        reply, _ = client.call("pool.create", config=to_json(config))
        self.client = client
        self.pool_id: int = _reply_field(reply, "pool", int, "pool.create")
        client._pools.append(self)

    def fill_background(self, *, seed: int | str) -> None:
        """:func:`kvspec.testing.fill_background`, here and on the server."""
        fill_background(self, seed=seed)
        self.client.call("pool.fill_background", pool=self.pool_id, seed=seed)

    def fill_producer_pages(
        self,
        block_ids: BlockIds,
        *,
        num_tokens: int,
        salt: int | str = 0,
        block_ends: Sequence[int] | None = None,
    ) -> None:
        """:func:`kvspec.testing.fill_producer_pages`, here and on the server."""
        fill_producer_pages(self, block_ids, num_tokens=num_tokens, salt=salt, block_ends=block_ends)
        self.client.call(
            "pool.fill_pages",
            pool=self.pool_id,
            block_ids=block_ids.to_lists(),
            num_tokens=num_tokens,
            salt=salt,
            block_ends=None if block_ends is None else list(block_ends),
        )

    def differing_regions(self) -> list[int]:
        """Regions whose remote digest differs from the shadow's (keyed BLAKE2b; no page bytes travel)."""
        reply, _ = self.client.call("pool.digests", pool=self.pool_id)
        regions = _reply_field(reply, "regions", list, "pool.digests")
        try:
            remote = [bytes.fromhex(d) for d in regions]
        except (TypeError, ValueError):
            raise MalformedMessageError("pool.digests reply field 'regions': expected hex digests") from None
        if len(remote) != len(self.regions):
            raise MalformedMessageError(
                f"pool.digests reply field 'regions': expected {len(self.regions)} digests, got {len(remote)}"
            )
        key = self.client.key
        return [i for i, r in enumerate(self.regions) if not hmac.compare_digest(remote[i], digest(key, r.buffer))]

    def read(self, region: int, offset: int, nbytes: int) -> bytes:
        """Bytes of the remote pool (to explain a mismatch), in bounded chunks."""
        parts = []
        for start in range(offset, offset + nbytes, _READ_CHUNK):
            size = min(_READ_CHUNK, offset + nbytes - start)
            _, body = self.client.call("pool.read", pool=self.pool_id, region=region, offset=start, nbytes=size)
            parts.append(body)
        return b"".join(parts)

    def verified(self) -> PagePool:
        """A pool that holds the remote pool's bytes: the shadow when every digest matches, else a copy read back."""
        differing = self.differing_regions()
        if not differing:
            return self
        regions = [
            MemoryRegion(buffer=memoryview(bytearray(self.read(i, 0, r.nbytes) if i in differing else r.buffer)))
            for i, r in enumerate(self.regions)
        ]
        return PagePool.from_regions(self.config, regions)

    def close(self) -> None:
        """Free the remote pool (the server frees it anyway when the client goes) and the shadow."""
        if not self.closed:
            with contextlib.suppress(KVSpecError):
                self.client.call("pool.destroy", pool=self.pool_id)
            with contextlib.suppress(ValueError):
                self.client._pools.remove(self)
        super().close()

    def __repr__(self) -> str:
        return f"RemotePool(pool={self.pool_id}, server={self.client.address[0]}:{self.client.address[1]})"


class RemoteAgent:
    """A :class:`kvspec.transport.Transport` whose agent runs in ``kvspec agent serve``; every call is one request."""

    def __init__(self, client: AgentClient, name: str) -> None:
        reply, _ = client.call("agent.create", name=name)
        self._client = client
        self._id: int = _reply_field(reply, "agent", int, "agent.create")
        self._name: str = _reply_field(reply, "name", str, "agent.create")
        self._capabilities = _capabilities(_reply_field(reply, "capabilities", dict, "agent.create"))
        self._closed = False

    @property
    def name(self) -> str:
        """The agent's name, as its backend gave it."""
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        """The remote agent's capabilities."""
        return self._capabilities

    def _call(self, op: str, payload: bytes | memoryview = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        if self._closed:
            raise closed_agent_error(self._name)
        return self._client.call(op, payload, agent=self._id, **fields)

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register the remote pool whose shadow ``regions`` are (a :class:`RemotePool` of the same client)."""
        pool = self._client.pool_of(regions)
        self._call("agent.register", pool=pool.pool_id)

    def get_agent_metadata(self) -> bytes:
        """The remote agent's metadata, as its backend gives it."""
        return self._call("agent.metadata")[1]

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata into the remote agent (sent over the authenticated channel)."""
        return str(_reply_field(self._call("agent.add_remote", metadata)[0], "peer", str, "agent.add_remote"))

    def remove_remote_agent(self, peer: str) -> None:
        """Make the remote agent forget ``peer``."""
        self._call("agent.remove_remote", peer=peer)

    def post(
        self,
        mode: TransferMode,
        descriptors: Sequence[Descriptor],
        *,
        peer: str,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Post on the remote agent; the server checks its side of every descriptor against its pool (PLAN-1)."""
        table = DescriptorList.of(descriptors)
        reply, _ = self._call(
            "agent.post",
            table.to_bytes(),
            mode=TransferMode(mode).value,
            peer=peer,
            notification=None if notification is None else bytes(notification).hex(),
        )
        return TransferHandle(transfer_id=_reply_field(reply, "handle", int, "agent.post"), peer=peer, mode=mode)

    def check(self, handle: TransferHandle) -> TransferStatus:
        """The remote agent's status of the transfer; a lost server reports FAILED(peer_disconnected)."""
        try:
            reply, _ = self._call("agent.check", handle=handle.transfer_id)
        except TransportError as exc:
            if exc.reason is not FailureReason.PEER_DISCONNECTED:
                raise
            return TransferStatus(state=TransferState.FAILED, reason=exc.reason, detail=str(exc))
        reason = reply.get("reason")
        try:
            return TransferStatus(
                state=TransferState(reply.get("state")),
                reason=None if reason is None else FailureReason(reason),
                detail=str(reply.get("detail", "")),
            )
        except KVSpecError:
            raise
        except (TypeError, ValueError) as exc:
            raise MalformedMessageError(f"agent.check reply: expected a transfer status ({exc})") from None

    def release(self, handle: TransferHandle) -> None:
        """Release the handle on the remote agent."""
        self._call("agent.release", handle=handle.transfer_id)

    def send_notification(self, peer: str, message: bytes) -> None:
        """Have the remote agent send ``message`` to ``peer``."""
        self._call("agent.notify", bytes(message), peer=peer)

    def get_notifications(self) -> Sequence[Notification]:
        """Drain the remote agent's notifications."""
        reply, body = self._call("agent.notifications")
        notes, at = [], 0
        for entry in _reply_field(reply, "notes", list, "agent.notifications"):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int) and entry[1] >= 0):
                raise MalformedMessageError("agent.notifications reply field 'notes': expected [peer, size] pairs")
            notes.append(Notification(peer=str(entry[0]), message=body[at : at + entry[1]]))
            at += entry[1]
        if at != len(body):
            raise MalformedMessageError(f"agent.notifications reply: sizes add up to {at}, the payload has {len(body)}")
        return notes

    def kill(self) -> None:
        """Kill the remote agent's worker process at once (peer loss without a goodbye)."""
        self._call("agent.kill")

    def close(self) -> None:
        """Close the remote agent; idempotent, and quiet when the server is already gone."""
        if self._closed:
            return
        with contextlib.suppress(TransportError):
            self._call("agent.close")
        self._closed = True

    def __repr__(self) -> str:
        return f"RemoteAgent({self._name!r}, server={self._client.address[0]}:{self._client.address[1]})"


class PeerBackend:
    """A Backend whose producer agent and pool live on an agent server; the consumer's are local.

    The suite's oracle reads the consumer's pool directly and the producer's
    through digests (:meth:`RemotePool.verified`). READ then pulls
    across the hosts (the local consumer initiates) and WRITE pushes across
    them (the remote producer initiates).
    """

    remote_role = "producer"

    def __init__(self, local: Backend, client: AgentClient) -> None:
        if client.backend_name != local.name:
            raise ConfigError(
                f"PeerBackend: expected the agent server to run backend {local.name!r}, got {client.backend_name!r}"
            )
        self.local = local
        self.client = client
        here, there = local.capabilities, client.capabilities
        self._capabilities = attrs.evolve(
            here,
            modes=here.modes & there.modes,
            notifications=here.notifications and there.notifications,
            cross_process=True,
            integrity=here.integrity and there.integrity,
            observable_in_flight=here.observable_in_flight and there.observable_in_flight,
            immediate_cancel=here.immediate_cancel and there.immediate_cancel,
            remote_pools=True,
        )

    @property
    def name(self) -> str:
        """The local backend's name (the server runs the same backend)."""
        return self.local.name

    @property
    def capabilities(self) -> Capabilities:
        """What both sides can do, with ``remote_pools`` set."""
        return self._capabilities

    def create_agent(self, name: str) -> Transport:
        """A :class:`RemoteAgent` for ``remote_role``, else an agent of the local backend."""
        if name == self.remote_role:
            return RemoteAgent(self.client, name)
        return self.local.create_agent(name)

    def allocate_pool(self, role: str, config: KVCacheConfig) -> PagePool:
        """A :class:`RemotePool` for ``remote_role``, else a local shared-memory pool."""
        if role == self.remote_role:
            return RemotePool(self.client, config)
        return allocate_pool(config)

    def close(self) -> None:
        """Close the local backend and the connection (the server then closes its agents and pools)."""
        try:
            self.local.close()
        finally:
            self.client.close()
