"""Per-session keys that authenticate the torch workers' control connections to each other (stdlib only).

Each worker life (a fresh one after ``reset``) makes an ephemeral
Diffie-Hellman key in the 2048-bit MODP group of RFC 3526 (group 14). Its
agent metadata carries only the public value, a random nonce and the uid;
the private exponent never leaves the process. Two workers that hold each
other's metadata derive the same pair key, ``HMAC-SHA256(Z, context | both
(uid, nonce, public) triples in uid order)`` where ``Z`` is the shared DH
secret, and prove it to each other on every connection with an HMAC over
both connection nonces (a different message per role, so a reflected answer
does not verify).

What this protects (docs/backends/torch.md, Security): someone who reads the
metadata on the wire, or holds the agent token, learns public values only and
cannot compute any pair key, so cannot open a control connection to a worker.
What it does not: DH without a signature does not stop an active
man-in-the-middle on the agent channel who replaces the metadata in flight;
that channel is authenticated by the agent token (kvspec.remote), not
encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kvspec.core._errors import PairKeyError  # the one import from kvspec: every error class lives there

__all__ = [
    "GROUP_BITS",
    "NONCE_BYTES",
    "PairKeyError",
    "SessionKey",
    "connector_mac",
    "listener_mac",
    "parse_nonce",
    "parse_public",
]

# RFC 3526, section 3: the 2048-bit MODP group (a safe prime; generator 2).
_P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3B"
    "E39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6955817183995497CEA956AE515D2261898FA0510"
    "15728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
_G = 2
GROUP_BITS = 2048
_EXPONENT_BITS = 320  # well above twice the group's ~112-bit strength
_CONTEXT = b"kvspec-torch-pair/1"
NONCE_BYTES = 32


def parse_public(text: object, field: str) -> int:
    """A peer's DH public value from its hex form; refuses 0, 1, p - 1 and anything outside the group."""
    if not isinstance(text, str) or not 0 < len(text) <= GROUP_BITS // 4:
        raise PairKeyError(f"{field}: expected a hex string of at most {GROUP_BITS // 4} digits, got {text!r:.80}")
    try:
        value = int(text, 16)
    except ValueError:
        raise PairKeyError(f"{field}: expected hex digits, got {text!r:.80}") from None
    if not 2 <= value <= _P - 2:
        raise PairKeyError(f"{field}: expected a value in [2, p - 2] of the RFC 3526 2048-bit group")
    return value


def parse_nonce(text: object, field: str) -> bytes:
    """A nonce from its hex form: exactly ``NONCE_BYTES`` bytes."""
    if not isinstance(text, str) or len(text) != 2 * NONCE_BYTES:
        raise PairKeyError(f"{field}: expected {2 * NONCE_BYTES} hex digits, got {text!r:.80}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise PairKeyError(f"{field}: expected hex digits, got {text!r:.80}") from None


class SessionKey:
    """One worker life's ephemeral DH key and metadata nonce."""

    def __init__(self) -> None:
        self._private = secrets.randbits(_EXPONENT_BITS) | (1 << (_EXPONENT_BITS - 1))
        self.public = pow(_G, self._private, _P)
        self.nonce = secrets.token_bytes(NONCE_BYTES)

    @property
    def public_hex(self) -> str:
        """The public value as metadata carries it."""
        return format(self.public, "x")

    def pair_key(self, my_uid: str, peer_uid: str, peer_public: int, peer_nonce: bytes) -> bytes:
        """The key this worker shares with the peer whose metadata said ``peer_public`` and ``peer_nonce``."""
        shared = pow(peer_public, self._private, _P).to_bytes(GROUP_BITS // 8, "big")
        sides = sorted(
            [
                (my_uid.encode(), self.nonce, self.public.to_bytes(GROUP_BITS // 8, "big")),
                (peer_uid.encode(), peer_nonce, peer_public.to_bytes(GROUP_BITS // 8, "big")),
            ]
        )
        message = b"|".join([_CONTEXT, *(part for side in sides for part in side)])
        return hmac.new(shared, message, hashlib.sha256).digest()


def _mac(
    key: bytes, role: bytes, connector: str, listener: str, connector_nonce: bytes, listener_nonce: bytes
) -> bytes:
    parts = [_CONTEXT, role, connector.encode(), listener.encode(), connector_nonce, listener_nonce]
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def listener_mac(key: bytes, connector: str, listener: str, connector_nonce: bytes, listener_nonce: bytes) -> bytes:
    """What the accepting worker proves it holds the pair key with."""
    return _mac(key, b"listener", connector, listener, connector_nonce, listener_nonce)


def connector_mac(key: bytes, connector: str, listener: str, connector_nonce: bytes, listener_nonce: bytes) -> bytes:
    """What the connecting worker proves it holds the pair key with (a different message: no reflection)."""
    return _mac(key, b"connector", connector, listener, connector_nonce, listener_nonce)
