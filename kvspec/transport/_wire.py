"""Framed JSON with raw payloads, bounded before reading: the agent channel and the torch workers' pair channel.

One frame is ``MAGIC`` (4 bytes), the header length (big-endian u32), the
payload length (big-endian u64), the header (UTF-8 JSON object) and the
payload (raw bytes). Both lengths are checked against the receiver's limits
before anything is read, so a peer cannot make the other side allocate more
than it allows. The header is parsed with its nesting (``MAX_DEPTH``) and its
numbers (``MAX_NUMBER_CHARS`` characters, finite) bounded, so a hostile peer's
frame is a :class:`WireError`, never a RecursionError or a huge integer.
Nothing on the wire is ever unpickled or evaluated.

Authentication (before anything else is served): the server sends a random
nonce; the client answers ``HMAC-SHA256(token, "client" | server nonce | client
nonce)`` and its own nonce; the server compares in constant time
(:func:`hmac.compare_digest`) and proves it holds the token too with
``HMAC-SHA256(token, "server" | client nonce | server nonce)``. Both sides
then derive the session's digest key from the token and both nonces.

After the handshake every frame carries a tag: ``HMAC-SHA256(frame key,
direction | sequence number | frame)``, the frame key derived from the token and
both nonces like the digest key. So a relay that passed the handshake through
(someone between the client and the server) cannot send a request of its own,
change, replay, reorder or drop a frame unnoticed: the session stays the
client's.

Every payload after the handshake is encrypted (:class:`PayloadSeal`):
ChaCha20-Poly1305 under a key HKDF derives from the token and both nonces,
each direction numbering its messages. Payloads are where a backend's
addresses travel (``agent.metadata``'s reply, ``agent.add_remote``'s request:
NIXL's UCX address and registered ranges, Mooncake's and torch's endpoints),
and UCX over TCP lets whoever holds them read and write the worker's whole
process, so nobody without the token may read them off the wire. Headers
(ops, ids, sizes, configs) stay readable; someone on the path can still see
them, and cut the connection.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
import operator
import os
import re
import secrets
import socket
import struct
import time
from typing import Any, ClassVar

from kvspec.core._errors import AgentAuthError, AgentRefusedError, BackendUnavailableError, ConfigError, WireError
from kvspec.core._models import KVCacheConfig

__all__ = [
    "DIGEST_SIZE",
    "HEADER_LIMIT",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_NUMBER_CHARS",
    "PRE_AUTH_HEADER_LIMIT",
    "AgentAuthError",
    "AgentRefusedError",
    "FrameMac",
    "PayloadSeal",
    "WireError",
    "check_token",
    "client_mac",
    "digest",
    "digest_key",
    "digest_pages",
    "frame_key",
    "keep_alive",
    "new_nonce",
    "no_delay",
    "page_table",
    "parse_header",
    "payload_key",
    "read_token",
    "recv_frame",
    "require_aead",
    "send_frame",
    "server_mac",
    "token_bits",
    "token_pieces",
]

MAGIC = b"KVA3"  # 2: frames after the handshake carry a tag; 3: and their payloads are encrypted
_PREFIX = struct.Struct(">4sIQ")
HEADER_LIMIT = 1 << 20  # a header is a small JSON object; notifications travel in it hex-encoded
PRE_AUTH_HEADER_LIMIT = 512  # before authentication only the nonce and the MAC are accepted
_CONTEXT = b"kvspec-agent/1"
_NONCE_BYTES = 32
DIGEST_SIZE = 16
_COALESCE = 1 << 16
MAX_DEPTH = 32  # nesting of a header's arrays and objects; the protocol's deepest is 4
MAX_NUMBER_CHARS = 40  # characters of one JSON number; an int64 has at most 20
MIN_TOKEN_BITS = 40  # token_bits: pieces x log2(alphabet); 16 random hex digits give 64 at most
TOKEN_HOWTO = "make one with: python -c 'import secrets; print(secrets.token_hex(32))' > FILE"


class FrameMac:
    """The tags of one session's frames in both directions, with their sequence numbers (see the module docstring).

    ``role`` is this end's, ``"client"`` or ``"server"``; each direction has its
    own counter, so a frame replayed, reordered or dropped fails the next check.
    """

    TAG_SIZE = 32

    def __init__(self, key: bytes, role: str) -> None:
        self._key = key
        self._out, self._in = (b"c>s", b"s>c") if role == "client" else (b"s>c", b"c>s")
        self._sent = 0
        self._received = 0

    def _tag(self, direction: bytes, number: int, parts: tuple[bytes | memoryview, ...]) -> bytes:
        mac = hmac.new(self._key, direction + number.to_bytes(8, "big"), hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def sign(self, *parts: bytes | memoryview) -> bytes:
        """The tag of the next frame this end sends."""
        self._sent += 1
        return self._tag(self._out, self._sent, parts)

    def verify(self, tag: bytes, *parts: bytes | memoryview) -> None:
        """Check the tag of the next frame this end receives; :class:`AgentAuthError` when it does not match."""
        self._received += 1
        if not hmac.compare_digest(tag, self._tag(self._in, self._received, parts)):
            raise AgentAuthError(
                f"frame {self._received}: its tag does not match (changed, replayed, reordered or not from the peer)"
            )


_AEAD_HINT = "pip install 'kvspec[remote]' (or pip install cryptography)"


def _aead() -> tuple[Any, type[Exception]]:
    """cryptography's ChaCha20-Poly1305 class and its tag error; :class:`kvspec.BackendUnavailableError` if missing."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    except ImportError:
        raise BackendUnavailableError(
            f"the agent channel encrypts its payloads with the 'cryptography' package, which is not installed: "
            f"{_AEAD_HINT}"
        ) from None
    return ChaCha20Poly1305, InvalidTag


def require_aead() -> None:
    """Check that :class:`PayloadSeal` can work here (a server or client checks before it listens or connects)."""
    _aead()


class PayloadSeal:
    """The encryption of one session's payloads in both directions (see the module docstring).

    ``key`` comes from :func:`payload_key`, fresh per handshake; ``role`` is
    this end's, ``"client"`` or ``"server"``. Each direction numbers its
    messages from 1; the AEAD nonce is the direction and the number, and the
    associated data binds both and the request's op. So a payload that was
    changed, replayed, reordered, sent back to its sender (reflected), moved
    to another op or sealed under another session's key does not open:
    :class:`AgentAuthError`, naming the message.
    """

    TAG_SIZE = 16
    _LABEL: ClassVar[dict[str, bytes]] = {"client": b"c>s\x00", "server": b"s>c\x00"}

    def __init__(self, key: bytes, role: str) -> None:
        if role not in self._LABEL:
            raise ConfigError(f"PayloadSeal.role: expected 'client' or 'server', got {role!r}")
        aead, self._invalid = _aead()
        self._aead = aead(key)
        self._out = self._LABEL[role]
        self._in = self._LABEL["server" if role == "client" else "client"]
        self._sent = 0
        self._received = 0

    @staticmethod
    def _nonce_and_data(direction: bytes, number: int, op: str) -> tuple[bytes, bytes]:
        nonce = direction + number.to_bytes(8, "big")  # 12 bytes: never repeats under one key
        return nonce, b"|".join((_CONTEXT, b"payload", nonce, op.encode("utf-8", "replace")))

    def seal(self, op: str, payload: bytes | memoryview) -> bytes:
        """The next outgoing payload of ``op`` (a request's, or the reply to it), encrypted and tagged."""
        self._sent += 1
        nonce, data = self._nonce_and_data(self._out, self._sent, op)
        sealed: bytes = self._aead.encrypt(nonce, bytes(payload), data)
        return sealed

    def open(self, op: str, sealed: bytes) -> bytes:
        """The next incoming payload of ``op``, decrypted; :class:`AgentAuthError` when it does not open."""
        self._received += 1
        nonce, data = self._nonce_and_data(self._in, self._received, op)
        if len(sealed) < self.TAG_SIZE:
            raise AgentAuthError(
                f"payload {self._received} ({op!r:.60}): expected at least {self.TAG_SIZE} bytes (an encrypted "
                f"payload), got {len(sealed)}"
            )
        try:
            opened: bytes = self._aead.decrypt(nonce, sealed, data)
        except self._invalid:
            raise AgentAuthError(
                f"payload {self._received} ({op!r:.60}): it does not decrypt under this session's key (changed, "
                "replayed, reflected or not from the peer)"
            ) from None
        return opened


def send_frame(
    sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"", mac: FrameMac | None = None
) -> None:
    """Send one frame: ``header`` as JSON, ``payload`` as raw bytes, then the tag when ``mac`` is given."""
    body = json.dumps(header, separators=(",", ":")).encode()
    view = memoryview(payload).cast("B")
    head = _PREFIX.pack(MAGIC, len(body), view.nbytes) + body
    tag = b"" if mac is None else mac.sign(head, view)
    if view.nbytes <= _COALESCE:
        sock.sendall(head + view + tag)  # one write: no Nagle stall between the header and a small payload
    else:
        sock.sendall(head)
        sock.sendall(view)
        sock.sendall(tag)


def no_delay(sock: socket.socket) -> None:
    """Send small frames at once (TCP_NODELAY): the channel is request-reply."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


KEEPALIVE_IDLE = 60  # seconds of silence before the first probe
KEEPALIVE_INTERVAL = 10  # seconds between probes
KEEPALIVE_PROBES = 6  # unanswered probes after which the kernel drops the connection


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive: a peer that vanished without FIN or RST is noticed within about two minutes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        option = getattr(socket, name, None)  # Linux names; elsewhere the system's defaults stand
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _recv_exactly(sock: socket.socket, nbytes: int, deadline: float | None = None) -> bytearray:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    got = 0
    while got < nbytes:
        if deadline is not None:  # one deadline for the whole frame, not one per recv (no byte-dribbling)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"deadline passed after {got} of {nbytes} bytes")
            sock.settimeout(left)
        count = sock.recv_into(view[got:], nbytes - got)
        if count == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {nbytes} bytes")
        got += count
    return buffer


def recv_frame(
    sock: socket.socket,
    *,
    header_limit: int,
    payload_limit: int,
    deadline: float | None = None,
    mac: FrameMac | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Receive one frame; :class:`WireError` when it is malformed or larger than the limits (checked first).

    ``deadline`` (a :func:`time.monotonic` time) bounds the whole frame:
    :class:`TimeoutError` when it passes, however the bytes trickle in. With
    ``mac`` the frame's tag is checked before the header is parsed
    (:class:`AgentAuthError` when it does not match).
    """
    prefix = bytes(_recv_exactly(sock, _PREFIX.size, deadline))
    magic, header_len, payload_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"frame magic: expected {MAGIC!r}, got {magic!r}")
    if header_len > header_limit:
        raise WireError(f"frame header: expected at most {header_limit} bytes, got {header_len}")
    if payload_len > payload_limit:
        raise WireError(f"frame payload: expected at most {payload_limit} bytes, got {payload_len}")
    body = bytes(_recv_exactly(sock, header_len, deadline))
    payload = bytes(_recv_exactly(sock, payload_len, deadline)) if payload_len else b""
    if mac is not None:
        mac.verify(bytes(_recv_exactly(sock, FrameMac.TAG_SIZE, deadline)), prefix, body, payload)
    return parse_header(body), payload


_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')  # linear: escapes are gone before it runs
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # 2 opens, 0 closes; minus 1 below


def _depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in ``body`` (JSON text), in linear time and C-level passes."""
    brackets = body.translate(None, _NOT_BRACKET)
    if len(brackets) <= MAX_DEPTH:
        return len(brackets)  # cannot nest deeper than it has brackets
    text = _STRING.sub(b"", _ESCAPE.sub(b"_", body)).translate(None, _NOT_BRACKET)
    steps = map(operator.sub, text.translate(_DEPTH_STEP), itertools.repeat(1))
    return max(itertools.accumulate(steps), default=0)


def _number(text: str) -> int | float:
    if len(text) > MAX_NUMBER_CHARS:
        raise WireError(f"frame header: expected numbers of at most {MAX_NUMBER_CHARS} characters, got {len(text)}")
    value = float(text) if any(c in text for c in ".eE") else int(text)
    if isinstance(value, float) and not math.isfinite(value):
        raise WireError(f"frame header: expected finite numbers, got {text[:MAX_NUMBER_CHARS]}")
    return value


def _constant(text: str) -> None:
    raise WireError(f"frame header: expected finite numbers, got {text}")


def parse_header(body: bytes) -> dict[str, Any]:
    """A frame header: a JSON object at most ``MAX_DEPTH`` deep, numbers bounded; else :class:`WireError`."""
    depth = _depth(body)
    if depth > MAX_DEPTH:
        raise WireError(f"frame header: expected JSON nested at most {MAX_DEPTH} deep, got {depth}")
    try:
        header = json.loads(body, parse_int=_number, parse_float=_number, parse_constant=_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"frame header: expected a JSON object ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise WireError(f"frame header: expected a JSON object, got {type(header).__name__}")
    return header


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


def frame_key(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The session's key for frame tags (:class:`FrameMac`), fresh per connection."""
    return hmac.new(token, b"|".join((_CONTEXT, b"frames", server_nonce, client_nonce)), hashlib.sha256).digest()


def payload_key(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The session's key for payloads (:class:`PayloadSeal`): HKDF-SHA256 of the token, salted with both nonces.

    Each nonce is length-prefixed in the salt, so no two handshakes' nonce
    pairs give the same salt; the key is fresh per connection.
    """
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    salt = b"".join(len(n).to_bytes(2, "big") + n for n in (server_nonce, client_nonce))
    key: bytes = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=_CONTEXT + b"|payload").derive(token)
    return key


def token_bits(token: bytes) -> float:
    """An estimate of the token's entropy in bits: its pieces (:func:`token_pieces`) times log2 of its alphabet.

    The alphabet is 16 for hex digits (10 for digits alone), else the sum of
    the classes present: 10 digits, 26 lowercase, 26 uppercase, 33 other
    printable ASCII, 128 other bytes. It cannot prove a token random; it
    refuses the usual mistakes: short, repeated, sequential or wordy secrets.
    """
    return token_pieces(token) * math.log2(_alphabet(token)) if token else 0.0


_HEX = frozenset(b"0123456789abcdefABCDEF")
_CLASSES = (
    (frozenset(b"0123456789"), 10),
    (frozenset(b"abcdefghijklmnopqrstuvwxyz"), 26),
    (frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 26),
    (frozenset(range(0x21, 0x7F)) - frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"), 33),
)
_COMMON_WORDS = (  # lowercase; found case-insensitively anywhere in a token
    b"password", b"passwd", b"changeme", b"change", b"secret", b"token", b"letmein", b"welcome", b"default",
    b"example", b"admin", b"login", b"test", b"kvspec", b"agent", b"hello",
)  # fmt: skip
_KEYBOARD_ROWS = (b"qwertyuiop", b"asdfghjkl", b"zxcvbnm", b"poiuytrewq", b"lkjhgfdsa", b"mnbvcxz")
_PATTERN = 4  # shortest run, sequence or repeat that counts as a pattern


def _word_starts() -> dict[bytes, tuple[bytes, ...]]:
    """Common words and keyboard walks (4+ keys along a row) by their first 4 characters."""
    words = [*_COMMON_WORDS]
    for row in _KEYBOARD_ROWS:
        words += [row[at:end] for at in range(len(row)) for end in range(at + _PATTERN, len(row) + 1)]
    starts: dict[bytes, tuple[bytes, ...]] = {}
    for word in words:
        starts[word[:_PATTERN]] = (*starts.get(word[:_PATTERN], ()), word)
    return starts


_WORD_STARTS = _word_starts()


def _alphabet(token: bytes) -> int:
    present = set(token)
    if present <= _HEX:
        return 10 if present <= _CLASSES[0][0] else 16
    size = sum(count for members, count in _CLASSES if present & members)
    return size + (128 if any(byte not in range(0x21, 0x7F) for byte in present) else 0)


def _pattern_at(token: bytes, lowered: bytes, i: int) -> int:
    """The length of the longest run, +-1 sequence, repeat of earlier text or common word starting at ``i``."""
    n, best = len(token), 0
    step = token[i + 1] - token[i]
    if step in (-1, 0, 1):  # aaaa, abcd, dcba
        j = i + 1
        while j + 1 < n and token[j + 1] - token[j] == step:
            j += 1
        best = j + 1 - i
    head = token[i : i + _PATTERN]
    at = token.find(head, 0, i + _PATTERN - 1)  # an earlier start (overlap allowed)
    while 0 <= at < i:
        length = _PATTERN
        while i + length < n and token[at + length] == token[i + length]:
            length += 1
        best = max(best, length)
        at = token.find(head, at + 1, i + _PATTERN - 1)
    for word in _WORD_STARTS.get(lowered[i : i + _PATTERN], ()):
        if len(word) > best and lowered.startswith(word, i):
            best = len(word)
    return best


def token_pieces(token: bytes) -> int:
    """The token's length with each pattern of 4+ characters (:func:`_pattern_at`) counted as 2 characters."""
    lowered, pieces, i = token.lower(), 0, 0
    while i < len(token):
        length = _pattern_at(token, lowered, i) if i + _PATTERN <= len(token) else 0
        pieces, i = (pieces + 2, i + length) if length >= _PATTERN else (pieces + 1, i + 1)
    return pieces


def check_token(token: bytes, source: str) -> bytes:
    """``token`` when it passes the three rules below; else :class:`AgentAuthError` naming the rule it fails.

    At least 16 bytes (characters); at least half of them left when each run
    (``aaaa``), sequence (``abcd``, ``4321``), repeat of earlier text or common
    word (``password``, ``changeme``...), of 4+ characters, counts as 2
    (:func:`token_pieces`); and at least ``MIN_TOKEN_BITS`` by
    :func:`token_bits`. ``secrets.token_hex(8)`` (16 hex digits) and longer,
    or ``secrets.token_urlsafe(12)`` and longer, pass.
    """
    if len(token) < 16:
        raise AgentAuthError(f"agent token ({source}): expected at least 16 bytes, got {len(token)}; {TOKEN_HOWTO}")
    pieces = token_pieces(token)
    if 2 * pieces < len(token):
        raise AgentAuthError(
            f"agent token ({source}): expected a random token, got one mostly made of runs, sequences, repeats "
            f"or common words ({pieces} pieces in {len(token)} characters, at least half expected); {TOKEN_HOWTO}"
        )
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        raise AgentAuthError(
            f"agent token ({source}): expected at least {MIN_TOKEN_BITS} bits of entropy (pieces x log2 of its "
            f"alphabet), got about {bits:.0f}; {TOKEN_HOWTO}"
        )
    return token


_TOKEN_FILE_LIMIT = 4096


def read_token(path: str | None, environ: dict[str, str] | None = None) -> bytes:
    """The shared secret: the file's contents (stripped) or ``KVSPEC_AGENT_TOKEN``, checked by :func:`check_token`.

    A file that cannot be read, or holds more than 4096 bytes, is a
    :class:`kvspec.ConfigError` naming it.
    """
    if path is not None:
        source = f"--token-file {path}"
        try:
            with open(path, "rb") as handle:
                token = handle.read(_TOKEN_FILE_LIMIT + 1)
        except OSError as exc:
            raise ConfigError(f"{source}: expected a readable file holding the token ({exc.strerror})") from None
        if len(token) > _TOKEN_FILE_LIMIT:
            raise ConfigError(f"{source}: expected at most {_TOKEN_FILE_LIMIT} bytes (a token), got more")
        token = token.strip()
    else:
        token = (environ if environ is not None else dict(os.environ)).get("KVSPEC_AGENT_TOKEN", "").encode()
        source = "KVSPEC_AGENT_TOKEN"
    return check_token(token, source)


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
