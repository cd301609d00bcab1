"""Drivers: run one request end to end over a Transport, for both roles (SM-1, SM-2).

The sessions at the top level say what to do; these drivers do it, with a
block allocator, a clock and a :class:`kvspec.transport.Transport`.
"""

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
    "ExchangeResult",
    "ProducerEndpoint",
    "ProducerResult",
    "connect",
    "run_request",
]
