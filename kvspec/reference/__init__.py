"""The reference layer: the reference functions of the rules, messages, page digests, model presets.

Private modules only (docs/explanation/layers.md): import their public names from :mod:`kvspec` or
the public submodule that re-exports them.
"""

__all__: list[str] = []
