"""The connector seams: the block logic a connector computes before it posts, replaceable by one under test.

:class:`Connector` is the exchange seam (admission, clipping, pairing,
planning), :class:`OffloadConnector` the offload seam (hit, store and load
sets) and :class:`ParallelConnector` the many-ranks seam (which bytes each
consumer rank reads from which producer rank); :class:`ReferenceConnector`,
:class:`ReferenceOffloadConnector` and :class:`ReferenceParallelConnector`
are kvspec's reference functions behind them. The driver core
(:class:`kvspec.exchange.Driver`) and the conformance suite call only these
hooks (docs/reference/connector.md).
"""

from kvspec.drivers._connector import (
    Connector,
    ConsumerRankPlan,
    OffloadConnector,
    ParallelConnector,
    ReferenceConnector,
    ReferenceOffloadConnector,
    ReferenceParallelConnector,
    as_offload_connector,
    as_parallel_connector,
    pair_keywords,
    pair_with,
    takes_keywords,
)

__all__ = [
    "Connector",
    "ConsumerRankPlan",
    "OffloadConnector",
    "ParallelConnector",
    "ReferenceConnector",
    "ReferenceOffloadConnector",
    "ReferenceParallelConnector",
    "as_offload_connector",
    "as_parallel_connector",
    "pair_keywords",
    "pair_with",
    "takes_keywords",
]
