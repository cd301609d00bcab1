"""Drivers: run one request end to end over a Transport, for both roles (SM-1, SM-2).

The sessions at the top level say what to do; these drivers do it, with a
block allocator, a clock and a :class:`kvspec.transport.Transport`.
:class:`Driver` is the core both the endpoints and the conformance suite's
scenarios play through; it calls a :class:`kvspec.connector.Connector`.
"""

from kvspec._driver import Driver, DriverFault, LiveRequest, Operation, reason_of
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
    "BlockAllocator",
    "ConsumerEndpoint",
    "ConsumerResult",
    "Driver",
    "DriverFault",
    "ExchangeResult",
    "LiveRequest",
    "Operation",
    "ProducerEndpoint",
    "ProducerResult",
    "connect",
    "reason_of",
    "run_request",
]
