"""The conformance cases; importing this package registers every case."""

from . import caches, data, exchange, handshake, lifecycle, offload, parallel, peer, positions, stale, state, transport

__all__ = [
    "caches",
    "data",
    "exchange",
    "handshake",
    "lifecycle",
    "offload",
    "parallel",
    "peer",
    "positions",
    "stale",
    "state",
    "transport",
]
