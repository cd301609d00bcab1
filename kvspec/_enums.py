"""The enums every layer shares: who moves the bytes, and why a request failed.

They sit below :mod:`kvspec._errors` so that an error can carry a typed
:class:`FailureReason` (docs/spec/protocol-lifecycle.md, FAIL-1).
"""

from __future__ import annotations

import enum

__all__ = ["FailureReason", "TransferMode"]


class TransferMode(str, enum.Enum):
    """Who moves the bytes: the consumer pulls (READ) or the producer pushes (WRITE) (ADM-2)."""

    READ = "read"
    WRITE = "write"


class FailureReason(str, enum.Enum):
    """Why a request ended FAILED (FAIL-1); every failure carries one."""

    TIMEOUT = "timeout"
    LEASE_EXPIRED = "lease_expired"
    PEER_DISCONNECTED = "peer_disconnected"
    POST_FAILED = "post_failed"
    TRANSFER_ERROR = "transfer_error"
    PARTIAL_TRANSFER = "partial_transfer"
    INTEGRITY = "integrity"
    WINDOW_COVERAGE = "window_coverage"
    BLOCK_ALIGNMENT = "block_alignment"
    INCOMPATIBLE_PEER = "incompatible_peer"
    ABORTED = "aborted"
    PROTOCOL = "protocol"
