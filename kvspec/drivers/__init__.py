"""The drivers layer: the connector seams, the driver core and the exchange endpoints.

Private modules only (docs/explanation/layers.md): import their public names from :mod:`kvspec` or
the public submodule that re-exports them.
"""

__all__: list[str] = []
