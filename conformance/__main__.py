"""``python -m kvspec_conformance``: the same command as ``kvspec conform``."""

from .cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
