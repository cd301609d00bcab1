"""The conformance cases; importing this package registers every case."""

from . import data, exchange, handshake, lifecycle, offload, parallel, peer, positions, stale, state, transport

__all__ = [
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
