"""The tools layer's private modules: the test vectors (written, answered, checked).

Private modules only (docs/explanation/layers.md): import their public names from :mod:`kvspec` or
the public submodule that re-exports them.
"""

__all__: list[str] = []
