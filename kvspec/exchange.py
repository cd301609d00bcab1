"""Drivers: run one request end to end over a Transport, for both roles (SM-1, SM-2).

The sessions at the top level say what to do; these drivers do it, with a
block allocator, a clock and a :class:`kvspec.transport.Transport`.
:class:`Driver` is the core both the endpoints and the conformance suite's
scenarios play through; it calls a :class:`kvspec.connector.Connector`.
"""

from kvspec._driver import (
    CONSUMER,
    INTEGRITY_ROWS,
    PRODUCER,
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
from kvspec._exchange import (
    BlockAllocator,
    ConsumerEndpoint,
    ConsumerResult,
    ExchangeResult,
    ProducerEndpoint,
    ProducerResult,
    connect,
    run_request,
)

__all__ = [
    "CONSUMER",
    "INTEGRITY_ROWS",
    "PRODUCER",
    "BlockAllocator",
    "ConsumerEndpoint",
    "ConsumerResult",
    "Driver",
    "DriverFault",
    "Evidence",
    "ExchangeResult",
    "IntegrityRow",
    "LiveRequest",
    "Moment",
    "Operation",
    "ProducerEndpoint",
    "ProducerResult",
    "Role",
    "connect",
    "poll_until",
    "reason_of",
    "run_request",
]
