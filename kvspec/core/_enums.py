"""The enums every layer shares: who moves the bytes, and why a request failed.

They sit below :mod:`kvspec.core._errors` so that an error can carry a typed
:class:`FailureReason` (docs/spec/protocol-lifecycle.md, FAIL-1).
"""

from __future__ import annotations

import enum

__all__ = ["FailureReason", "StateProfile", "TransferMode"]


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


class StateProfile(str, enum.Enum):
    """Where a transferred state group's state stands, and what the consumer does next (STATE-1).

    ``recompute`` (vLLM): the state has absorbed ``T = N - b`` prompt tokens
    and the consumer recomputes the last ``b``. ``prebuilt`` (SGLang): the
    state has absorbed all ``N`` prompt tokens, the consumer recomputes
    nothing and its first step consumes the sampled token.
    """

    RECOMPUTE = "recompute"
    PREBUILT = "prebuilt"
