"""The conformance cases; importing this package registers every case."""

from . import data, handshake, lifecycle

__all__ = ["data", "handshake", "lifecycle"]
