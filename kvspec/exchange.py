"""Drivers: run one request end to end over a Transport, for both roles (SM-1, SM-2).

The sessions at the top level say what to do; these drivers do it, with a
block allocator, a clock and a :class:`kvspec.transport.Transport`.
:class:`Driver` is the core both the endpoints and the conformance suite's
scenarios play through, one :class:`Role` per side (:data:`PRODUCER`,
:data:`CONSUMER`, :data:`OFFLOAD` for an offload engine's copies, each an
:class:`OffloadSession`); it calls a :class:`kvspec.connector.Connector`.
:class:`ProducerEngine` and :class:`ConsumerEngine` are the engine roles:
the steps each side plays for a request (allocate, clip, session, check,
pair, plan, start), shared by the endpoints and the suite's scenarios;
they allocate every request table. :class:`OffloadEngine` plays lookup,
load, store and evict over the OFF-4 chunk table, and posts the copies.
:func:`poll_until` is the one loop that waits for requests to settle.
"""

from kvspec.drivers._driver import (
    CONSUMER,
    INTEGRITY_ROWS,
    OFFLOAD,
    PRODUCER,
    DrivenSession,
    Driver,
    DriverFault,
    Evidence,
    IntegrityRow,
    LiveRequest,
    Moment,
    Operation,
    Role,
    poll_until,
    reason_of,
)
from kvspec.drivers._engine import (
    ChunkKey,
    ConsumerEngine,
    GpuCopy,
    OffloadEngine,
    PairOffer,
    ProducerEngine,
    StorePlan,
    pair_offer_by_connector,
    pair_offer_by_ends,
)
from kvspec.drivers._exchange import (
    BlockAllocator,
    ConsumerEndpoint,
    ConsumerResult,
    ExchangeResult,
    ProducerEndpoint,
    ProducerResult,
    connect,
    run_request,
)
from kvspec.protocol._offload_session import ChunkCopy, OffloadKind, OffloadSession, OffloadState

__all__ = [
    "CONSUMER",
    "INTEGRITY_ROWS",
    "OFFLOAD",
    "PRODUCER",
    "BlockAllocator",
    "ChunkCopy",
    "ChunkKey",
    "ConsumerEndpoint",
    "ConsumerEngine",
    "ConsumerResult",
    "DrivenSession",
    "Driver",
    "DriverFault",
    "Evidence",
    "ExchangeResult",
    "GpuCopy",
    "IntegrityRow",
    "LiveRequest",
    "Moment",
    "OffloadEngine",
    "OffloadKind",
    "OffloadSession",
    "OffloadState",
    "Operation",
    "PairOffer",
    "ProducerEndpoint",
    "ProducerEngine",
    "ProducerResult",
    "Role",
    "StorePlan",
    "connect",
    "pair_offer_by_connector",
    "pair_offer_by_ends",
    "poll_until",
    "reason_of",
    "run_request",
]
