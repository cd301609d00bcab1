"""The package version, in one place: pyproject.toml reads it (``[tool.setuptools.dynamic]``)."""

__all__ = ["__version__"]

__version__ = "0.2.0"
"""kvspec's package version (SemVer; docs/explanation/versioning.md). The protocol version is ``PROTOCOL_VERSION``."""
