"""The connector seams: the block logic a connector computes before it posts, replaceable by one under test.

:class:`Connector` is the exchange seam (admission, clipping, pairing,
planning) and :class:`OffloadConnector` the offload seam (hit, store and load
sets); :class:`ReferenceConnector` and :class:`ReferenceOffloadConnector` are
kvspec's reference functions behind them. The driver core
(:class:`kvspec.exchange.Driver`) and the conformance suite call only these
hooks (docs/reference/connector.md).
"""

from kvspec.drivers._connector import (
    Connector,
    OffloadConnector,
    ReferenceConnector,
    ReferenceOffloadConnector,
    as_offload_connector,
    pair_keywords,
)

__all__ = [
    "Connector",
    "OffloadConnector",
    "ReferenceConnector",
    "ReferenceOffloadConnector",
    "as_offload_connector",
    "pair_keywords",
]
