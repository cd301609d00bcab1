"""The core layers: enums, deprecation aliases, errors, KV-cache models, descriptors, the rule registry.

Private modules only (docs/explanation/layers.md): import their public names from :mod:`kvspec` or
the public submodule that re-exports them.
"""

__all__: list[str] = []
