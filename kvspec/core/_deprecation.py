"""Deprecation aliases: old names keep working for one minor version, with a warning naming the new one.

Each rename is listed in CHANGELOG.md with its alias; aliases added in 0.2.0
are removed in 0.3.0 (docs/explanation/versioning.md).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

__all__ = ["REMOVED_IN", "keyword_only", "moved_names", "warn_renamed"]

P = ParamSpec("P")
R = TypeVar("R")

REMOVED_IN = "0.3.0"
"""The release that drops the aliases added in this one."""


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (both spelled as a user would write them)."""
    warnings.warn(
        f"{old} is deprecated; use {new} (the old spelling is removed in kvspec {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def keyword_only(positional: int, *names: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Accept, with a warning, the arguments ``names`` passed positionally after the first ``positional``.

    The decorated function's own signature is the new, keyword-only one; type
    checkers see only that one.
    """

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > positional:
                extra = args[positional:]
                if len(extra) > len(names):
                    raise TypeError(f"{func.__name__}() takes {positional + len(names)} arguments, got {len(args)}")
                spelled = ", ".join(f"{name}=" for name in names[: len(extra)])
                warn_renamed(f"passing {spelled} positionally to {func.__name__}()", "keywords")
                kwargs.update(zip(names, extra, strict=False))
                args = args[:positional]
            return func(*args, **kwargs)

        return wrapper

    return decorate


def moved_names(
    module: str, table: Mapping[str, tuple[str, str, str]], *, lazy_submodules: tuple[str, ...] = ()
) -> Callable[[str], object]:
    """A module ``__getattr__`` that serves each old name in ``table`` with a warning.

    ``table`` maps an old attribute name to ``(module that defines it now,
    attribute there, the new public spelling)``. A name in ``lazy_submodules``
    is imported as ``module.name`` on first use, without a warning.
    """

    def __getattr__(name: str) -> object:
        if name in lazy_submodules:
            return importlib.import_module(f"{module}.{name}")
        try:
            where, attribute, spelling = table[name]
        except KeyError:
            raise AttributeError(f"module {module!r} has no attribute {name!r}") from None
        warn_renamed(f"{module}.{name}", spelling)
        return getattr(importlib.import_module(where), attribute)

    return __getattr__
