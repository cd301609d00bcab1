"""The protocol layers: the planner, the codec, the handshake, the sans-IO sessions; schemas, summaries.

Private modules only (docs/explanation/layers.md): import their public names from :mod:`kvspec` or
the public submodule that re-exports them.
"""

__all__: list[str] = []
