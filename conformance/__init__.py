"""kvspec's conformance suite: run it against any Transport backend (installed as kvspec_conformance)."""

__all__: list[str] = []
