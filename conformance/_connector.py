"""The connector seam, as the suite names it: kvspec's driver core calls it, a connector under test replaces it."""

from __future__ import annotations

from kvspec._connector import Connector, ReferenceConnector

__all__ = ["Connector", "ReferenceConnector"]
