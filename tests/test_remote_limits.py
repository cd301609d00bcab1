"""The agent server's limits against a hostile client (issue 37, findings 4 to 6).

Aliasing pages cost digest work only for the bytes charged, and SIGTERM does
not wait for a digest; a silent client is dropped and its pools freed; the
unreleased posts are bounded; one source cannot keep the client out of the
pre-auth slots. Each test failed on the server before issue 37. They run the
loopback backend's server in a thread of this process, with short deadlines.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvspec_conformance.configs import full, make_config

from kvspec import TransferMode
from kvspec.remote import AgentClient, AgentRefusedError, AgentServer, RemoteAgent, RemotePool
from kvspec.tools._vectors import to_json
from kvspec.transport import Descriptor

TOKEN = b"a-test-token-of-32-bytes-exactly"
CONFIG = make_config(full(4), num_blocks=8)
PAGE = 64 << 10


@contextlib.contextmanager
def _server(**kwargs: Any) -> Iterator[tuple[AgentServer, list[str], threading.Thread]]:
    log: list[str] = []
    kwargs.setdefault("max_pool", 64 << 20)
    server = AgentServer("loopback", host="127.0.0.1", port=0, token=TOKEN, log=log.append, **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, log, thread
    finally:
        server.stop()
        thread.join(timeout=10)


def _big_page_config(layers: int, blocks: int, layer_stride: int) -> dict[str, Any]:
    """One tensor of ``blocks`` 64 KiB pages whose ``layers`` layers start ``layer_stride`` bytes apart."""
    names = [f"l{i}" for i in range(layers)]
    spec = dict(to_json(CONFIG)["kv_cache_groups"][0]["kv_cache_spec"], head_size=PAGE // 8, page_size_bytes=PAGE)
    size = PAGE * blocks + layer_stride * (layers - 1)
    return {
        "num_blocks": blocks,
        "kv_cache_tensors": [
            {"size": size, "layers": names, "layer_stride": layer_stride, "block_stride": PAGE, "offset": 0}
        ],
        "kv_cache_groups": [{"layer_names": names, "kv_cache_spec": spec}],
    }


class _CountingBlake2b:
    """hashlib.blake2b that adds the bytes it hashes to ``hashed`` (and sleeps ``delay`` a call)."""

    hashed = 0
    delay = 0.0
    real = hashlib.blake2b

    def __init__(self, data: Any = b"", **kwargs: Any) -> None:
        self._inner = self.real(**kwargs)
        self.update(data)

    def update(self, data: Any) -> None:
        type(self).hashed += memoryview(data).nbytes
        if self.delay:
            time.sleep(self.delay)
        self._inner.update(data)

    def digest(self) -> bytes:
        return self._inner.digest()


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[_CountingBlake2b]:
    counter = type("Counting", (_CountingBlake2b,), {"hashed": 0, "delay": 0.0})
    monkeypatch.setattr(hashlib, "blake2b", counter)
    return counter


# --------------------------------------------------------------------------- finding 4: digests


def test_aliasing_pages_are_hashed_once(counting: type[_CountingBlake2b]) -> None:
    """128 layers sharing one 1 MiB tensor: 2048 pages, 1 MiB of distinct bytes, not 128 MiB of hashing."""
    config = _big_page_config(layers=128, blocks=16, layer_stride=0)
    with _server() as (server, _, _), AgentClient(*server.address, TOKEN, timeout=30.0) as client:
        reply, _ = client.call("pool.create", config=config)
        counting.hashed = 0
        _, pages = client.call("pool.digests", pool=reply["pool"], pages=True)
        assert len(pages) == 16 * 128 * 16  # one digest a page, in page-table order, as before
        assert pages[:16] == pages[16 * 16 : 17 * 16]  # layer 1's page 0 is layer 0's page 0
        tensor = PAGE * 16
        assert counting.hashed <= 2 * tensor, f"{counting.hashed} bytes hashed for a {tensor}-byte pool"


def test_overlapping_pages_are_charged_for_their_hashing() -> None:
    """512 layers 64 bytes apart over 1 MiB: 512 MiB of distinct pages to hash, refused under --max-pool 64 MiB."""
    config = _big_page_config(layers=512, blocks=16, layer_stride=64)
    with _server() as (server, _, _), AgentClient(*server.address, TOKEN, timeout=30.0) as client:
        with pytest.raises(AgentRefusedError, match=r"--max-pool .*its pages overlap, and hashing them takes"):
            client.call("pool.create", config=config)
        client.call("pool.create", config=_big_page_config(layers=512, blocks=16, layer_stride=0))


def test_stop_does_not_wait_for_a_digest(counting: type[_CountingBlake2b]) -> None:
    with _server() as (server, _, thread), AgentClient(*server.address, TOKEN, timeout=30.0) as client:
        pool = RemotePool(client, make_config(full(4), num_blocks=64))  # 128 pages
        counting.delay = 0.03  # 3.8 s for the pages
        answer: list[object] = []

        def snapshot() -> None:
            try:
                answer.append(client.call("pool.snapshot", pool=pool.pool_id))
            except Exception as exc:  # the server stops under the call: any kvspec error will do
                answer.append(exc)

        caller = threading.Thread(target=snapshot)
        caller.start()
        time.sleep(0.3)
        started = time.monotonic()
        server.stop()
        thread.join(timeout=5)
        assert not thread.is_alive()
        assert time.monotonic() - started < 1.5, "stop() waited for the digest"
        caller.join(timeout=5)
        assert len(answer) == 1
        assert isinstance(answer[0], Exception), answer


# --------------------------------------------------------------------------- finding 5: a vanished client


def test_a_silent_client_is_dropped_and_its_pools_freed() -> None:
    with _server(idle_timeout=0.5) as (server, log, _):
        client = AgentClient(*server.address, TOKEN, timeout=5.0)
        RemotePool(client, CONFIG)
        client._closing.set()  # the client's host is gone: nothing more comes from it, not even its hello
        session = server._session
        assert session is not None
        (held,) = session.pools.values()
        names = [name for name in held.pool.shm_names if name]
        assert names
        assert all(Path("/dev/shm", name).exists() for name in names)
        conn = session.sock
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
        end = time.monotonic() + 3.0
        while server._session is not None and time.monotonic() < end:
            time.sleep(0.05)
        assert server._session is None, "a client silent past idle_timeout kept the server"
        assert any("no request for 0.5 s" in line for line in log), log
        assert not any(Path("/dev/shm", name).exists() for name in names)
        with AgentClient(*server.address, TOKEN, timeout=5.0) as again:
            assert again.backend_name == "loopback"
        client._sock.close()


def test_a_client_with_nothing_to_ask_stays_connected() -> None:
    """The client says hello a third of idle_timeout after its last call: only a vanished client is dropped."""
    with _server(idle_timeout=0.3) as (server, log, _), AgentClient(*server.address, TOKEN, timeout=5.0) as client:
        session = server._session
        time.sleep(0.8)
        assert server._session is session, log
        assert client.call("hello")[0]["idle_timeout"] == 0.3


# --------------------------------------------------------------------------- finding 6: posts, pre-auth slots


def test_unreleased_posts_are_bounded() -> None:
    with _server(max_posted=100_000) as (server, _, _), AgentClient(*server.address, TOKEN, timeout=5.0) as client:
        agents = []
        for name in ("producer", "consumer"):
            agent = RemoteAgent(client, name)
            agent.register_memory(RemotePool(client, CONFIG).regions)
            agents.append(agent)
        producer, consumer = agents
        peer = producer.add_remote_agent(consumer.get_agent_metadata())
        descriptors = [Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=8)] * 1000
        first = producer.post(TransferMode.WRITE, descriptors, peer=peer)  # 44,096 bytes charged
        producer.post(TransferMode.WRITE, descriptors, peer=peer)
        with pytest.raises(AgentRefusedError, match=r"unreleased posts \(--max-posted 100000, 88192 held\)"):
            producer.post(TransferMode.WRITE, descriptors, peer=peer)
        producer.release(first)
        producer.post(TransferMode.WRITE, descriptors, peer=peer)


def test_one_source_cannot_keep_the_client_out_of_the_pre_auth_slots() -> None:
    """Sixteen silent connections from the client's own address: the client still gets in, every time."""
    with _server(auth_timeout=5.0) as (server, log, _):
        silent = [socket.create_connection(server.address, timeout=5.0) for _ in range(16)]
        try:
            time.sleep(0.1)
            for _ in range(3):
                with AgentClient(*server.address, TOKEN, timeout=2.0) as client:
                    assert client.backend_name == "loopback"
                silent.append(socket.create_connection(server.address, timeout=5.0))
        finally:
            for sock in silent:
                sock.close()
        assert any("evicted the oldest silent handshake from 127.0.0.1" in line for line in log), log
