"""The agent channel hides what opens a worker's memory (issue 37, finding 1): payloads are encrypted.

NIXL's metadata (its UCX address and the registered ranges) lets whoever
holds it read and write the worker's whole process over UCX/TCP, so a passive
observer of the agent channel must not find it there. These tests record
every byte between the suite and ``kvspec agent serve`` through a relay, and
check the encryption itself: a changed, replayed, reflected or foreign
payload is one kvspec error, and the key is fresh per handshake. The
loopback tests take well under a second; the NIXL one about two.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import require_backend_module
from kvspec_conformance.configs import full, make_config

from kvspec import BackendUnavailableError, ConfigError, KVSpecError, TransportError
from kvspec.remote import AgentAuthError, AgentClient, AgentServer, RemoteAgent, RemotePool
from kvspec.remote._server import PAGE_COST
from kvspec.transport import _netaddr
from kvspec.transport._netaddr import interface_of
from kvspec.transport._wire import (
    FrameMac,
    PayloadSeal,
    digest_key,
    frame_key,
    new_nonce,
    payload_key,
    recv_frame,
    send_frame,
    server_mac,
)

TOKEN = b"a-test-token-of-32-bytes-exactly"
CONFIG = make_config(full(2), num_blocks=4)
POOL_BYTES = sum(t.size for t in CONFIG.kv_cache_tensors)


@contextlib.contextmanager
def _server(backend: str = "loopback", **options: Any) -> Iterator[tuple[AgentServer, list[str]]]:
    log: list[str] = []
    server = AgentServer(
        backend,
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        max_pool=4 * POOL_BYTES + 64 * PAGE_COST,
        options=options,
        log=log.append,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, log
    finally:
        server.stop()
        thread.join(timeout=20)


class _Tap:
    """A TCP relay between a client and ``target`` that records every byte both ways: a passive observer."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(self._target, timeout=10.0)
        for source, sink in ((client, server), (server, client)):
            thread = threading.Thread(target=self._pump, args=(source, sink), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(1 << 16):
                with self._lock:
                    self.seen += chunk
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> bytes:
        """Everything the observer saw, once both directions ended."""
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=10)
        return bytes(self.seen)


def _leaks(secret: bytes, seen: bytes, width: int = 16) -> list[int]:
    """Offsets of ``secret``'s ``width``-byte windows (those with 8+ distinct bytes) found verbatim in ``seen``."""
    windows = range(0, max(1, len(secret) - width + 1), 4)
    return [i for i in windows if len(set(secret[i : i + width])) >= 8 and secret[i : i + width] in seen]


def test_a_passive_observer_of_the_agent_channel_finds_no_agent_metadata() -> None:
    """agent.metadata's reply and agent.add_remote's request cross the wire encrypted (old code: in the clear)."""
    with _server() as (server, _):
        tap = _Tap(server.address)
        with AgentClient(*tap.address, TOKEN, timeout=10.0) as client:
            pool = RemotePool(client, CONFIG)
            producer, consumer = RemoteAgent(client, "producer"), RemoteAgent(client, "consumer")
            producer.register_memory(pool.regions)
            metadata = producer.get_agent_metadata()
            assert consumer.add_remote_agent(metadata) == producer.name  # the channel still works
            assert client.call("pool.read", pool=pool.pool_id, region=0, offset=0, nbytes=64)[1] == bytes(64)
            peer_metadata = consumer.get_agent_metadata()
            for agent in (producer, consumer):
                agent.close()
            pool.close()
        seen = tap.close()
    assert b"agent.metadata" in seen, "the relay did not see the session"  # headers stay readable
    for secret in (metadata, peer_metadata):
        assert secret not in seen
        assert _leaks(secret, seen) == [], secret


@pytest.mark.nixl
def test_nixl_metadata_and_pool_addresses_never_cross_in_the_clear(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The observer finds neither NIXL's blob (UCX address) nor the addresses of the registered pool.

    And the agent's UCX was created on the interface of the address the server serves (loopback here).
    """
    require_backend_module(pytestconfig, "nixl_cu12", "nixl")
    require_backend_module(pytestconfig, "numpy", "nixl")
    from kvspec.transport._nixl_worker import unpack_metadata

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)  # no user's choice: the served address decides
    with _server("nixl", in_process="producer") as (server, _):  # no worker to start: about 0.5 s
        tap = _Tap(server.address)
        with AgentClient(*tap.address, TOKEN, timeout=30.0) as client:
            pool = RemotePool(client, CONFIG)
            agent = RemoteAgent(client, "producer")
            agent.register_memory(pool.regions)
            metadata = agent.get_agent_metadata()
            assert server._session is not None
            (served,) = server._session.agents.values()
            info: Any = served.transport.info()  # type: ignore[attr-defined]
            assert info["env"]["UCX_NET_DEVICES"] == interface_of("127.0.0.1") == "lo"
            agent.close()
            pool.close()
        seen = tap.close()
    _, regions, blob = unpack_metadata(metadata)
    assert regions, "expected the registered pool in NIXL's metadata"
    assert _leaks(blob, seen) == []
    for address, _ in regions:
        assert str(address).encode() not in seen
        assert address.to_bytes(8, "little") not in seen


# --------------------------------------------------------------------------- UCX faces the peer


def _worker_env(**options: Any) -> dict[str, str]:
    """The environment the NIXL workers of an agent server on 127.0.0.1 start with (no worker is started)."""
    from kvspec.transport.nixl import NixlBackend

    server = AgentServer("nixl", host="127.0.0.1", port=0, token=TOKEN, options=options)
    try:
        assert isinstance(server.backend, NixlBackend)
        return server.backend.worker_env()
    finally:
        server.close()


@pytest.mark.nixl
def test_the_agent_servers_nixl_workers_use_the_interface_it_serves_on(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCX_NET_DEVICES is the interface that owns the served address (here a stand-in for a NIC), never all."""
    require_backend_module(pytestconfig, "nixl_cu12", "nixl")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setattr(_netaddr, "interface_of", {"127.0.0.1": "kvspec-nic0"}.get)
    env = _worker_env()
    assert (env["UCX_NET_DEVICES"], env.get("UCX_TLS")) == ("kvspec-nic0", "tcp")
    assert _worker_env(net_devices="lo")["UCX_NET_DEVICES"] == "lo"  # an option wins


@pytest.mark.nixl
def test_a_users_ucx_net_devices_is_kept(pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend_module(pytestconfig, "nixl_cu12", "nixl")
    from kvspec.transport.nixl import NixlBackend

    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    env = _worker_env()  # not the served address's lo
    assert (env["UCX_NET_DEVICES"], env.get("UCX_TLS")) == ("mlx5_0:1", None)
    with NixlBackend() as backend:
        assert backend.worker_env()["UCX_NET_DEVICES"] == "mlx5_0:1"
    with NixlBackend(net_devices="lo") as backend:
        assert backend.worker_env()["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0;rm -rf")
    with pytest.raises(ConfigError, match=r"NixlBackend\.net_devices: .*got 'eth0;rm -rf' \(from UCX_NET_DEVICES\)"):
        NixlBackend()


# --------------------------------------------------------------------------- the seal itself


def _pair() -> tuple[PayloadSeal, PayloadSeal]:
    server_nonce, client_nonce = new_nonce(), new_nonce()
    key = payload_key(TOKEN, server_nonce, client_nonce)
    return PayloadSeal(key, "client"), PayloadSeal(key, "server")


def test_sealed_payloads_open_once_in_order_for_their_op_and_direction() -> None:
    client, server = _pair()
    first, second = client.seal("agent.add_remote", b"metadata"), client.seal("agent.add_remote", b"metadata")
    assert first != second  # a fresh nonce per message
    assert b"metadata" not in first
    assert server.open("agent.add_remote", first) == b"metadata"
    with pytest.raises(AgentAuthError, match=r"payload 2 \('agent.add_remote'\): it does not decrypt"):
        server.open("agent.add_remote", first)  # replayed: the second message has another number
    client, server = _pair()
    sealed = bytearray(client.seal("agent.metadata", b"x" * 64))
    sealed[5] ^= 1
    with pytest.raises(AgentAuthError, match="does not decrypt"):
        server.open("agent.metadata", bytes(sealed))  # changed
    client, server = _pair()
    with pytest.raises(AgentAuthError, match="does not decrypt"):
        server.open("agent.notify", client.seal("agent.add_remote", b"metadata"))  # moved to another op
    client, server = _pair()
    with pytest.raises(AgentAuthError, match="does not decrypt"):
        client.open("hello", client.seal("hello", b"metadata"))  # reflected back to its sender
    with pytest.raises(AgentAuthError, match="expected at least 16 bytes"):
        server.open("hello", b"short")
    other, _ = _pair()
    with pytest.raises(AgentAuthError, match="does not decrypt"):
        _pair()[1].open("hello", other.seal("hello", b"metadata"))  # another handshake's key


def test_the_payload_key_is_fresh_per_handshake_and_apart_from_the_other_keys() -> None:
    server_nonce, client_nonce = new_nonce(), new_nonce()
    key = payload_key(TOKEN, server_nonce, client_nonce)
    assert len(key) == 32
    assert key == payload_key(TOKEN, server_nonce, client_nonce)
    assert key != payload_key(TOKEN, new_nonce(), client_nonce)
    assert key != payload_key(TOKEN, server_nonce, new_nonce())
    assert key != payload_key(b"another-token-of-32-bytes-random", server_nonce, client_nonce)
    assert key not in (frame_key(TOKEN, server_nonce, client_nonce), digest_key(TOKEN, server_nonce, client_nonce))
    # The salt length-prefixes each nonce: moving a byte from one nonce to the other gives another key.
    assert key != payload_key(TOKEN, server_nonce + client_nonce[:1], client_nonce[1:])


def test_two_sessions_encrypt_the_same_payload_differently() -> None:
    sealed = []
    with _server() as (server, _):
        for _ in range(2):
            with AgentClient(*server.address, TOKEN, timeout=5.0) as client:
                sealed.append(client._seal.seal("agent.metadata", b"the same metadata"))
    assert sealed[0] != sealed[1]


def test_a_payload_that_does_not_open_drops_the_client_with_one_line() -> None:
    """A frame with a good tag but a payload under another key: the server logs one line and drops that client."""
    with _server() as (server, log):
        client = AgentClient(*server.address, TOKEN, timeout=5.0)
        foreign, _ = _pair()
        send_frame(client._sock, {"op": "hello"}, foreign.seal("hello", b""), client._mac)
        with pytest.raises((ConnectionError, OSError)):
            recv_frame(client._sock, header_limit=1 << 20, payload_limit=1 << 20, deadline=None)
        client._sock.close()
        dropped = [line for line in log if "dropping" in line]
        assert len(dropped) == 1, log
        assert "payload 2 ('hello'): it does not decrypt under this session's key" in dropped[0]  # hello was 1
        with AgentClient(*server.address, TOKEN, timeout=5.0) as again:  # the server goes on
            assert again.backend_name == "loopback"


def test_a_reflected_reply_is_one_kvspec_error_for_the_client() -> None:
    """A server that holds the tags' key but sends the client's own sealed payload back: TransportError, one line."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            nonce = new_nonce()
            send_frame(conn, {"op": "challenge", "nonce": nonce.hex()})
            auth, _ = recv_frame(conn, header_limit=512, payload_limit=0)
            theirs = bytes.fromhex(auth["nonce"])
            send_frame(conn, {"ok": True, "mac": server_mac(TOKEN, nonce, theirs).hex()})
            mac = FrameMac(frame_key(TOKEN, nonce, theirs), "server")
            _, payload = recv_frame(conn, header_limit=1 << 20, payload_limit=1 << 20, mac=mac)
            send_frame(conn, {"ok": True, "backend": "loopback", "capabilities": {}}, payload, mac)
            with contextlib.suppress(OSError):
                conn.recv(1)

    host, port = listener.getsockname()[:2]
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(TransportError, match=r"connection lost during hello \(payload 1 \('hello'\): it does not"):
            AgentClient(host, port, TOKEN, timeout=5.0)
    finally:
        thread.join(timeout=5)
        listener.close()


def test_without_cryptography_the_agent_is_one_line_saying_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    for start in (
        lambda: AgentServer("loopback", host="127.0.0.1", port=0, token=TOKEN),
        lambda: AgentClient("127.0.0.1", 9, TOKEN, timeout=1.0),
    ):
        with pytest.raises(BackendUnavailableError, match=r"'cryptography' package.*kvspec\[remote\]") as caught:
            start()
        assert isinstance(caught.value, KVSpecError)
        assert "\n" not in str(caught.value)
