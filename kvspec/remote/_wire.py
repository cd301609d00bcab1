"""The agent control channel's wire: framed JSON headers with raw payloads, and the shared-secret handshake.

One frame is ``MAGIC`` (4 bytes), the header length (big-endian u32), the
payload length (big-endian u64), the header (UTF-8 JSON object) and the
payload (raw bytes). Both lengths are checked against the receiver's limits
before anything is read, so a peer cannot make the other side allocate more
than it allows. Nothing on the wire is ever unpickled or evaluated.

Authentication (before anything else is served): the server sends a random
nonce; the client answers ``HMAC-SHA256(token, "client" | server nonce | client
nonce)`` and its own nonce; the server compares in constant time
(:func:`hmac.compare_digest`) and proves it holds the token too with
``HMAC-SHA256(token, "server" | client nonce | server nonce)``. Both sides
then derive the session's digest key from the token and both nonces.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from typing import Any

from kvspec._errors import KVSpecError
from kvspec._models import KVCacheConfig

__all__ = [
    "DIGEST_SIZE",
    "HEADER_LIMIT",
    "MAGIC",
    "PRE_AUTH_HEADER_LIMIT",
    "AgentAuthError",
    "AgentRefusedError",
    "WireError",
    "client_mac",
    "digest",
    "digest_key",
    "digest_pages",
    "new_nonce",
    "no_delay",
    "page_table",
    "read_token",
    "recv_frame",
    "send_frame",
    "server_mac",
]

MAGIC = b"KVA1"
_PREFIX = struct.Struct(">4sIQ")
HEADER_LIMIT = 1 << 20  # a header is a small JSON object; notifications travel in it hex-encoded
PRE_AUTH_HEADER_LIMIT = 512  # before authentication only the nonce and the MAC are accepted
_CONTEXT = b"kvspec-agent/1"
_NONCE_BYTES = 32
DIGEST_SIZE = 16
_COALESCE = 1 << 16


class WireError(KVSpecError, ValueError):
    """A frame that is not a kvspec agent frame, or exceeds the receiver's limits; the connection is dropped."""


class AgentAuthError(KVSpecError, PermissionError):
    """The shared-secret handshake failed: wrong token, or a peer that is not a kvspec agent."""


class AgentRefusedError(KVSpecError, PermissionError):
    """The agent refused a request: memory, pool, agent or handle it does not own, a limit, or another client."""


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Send one frame: ``header`` as JSON, ``payload`` as raw bytes."""
    body = json.dumps(header, separators=(",", ":")).encode()
    view = memoryview(payload).cast("B")
    head = _PREFIX.pack(MAGIC, len(body), view.nbytes) + body
    if view.nbytes <= _COALESCE:
        sock.sendall(head + view)  # one write: no Nagle stall between the header and a small payload
    else:
        sock.sendall(head)
        sock.sendall(view)


def no_delay(sock: socket.socket) -> None:
    """Send small frames at once (TCP_NODELAY): the channel is request-reply."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    got = 0
    while got < nbytes:
        count = sock.recv_into(view[got:], nbytes - got)
        if count == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {nbytes} bytes")
        got += count
    return buffer


def recv_frame(sock: socket.socket, *, header_limit: int, payload_limit: int) -> tuple[dict[str, Any], bytes]:
    """Receive one frame; :class:`WireError` when it is malformed or larger than the limits (checked first)."""
    magic, header_len, payload_len = _PREFIX.unpack(bytes(_recv_exactly(sock, _PREFIX.size)))
    if magic != MAGIC:
        raise WireError(f"frame magic: expected {MAGIC!r}, got {magic!r}")
    if header_len > header_limit:
        raise WireError(f"frame header: expected at most {header_limit} bytes, got {header_len}")
    if payload_len > payload_limit:
        raise WireError(f"frame payload: expected at most {payload_limit} bytes, got {payload_len}")
    try:
        header = json.loads(bytes(_recv_exactly(sock, header_len)))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"frame header: expected a JSON object ({exc})") from None
    if not isinstance(header, dict):
        raise WireError(f"frame header: expected a JSON object, got {type(header).__name__}")
    payload = bytes(_recv_exactly(sock, payload_len)) if payload_len else b""
    return header, payload


def new_nonce() -> bytes:
    """A fresh random challenge."""
    return secrets.token_bytes(_NONCE_BYTES)


def client_mac(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the client proves it holds the token with."""
    return hmac.new(token, b"|".join((_CONTEXT, b"client", server_nonce, client_nonce)), hashlib.sha256).digest()


def server_mac(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the server proves it holds the token with (a different message, so no reflection)."""
    return hmac.new(token, b"|".join((_CONTEXT, b"server", client_nonce, server_nonce)), hashlib.sha256).digest()


def digest_key(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The session's key for page digests (keyed BLAKE2b), fresh per connection."""
    return hmac.new(token, b"|".join((_CONTEXT, b"digest", server_nonce, client_nonce)), hashlib.sha256).digest()


def read_token(path: str | None, environ: dict[str, str] | None = None) -> bytes:
    """The shared secret: the file's contents (stripped) or ``KVSPEC_AGENT_TOKEN``; at least 16 bytes."""
    if path is not None:
        with open(path, "rb") as handle:
            token = handle.read().strip()
        source = f"--token-file {path}"
    else:
        token = (environ if environ is not None else dict(os.environ)).get("KVSPEC_AGENT_TOKEN", "").encode()
        source = "KVSPEC_AGENT_TOKEN"
    if len(token) < 16:
        raise AgentAuthError(f"agent token ({source}): expected at least 16 bytes, got {len(token)}")
    return token


def page_table(config: KVCacheConfig) -> list[tuple[int, int, int]]:
    """``(tensor index, offset, size)`` of every page of ``config``: group by group, layer by layer, block by block."""
    table: list[tuple[int, int, int]] = []
    for group in config.kv_cache_groups:
        size = group.kv_cache_spec.page_size_bytes
        for layer in group.layer_names:
            for block in range(config.num_blocks):
                tensor_index, offset = config.page_offset(layer, block)
                table.append((tensor_index, offset, size))
    return table


def digest(key: bytes, data: bytes | memoryview) -> bytes:
    """The keyed BLAKE2b digest (16 bytes) both sides compute of a page or a region."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, key=key).digest()


def digest_pages(key: bytes, table: list[tuple[int, int, int]], buffers: list[memoryview]) -> bytes:
    """The digest of every page of ``table``, concatenated (``DIGEST_SIZE`` bytes each)."""
    return b"".join(digest(key, buffers[t][offset : offset + size]) for t, offset, size in table)
