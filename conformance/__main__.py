"""``python -m kvspec_conformance``: the same command as ``kvspec conform``."""

from .cli import main

raise SystemExit(main())
