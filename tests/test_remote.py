"""The agent server's control channel on 127.0.0.1: authentication first, ownership, limits, one client, shutdown.

The server runs the loopback backend in a thread of this process (or, for
signals, ``kvspec agent serve loopback`` in a child process): these tests are
about the channel, not about moving bytes between hosts (tests/test_two_hosts.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kvspec_conformance import Outcome, run_suite
from kvspec_conformance.configs import full, make_config

from kvspec import BlockIds, FailureReason, MalformedMessageError, PlanError, TransferMode, TransportError
from kvspec.remote import (
    AgentAuthError,
    AgentClient,
    AgentRefusedError,
    AgentServer,
    PeerBackend,
    RemoteAgent,
    RemotePool,
    read_token,
)
from kvspec.remote._server import _HANDLERS, PAGE_COST
from kvspec.testing import MismatchKind, check_pools
from kvspec.transport import Descriptor, TransferHandle, TransferState, Transport
from kvspec.transport._wire import MAGIC, client_mac, new_nonce, recv_frame, send_frame

TOKEN = b"a-test-token-of-32-bytes-exactly"
CONFIG = make_config(full(4), num_blocks=8)
# What one pool counts against --max-pool: its tensors and PAGE_COST bytes of bookkeeping a page.
POOL_BYTES = sum(t.size for t in CONFIG.kv_cache_tensors) + PAGE_COST * CONFIG.num_blocks * 2


@contextlib.contextmanager
def _server(**kwargs: object) -> Iterator[AgentServer]:
    server = AgentServer("loopback", host="127.0.0.1", port=0, token=TOKEN, log=lambda _: None, **kwargs)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the agent server did not stop"


@pytest.fixture
def server() -> Iterator[AgentServer]:
    with _server(max_pool=4 * POOL_BYTES) as running:
        yield running


def _client(server: AgentServer, token: bytes = TOKEN) -> AgentClient:
    return AgentClient(*server.address, token, timeout=10.0)


def _raw(server: AgentServer) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=5.0)
    return sock


def _closed_without_reply(sock: socket.socket) -> bool:
    """True when the server closed ``sock`` without sending another frame."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# --------------------------------------------------------------------------- authentication


def test_right_token_is_served(server: AgentServer) -> None:
    with _client(server) as client:
        assert client.backend_name == "loopback"
        assert len(client.key) == 32


def test_wrong_token_is_refused(server: AgentServer) -> None:
    with pytest.raises(AgentAuthError, match="wrong token"):
        _client(server, token=b"another-token-of-32-bytes-length")
    # The refusal did not wedge the server: the right token is served next.
    with _client(server) as client:
        assert client.backend_name == "loopback"


def test_nothing_is_served_before_authentication(server: AgentServer) -> None:
    for op in sorted(_HANDLERS):
        sock = _raw(server)
        header, _ = recv_frame(sock, header_limit=512, payload_limit=0)
        assert header["op"] == "challenge"
        send_frame(sock, {"op": op, "pool": 1, "agent": 1})  # a request instead of the answer
        assert _closed_without_reply(sock), f"{op} got a reply before authentication"
        sock.close()


def test_oversized_frame_before_authentication_is_dropped(server: AgentServer) -> None:
    sock = _raw(server)
    recv_frame(sock, header_limit=512, payload_limit=0)
    # Announces 1 GiB of payload: dropped on the prefix alone, nothing allocated or read.
    sock.sendall(MAGIC + (10).to_bytes(4, "big") + (1 << 30).to_bytes(8, "big"))
    assert _closed_without_reply(sock)
    sock.close()


def test_a_mac_over_another_nonce_is_refused(server: AgentServer) -> None:
    """A replayed answer (computed for another challenge) fails the constant-time comparison."""
    sock = _raw(server)
    recv_frame(sock, header_limit=512, payload_limit=0)
    mine = new_nonce()
    send_frame(sock, {"op": "auth", "mac": client_mac(TOKEN, new_nonce(), mine).hex(), "nonce": mine.hex()})
    reply, _ = recv_frame(sock, header_limit=512, payload_limit=0)
    assert reply["ok"] is False
    assert reply["error"]["type"] == "AgentAuthError"
    assert _closed_without_reply(sock)
    sock.close()


def test_client_refuses_a_server_without_the_token() -> None:
    """Both ends prove the token: a server that answers "ok" without proving it is refused by the client."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = listener.accept()
        send_frame(conn, {"op": "challenge", "nonce": new_nonce().hex()})
        recv_frame(conn, header_limit=512, payload_limit=0)
        send_frame(conn, {"ok": True, "mac": "00" * 32})
        conn.close()

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    host, port = listener.getsockname()[:2]
    with pytest.raises(AgentAuthError, match="does not hold the token"):
        AgentClient(host, port, TOKEN, timeout=5.0)
    thread.join(timeout=5)
    listener.close()


def test_token_is_at_least_16_bytes(tmp_path: Path) -> None:
    short = tmp_path / "token"
    short.write_bytes(b"short\n")
    with pytest.raises(AgentAuthError, match="at least 16 bytes"):
        read_token(str(short))
    with pytest.raises(AgentAuthError, match="KVSPEC_AGENT_TOKEN"):
        read_token(None, environ={})
    assert read_token(None, environ={"KVSPEC_AGENT_TOKEN": TOKEN.decode()}) == TOKEN


# --------------------------------------------------------------------------- ownership and limits


def test_requests_naming_what_the_client_does_not_own_are_refused(server: AgentServer) -> None:
    with _client(server) as client:
        pool = RemotePool(client, CONFIG)
        agent = RemoteAgent(client, "producer")
        requests: list[tuple[str, dict[str, Any]]] = [
            ("pool.read", {"pool": pool.pool_id + 100, "region": 0, "offset": 0, "nbytes": 1}),
            ("pool.fill_background", {"pool": 999, "seed": "x"}),
            ("pool.digests", {"pool": -1}),
            ("agent.metadata", {"agent": agent._id + 100}),
            ("agent.register", {"agent": agent._id, "pool": 999}),
            ("agent.check", {"agent": agent._id, "handle": 12345}),
            ("agent.release", {"agent": agent._id, "handle": 12345}),
        ]
        for op, fields in requests:
            with pytest.raises(AgentRefusedError, match=r"not an? "):
                client.call(op, **fields)
        with pytest.raises(AgentRefusedError, match="expected one of"):
            client.call("shell", command="id")


def test_memory_outside_the_pool_is_refused(server: AgentServer) -> None:
    with _client(server) as client:
        pool = RemotePool(client, CONFIG)
        size = pool.regions[0].nbytes
        with pytest.raises(AgentRefusedError, match="outside pool"):
            pool.read(0, size - 4, 8)
        with pytest.raises(AgentRefusedError, match="outside pool"):
            pool.read(len(pool.regions), 0, 1)
        with pytest.raises(AgentRefusedError, match="outside pool"):
            client.call("pool.fill_pages", pool=pool.pool_id, block_ids=[[CONFIG.num_blocks]], num_tokens=4, salt="s")
        # A descriptor outside the agent's own pool is refused before the backend sees it (PLAN-1).
        agent = RemoteAgent(client, "producer")
        agent.register_memory(pool.regions)
        outside = Descriptor(local_region=0, local_offset=size - 4, remote_region=0, remote_offset=0, nbytes=8)
        with pytest.raises(PlanError, match="outside the agent's pool"):
            agent.post(TransferMode.WRITE, [outside], peer="nobody")
        inside = Descriptor(local_region=0, local_offset=0, remote_region=0, remote_offset=0, nbytes=8)
        with pytest.raises(TransportError, match="unknown or disconnected peer") as caught:
            agent.post(TransferMode.WRITE, [inside], peer="nobody")  # inside: reaches the backend, which refuses
        assert caught.value.reason is FailureReason.PEER_DISCONNECTED


def test_register_memory_takes_only_this_clients_remote_pools(server: AgentServer) -> None:
    from kvspec.testing import allocate_pool

    with _client(server) as client, allocate_pool(CONFIG) as local:
        agent = RemoteAgent(client, "producer")
        with pytest.raises(ValueError, match="regions of a RemotePool"):
            agent.register_memory(local.regions)


def test_max_pool_is_enforced() -> None:
    with _server(max_pool=2 * POOL_BYTES) as server, _client(server) as client:
        first, second = RemotePool(client, CONFIG), RemotePool(client, CONFIG)
        with pytest.raises(AgentRefusedError, match="max-pool"):
            RemotePool(client, CONFIG)
        second.close()  # freeing one makes room for one again
        third = RemotePool(client, CONFIG)
        assert third.pool_id not in (first.pool_id, second.pool_id)


def test_one_client_at_a_time(server: AgentServer) -> None:
    with _client(server), pytest.raises(AgentRefusedError, match="one client at a time"):
        _client(server)
    # Once the first is gone, the next is served (its pools were freed with it).
    with _client(server) as again:
        RemotePool(again, CONFIG)


def test_a_malformed_request_gets_a_named_error_and_the_client_stays(server: AgentServer) -> None:
    client = _client(server)
    with pytest.raises(MalformedMessageError, match="'pool': expected an int"):
        client.call("pool.read", pool="one", region=0, offset=0, nbytes=1)
    assert client.call("hello")[0]["backend"] == "loopback"
    client.close()
    with _client(server) as again:
        assert again.backend_name == "loopback"


# --------------------------------------------------------------------------- digests


def test_untouched_pool_is_checked_by_digests_and_a_change_is_read_back(server: AgentServer) -> None:
    with _client(server) as client:
        pool = RemotePool(client, CONFIG)
        pool.fill_background(seed="producer")
        pool.fill_producer_pages(BlockIds([[1, 2, 3]]), num_tokens=12, salt="r0")
        before = pool.snapshot()
        assert pool.differing_regions() == []
        assert pool.verified() is pool  # nothing read back
        # Mutant: a stray write on the server's copy must be found, located and explained.
        session = server._session
        assert session is not None
        session.pools[pool.pool_id].pool.page(CONFIG.kv_cache_groups[0].layer_names[0], 2)[7] ^= 0xFF
        assert pool.differing_regions() == [0]
        view = pool.verified()
        assert view is not pool
        found = check_pools(producer=view, consumer=view, producer_before=before, consumer_before=before, loads=[])
        assert [m.kind for m in found if m.side == "producer"] == [MismatchKind.PRODUCER_MODIFIED]
        assert [m.block for m in found if m.side == "producer"] == [2]


def test_server_side_snapshot_and_compare(server: AgentServer) -> None:
    with _client(server) as client:
        pool = RemotePool(client, CONFIG)
        pool.fill_background(seed="x")
        client.call("pool.snapshot", pool=pool.pool_id)
        assert client.call("pool.compare", pool=pool.pool_id)[0]["changed"] == []
        session = server._session
        assert session is not None
        session.pools[pool.pool_id].pool.page(CONFIG.kv_cache_groups[0].layer_names[0], 5)[0] ^= 1
        assert client.call("pool.compare", pool=pool.pool_id)[0]["changed"] == [5]


# --------------------------------------------------------------------------- processes


def _serve_process(tmp_path: Path) -> tuple[subprocess.Popen[str], tuple[str, int]]:
    token = tmp_path / "token"
    token.write_bytes(TOKEN + b"\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvspec",
            "agent",
            "serve",
            "loopback",
            "--listen",
            f"127.0.0.1:{port}",
            "--token-file",
            str(token),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert "serving loopback" in line, line
    return process, ("127.0.0.1", port)


def test_sigterm_closes_agents_and_frees_pools(tmp_path: Path) -> None:
    """SIGTERM acts at once, even with a handshake pending (a silent connection), and frees everything."""
    process, address = _serve_process(tmp_path)
    silent = socket.create_connection(address, timeout=5.0)  # a handshake left pending the whole test
    try:
        client = AgentClient(*address, TOKEN, timeout=3.0)  # served although the silent connection came first
        pool = RemotePool(client, CONFIG)
        RemoteAgent(client, "producer").register_memory(pool.regions)
        # The blocks this server maps: other tests (another pytest worker) may hold kvspec_agent blocks meanwhile.
        maps = Path(f"/proc/{process.pid}/maps").read_text().splitlines()
        mapped = {line.split("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line}
        names = {name for name in mapped if name.startswith("kvspec_agent")}
        assert names, "the server's pool is not in shared memory"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
        assert time.monotonic() - started < 2.0, "SIGTERM waited for the pending handshake"
        assert process.returncode == 0, output
        assert "stopped" in output
        left = {f.name for f in Path("/dev/shm").iterdir() if f.name in names}
        assert left == set(), f"shared memory left behind: {left}"
    finally:
        silent.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_killed_server_ends_every_call_bounded(tmp_path: Path) -> None:
    process, address = _serve_process(tmp_path)
    try:
        client = AgentClient(*address, TOKEN, timeout=10.0)
        pool = RemotePool(client, CONFIG)
        agent = RemoteAgent(client, "producer")
        agent.register_memory(pool.regions)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        status = agent.check(TransferHandle(transfer_id=1, peer="consumer", mode=TransferMode.READ))
        assert status.state is TransferState.FAILED
        assert status.reason is FailureReason.PEER_DISCONNECTED
        with pytest.raises(TransportError, match=r"connection lost|client is closed") as caught:
            agent.get_notifications()
        assert caught.value.reason is FailureReason.PEER_DISCONNECTED
        agent.close()  # quiet when the server is gone
        pool.close()
        client.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --------------------------------------------------------------------------- the suite over the channel (one host)


class _DeafAgent(RemoteAgent):
    """Mutant: a remote agent whose kill does nothing (a suite that only pretends to lose its peer)."""

    def kill(self) -> None:
        return None


class _DeafPeer(PeerBackend):
    def create_agent(self, name: str) -> Transport:
        return _DeafAgent(self.client, name) if name == self.remote_role else self.local.create_agent(name)


@pytest.mark.parametrize("mutant", [False, True])
def test_peer_kill_case_over_nixl_on_one_host(mutant: bool, require_module: Callable[..., ModuleType]) -> None:
    """The kill case passes with a real kill, and fails when the kill is a no-op (request "a" then loads)."""
    from kvspec.transport.nixl import find_nixl

    require_module("numpy", "nixl")
    require_module(find_nixl() or "nixl", "nixl")
    from kvspec.transport import load_backend

    server = AgentServer("nixl", host="127.0.0.1", port=0, token=TOKEN, log=lambda _: None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        kind = _DeafPeer if mutant else PeerBackend
        backend = kind(load_backend("nixl"), AgentClient(*server.address, TOKEN))
        try:
            report = run_suite(backend, rules=["FAIL-1/peer-agent-killed-mid-transfer"])
        finally:
            backend.close()
    finally:
        server.stop()
        thread.join(timeout=30)
    (result,) = report.results
    assert result.outcome is (Outcome.FAILED if mutant else Outcome.PASSED), result.message
