"""The connector seam, as the suite names it: kvspec's driver core calls it, a connector under test replaces it."""

from __future__ import annotations

from kvspec.connector import (
    Connector,
    OffloadConnector,
    ReferenceConnector,
    ReferenceOffloadConnector,
    as_offload_connector,
)

__all__ = ["Connector", "OffloadConnector", "ReferenceConnector", "ReferenceOffloadConnector", "as_offload_connector"]
