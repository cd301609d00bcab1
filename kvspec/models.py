"""Deprecated: the model presets moved to :mod:`kvspec.presets` (this name clashed with the KV-cache models)."""

from typing import TYPE_CHECKING

from kvspec.core._deprecation import moved_names

__all__ = ["Layout", "ModelPreset", "get_preset", "list_presets"]  # noqa: F822  # served by __getattr__

if not TYPE_CHECKING:  # hidden from type checkers, which then flag the old names
    __getattr__ = moved_names(
        "kvspec.models",
        {name: ("kvspec.reference._presets", name, f"kvspec.presets.{name}") for name in __all__},
    )
