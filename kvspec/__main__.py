"""Run the ``kvspec`` command line as ``python -m kvspec``."""

import sys

from kvspec.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
