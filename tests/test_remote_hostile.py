"""The agent channel against hostile peers (issue 23): handshakes, frames, memory, kills, guessing, tokens.

Every test here failed on the channel as it was before issue 23. They run the
loopback backend's server in a thread of this process, with short deadlines,
so each takes well under a second.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import secrets
import socket
import struct
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvspec_conformance.configs import full, make_config

from kvspec import ConfigError, KVSpecError, MalformedMessageError, TransferMode, TransportError
from kvspec.remote import (
    AgentAuthError,
    AgentClient,
    AgentRefusedError,
    AgentServer,
    RemoteAgent,
    RemotePool,
    WireError,
)
from kvspec.remote._server import PAGE_COST, _Guesses
from kvspec.tools._vectors import to_json
from kvspec.transport import Descriptor
from kvspec.transport._wire import (
    MAGIC,
    MAX_DEPTH,
    FrameMac,
    PayloadSeal,
    check_token,
    client_mac,
    frame_key,
    new_nonce,
    parse_header,
    payload_key,
    read_token,
    recv_frame,
    send_frame,
    server_mac,
)

TOKEN = b"a-test-token-of-32-bytes-exactly"
CONFIG = make_config(full(4), num_blocks=8)
POOL_BYTES = sum(t.size for t in CONFIG.kv_cache_tensors)


@contextlib.contextmanager
def _server(**kwargs: Any) -> Iterator[tuple[AgentServer, list[str], threading.Thread]]:
    log: list[str] = []
    kwargs.setdefault("max_pool", 4 * POOL_BYTES + 64 * PAGE_COST)
    server = AgentServer("loopback", host="127.0.0.1", port=0, token=TOKEN, log=log.append, **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, log, thread
    finally:
        server.stop()
        thread.join(timeout=10)


def _raw(server: AgentServer, source: str = "127.0.0.1") -> socket.socket:
    """A connection from ``source`` (any 127.x.y.z address reaches the server over loopback)."""
    return socket.create_connection(server.address, timeout=5.0, source_address=(source, 0))


def _closed(sock: socket.socket, within: float) -> bool:
    """True when the peer closes ``sock`` within ``within`` seconds (frames before the close are skipped)."""
    sock.settimeout(within)
    end = time.monotonic() + within
    try:
        while time.monotonic() < end:
            if sock.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def _raw_frame(mac: FrameMac | None, body: bytes, payload: bytes = b"") -> bytes:
    head = struct.pack(">4sIQ", MAGIC, len(body), len(payload)) + body
    return head + payload + (b"" if mac is None else mac.sign(head, payload))


# --------------------------------------------------------------------------- finding 2: slowloris


def test_silent_and_dribbling_connections_do_not_lock_out_the_client() -> None:
    with _server(auth_timeout=3.0) as (server, _, _):
        silent = [_raw(server, f"127.0.0.{2 + i // 4}") for i in range(8)]  # four from each of two addresses
        dribblers = [_raw(server, "127.0.0.4") for _ in range(2)]
        stop = threading.Event()

        def dribble(sock: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while not stop.wait(0.2):
                    sock.send(b"K")

        threads = [threading.Thread(target=dribble, args=(s,), daemon=True) for s in dribblers]
        for thread in threads:
            thread.start()
        try:
            started = time.monotonic()
            with AgentClient(*server.address, TOKEN, timeout=1.5) as client:
                assert client.backend_name == "loopback"
            assert time.monotonic() - started < 1.0
        finally:
            stop.set()
            for sock in silent + dribblers:
                sock.close()


def test_one_deadline_for_the_whole_handshake() -> None:
    """A byte every 0.1 s keeps no connection past the 0.5 s handshake deadline."""
    with _server(auth_timeout=0.5) as (server, log, _):
        sock = _raw(server)
        recv_frame(sock, header_limit=512, payload_limit=0)  # the challenge
        started = time.monotonic()
        closed_after = None
        with contextlib.suppress(OSError):
            for byte in (MAGIC + bytes(12)) * 3:
                sock.send(bytes([byte]))
                if _closed(sock, 0.1):
                    closed_after = time.monotonic() - started
                    break
        sock.close()
        assert closed_after is not None
        assert closed_after < 1.0, closed_after
        assert any("no valid authentication" in line for line in log), log


def test_stop_is_prompt_while_a_handshake_is_pending() -> None:
    with _server(auth_timeout=30.0) as (server, _, thread):
        sock = _raw(server)
        time.sleep(0.1)
        started = time.monotonic()
        server.stop()
        thread.join(timeout=1.0)
        assert not thread.is_alive(), "a pending handshake held the server past stop()"
        assert time.monotonic() - started < 1.0
        sock.close()


def test_pending_handshakes_are_capped_in_all_and_per_address() -> None:
    """Past a cap a newcomer takes the slot of the oldest silent handshake: its own address's, else the busiest's."""
    with _server(auth_timeout=2.0, max_pending=3, max_pending_per_host=2) as (server, log, _):
        held = [_raw(server, "127.0.0.2") for _ in range(2)]
        time.sleep(0.1)
        extra = _raw(server, "127.0.0.2")
        assert _closed(held[0], 1.0), "the oldest silent handshake of 127.0.0.2 kept its slot"
        assert not _closed(held[1], 0.1)
        other = _raw(server, "127.0.0.3")
        time.sleep(0.1)
        full = _raw(server, "127.0.0.4")  # 3 in progress: 127.0.0.2, which holds the most, gives one up
        assert _closed(held[1], 1.0)
        assert not _closed(other, 0.1)
        assert sum("evicted the oldest silent handshake from 127.0.0.2" in line for line in log) == 2, log
        for sock in [*held, extra, other, full]:
            sock.close()


# --------------------------------------------------------------------------- finding 3: JSON bounds


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested at most"),
        (b'{"x":' + b"9" * 5000 + b"}", "numbers of at most"),
        (b'{"x":1e999}', "finite"),
        (b'{"x":NaN}', "finite"),
        (b"[1]", "JSON object"),
    ],
)
def test_header_parsing_is_bounded(body: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        parse_header(body)


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    deep = "[" * (MAX_DEPTH * 4) + '\\"' + "{" * 10
    assert parse_header(json.dumps({"x": deep, "y": [[1]]}).encode()) == {"x": deep, "y": [[1]]}


@pytest.mark.parametrize(
    "body", [b'{"op":"hello","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"op":"hello","x":' + b"7" * 5000 + b"}"]
)
def test_a_hostile_frame_drops_that_client_never_the_server(body: bytes) -> None:
    with _server() as (server, log, thread):
        client = AgentClient(*server.address, TOKEN, timeout=5.0)
        client._sock.sendall(_raw_frame(client._mac, body))
        assert _closed(client._sock, 2.0)
        client._sock.close()
        time.sleep(0.05)
        assert thread.is_alive(), "the server died"
        assert any("dropping" in line for line in log), log
        with AgentClient(*server.address, TOKEN, timeout=5.0) as again:
            assert again.backend_name == "loopback"


def _impostor(reply_body: bytes) -> tuple[tuple[str, int], threading.Thread, socket.socket]:
    """A server that holds the token and completes the handshake, then answers ``reply_body`` to the first request."""
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
            seal = PayloadSeal(payload_key(TOKEN, nonce, theirs), "server")
            request, payload = recv_frame(conn, header_limit=1 << 20, payload_limit=1 << 20, mac=mac)
            seal.open(request["op"], payload)
            conn.sendall(_raw_frame(mac, reply_body, seal.seal(request["op"], b"")))
            with contextlib.suppress(OSError):
                conn.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[:2], thread, listener


@pytest.mark.parametrize(
    "reply",
    [
        b'{"ok":true,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"ok":true,"backend":' + b"1" * 5000 + b"}",
        b'{"ok":true,"backend":"loopback","capabilities":{"modes":["sideways"]}}',
        b'{"ok":true}',
    ],
)
def test_a_hostile_server_gets_one_kvspec_error_from_the_client(reply: bytes) -> None:
    address, thread, listener = _impostor(reply)
    try:
        with pytest.raises(KVSpecError):
            AgentClient(*address, TOKEN, timeout=5.0)
    finally:
        thread.join(timeout=5)
        listener.close()


# --------------------------------------------------------------------------- finding 4: kills


class _WorkerTransport:
    """The loopback agent with a worker process, as nixl and torch agents have (``_process``, ``pid``)."""

    def __init__(self, inner: Any, process: subprocess.Popen[bytes]) -> None:
        self._inner, self._process = inner, process
        self.in_process = False

    @property
    def pid(self) -> int:
        return self._process.pid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_repeated_kill_signals_nothing_and_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    signalled: list[int] = []
    real_kill = os.kill

    def recording_kill(pid: int, sig: int) -> None:
        signalled.append(pid)
        real_kill(pid, sig)

    with _server() as (server, _, _), AgentClient(*server.address, TOKEN, timeout=5.0) as client:
        agent = RemoteAgent(client, "producer")
        worker = subprocess.Popen(["sleep", "30"])
        try:
            session = server._session
            assert session is not None
            held = session.agents[agent._id]
            held.transport = _WorkerTransport(held.transport, worker)
            monkeypatch.setattr(os, "kill", recording_kill)
            agent.kill()
            assert worker.wait(timeout=5) != 0  # killed, and reaped: its pid is free for a stranger now
            assert signalled == [worker.pid]
            with pytest.raises(TransportError, match=r"killed by agent\.kill"):
                agent.kill()
            with pytest.raises(TransportError, match=r"killed by agent\.kill"):
                agent.get_notifications()
            assert signalled == [worker.pid], "a second kill signalled a reaped worker's pid"
            agent.close()  # the one request a killed agent still answers
        finally:
            monkeypatch.undo()
            if worker.poll() is None:
                worker.kill()
                worker.wait()


# --------------------------------------------------------------------------- finding 5: memory


def _aliasing_config(layers: int, blocks: int) -> dict[str, Any]:
    """A small pool (16 bytes a block) whose ``layers`` layers all alias one buffer: layers x blocks pages."""
    names = [f"l{i}" for i in range(layers)]
    group_spec = to_json(CONFIG)["kv_cache_groups"][0]["kv_cache_spec"]
    return {
        "num_blocks": blocks,
        "kv_cache_tensors": [
            {"size": 16 * blocks, "layers": names, "layer_stride": 0, "block_stride": 16, "offset": 0}
        ],
        "kv_cache_groups": [{"layer_names": names, "kv_cache_spec": group_spec}],
    }


def _peak_during(call: Any) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        try:
            result: Any = call()
        except KVSpecError as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_page_bookkeeping_counts_against_max_pool() -> None:
    """A 30 KB request for a 16 KB pool of 2000 aliasing layers: 2M pages, refused before the page table exists."""
    with _server(max_pool=64 << 20) as (server, _, _), AgentClient(*server.address, TOKEN, timeout=30.0) as client:
        config = _aliasing_config(layers=2000, blocks=1000)
        result, peak = _peak_during(lambda: client.call("pool.create", config=config))
        assert isinstance(result, AgentRefusedError), result
        assert "--max-pool" in str(result)
        assert "pages" in str(result)
        assert peak < 16 << 20, f"{peak} bytes allocated for a refused pool"
        # A pool of the same bytes with few pages is still served.
        client.call("pool.create", config=_aliasing_config(layers=2, blocks=1000))


def test_a_large_remote_region_number_allocates_nothing() -> None:
    with _server() as (server, _, _), AgentClient(*server.address, TOKEN, timeout=30.0) as client:
        pool = RemotePool(client, CONFIG)
        agent = RemoteAgent(client, "producer")
        agent.register_memory(pool.regions)
        far = Descriptor(local_region=0, local_offset=0, remote_region=20_000_000, remote_offset=0, nbytes=8)
        result, peak = _peak_during(lambda: agent.post(TransferMode.WRITE, [far], peer="nobody"))
        assert isinstance(result, TransportError), result  # reached the backend, which knows no such peer
        assert peak < 16 << 20, f"{peak} bytes allocated for one descriptor"


# --------------------------------------------------------------------------- finding 9: malformed, guessing, tokens


@pytest.mark.parametrize(
    ("op", "fields", "payload"),
    [
        ("pool.create", {"config": "x"}, b""),
        ("pool.create", {"config": {"num_blocks": 1}}, b""),
        ("pool.fill_pages", {"block_ids": "x", "num_tokens": 4}, b""),
        ("pool.fill_pages", {"block_ids": [[1]], "num_tokens": 4, "block_ends": ["a"]}, b""),
        ("agent.post", {"mode": "sideways", "peer": "p"}, b""),
        ("agent.post", {"mode": "write", "peer": "p", "notification": "zz"}, b""),
        ("agent.post", {"mode": "write", "peer": "p"}, b"x" * 41),
        ("agent.create", {"name": "x" * 1000}, b""),
        ("agent.add_remote", {}, b"\xff not metadata"),
    ],
)
def test_malformed_requests_get_a_named_error_and_one_log_line(op: str, fields: dict[str, Any], payload: bytes) -> None:
    with _server() as (server, log, _), AgentClient(*server.address, TOKEN, timeout=5.0) as client:
        pool = RemotePool(client, CONFIG)
        agent = RemoteAgent(client, "producer")
        agent.register_memory(pool.regions)
        fields = {"pool": pool.pool_id, "agent": agent._id, **fields}
        with pytest.raises(KVSpecError) as caught:
            client.call(op, payload, **fields)
        assert "InternalError" not in str(caught.value), caught.value
        assert not any("internal error" in line or "Traceback" in line for line in log), log
        assert client.call("hello")[0]["backend"] == "loopback"  # the client is still served


def test_a_wrong_field_type_is_a_malformed_message_naming_it() -> None:
    with (
        _server() as (server, _, _),
        AgentClient(*server.address, TOKEN, timeout=5.0) as client,
        pytest.raises(MalformedMessageError, match="'pool': expected an int"),
    ):
        client.call("pool.read", pool="one", region=0, offset=0, nbytes=1)


def test_failed_handshakes_from_one_source_are_refused_for_a_while() -> None:
    wrong = b"another-token-of-32-bytes-length"
    with _server(auth_failures=2, auth_window=30.0) as (server, _, _):
        for _ in range(2):
            with pytest.raises(AgentAuthError, match="wrong token"):
                AgentClient(*server.address, wrong, timeout=5.0)
        with pytest.raises(AgentRefusedError, match=r"too many failed authentications from 127\.0\.0\.1; retry in"):
            AgentClient(*server.address, TOKEN, timeout=5.0)


def test_guessing_memory_is_bounded_and_backs_off() -> None:
    guesses = _Guesses(limit=3, window=60.0)
    for host in range(10_000):
        guesses.failed(f"10.0.{host >> 8}.{host & 255}", now=0.0)
    assert len(guesses) <= 4096
    waits = []
    for attempt in range(5):
        guesses.failed("192.0.2.1", now=float(attempt))
        waits.append(guesses.refused_for("192.0.2.1", now=float(attempt)))
    assert waits == [0.0, 0.0, 1.0, 2.0, 4.0]


def test_frames_after_the_handshake_need_the_session_tag() -> None:
    """A relay that passed the handshake through cannot inject a request: untagged, or replayed, frames end it."""
    with _server() as (server, log, _):
        client = AgentClient(*server.address, TOKEN, timeout=5.0)
        client._sock.sendall(_raw_frame(None, b'{"op":"hello"}') + bytes(32))
        assert _closed(client._sock, 2.0)
        client._sock.close()
        assert any("tag does not match" in line for line in log), log
        # Replay: a frame the client really sent, sent again, fails its sequence number.
        client = AgentClient(*server.address, TOKEN, timeout=5.0)
        frame = _raw_frame(client._mac, b'{"op":"hello"}', client._seal.seal("hello", b""))
        client._sock.sendall(frame)
        recv_frame(client._sock, header_limit=1 << 20, payload_limit=1 << 20)
        client._sock.sendall(frame)
        assert _closed(client._sock, 2.0)
        client._sock.close()


def test_a_handshake_from_another_connection_cannot_be_reused() -> None:
    """The tag key comes from this handshake's nonces: a client MAC for another challenge fails."""
    with _server() as (server, _, _):
        sock = _raw(server)
        recv_frame(sock, header_limit=512, payload_limit=0)
        mine = new_nonce()
        send_frame(sock, {"op": "auth", "mac": client_mac(TOKEN, new_nonce(), mine).hex(), "nonce": mine.hex()})
        reply, _ = recv_frame(sock, header_limit=512, payload_limit=0)
        assert reply["ok"] is False
        sock.close()


@pytest.mark.parametrize(
    ("token", "rule"),
    [
        (b"x" * 16, "mostly made of runs"),
        (b"ab" * 16, "mostly made of runs"),
        (b"ab" * 40, "mostly made of runs"),  # 80 bits by the old Shannon estimate: accepted before issue 37
        (b"passwordpassword", "mostly made of runs"),
        (b"changeme-changeme-changeme", "mostly made of runs"),  # 73 bits by the old estimate
        (b"foobarxy-foobarxy-foobarxy", "mostly made of runs"),
        (b"qwertyuiopasdfgh", "mostly made of runs"),
        (b"1111222233334444", "bits of entropy"),
        (b"0101101001011010", "bits of entropy"),
        (b"Password1234!!!!", "mostly made of runs"),
    ],
)
def test_low_entropy_tokens_are_refused_with_how_to_make_one(tmp_path: Path, token: bytes, rule: str) -> None:
    path = tmp_path / "token"
    path.write_bytes(token + b"\n")
    with pytest.raises(AgentAuthError, match=rf"{rule}.*secrets\.token_hex\(32\)"):
        read_token(str(path))
    with pytest.raises(AgentAuthError, match=rule):
        AgentServer("loopback", host="127.0.0.1", port=0, token=token)


def test_random_tokens_of_16_characters_are_accepted() -> None:
    """secrets.token_hex(8) (16 hex digits) and token_urlsafe(16): 1000 of each, all accepted (issue 37).

    The old Shannon estimate refused every token_hex(8). Seeded, so the run is
    the same every time; the same draws from ``secrets`` (1,000,000 hex, 300,000
    urlsafe) were all accepted when the rule was set.
    """
    draw = random.Random(37)
    for _ in range(1000):
        check_token(draw.randbytes(8).hex().encode(), "test")
        check_token(base64.urlsafe_b64encode(draw.randbytes(16)).rstrip(b"="), "test")
    check_token(secrets.token_hex(8).encode(), "test")


def test_token_file_and_listen_errors_are_clean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--token-file .*missing: expected a readable file"):
        read_token(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="expected a readable file"):
        read_token(str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"--listen 127\.0\.0\.1:{port}: cannot listen there"):
            AgentServer("loopback", host="127.0.0.1", port=port, token=TOKEN)
